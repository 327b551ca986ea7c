"""Each replica's engine API key (its engine refuses requests without it).

The gateway and the observer send it; only the replica's agent is given it.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-03
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | Sequence[str] | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Nullable: replicas placed before this revision run without a key until they are replaced.
    with op.batch_alter_table("replicas") as batch:
        batch.add_column(sa.Column("engine_key", sa.String(64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("replicas") as batch:
        batch.drop_column("engine_key")
