"""Adapters (``kind: Adapter``): LoRA adapters on a base model, fetched into node caches like models
and listed by the deployments that serve them. A new adapter, a changed spec or a deleted one moves
the change counter (migration 0006), as a model's does; so does a replica whose agent reports
another set of adapters loaded (its status's ``adapters``: the gateway routes an adapter's
requests to the replicas that loaded it), beside 0006's port and restarts.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-07
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | Sequence[str] | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# The same bump as 0006's: on PostgreSQL its function (once per transaction, at the commit).
_PG = (
    "CREATE CONSTRAINT TRIGGER fleet_changed_adapters AFTER INSERT OR DELETE ON adapters"
    " DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION fleet_changed()",
    "CREATE CONSTRAINT TRIGGER fleet_changed_adapters_update AFTER UPDATE OF spec ON adapters"
    " DEFERRABLE INITIALLY DEFERRED FOR EACH ROW WHEN (OLD.spec::text IS DISTINCT FROM NEW.spec::text)"
    " EXECUTE FUNCTION fleet_changed()",
)
_SQLITE_BUMP = "INSERT INTO fleet_changes (slot, n) VALUES (0, 1) ON CONFLICT (slot) DO UPDATE SET n = n + 1;"
_SQLITE = (
    f"CREATE TRIGGER fleet_changed_adapters_insert AFTER INSERT ON adapters BEGIN {_SQLITE_BUMP} END",
    f"CREATE TRIGGER fleet_changed_adapters_delete AFTER DELETE ON adapters BEGIN {_SQLITE_BUMP} END",
    "CREATE TRIGGER fleet_changed_adapters_update AFTER UPDATE OF spec ON adapters"
    f" WHEN OLD.spec IS NOT NEW.spec BEGIN {_SQLITE_BUMP} END",
)

# 0006's replica update trigger, again with the status's adapters among what is a change.
_PG_REPLICAS = (
    "CREATE CONSTRAINT TRIGGER fleet_changed_replicas_update AFTER UPDATE OF state, spec, engine_key, status"
    " ON replicas DEFERRABLE INITIALLY DEFERRED FOR EACH ROW WHEN (OLD.state IS DISTINCT FROM NEW.state"
    " OR OLD.spec::text IS DISTINCT FROM NEW.spec::text OR OLD.engine_key IS DISTINCT FROM NEW.engine_key"
    " OR (OLD.status->>'port') IS DISTINCT FROM (NEW.status->>'port')"
    " OR (OLD.status->>'restarts') IS DISTINCT FROM (NEW.status->>'restarts')"
    "{adapters}) EXECUTE FUNCTION fleet_changed()"
)
_PG_ADAPTERS = " OR (OLD.status->>'adapters') IS DISTINCT FROM (NEW.status->>'adapters')"
_SQLITE_REPLICAS = (
    "CREATE TRIGGER fleet_changed_replicas_update AFTER UPDATE OF state, spec, engine_key, status ON replicas"
    " WHEN OLD.state IS NOT NEW.state OR OLD.spec IS NOT NEW.spec OR OLD.engine_key IS NOT NEW.engine_key"
    " OR json_extract(OLD.status, '$.port') IS NOT json_extract(NEW.status, '$.port')"
    " OR json_extract(OLD.status, '$.restarts') IS NOT json_extract(NEW.status, '$.restarts')"
    "{adapters} BEGIN " + _SQLITE_BUMP + " END"
)
_SQLITE_ADAPTERS = " OR json_extract(OLD.status, '$.adapters') IS NOT json_extract(NEW.status, '$.adapters')"


def _replicas_trigger(postgres: bool, adapters: bool) -> list[str]:
    if postgres:
        drop = "DROP TRIGGER fleet_changed_replicas_update ON replicas"
        return [drop, _PG_REPLICAS.format(adapters=_PG_ADAPTERS if adapters else "")]
    drop = "DROP TRIGGER fleet_changed_replicas_update"
    return [drop, _SQLITE_REPLICAS.format(adapters=_SQLITE_ADAPTERS if adapters else "")]


def upgrade() -> None:
    op.create_table(
        "adapters",
        sa.Column("name", sa.String(63), nullable=False),
        sa.Column("spec", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_adapters")),
    )
    postgres = op.get_bind().dialect.name == "postgresql"
    for statement in (*(_PG if postgres else _SQLITE), *_replicas_trigger(postgres, True)):
        op.execute(statement)


def downgrade() -> None:
    for statement in _replicas_trigger(op.get_bind().dialect.name == "postgresql", False):
        op.execute(statement)
    op.drop_table("adapters")
