"""Shared fixtures: the state store over SQLite and PostgreSQL.

PostgreSQL cases use ``FLEETSERVE_TEST_DATABASE_URL`` (default: postgres on 127.0.0.1:5432,
database ``test``), each test module in its own fresh schema, dropped at the end. When the
server does not answer they FAIL with a message saying so; ``FLEETSERVE_SKIP_POSTGRES=1`` skips
them instead.
Every PostgreSQL case is marked ``slow`` at collection (``pytest_collection_modifyitems``): the
fast tier, ``pytest -m "not slow"``, runs the SQLite cases only and needs no PostgreSQL server.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from sqlalchemy import Engine

    from fleetserve.store import SqlStore

# The store's modules are imported inside the fixtures: suites that do not use them never load them.

POSTGRES_URL = os.environ.get("FLEETSERVE_TEST_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/test")

# The fixtures that reach the PostgreSQL server, and the parameter value that picks it in the
# fixtures parametrized over both backends (``store``, ``two_stores``, ``inventory``...).
POSTGRES_FIXTURES = frozenset(
    {"postgres_url", "postgres_schema", "postgres_engine", "postgres_store", "pg_database"}
)
POSTGRES_PARAM = "postgres"


def uses_postgres(item: pytest.Item) -> bool:
    """Whether a collected test reaches the PostgreSQL server: it asks for one of the PostgreSQL
    fixtures (itself or through another fixture), or one of its parameters picks ``postgres``."""
    if POSTGRES_FIXTURES.intersection(getattr(item, "fixturenames", ())):
        return True
    callspec = getattr(item, "callspec", None)
    params = callspec.params.values() if callspec is not None else ()
    return any(isinstance(value, str) and value == POSTGRES_PARAM for value in params)


@pytest.hookimpl(tryfirst=True)  # before ``-m`` selects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every PostgreSQL case is ``slow``: the fast tier (``-m "not slow"``) needs no server."""
    for item in items:
        if uses_postgres(item):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def postgres_url() -> str:
    """The test PostgreSQL server's URL, checked to answer."""
    import psycopg

    if os.environ.get("FLEETSERVE_SKIP_POSTGRES") == "1":
        pytest.skip("FLEETSERVE_SKIP_POSTGRES=1: the PostgreSQL cases are skipped")
    try:
        with psycopg.connect(POSTGRES_URL, connect_timeout=5) as conn:
            conn.execute("SELECT 1")
    except psycopg.Error as exc:
        pytest.fail(
            f"PostgreSQL is not reachable at {POSTGRES_URL}: {exc}. Start it (scripts/ensure-postgres.sh), "
            "point FLEETSERVE_TEST_DATABASE_URL at one, or set FLEETSERVE_SKIP_POSTGRES=1 to skip "
            "the PostgreSQL cases.",
            pytrace=False,
        )
    return POSTGRES_URL


@pytest.fixture(scope="module")
def postgres_schema(postgres_url: str) -> Iterator[str]:
    """A fresh, empty schema for one test module, dropped (CASCADE) after it."""
    import psycopg
    from psycopg import sql

    schema = f"fs_test_{secrets.token_hex(6)}"
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
    try:
        yield schema
    finally:
        with psycopg.connect(postgres_url, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))


def postgres_engine_for(url: str, schema: str) -> Engine:
    """An engine whose connections work inside ``schema``."""
    from fleetserve.store import make_engine

    return make_engine(url, connect_args={"options": f"-csearch_path={schema}"})


@pytest.fixture(scope="module")
def postgres_engine(postgres_url: str, postgres_schema: str) -> Iterator[Engine]:
    """A migrated engine on the module's schema."""
    from fleetserve.store import migrate

    engine = postgres_engine_for(postgres_url, postgres_schema)
    try:
        migrate(engine)
        yield engine
    finally:
        engine.dispose()


@pytest.fixture
def postgres_store(postgres_engine: Engine) -> SqlStore:
    """A store on the module's schema, emptied before the test."""
    from fleetserve.store import SqlStore
    from fleetserve.store.tables import Base

    with postgres_engine.begin() as conn:
        # DELETE, not TRUNCATE: on a handful of rows it is many times faster.
        for table in reversed(Base.metadata.sorted_tables):
            conn.execute(table.delete())
    return SqlStore(postgres_engine)


@pytest.fixture
def sqlite_store(tmp_path: Path) -> Iterator[SqlStore]:
    """A store on a fresh, migrated SQLite file."""
    from fleetserve.store import SqlStore, make_engine, migrate

    engine = make_engine(tmp_path / "state.db")
    try:
        migrate(engine)
        yield SqlStore(engine)
    finally:
        engine.dispose()


@pytest.fixture(params=["sqlite", "postgres"])
def store(request: pytest.FixtureRequest) -> SqlStore:
    """The store on each backend."""
    result: SqlStore = request.getfixturevalue(f"{request.param}_store")
    return result
