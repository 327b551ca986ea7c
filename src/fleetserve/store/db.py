"""Engines for the state store: a SQLite file by default, PostgreSQL for several servers.

SQLite connections get WAL journaling (readers never block the writer), foreign keys, a busy
timeout, and ``BEGIN IMMEDIATE`` for every transaction not marked read-only, so writers from
several processes serialise instead of failing half-way with "database is locked". PostgreSQL
URLs are mapped to the psycopg 3 driver. Database errors become ``StoreError`` here, at the
boundary, with the driver's exception chained.
"""

from __future__ import annotations

import os
import time
import weakref
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import URL, Connection, make_url
from sqlalchemy.exc import ArgumentError, DBAPIError, InvalidatePoolError, SQLAlchemyError

from fleetserve.errors import InternalError, StoreError

# Execution option that makes a SQLite transaction start with a plain (deferred) BEGIN.
READ_ONLY = "fleetserve_read_only"
DEFAULT_BUSY_TIMEOUT = 30.0
# PostgreSQL connections per server process, in two pools: the transactions' (the server's 40
# worker threads share it) and the autocommit twin's (single statements: the agents' hot path, a
# thread per batch kind, and whatever route falls back to it). Each keeps its SIZE open and opens
# up to OVERFLOW more under load (closed again when returned to a full pool); a thread finding
# its pool exhausted waits for a connection. At most MAX_CONNECTIONS in all, so that two server
# processes stay inside a stock PostgreSQL's max_connections of 100 (three of them reserved for
# superusers); more processes need max_connections raised to MAX_CONNECTIONS each, plus headroom.
# (Twice 40 each, before, and two servers under 1,000 agents met "sorry, too many clients".)
POOL_SIZE = 20
POOL_OVERFLOW = 10
TWIN_POOL_SIZE = 10
TWIN_POOL_OVERFLOW = 5
MAX_CONNECTIONS = POOL_SIZE + POOL_OVERFLOW + TWIN_POOL_SIZE + TWIN_POOL_OVERFLOW
# A pooled connection idle longer than this is pinged before use (one that answered a moment ago
# is taken as alive: a ping on every checkout was a round trip per statement on the agents' path).
PING_AFTER_IDLE = 2.0
_IDLE_SINCE = "fleetserve_idle_since"


def default_database_path() -> Path:
    """``$XDG_DATA_HOME/fleetserve/state.db`` (``~/.local/share/fleetserve/state.db``)."""
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "fleetserve" / "state.db"


def database_url(url: str | os.PathLike[str] | None) -> URL:
    """The SQLAlchemy URL for a database URL, a SQLite file path, or None (the default file)."""
    if url is None:
        url = default_database_path()
    if isinstance(url, os.PathLike) or "://" not in url:
        return URL.create("sqlite", database=str(Path(url)))
    try:
        parsed = make_url(url)
    except (ArgumentError, ValueError) as exc:
        raise StoreError(f"not a database URL: {url!r}") from exc
    if parsed.drivername in ("postgresql", "postgres", "postgresql+psycopg"):
        return parsed.set(drivername="postgresql+psycopg")
    if parsed.drivername in ("sqlite", "sqlite+pysqlite"):
        if parsed.database in (None, "", ":memory:"):
            raise StoreError(
                "an in-memory SQLite database is not supported: every connection would see its own "
                "empty database; give a file path"
            )
        return parsed
    raise StoreError(
        f"unsupported database {parsed.drivername!r}: use a SQLite file path, sqlite:///PATH "
        "or postgresql://USER@HOST/DB"
    )


def shown_url(url: str | os.PathLike[str] | None) -> str:
    """``url`` as logs and output may show it: its password hidden (a path as it was given)."""
    if url is None or isinstance(url, os.PathLike) or "://" not in url:
        return str(url if url is not None else default_database_path())
    try:
        return make_url(url).render_as_string(hide_password=True)
    except (ArgumentError, ValueError):
        return "<not a database URL>"


def private_database(path: Path) -> None:
    """Make the SQLite file ``path`` private before SQLite opens it: missing directories are
    created 0700, the file is created (or tightened to) 0600, and so are WAL and shared-memory
    files left beside it (SQLite gives the ones it creates the database file's mode). It holds
    every engine key: no other local user may read it."""
    missing = [p for p in (path.parent, *path.parent.parents) if not p.exists()]
    for folder in reversed(missing):
        folder.mkdir(mode=0o700)
        folder.chmod(0o700)
    os.close(os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o600))
    for companion in (path, path.with_name(f"{path.name}-wal"), path.with_name(f"{path.name}-shm")):
        if companion.exists() and companion.stat().st_mode & 0o077:
            companion.chmod(0o600)


def make_engine(
    url: str | os.PathLike[str] | None = None,
    *,
    connect_args: Mapping[str, Any] | None = None,
    busy_timeout: float = DEFAULT_BUSY_TIMEOUT,
) -> Engine:
    """An engine for ``url``: a SQLite file path or ``sqlite:///PATH`` (None: the default file),
    or ``postgresql://…`` (run through psycopg 3). ``connect_args`` go to the driver."""
    target = database_url(url)
    args = dict(connect_args or {})
    try:
        if target.get_backend_name() == "sqlite":
            if not target.database:  # database_url() refuses a SQLite URL without a file
                raise InternalError(f"a SQLite URL without a file reached make_engine: {target!r}")
            private_database(Path(target.database))
            engine = create_engine(target, connect_args=args)
            _configure_sqlite(engine, busy_timeout)
        else:
            args.setdefault("connect_timeout", 10)
            engine = create_engine(target, connect_args=args, pool_size=POOL_SIZE, max_overflow=POOL_OVERFLOW)
            _ping_when_idle(engine)
            _CONNECT_ARGS[engine] = args
    except (SQLAlchemyError, ImportError) as exc:
        raise StoreError(f"cannot create a database engine for {target!r}: {exc}") from exc
    return engine


