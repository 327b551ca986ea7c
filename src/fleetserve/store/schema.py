"""Bring a database's schema up to date with the migrations shipped inside the package."""

from __future__ import annotations

import os
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.util.exc import CommandError
from sqlalchemy import Engine, text

from fleetserve.errors import StoreError
from fleetserve.store.db import converted, make_engine

MIGRATIONS = Path(__file__).with_name("migrations")
# pg_advisory_xact_lock key: servers starting together migrate one after the other.
_MIGRATION_LOCK = 0x666C6565_74737276  # "fleetsrv"


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
            try:
                command.upgrade(config, "head")
            except CommandError as exc:
                raise StoreError(f"state store: migrating the schema failed: {exc}") from exc
    finally:
        if engine is not target:
            engine.dispose()
