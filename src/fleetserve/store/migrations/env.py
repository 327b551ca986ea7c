"""Alembic environment of the state store.

Migrations run through ``fleetserve.store.migrate``, which passes its connection in
``config.attributes["connection"]`` (inside its transaction). For the ``alembic`` command line
(e.g. ``alembic revision --autogenerate`` while developing) set ``sqlalchemy.url`` instead.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import Connection

from fleetserve.store.db import make_engine
from fleetserve.store.tables import Base


def run(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=Base.metadata,
        render_as_batch=connection.dialect.name == "sqlite",
    )
    with context.begin_transaction():
        context.run_migrations()


given = context.config.attributes.get("connection")
if isinstance(given, Connection):
    run(given)
else:
    engine = make_engine(context.config.get_main_option("sqlalchemy.url"))
    try:
        with engine.connect() as connection:
            run(connection)
    finally:
        engine.dispose()
