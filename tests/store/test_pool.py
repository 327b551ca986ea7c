"""The PostgreSQL connection pool: a connection is pinged before use only after it sat idle
(``PING_AFTER_IDLE``), and one that died meanwhile is replaced, not handed out."""

from __future__ import annotations

import threading
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


def test_a_store_under_more_demand_than_its_pools_opens_at_most_max_connections_and_makes_the_rest_wait(
    postgres_url: str, postgres_schema: str, postgres_store: SqlStore
) -> None:
    """Two server processes on a stock PostgreSQL (max_connections 100, 3 for superusers) must not
    be refused: one process's store, with 80 threads each holding a connection of each pool at
    once, opens at most ``MAX_CONNECTIONS`` (45); the threads beyond wait and all finish."""
    name = f"fleetserve-pool-{postgres_schema}"
    args = {"options": f"-csearch_path={postgres_schema}", "application_name": name}
    engine = make_engine(postgres_url, connect_args=args)
    twin = store_db.autocommit_twin(engine)  # as SqlStore makes it
    peak = 0
    done: list[bool] = []

    def hold() -> None:
        with engine.connect() as conn, twin.connect() as single:
            conn.execute(text("SELECT pg_sleep(0.2)"))
            single.execute(text("SELECT 1"))
        done.append(True)

    try:
        with psycopg.connect(postgres_url, autocommit=True) as admin:
            threads = [threading.Thread(target=hold) for _ in range(80)]
            for t in threads:
                t.start()
            while any(t.is_alive() for t in threads):
                row = admin.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s", (name,)
                ).fetchone()
                peak = max(peak, row[0] if row else 0)
                time.sleep(0.02)
            for t in threads:
                t.join()
    finally:
        engine.dispose()
    assert len(done) == 80, "every thread got its connections, waiting where the pools were full"
    assert store_db.MAX_CONNECTIONS == 45
    assert 2 * store_db.MAX_CONNECTIONS <= 100 - 3
    assert store_db.POOL_SIZE + store_db.TWIN_POOL_SIZE <= peak <= store_db.MAX_CONNECTIONS
