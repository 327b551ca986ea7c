"""The PostgreSQL connection pool: a connection is pinged before use only after it sat idle
(``PING_AFTER_IDLE``), and one that died meanwhile is replaced, not handed out."""

from __future__ import annotations

import time
from collections.abc import Iterator

import psycopg
import pytest
from sqlalchemy import Engine, text

from fleetserve.errors import StoreError
from fleetserve.store import SqlStore, TokenKind, make_engine
from fleetserve.store import db as store_db


@pytest.fixture
def engine(postgres_url: str, postgres_schema: str, postgres_store: SqlStore) -> Iterator[Engine]:
    made = make_engine(postgres_url, connect_args={"options": f"-csearch_path={postgres_schema}"})
    try:
        yield made
    finally:
        made.dispose()


def backend_of(engine: Engine) -> int:
    with engine.connect() as conn:
        pid: int = conn.execute(text("SELECT pg_backend_pid()")).scalar_one()
        return pid


def test_a_pooled_connection_that_died_while_idle_is_replaced_before_use(
    engine: Engine, postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = SqlStore(engine)
    pid = backend_of(engine)
    with psycopg.connect(postgres_url, autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
    time.sleep(0.05)
    monkeypatch.setattr(store_db, "PING_AFTER_IDLE", 0.0)  # it has been idle long enough
    assert store.list_tokens() == []  # answered on a fresh connection, no error
    assert backend_of(engine) != pid


def test_a_connection_used_a_moment_ago_is_not_pinged_and_one_failure_renews_the_pool(
    engine: Engine, postgres_url: str
) -> None:
    store = SqlStore(engine)
    pid = backend_of(engine)
    with psycopg.connect(postgres_url, autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
    time.sleep(0.05)
    # Used well within PING_AFTER_IDLE: taken as alive, so its statement meets the dead backend.
    with pytest.raises(StoreError):
        store.verify_token("fs_join_nothing", TokenKind.JOIN)
    # The disconnect renewed the pool: the next request is answered.
    assert store.verify_token("fs_join_nothing", TokenKind.JOIN) is False
    assert backend_of(engine) != pid
