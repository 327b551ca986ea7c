"""The store's common ground: the engine, one transaction per public method (``_write`` /
``_read``), the upsert and delete helpers every aggregate uses, and the row → value converters.

Every public method of the aggregates (``inventory``, ``reports``, ``deployments``,
``credentials``, ``lease``) is one transaction. Writers serialise where they must: on SQLite every
write transaction starts with ``BEGIN IMMEDIATE`` (see ``db``); on PostgreSQL a write locks the
rows it changes (``SELECT … FOR UPDATE``). Times are passed in (``now``); nothing here reads a clock.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import Any

from pydantic import BaseModel
from sqlalchemy import Connection, Engine, Text, cast, delete, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from fleetserve.errors import (
    NotFound,
    UnknownNode,
)
from fleetserve.protocol import AgentStatus, ReplicaStatus
from fleetserve.snapshot import ReplicaFacts
from fleetserve.spec.nodeparts import Cordon
from fleetserve.spec.resources import Node, NodeState, Replica
from fleetserve.store.db import autocommit_twin, converted, read_only
from fleetserve.store.doccache import ParseCache, ReplicaDocs, ReplicaKey
from fleetserve.store.tables import (
    Base,
    NodeRow,
    ReplicaRow,
)

# Names per ``IN (...)`` list: well inside every driver's limit on bound parameters.
IN_CHUNK = 500

# A node's stored columns as read for a snapshot: its spec as JSON text, state, cordon reason and author.
NodeRaw = tuple[str, str, str | None, str | None]


def doc(model: BaseModel, exclude: set[str] | None = None) -> dict[str, Any]:
    """A document as the JSON the store keeps."""
    return model.model_dump(mode="json", by_alias=True, exclude=exclude)


def node_of(row: NodeRow) -> Node:
    """A node row as the Node document, with its state and cordon."""
    return _node(row.spec, row.state, row.cordon_reason, row.cordon_by)


def _node(spec: dict[str, Any], state: str, reason: str | None, by: str | None) -> Node:
    cordon = None if reason is None else Cordon(reason=reason, by=by or "operator")
    return Node.model_validate({**spec, "state": state, "cordon": cordon})


def move_node(row: NodeRow, state: NodeState) -> None:
    """Set a locked node row's state. A node that leaves Ready speaks for its GPUs no more: its
    last samples are dropped."""
    row.state = NodeState(state).value
    status = row.agent_status
    if row.state != NodeState.READY.value and status and status.get("gpuMetrics"):
        row.agent_status = {**status, "gpuMetrics": []}


def as_text(column: Any) -> Any:
    """A JSON column read as its text: compared as a string, decoded only when it changed (a
    whole fleet's documents decoded on every read were most of a snapshot at 5,000 nodes)."""
    return cast(column, Text)


def node_from(raw: NodeRaw) -> Node:
    """A node's stored columns (spec as JSON text, state, cordon reason and author) as the Node."""
    spec, state, reason, by = raw
    return _node(json.loads(spec), state, reason, by)


def status_from(raw: str | None) -> ReplicaStatus:
    """A replica's stored status (JSON text) as the typed value (empty when never reported)."""
    return ReplicaStatus.model_validate_json(raw) if raw and raw != "null" else ReplicaStatus()


FactsRaw = tuple[str | None, datetime | None, datetime | None]  # status JSON, reported at, draining since


def replica_facts_from(raw: FactsRaw) -> ReplicaFacts:
    """What the snapshot knows of a replica beyond its document, from its stored columns: its
    agent's last message and in-flight count, when that count was read, since when it drains."""
    text, reported_at, draining_since = raw
    status = status_from(text)
    read_at = reported_at
    if read_at is not None and status.in_flight_age is not None:
        read_at -= timedelta(seconds=status.in_flight_age)  # when the agent read the count
    return ReplicaFacts(
        message=status.message,
        in_flight=status.in_flight,
        reported_at=read_at,
        draining_since=draining_since,
    )


def agent_status_from(raw: str | None) -> AgentStatus:
    """A node's stored agent status (JSON text) as the typed value (empty when never reported)."""
    return AgentStatus.model_validate_json(raw) if raw and raw != "null" else AgentStatus()


def replica_of(spec: dict[str, Any], state: str) -> Replica:
    """A replica row's spec and state as the Replica."""
    return Replica.model_validate({**spec, "state": state})


class SqlBase:
    """A SQLAlchemy engine (SQLite or PostgreSQL) with the session helpers every aggregate uses."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._reader = read_only(engine)
        self._postgres = engine.dialect.name == "postgresql"
        # One statement on its own needs no transaction around it on PostgreSQL: in autocommit it
        # is one round trip, not three (BEGIN, the statement, COMMIT). The agents' hot path. A
        # pool of its own (``autocommit_twin``), disposed of with the engine.
        self._autocommit = autocommit_twin(engine) if self._postgres else None
        self._owned = False
        # Parsed documents kept between whole-fleet reads (``doccache``): one store per process.
        self._replica_docs = ReplicaDocs()
        self._node_docs: ParseCache[str, Node] = ParseCache(node_from)
        self._statuses: ParseCache[str, ReplicaStatus] = ParseCache(status_from)  # by replica
        # By replica: (status JSON, reported at, draining since) → what the snapshot knows of it.
        self._replica_facts: ParseCache[str, ReplicaFacts] = ParseCache(replica_facts_from)
        self._agent_statuses: ParseCache[str, AgentStatus] = ParseCache(agent_status_from)

    @property
    def engine(self) -> Engine:
        return self._engine

    # --- transactions ---------------------------------------------------------------------

    @contextmanager
    def _write(self, action: str) -> Iterator[Session]:
        with converted(action), Session(self._engine) as session, session.begin():
            yield session

    @contextmanager
    def _read(self, action: str) -> Iterator[Session]:
        with converted(action), Session(self._reader) as session, session.begin():
            yield session

    @contextmanager
    def _single(self, action: str, *, write: bool) -> Iterator[Connection]:
        """A connection for ONE statement, atomic on its own, with no ORM session: on PostgreSQL in
        autocommit (a single round trip); on SQLite in a transaction of its own (a write one with
        ``write``, which takes the lock up front as every write does)."""
        engine = self._autocommit or (self._engine if write else self._reader)
        with converted(action), engine.connect() as conn:
            if self._autocommit is not None:
                yield conn
                return
            with conn.begin():
                yield conn

    def _replicas_of(self, s: Session, rows: Sequence[tuple[str, str | None, str]]) -> dict[str, Replica]:
        """Per replica name, its document, for (name, engine key, state) rows read in ``s``: the
        JSON of only the allocations not kept already is fetched, in the same transaction."""
        keys: list[ReplicaKey] = [(name, key) for name, key, _ in rows]
        missing = self._replica_docs.missing(keys)
        fetched: dict[ReplicaKey, dict[str, Any]] = {}
        for i in range(0, len(missing), IN_CHUNK):
            names = [name for name, _ in missing[i : i + IN_CHUNK]]
            query = select(ReplicaRow.name, ReplicaRow.engine_key, ReplicaRow.spec).where(
                ReplicaRow.name.in_(names)
            )
            for name, key, spec in s.execute(query):
                fetched[(name, key)] = spec
        return self._replica_docs.resolve((((name, key), state) for name, key, state in rows), fetched)

    def _insert_new(self, session: Session, entity: type[Base], **values: Any) -> bool:
        """Insert a row unless its key exists; whether it was inserted. Race-free on both
        backends (ON CONFLICT DO NOTHING), so two first registrations never collide."""
        dialect_insert = postgresql.insert if self._postgres else sqlite.insert
        key = Base.metadata.tables[entity.__tablename__].primary_key.columns
        stmt = dialect_insert(entity).values(**values).on_conflict_do_nothing().returning(*key)
        # RETURNING, not rowcount: drivers need not report a rowcount for INSERT.
        return session.connection().execute(stmt).first() is not None

    def _put(self, session: Session, entity: type[Base], name: str, spec: dict[str, Any]) -> None:
        dialect_insert = postgresql.insert if self._postgres else sqlite.insert
        stmt = dialect_insert(entity).values(name=name, spec=spec)
        session.connection().execute(
            stmt.on_conflict_do_update(index_elements=["name"], set_={"spec": stmt.excluded.spec})
        )

    def _delete(self, session: Session, entity: type[Base], name: str, what: str) -> None:
        table = Base.metadata.tables[entity.__tablename__]
        result = session.connection().execute(delete(table).where(table.c.name == name))
        if result.rowcount == 0:
            raise NotFound(f"no {what} named {name!r} is stored")

    def _put_spec(self, s: Session, entity: type[Base], name: str, spec: dict[str, Any]) -> str:
        row = s.get(entity, name)
        result = (
            "created"
            if row is None
            else ("unchanged" if getattr(row, "spec", None) == spec else "configured")
        )
        self._put(s, entity, name, spec)
        return result

    @staticmethod
    def _locked_node(session: Session, name: str) -> NodeRow:
        row = session.scalars(select(NodeRow).where(NodeRow.name == name).with_for_update()).one_or_none()
        if row is None:
            raise UnknownNode(f"no node named {name!r} is registered")
        return row
