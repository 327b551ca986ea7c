"""Endpoints (``kind: Endpoint``): servers fleetserve did not start, with the control plane's last
health check of each. A new endpoint, a changed spec or a changed state moves the change counter
(migration 0006), so every gateway's routes follow; a check that only confirms the state does not.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-07
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | Sequence[str] | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# The same bump as 0006's: on PostgreSQL its function (once per transaction, at the commit).
_PG = (
    "CREATE CONSTRAINT TRIGGER fleet_changed_endpoints AFTER INSERT OR DELETE ON endpoints"
    " DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION fleet_changed()",
    "CREATE CONSTRAINT TRIGGER fleet_changed_endpoints_update AFTER UPDATE OF spec, state ON endpoints"
    " DEFERRABLE INITIALLY DEFERRED FOR EACH ROW WHEN (OLD.spec::text IS DISTINCT FROM NEW.spec::text"
    " OR OLD.state IS DISTINCT FROM NEW.state) EXECUTE FUNCTION fleet_changed()",
)
_SQLITE_BUMP = "INSERT INTO fleet_changes (slot, n) VALUES (0, 1) ON CONFLICT (slot) DO UPDATE SET n = n + 1;"
_SQLITE = (
    f"CREATE TRIGGER fleet_changed_endpoints_insert AFTER INSERT ON endpoints BEGIN {_SQLITE_BUMP} END",
    f"CREATE TRIGGER fleet_changed_endpoints_delete AFTER DELETE ON endpoints BEGIN {_SQLITE_BUMP} END",
    "CREATE TRIGGER fleet_changed_endpoints_update AFTER UPDATE OF spec, state ON endpoints"
    f" WHEN OLD.spec IS NOT NEW.spec OR OLD.state IS NOT NEW.state BEGIN {_SQLITE_BUMP} END",
)


def upgrade() -> None:
    op.create_table(
        "endpoints",
        sa.Column("name", sa.String(63), nullable=False),
        sa.Column("spec", sa.JSON(), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("checked_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_endpoints")),
    )
    for statement in _PG if op.get_bind().dialect.name == "postgresql" else _SQLITE:
        op.execute(statement)


def downgrade() -> None:
    op.drop_table("endpoints")
