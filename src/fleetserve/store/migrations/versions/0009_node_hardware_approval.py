"""A node's approved hardware: the facts an operator approved (devices per class, CPU cores,
memory; ``inventory.approval.Hardware``), and a registration's claim beyond them that waits for an
approval (the whole node document claimed, and when).

Nullable, filled by use: an enrolment records the facts it approved, an operator's ``apply`` of a
Node the facts it declares. A node enrolled before this migration has none recorded; its next
registration is judged against the facts its node row holds then (what the operator last saw),
which become its approved facts.

Plain ``ADD COLUMN`` (no batch copy), as 0008.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-07
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | Sequence[str] | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

COLUMNS = ("approved_hardware", "claimed_spec", "held_at")


def upgrade() -> None:
    op.add_column("node_credentials", sa.Column("approved_hardware", sa.JSON(), nullable=True))
    op.add_column("node_credentials", sa.Column("claimed_spec", sa.JSON(), nullable=True))
    op.add_column("node_credentials", sa.Column("held_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    for column in reversed(COLUMNS):
        op.execute(f"ALTER TABLE node_credentials DROP COLUMN {column}")
