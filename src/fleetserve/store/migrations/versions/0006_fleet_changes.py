"""A change counter the whole-fleet readers compare before reading (``store.changes``).

The database bumps it itself, by trigger, in the same transaction as every write that changes
what the observer's scrape targets, the gateway's routes or the assignment watch read: replicas
allocated, released or changed (state, document, engine key, reported port or restarts), shards,
nodes registered, deleted or changed (state, cordon, epoch, document), deployments' specs, models
and device classes. A heartbeat, an agent status or a replica's in-flight count bumps nothing.

On PostgreSQL the counter is split into ``SLOTS`` rows, one picked per connection, so concurrent
writers seldom queue on one row; readers add them up. Each transaction bumps it once, at its
commit. SQLite has one writer at a time: one row.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-03
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | Sequence[str] | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

SLOTS = 16

# Per table: the columns whose change is a change, and the condition (OLD against NEW) that says so.
_PG_UPDATES = {
    "replicas": (
        "state, spec, engine_key, status",
        "OLD.state IS DISTINCT FROM NEW.state OR OLD.spec::text IS DISTINCT FROM NEW.spec::text"
        " OR OLD.engine_key IS DISTINCT FROM NEW.engine_key"
        " OR (OLD.status->>'port') IS DISTINCT FROM (NEW.status->>'port')"
        " OR (OLD.status->>'restarts') IS DISTINCT FROM (NEW.status->>'restarts')",
    ),
    "nodes": (
        "state, cordon_reason, cordon_by, epoch, spec",
        "OLD.state IS DISTINCT FROM NEW.state OR OLD.cordon_reason IS DISTINCT FROM NEW.cordon_reason"
        " OR OLD.cordon_by IS DISTINCT FROM NEW.cordon_by OR OLD.epoch IS DISTINCT FROM NEW.epoch"
        " OR OLD.spec::text IS DISTINCT FROM NEW.spec::text",
    ),
    "deployments": ("spec", "OLD.spec::text IS DISTINCT FROM NEW.spec::text"),
}
_SQLITE_UPDATES = {
    "replicas": (
        "state, spec, engine_key, status",
        "OLD.state IS NOT NEW.state OR OLD.spec IS NOT NEW.spec OR OLD.engine_key IS NOT NEW.engine_key"
        " OR json_extract(OLD.status, '$.port') IS NOT json_extract(NEW.status, '$.port')"
        " OR json_extract(OLD.status, '$.restarts') IS NOT json_extract(NEW.status, '$.restarts')",
    ),
    "nodes": (
        "state, cordon_reason, cordon_by, epoch, spec",
        "OLD.state IS NOT NEW.state OR OLD.cordon_reason IS NOT NEW.cordon_reason"
        " OR OLD.cordon_by IS NOT NEW.cordon_by OR OLD.epoch IS NOT NEW.epoch OR OLD.spec IS NOT NEW.spec",
    ),
    "deployments": ("spec", "OLD.spec IS NOT NEW.spec"),
}
# Tables where any insert or delete is a change (and any update, for those not above).
_WHOLE = ("replicas", "replica_shards", "nodes", "deployments", "models", "device_classes")

_PG_BUMP = f"""
CREATE FUNCTION fleet_changed() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    -- Once per transaction, however many rows it wrote.
    IF current_setting('fleetserve.changed', true) = txid_current()::text THEN
        RETURN NULL;
    END IF;
    PERFORM set_config('fleetserve.changed', txid_current()::text, true);
    INSERT INTO fleet_changes (slot, n) VALUES (pg_backend_pid() % {SLOTS}, 1)
    ON CONFLICT (slot) DO UPDATE SET n = fleet_changes.n + 1;
    RETURN NULL;
END
$$
"""
_SQLITE_BUMP = "INSERT INTO fleet_changes (slot, n) VALUES (0, 1) ON CONFLICT (slot) DO UPDATE SET n = n + 1;"


def _pg_statements() -> list[str]:
    out = [_PG_BUMP]
    # Deferred to the commit: a transaction takes its slot's lock last, after every row lock it
    # takes, so the counter never joins a lock cycle (a deadlock) with the rows it counts.
    for table in _WHOLE:
        events = "INSERT OR DELETE" if table in _PG_UPDATES else "INSERT OR UPDATE OR DELETE"
        out.append(
            f"CREATE CONSTRAINT TRIGGER fleet_changed_{table} AFTER {events} ON {table}"
            " DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION fleet_changed()"
        )
    for table, (columns, when) in _PG_UPDATES.items():
        out.append(
            f"CREATE CONSTRAINT TRIGGER fleet_changed_{table}_update AFTER UPDATE OF {columns} ON {table}"
            f" DEFERRABLE INITIALLY DEFERRED FOR EACH ROW WHEN ({when}) EXECUTE FUNCTION fleet_changed()"
        )
    return out


def _sqlite_statements() -> list[str]:
    out = []
    for table in _WHOLE:
        events = ["insert", "delete"] + ([] if table in _SQLITE_UPDATES else ["update"])
        for event in events:
            out.append(
                f"CREATE TRIGGER fleet_changed_{table}_{event} AFTER {event.upper()} ON {table}"
                f" BEGIN {_SQLITE_BUMP} END"
            )
    for table, (columns, when) in _SQLITE_UPDATES.items():
        out.append(
            f"CREATE TRIGGER fleet_changed_{table}_update AFTER UPDATE OF {columns} ON {table}"
            f" WHEN {when} BEGIN {_SQLITE_BUMP} END"
        )
    return out


def _trigger_names(postgres: bool) -> list[tuple[str, str]]:
    """(trigger, table) of every trigger made above."""
    if postgres:
        return [(f"fleet_changed_{t}", t) for t in _WHOLE] + [
            (f"fleet_changed_{t}_update", t) for t in _PG_UPDATES
        ]
    out = []
    for table in _WHOLE:
        events = ["insert", "delete"] + ([] if table in _SQLITE_UPDATES else ["update"])
        out += [(f"fleet_changed_{table}_{event}", table) for event in events]
    return out + [(f"fleet_changed_{t}_update", t) for t in _SQLITE_UPDATES]


def upgrade() -> None:
    op.create_table(
        "fleet_changes",
        sa.Column("slot", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("n", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("slot", name=op.f("pk_fleet_changes")),
    )
    postgres = op.get_bind().dialect.name == "postgresql"
    for statement in _pg_statements() if postgres else _sqlite_statements():
        op.execute(statement)


def downgrade() -> None:
    postgres = op.get_bind().dialect.name == "postgresql"
    for trigger, table in _trigger_names(postgres):
        op.execute(f"DROP TRIGGER IF EXISTS {trigger}" + (f" ON {table}" if postgres else ""))
    if postgres:
        op.execute("DROP FUNCTION IF EXISTS fleet_changed()")
    op.drop_table("fleet_changes")
