"""Lifecycle: when a replica started to drain and when its agent last reported it; a deployment's
previous spec (for ``rollout undo``).

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-03
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | Sequence[str] | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

STAMP = sa.DateTime(timezone=True)


def upgrade() -> None:
    with op.batch_alter_table("replicas") as batch:
        batch.add_column(sa.Column("draining_since", STAMP, nullable=True))
        batch.add_column(sa.Column("reported_at", STAMP, nullable=True))
    with op.batch_alter_table("deployments") as batch:
        batch.add_column(sa.Column("previous_spec", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("deployments") as batch:
        batch.drop_column("previous_spec")
    with op.batch_alter_table("replicas") as batch:
        batch.drop_column("reported_at")
        batch.drop_column("draining_since")
