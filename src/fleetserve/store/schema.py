"""Bring a database's schema up to date with the migrations shipped inside the package.

The migration ids were renumbered in chain order before any release (0001 → 0003 → 0005 → 0002 →
0006 → 0007 → 0008 became 0001 → 0002 → … → 0007). A database stamped under the old numbering is
recognised before upgrading and restamped with the new id of the same migration (``RENUMBERED``):
most old ids are new ids of other migrations, so each is told apart by what the schema holds.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.util.exc import CommandError
from sqlalchemy import Connection, Engine, inspect, text

from fleetserve.errors import StoreError
from fleetserve.store.db import converted, make_engine

MIGRATIONS = Path(__file__).with_name("migrations")
# pg_advisory_xact_lock key: servers starting together migrate one after the other.
_MIGRATION_LOCK = 0x666C6565_74737276  # "fleetsrv"


def _has_table(name: str) -> Callable[[Connection], bool]:
    return lambda c: inspect(c).has_table(name)


def _lacks_table(name: str) -> Callable[[Connection], bool]:
    return lambda c: not inspect(c).has_table(name)


def _has_column(table: str, column: str) -> Callable[[Connection], bool]:
    return lambda c: column in {col["name"] for col in inspect(c).get_columns(table)}


def _has_fabric_trigger(c: Connection) -> bool:
    """Whether fabrics bump the change counter (what the fabric-changes migration adds)."""
    if c.dialect.name == "postgresql":
        found = c.scalar(
            text("SELECT count(*) FROM pg_trigger WHERE tgrelid = to_regclass('fabrics')"
                 " AND tgname = 'fleet_changed_fabrics'")
        )  # fmt: skip
    else:
        found = c.scalar(
            text("SELECT count(*) FROM sqlite_master WHERE type = 'trigger'"
                 " AND name = 'fleet_changed_fabrics_insert'")
        )  # fmt: skip
    return bool(found)


@dataclass(frozen=True)
class Renumbered:
    """An id of the old numbering: the new id of its migration, and what tells a database stamped
    with it under the new numbering (True) from one under the old (None: the id is old only)."""

    new: str
    is_new: Callable[[Connection], bool] | None


# Old id → its migration's new id; the probe looks for what the NEW migration of that id adds
# (or, for 0002, what only the old one's chain holds). A new migration 0008 must give 0008 a probe
# (tests/store/test_schema.py says so), or this table go once no database of the old ids is left.
RENUMBERED: dict[str, Renumbered] = {
    # old node identity; new replica engine key, which comes before node identity
    "0002": Renumbered("0004", _lacks_table("node_credentials")),
    "0003": Renumbered("0002", _has_column("replicas", "draining_since")),  # old engine key; new lifecycle
    "0005": Renumbered("0003", _has_table("usage_minutes")),  # old lifecycle; new usage and audit
    "0006": Renumbered("0005", _has_table("fleet_changes")),  # old usage and audit; new fleet changes
    "0007": Renumbered("0006", _has_fabric_trigger),  # old fleet changes; new fabric changes
    # old fabric changes (the old head); new model previous spec
    "0008": Renumbered("0007", _has_column("models", "previous_spec")),
}


def restamp_renumbered(c: Connection) -> str | None:
    """Restamp a database stamped under the old numbering with the new id of its migration; the
    new id, or None when there was nothing to restamp."""
    if not inspect(c).has_table("alembic_version"):
        return None
    stamped = c.scalar(text("SELECT version_num FROM alembic_version"))
    old = RENUMBERED.get(str(stamped))
    if old is None or (old.is_new is not None and old.is_new(c)):
        return None
    c.execute(text("UPDATE alembic_version SET version_num = :new"), {"new": old.new})
    return old.new


def migrate(target: Engine | str | os.PathLike[str] | None = None) -> None:
    """Run every pending migration (``alembic upgrade head``); a no-op when up to date.

    ``target`` is an engine (left open) or anything ``make_engine`` takes (disposed after)."""
    engine = target if isinstance(target, Engine) else make_engine(target)
    try:
        config = Config()
        config.set_main_option("script_location", str(MIGRATIONS))
        with converted("migrating the schema"), engine.begin() as connection:
            if connection.dialect.name == "postgresql":
                connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _MIGRATION_LOCK})
            config.attributes["connection"] = connection
            restamp_renumbered(connection)
            try:
                command.upgrade(config, "head")
            except CommandError as exc:
                raise StoreError(f"state store: migrating the schema failed: {exc}") from exc
    finally:
        if engine is not target:
            engine.dispose()
