"""A model's previous spec (for ``rollout undo model/NAME``): a change of its weights rolls every
deployment serving it, and undoing applies the spec it had before.

Plain ``ADD COLUMN`` (no batch copy): on SQLite a copied table would lose the models table's
change-counter triggers (migration 0006).

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-06
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | Sequence[str] | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("models", sa.Column("previous_spec", sa.JSON(), nullable=True))


def downgrade() -> None:
    op.execute("ALTER TABLE models DROP COLUMN previous_spec")
