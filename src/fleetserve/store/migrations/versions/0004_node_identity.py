"""Node identity: per-node credentials (hashed, bound to a name, with pending enrolments and
operator approvals), and an expiry for tokens.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-03
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | Sequence[str] | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

STAMP = sa.DateTime(timezone=True)


def upgrade() -> None:
    with op.batch_alter_table("tokens") as batch:
        batch.add_column(sa.Column("expires_at", STAMP, nullable=True))
    op.create_table(
        "node_credentials",
        sa.Column("node", sa.String(63), nullable=False),
        sa.Column("token_hash", sa.String(64), nullable=True),
        sa.Column("issued_at", STAMP, nullable=True),
        sa.Column("approved", sa.Boolean(), nullable=False),
        sa.Column("requested_at", STAMP, nullable=True),
        sa.Column("requested_from", sa.String(64), nullable=True),
        sa.PrimaryKeyConstraint("node", name=op.f("pk_node_credentials")),
        sa.UniqueConstraint("token_hash", name=op.f("uq_node_credentials_token_hash")),
    )


def downgrade() -> None:
    op.drop_table("node_credentials")
    with op.batch_alter_table("tokens") as batch:
        batch.drop_column("expires_at")
