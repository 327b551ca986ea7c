"""A replica whose engine dropped its whole KV cache (its agent's report: ``kvCache.clears``, from
vLLM's AllBlocksCleared event) moves the change counter (migration 0006), as a restart does: the
observer reads it within a tick and moves the replica's engine epoch, which clears every gateway's
cache model of it (``gateway.prefixcache``). The held block counts beside it move nothing: they
change with every request, and reach the gateways with the next read of the fleet.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-07
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0012"
down_revision: str | Sequence[str] | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_SQLITE_BUMP = "INSERT INTO fleet_changes (slot, n) VALUES (0, 1) ON CONFLICT (slot) DO UPDATE SET n = n + 1;"

# 0011's replica update trigger, with the status's KV cache clears among what is a change.
_PG_REPLICAS = (
    "CREATE CONSTRAINT TRIGGER fleet_changed_replicas_update AFTER UPDATE OF state, spec, engine_key, status"
    " ON replicas DEFERRABLE INITIALLY DEFERRED FOR EACH ROW WHEN (OLD.state IS DISTINCT FROM NEW.state"
    " OR OLD.spec::text IS DISTINCT FROM NEW.spec::text OR OLD.engine_key IS DISTINCT FROM NEW.engine_key"
    " OR (OLD.status->>'port') IS DISTINCT FROM (NEW.status->>'port')"
    " OR (OLD.status->>'restarts') IS DISTINCT FROM (NEW.status->>'restarts')"
    " OR (OLD.status->>'adapters') IS DISTINCT FROM (NEW.status->>'adapters')"
    "{clears}) EXECUTE FUNCTION fleet_changed()"
)
_PG_CLEARS = " OR (OLD.status->'kvCache'->>'clears') IS DISTINCT FROM (NEW.status->'kvCache'->>'clears')"
_SQLITE_REPLICAS = (
    "CREATE TRIGGER fleet_changed_replicas_update AFTER UPDATE OF state, spec, engine_key, status ON replicas"
    " WHEN OLD.state IS NOT NEW.state OR OLD.spec IS NOT NEW.spec OR OLD.engine_key IS NOT NEW.engine_key"
    " OR json_extract(OLD.status, '$.port') IS NOT json_extract(NEW.status, '$.port')"
    " OR json_extract(OLD.status, '$.restarts') IS NOT json_extract(NEW.status, '$.restarts')"
    " OR json_extract(OLD.status, '$.adapters') IS NOT json_extract(NEW.status, '$.adapters')"
    "{clears} BEGIN " + _SQLITE_BUMP + " END"
)
_SQLITE_CLEARS = (
    " OR json_extract(OLD.status, '$.kvCache.clears') IS NOT json_extract(NEW.status, '$.kvCache.clears')"
)


def _replicas_trigger(postgres: bool, clears: bool) -> list[str]:
    if postgres:
        drop = "DROP TRIGGER fleet_changed_replicas_update ON replicas"
        return [drop, _PG_REPLICAS.format(clears=_PG_CLEARS if clears else "")]
    drop = "DROP TRIGGER fleet_changed_replicas_update"
    return [drop, _SQLITE_REPLICAS.format(clears=_SQLITE_CLEARS if clears else "")]


def upgrade() -> None:
    for statement in _replicas_trigger(op.get_bind().dialect.name == "postgresql", True):
        op.execute(statement)


def downgrade() -> None:
    for statement in _replicas_trigger(op.get_bind().dialect.name == "postgresql", False):
        op.execute(statement)