def autocommit_twin(engine: Engine) -> Engine:
    """A second engine on ``engine``'s PostgreSQL database whose connections stay in autocommit
    for life: a pool of its own (``TWIN_POOL_SIZE``; the connection arguments ``make_engine`` gave
    ``engine``), with the same ping after idle. For single statements, atomic on their own (the
    agents' hot path).

    ``engine.execution_options(isolation_level="AUTOCOMMIT")`` shares the pool instead, so every
    checkout switched a connection into autocommit and every return switched it back: half the
    CPU of a one-row statement (0.47 against 0.27 ms, measured in process). Made once per
    engine, and disposed of with it (``Engine.dispose``)."""
    twin = _TWINS.get(engine)
    if twin is None:
        args = _CONNECT_ARGS.get(engine)
        if args is None:  # an engine not made by make_engine: its own pool's settings
            twin = create_engine(engine.url, pool=engine.pool.recreate(), isolation_level="AUTOCOMMIT")
        else:
            twin = create_engine(
                engine.url,
                connect_args=args,
                pool_size=TWIN_POOL_SIZE,
                max_overflow=TWIN_POOL_OVERFLOW,
                isolation_level="AUTOCOMMIT",
            )
        _ping_when_idle(twin)
        _TWINS[engine] = twin
        # One twin per engine, whatever the number of stores over it; gone with the engine's pool.
        event.listen(engine, "engine_disposed", lambda _engine: twin.dispose())
    return twin


_TWINS: weakref.WeakKeyDictionary[Engine, Engine] = weakref.WeakKeyDictionary()
# The driver arguments each PostgreSQL engine was made with, for its twin.
_CONNECT_ARGS: weakref.WeakKeyDictionary[Engine, dict[str, Any]] = weakref.WeakKeyDictionary()


def _ping_when_idle(engine: Engine) -> None:
    """Ping a PostgreSQL connection on checkout only when it sat in the pool for longer than
    ``PING_AFTER_IDLE``; a dead one is replaced (and the pool's older connections with it). A
    connection that broke within that time fails its statement (a ``StoreError``), and
    SQLAlchemy then replaces every pooled connection, so the next ones find fresh connections."""

    @event.listens_for(engine, "connect")
    def _on_connect(_dbapi_connection: Any, record: Any) -> None:
        record.info[_IDLE_SINCE] = time.monotonic()

    @event.listens_for(engine, "checkin")
    def _on_checkin(_dbapi_connection: Any, record: Any) -> None:
        if record is not None:
            record.info[_IDLE_SINCE] = time.monotonic()

    @event.listens_for(engine, "checkout")
    def _on_checkout(dbapi_connection: Any, record: Any, _proxy: Any) -> None:
        if time.monotonic() - record.info.get(_IDLE_SINCE, 0.0) <= PING_AFTER_IDLE:
            return
        try:
            engine.dialect.do_ping(dbapi_connection)
        except engine.dialect.loaded_dbapi.Error as exc:
            raise InvalidatePoolError(f"a pooled connection did not answer a ping: {exc}") from exc


def _configure_sqlite(engine: Engine, busy_timeout: float) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        # SQLAlchemy emits BEGIN itself (below); sqlite3 must not open transactions on its own.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute(f"PRAGMA busy_timeout = {int(busy_timeout * 1000)}")
            cursor.execute("PRAGMA journal_mode = WAL")
            cursor.execute("PRAGMA synchronous = NORMAL")
            cursor.execute("PRAGMA foreign_keys = ON")
        finally:
            cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(connection: Connection) -> None:
        # IMMEDIATE takes the write lock up front (waiting up to the busy timeout), so two writers
        # never both read, then both fail to upgrade. Read-only transactions need no lock.
        read_only = connection.get_execution_options().get(READ_ONLY, False)
        connection.exec_driver_sql("BEGIN" if read_only else "BEGIN IMMEDIATE")


def read_only(engine: Engine) -> Engine:
    """An engine sharing ``engine``'s pool whose transactions only read: a consistent snapshot
    (REPEATABLE READ on PostgreSQL, a deferred transaction on SQLite)."""
    if engine.dialect.name == "postgresql":
        return engine.execution_options(isolation_level="REPEATABLE READ", **{READ_ONLY: True})
    return engine.execution_options(**{READ_ONLY: True})


def describe(exc: BaseException) -> str:
    """A short, one-line account of a database error: the driver's class and first line."""
    cause = exc.orig if isinstance(exc, DBAPIError) and exc.orig is not None else exc
    lines = str(cause).strip().splitlines()
    text = lines[0] if lines else ""
    hint = ""
    if "no such table" in text or ("relation" in text and "does not exist" in text):
        hint = " (is the schema migrated? run fleetserve.store.migrate)"
    return f"{type(cause).__name__}: {text}{hint}"


@contextmanager
def converted(action: str) -> Iterator[None]:
    """Turn SQLAlchemy and driver errors raised inside into ``StoreError``, chained."""
    try:
        yield
    except SQLAlchemyError as exc:
        raise StoreError(f"state store: {action} failed: {describe(exc)}") from exc
