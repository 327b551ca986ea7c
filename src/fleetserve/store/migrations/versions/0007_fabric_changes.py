"""Fabrics count as a change too (the counter of migration 0006): the reconciler skips reading
and planning a fleet whose counter has not moved, and placement reads fabrics (which nodes share
a fast interconnect for a replica split over several of them).

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-04
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0007"
down_revision: str | Sequence[str] | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_EVENTS = ("insert", "update", "delete")
# The same bump as 0006's: on PostgreSQL its function (once per transaction, at the commit).
_PG = (
    "CREATE CONSTRAINT TRIGGER fleet_changed_fabrics AFTER INSERT OR UPDATE OR DELETE ON fabrics"
    " DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION fleet_changed()"
)
_SQLITE_BUMP = "INSERT INTO fleet_changes (slot, n) VALUES (0, 1) ON CONFLICT (slot) DO UPDATE SET n = n + 1;"


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(_PG)
        return
    for event in _EVENTS:
        op.execute(
            f"CREATE TRIGGER fleet_changed_fabrics_{event} AFTER {event.upper()} ON fabrics"
            f" BEGIN {_SQLITE_BUMP} END"
        )


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP TRIGGER IF EXISTS fleet_changed_fabrics ON fabrics")
        return
    for event in _EVENTS:
        op.execute(f"DROP TRIGGER IF EXISTS fleet_changed_fabrics_{event}")
