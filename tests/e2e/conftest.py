"""Fixtures of the process-level tests (helpers in e2e_support.py).

- ``servers`` / ``module_servers``: start ``fleetserve server`` subprocesses; every one is stopped
  at teardown (SIGTERM, then SIGKILL), whether the test passed or not.
- ``pg_database``: a fresh PostgreSQL database per test, dropped WITH (FORCE) after it.
- ``state_of``, ``poller``, ``eventually``: read the state straight from the database, poll one
  value cheaply, wait for a condition.
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from e2e_support import AgentFactory, ServerFactory, State, read_state, sql_poller, wait_for


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[ServerFactory]:
    factory = ServerFactory(tmp_path)
    try:
        yield factory
    finally:
        factory.close()


@pytest.fixture(scope="module")
def module_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerFactory]:
    """Like ``servers``, for one server shared by a module's tests."""
    factory = ServerFactory(tmp_path_factory.mktemp("servers"))
    try:
        yield factory
    finally:
        factory.close()


@pytest.fixture
def pg_database(postgres_url: str) -> Iterator[str]:
    """A fresh PostgreSQL database for one test (``postgresql://…/fs_e2e_…``), dropped after it
    with FORCE, which also ends any connection a killed server left behind."""
    import psycopg
    from psycopg import sql

    name = f"fs_e2e_{secrets.token_hex(5)}"
    url = urlsplit(postgres_url)._replace(path=f"/{name}").geturl()
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        yield url
    finally:
        with psycopg.connect(postgres_url, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


@pytest.fixture
def state_of() -> Callable[[str], State]:
    return read_state


@pytest.fixture
def poller() -> Callable[[str], contextlib.AbstractContextManager[Callable[[str], Any]]]:
    return sql_poller


@pytest.fixture
def eventually() -> Callable[..., Any]:
    return wait_for


@pytest.fixture
def agents(tmp_path: Path) -> Iterator[AgentFactory]:
    """Starts ``fleetserve agent`` subprocesses; at teardown every one is stopped, every engine
    left naming the test's tmp_path is killed, and such an orphan fails the test."""
    factory = AgentFactory(tmp_path)
    try:
        yield factory
    finally:
        orphans = factory.close()
    if orphans:
        pytest.fail("llama-server processes outlived their agents (killed now):\n" + "\n".join(orphans))
