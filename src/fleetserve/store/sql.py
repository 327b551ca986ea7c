"""The SQL state store: the ``Inventory`` over SQLite or PostgreSQL, plus the control plane's state.

Every public method is one transaction. Writers serialise where they must: on SQLite every write
transaction starts with ``BEGIN IMMEDIATE`` (see ``db``); on PostgreSQL an allocation locks the
rows of the nodes it touches (``SELECT … FOR UPDATE``, in name order so two allocations never
deadlock), then checks free capacity, then inserts its device rows — whose primary key
(node, device_index) makes the database refuse a doubly allocated device even if every check
above were wrong. Times are passed in (``now``); nothing here reads a clock.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum
from types import MappingProxyType, TracebackType
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel
from pydantic import ValidationError as PydanticValidationError
from sqlalchemy import Engine, delete, func, insert, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from fleetserve.errors import (
    AllocationConflict,
    ConfigError,
    NotFound,
    Problem,
    StaleEpoch,
    UnknownNode,
    UnknownReplica,
)
from fleetserve.inventory.base import Registration
from fleetserve.modelfacts import ModelFacts
from fleetserve.placement.state import WorkingState
from fleetserve.snapshot import ClusterSnapshot, replica_ordinal
from fleetserve.spec.loader import Documents
from fleetserve.spec.resources import (
    Cordon,
    Deployment,
    DeviceClass,
    Fabric,
    Model,
    Node,
    NodeState,
    Replica,
    ReplicaState,
)
from fleetserve.store.db import converted, describe, make_engine, read_only
from fleetserve.store.schema import migrate
from fleetserve.store.tables import (
    ApiKeyRow,
    Base,
    DecisionRow,
    DeploymentRow,
    DeviceAllocationRow,
    DeviceClassRow,
    FabricRow,
    LeaderLeaseRow,
    ModelRow,
    NodeRow,
    ReplicaOrdinalRow,
    ReplicaRow,
    ReplicaShardRow,
    TokenRow,
    stamp,
)

if TYPE_CHECKING:
    import os

    from fleetserve.inventory.base import Inventory


class TokenKind(StrEnum):
    """What a token lets its bearer do."""

    ADMIN = "admin"  # the admin API
    JOIN = "join"  # an agent registering its node


@dataclass(frozen=True)
class StoredDeployment:
    """A deployment as stored: its spec, the generation of that spec, and its status."""

    deployment: Deployment
    generation: int
    status: Mapping[str, Any]


@dataclass(frozen=True)
class NodeHeartbeat:
    """When a node's agent was last heard from, with the node's state and epoch."""

    name: str
    state: NodeState
    epoch: int
    last_heartbeat: datetime | None


@dataclass(frozen=True)
class Decision:
    """One recorded placement decision or explanation for a deployment."""

    id: int
    deployment: str
    created_at: datetime
    explanation: Mapping[str, Any]


@dataclass(frozen=True)
class IssuedToken:
    """A new token. ``plaintext`` is returned this once; only its sha256 is stored."""

    id: int
    kind: TokenKind
    plaintext: str


@dataclass(frozen=True)
class ApiKey:
    """A gateway API key, without its secret."""

    id: int
    name: str
    models: tuple[str, ...]
    rpm: int | None
    tpm: int | None
    created_at: datetime
    revoked: bool

    def allows(self, model: str) -> bool:
        """Whether this key may use ``model``."""
        return "*" in self.models or model in self.models


def _api_key(row: ApiKeyRow) -> ApiKey:
    return ApiKey(row.id, row.name, tuple(row.models), row.rpm, row.tpm, row.created_at, row.revoked)


@dataclass(frozen=True)
class TokenRecord:
    """A stored token, without any secret."""

    id: int
    kind: TokenKind
    created_at: datetime
    revoked: bool


def _doc(model: BaseModel, exclude: set[str] | None = None) -> dict[str, Any]:
    return model.model_dump(mode="json", by_alias=True, exclude=exclude)


def _node(row: NodeRow) -> Node:
    cordon = None
    if row.cordon_reason is not None:
        cordon = Cordon(reason=row.cordon_reason, by=row.cordon_by or "operator")
    return Node.model_validate({**row.spec, "state": row.state, "cordon": cordon})


def _replica(spec: dict[str, Any], state: str) -> Replica:
    return Replica.model_validate({**spec, "state": state})


def _hash(plaintext: str) -> str:
    return hashlib.sha256(plaintext.encode()).hexdigest()


class SqlStore:
    """The state store over a SQLAlchemy engine (SQLite or PostgreSQL), schema already migrated.

    The engine stays the caller's unless the store was made by ``open``; ``close`` disposes it."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._reader = read_only(engine)
        self._postgres = engine.dialect.name == "postgresql"
        self._owned = False

    @classmethod
    def open(cls, url: str | os.PathLike[str] | None = None, *, migrate_schema: bool = True) -> SqlStore:
        """A store over a new engine for ``url`` (see ``make_engine``), migrated unless told not."""
        engine = make_engine(url)
        try:
            if migrate_schema:
                migrate(engine)
        except BaseException:
            engine.dispose()
            raise
        store = cls(engine)
        store._owned = True
        return store

    @property
    def engine(self) -> Engine:
        return self._engine

    def close(self) -> None:
        """Dispose of the engine if this store created it."""
        if self._owned:
            self._engine.dispose()

    def __enter__(self) -> SqlStore:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # --- transactions ---------------------------------------------------------------------

    @contextmanager
    def _write(self, action: str) -> Iterator[Session]:
        with converted(action), Session(self._engine) as session, session.begin():
            yield session

    @contextmanager
    def _read(self, action: str) -> Iterator[Session]:
        with converted(action), Session(self._reader) as session, session.begin():
            yield session

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

    @staticmethod
    def _locked_node(session: Session, name: str) -> NodeRow:
        row = session.scalars(select(NodeRow).where(NodeRow.name == name).with_for_update()).one_or_none()
        if row is None:
            raise UnknownNode(f"no node named {name!r} is registered")
        return row

    # --- Inventory ------------------------------------------------------------------------

    def put_class(self, cls: DeviceClass) -> None:
        with self._write(f"storing device class {cls.name}") as s:
            self._put(s, DeviceClassRow, cls.name, _doc(cls))

    def put_fabric(self, fabric: Fabric) -> None:
        with self._write(f"storing fabric {fabric.name}") as s:
            self._put(s, FabricRow, fabric.name, _doc(fabric))

    def register(self, node: Node) -> Registration:
        with self._write(f"registering node {node.name}") as s:
            return self._register(s, node)

    def _register(self, s: Session, node: Node) -> Registration:
        created = self._insert_new(
            s,
            NodeRow,
            name=node.name,
            spec={},
            state=NodeState.READY.value,
            # A new node keeps a cordon its document carries; an existing one keeps its own.
            cordon_reason=node.cordon.reason if node.cordon else None,
            cordon_by=node.cordon.by if node.cordon else None,
            epoch=0,
        )
        row = self._locked_node(s, node.name)
        row.spec = _doc(node, exclude={"state", "cordon"})
        row.state = NodeState.READY.value
        row.epoch += 1
        return Registration(_node(row), row.epoch, created)

    def get_node(self, name: str) -> Node:
        with self._read(f"reading node {name}") as s:
            row = s.get(NodeRow, name)
            if row is None:
                raise UnknownNode(f"no node named {name!r} is registered")
            return _node(row)

    def nodes(self) -> list[Node]:
        with self._read("listing nodes") as s:
            return sorted((_node(r) for r in s.scalars(select(NodeRow))), key=lambda n: n.name)

    def epoch(self, name: str) -> int:
        """The node's registration epoch (0 if never registered)."""
        with self._read(f"reading node {name}") as s:
            return s.scalar(select(NodeRow.epoch).where(NodeRow.name == name)) or 0

    def cordon(self, name: str, reason: str, by: str = "operator") -> Node:
        try:
            cordon = Cordon(reason=reason, by=by)  # validates before touching the database
        except PydanticValidationError as exc:
            raise ConfigError(
                [Problem(f"Node {name}", "cordon.reason", "give a reason for the cordon")]
            ) from exc
        with self._write(f"cordoning node {name}") as s:
            row = self._locked_node(s, name)
            row.cordon_reason, row.cordon_by = cordon.reason, cordon.by
            return _node(row)

    def uncordon(self, name: str) -> Node:
        with self._write(f"uncordoning node {name}") as s:
            row = self._locked_node(s, name)
            row.cordon_reason = row.cordon_by = None
            return _node(row)

    def set_state(self, name: str, state: NodeState) -> Node:
        with self._write(f"setting node {name} {state}") as s:
            row = self._locked_node(s, name)
            row.state = NodeState(state).value
            return _node(row)

    def allocate(self, replica: Replica) -> None:
        names = sorted({shard.node for shard in replica.shards})
        with self._write(f"allocating replica {replica.name}") as s:
            # Lock the nodes first: concurrent allocations on them wait here, then see our rows.
            rows = s.scalars(
                select(NodeRow).where(NodeRow.name.in_(names)).order_by(NodeRow.name).with_for_update()
            ).all()
            if s.get(ReplicaRow, replica.name) is not None:
                raise AllocationConflict(f"replica {replica.name} is already allocated")
            self._free_capacity(s, rows).check(replica)
            epochs = {row.name: row.epoch for row in rows}
            conn = s.connection()
            try:
                conn.execute(
                    insert(ReplicaRow).values(
                        name=replica.name,
                        deployment=replica.deployment,
                        profile=replica.profile,
                        spec=_doc(replica, exclude={"state"}),
                        state=replica.state.value,
                    )
                )
                conn.execute(
                    insert(ReplicaShardRow),
                    [
                        {
                            "replica": replica.name,
                            "shard": i,
                            "node": shard.node,
                            "cpu_cores": shard.cpu_cores,
                            "memory": shard.memory,
                            "node_epoch": epochs[shard.node],
                        }
                        for i, shard in enumerate(replica.shards)
                    ],
                )
                devices = [
                    {"node": shard.node, "device_index": index, "replica": replica.name}
                    for shard in replica.shards
                    for index in shard.devices
                ]
                if devices:
                    conn.execute(insert(DeviceAllocationRow), devices)
                ordinal = replica_ordinal(replica.deployment, replica.name)
                if ordinal is not None:
                    self._bump_ordinal(s, replica.deployment, ordinal + 1)
            except IntegrityError as exc:
                raise AllocationConflict(
                    f"replica {replica.name}: taken concurrently by another allocation ({describe(exc)})"
                ) from exc

    def _bump_ordinal(self, s: Session, deployment: str, at_least: int) -> None:
        dialect_insert = postgresql.insert if self._postgres else sqlite.insert
        stmt = dialect_insert(ReplicaOrdinalRow).values(deployment=deployment, next_ordinal=at_least)
        s.connection().execute(
            stmt.on_conflict_do_update(
                index_elements=["deployment"],
                set_={"next_ordinal": func.max(ReplicaOrdinalRow.next_ordinal, stmt.excluded.next_ordinal)}
                if not self._postgres
                else {
                    "next_ordinal": func.greatest(ReplicaOrdinalRow.next_ordinal, stmt.excluded.next_ordinal)
                },
            )
        )

    @staticmethod
    def _free_capacity(session: Session, rows: Sequence[NodeRow]) -> WorkingState:
        """The free devices, cores and memory of the locked nodes, as a ``WorkingState``."""
        state = WorkingState(ClusterSnapshot(classes=MappingProxyType({}), nodes=tuple(map(_node, rows))))
        names = [row.name for row in rows]
        taken = select(DeviceAllocationRow.node, DeviceAllocationRow.device_index).where(
            DeviceAllocationRow.node.in_(names)
        )
        for node, index in session.execute(taken):
            work = state.by_name[node]
            cls = work.class_of.get(index)
            if cls is not None and cls in work.free:
                work.free[cls].discard(index)
        used = (
            select(
                ReplicaShardRow.node, func.sum(ReplicaShardRow.cpu_cores), func.sum(ReplicaShardRow.memory)
            )
            .where(ReplicaShardRow.node.in_(names))
            .group_by(ReplicaShardRow.node)
        )
        for node, cores, memory in session.execute(used):
            state.by_name[node].used_cores = int(cores or 0)
            state.by_name[node].used_memory = int(memory or 0)
        return state

    def release(self, name: str) -> Replica:
        with self._write(f"releasing replica {name}") as s:
            # Shards and device rows go with it (ON DELETE CASCADE).
            row = (
                s.connection()
                .execute(
                    delete(ReplicaRow)
                    .where(ReplicaRow.name == name)
                    .returning(ReplicaRow.spec, ReplicaRow.state)
                )
                .one_or_none()
            )
            if row is None:
                raise UnknownReplica(f"no replica named {name!r} is allocated")
            return _replica(row.spec, row.state)

    def replicas(self, deployment: str | None = None) -> list[Replica]:
        """Every allocated replica (of one deployment, if named), by name."""
        query = select(ReplicaRow)
        if deployment is not None:
            query = query.where(ReplicaRow.deployment == deployment)
        with self._read("listing replicas") as s:
            out = [_replica(r.spec, r.state) for r in s.scalars(query)]
        return sorted(out, key=lambda r: r.name)

    def snapshot(self, models: Mapping[str, ModelFacts] | None = None) -> ClusterSnapshot:
        with self._read("taking a snapshot") as s:
            classes = {r.name: DeviceClass.model_validate(r.spec) for r in s.scalars(select(DeviceClassRow))}
            fabrics = {r.name: Fabric.model_validate(r.spec) for r in s.scalars(select(FabricRow))}
            nodes = sorted((_node(r) for r in s.scalars(select(NodeRow))), key=lambda n: n.name)
            replicas = sorted(
                (_replica(r.spec, r.state) for r in s.scalars(select(ReplicaRow))), key=lambda r: r.name
            )
            ordinal_rows = s.execute(select(ReplicaOrdinalRow.deployment, ReplicaOrdinalRow.next_ordinal))
            ordinals = {name: n for name, n in ordinal_rows}
        return ClusterSnapshot(
            classes=MappingProxyType(dict(sorted(classes.items()))),
            nodes=tuple(nodes),
            fabrics=MappingProxyType(dict(sorted(fabrics.items()))),
            replicas=tuple(replicas),
            models=MappingProxyType(dict(models or {})),
            next_ordinals=MappingProxyType(ordinals),
        )

    # --- whole batches and deletions ---------------------------------------------------------

    def _put_spec(self, s: Session, entity: type[Base], name: str, spec: dict[str, Any]) -> str:
        row = s.get(entity, name)
        result = (
            "created"
            if row is None
            else ("unchanged" if getattr(row, "spec", None) == spec else "configured")
        )
        self._put(s, entity, name, spec)
        return result

    def apply_documents(self, docs: Documents) -> list[tuple[str, str, str]]:
        """Write classes, fabrics, nodes, models and deployments in ONE transaction (all or
        nothing); per document (kind, name, created|configured|unchanged). Nodes are registered
        (hardware facts updated, cordon kept). The caller checks references first."""
        out: list[tuple[str, str, str]] = []
        with self._write(f"applying {sum(1 for _ in docs.all())} documents") as s:
            for cls in docs.classes:
                out.append(("DeviceClass", cls.name, self._put_spec(s, DeviceClassRow, cls.name, _doc(cls))))
            for fabric in docs.fabrics:
                out.append(("Fabric", fabric.name, self._put_spec(s, FabricRow, fabric.name, _doc(fabric))))
            for node in docs.nodes:
                reg = self._register(s, node)
                out.append(("Node", node.name, "created" if reg.created else "configured"))
            for model in docs.models:
                out.append(("Model", model.name, self._put_spec(s, ModelRow, model.name, _doc(model))))
            for dep in docs.deployments:
                out.append(("Deployment", dep.name, self._put_deployment(s, dep)[1]))
        return out

    def delete_class(self, name: str) -> None:
        """Forget a device class. Nodes and deployments naming it stay; the gate reports them."""
        with self._write(f"deleting device class {name}") as s:
            self._delete(s, DeviceClassRow, name, "device class")

    def delete_fabric(self, name: str) -> None:
        """Forget a fabric."""
        with self._write(f"deleting fabric {name}") as s:
            self._delete(s, FabricRow, name, "fabric")

    def delete_node(self, name: str) -> None:
        """Forget a node; refused (AllocationConflict) while a replica holds anything on it."""
        with self._write(f"deleting node {name}") as s:
            self._locked_node(s, name)
            held = s.scalars(select(ReplicaShardRow.replica).where(ReplicaShardRow.node == name)).all()
            if held:
                raise AllocationConflict(
                    f"node {name} still holds replicas {sorted(set(held))}; drain it first"
                )
            self._delete(s, NodeRow, name, "node")

    # --- nodes: liveness ------------------------------------------------------------------

    def heartbeat(self, name: str, now: datetime, epoch: int | None = None) -> None:
        """Record that the node's agent was heard from at ``now``; raises UnknownNode, and
        StaleEpoch when ``epoch`` is given and is not the node's current registration."""
        when = stamp(now)
        with self._write(f"recording a heartbeat of node {name}") as s:
            row = s.get(NodeRow, name)
            if row is None:
                raise UnknownNode(f"no node named {name!r} is registered")
            self._check_epoch(row, epoch)
            s.connection().execute(update(NodeRow).where(NodeRow.name == name).values(last_heartbeat=when))

    @staticmethod
    def _check_epoch(row: NodeRow, epoch: int | None) -> None:
        if epoch is None:
            return
        if epoch != row.epoch:
            raise StaleEpoch(
                f"node {row.name} is at epoch {row.epoch}, not {epoch}: it registered again since; "
                "register again and stop every replica not assigned"
            )
        if row.state != NodeState.READY.value:
            # Judged NotReady or Lost while silent: only a registration brings it back, and tells
            # the agent which of its replicas were moved away meanwhile.
            raise StaleEpoch(f"node {row.name} was marked {row.state} while silent; register again")

    def assignments(self, node: str) -> list[Replica]:
        """The replicas with a shard on ``node``, by name: what its agent must run."""
        with self._read(f"listing the assignments of node {node}") as s:
            names = select(ReplicaShardRow.replica).where(ReplicaShardRow.node == node)
            rows = s.scalars(select(ReplicaRow).where(ReplicaRow.name.in_(names)))
            return sorted((_replica(r.spec, r.state) for r in rows), key=lambda r: r.name)

    def report(
        self,
        node: str,
        epoch: int,
        now: datetime,
        replicas: Mapping[str, tuple[ReplicaState, Mapping[str, Any]]],
        model_cache: Sequence[str] | None = None,
        agent_status: Mapping[str, Any] | None = None,
    ) -> list[str]:
        """An agent's status report, in one transaction: the states of its replicas (only those
        assigned to it), its model cache (placement prefers nodes holding a model) and anything
        else it reports; also a heartbeat. Returns the reported names not assigned to the node —
        the agent must stop those. Raises StaleEpoch for an old registration."""
        when = stamp(now)
        with self._write(f"recording a status report of node {node}") as s:
            row = self._locked_node(s, node)
            self._check_epoch(row, epoch)
            row.last_heartbeat = when
            if model_cache is not None:
                row.spec = {**row.spec, "modelCache": sorted(set(model_cache))}
            if agent_status is not None:
                row.agent_status = dict(agent_status)
            mine = set(s.scalars(select(ReplicaShardRow.replica).where(ReplicaShardRow.node == node)))
            for name, (state, status) in replicas.items():
                if name in mine:
                    s.connection().execute(
                        update(ReplicaRow)
                        .where(ReplicaRow.name == name)
                        .values(state=ReplicaState(state).value, status=dict(status))
                    )
            return sorted(set(replicas) - mine)

    def replica_status(self, name: str) -> dict[str, Any]:
        """What the agent last reported about a replica (message, restarts, stderr tail)."""
        with self._read(f"reading replica {name}") as s:
            row = s.get(ReplicaRow, name)
            if row is None:
                raise UnknownReplica(f"no replica named {name!r} is allocated")
            return dict(row.status or {})

    def agent_statuses(self) -> dict[str, dict[str, Any]]:
        """Every node's last agent report beyond replica states, in one read."""
        with self._read("reading the agents' reports") as s:
            rows = s.execute(select(NodeRow.name, NodeRow.agent_status))
            return {name: dict(status or {}) for name, status in rows}

    def agent_status(self, node: str) -> dict[str, Any]:
        """What the node's agent last reported beyond replica states (downloads, problems)."""
        with self._read(f"reading node {node}") as s:
            row = s.get(NodeRow, node)
            if row is None:
                raise UnknownNode(f"no node named {node!r} is registered")
            return dict(row.agent_status or {})

    def node_heartbeats(self) -> list[NodeHeartbeat]:
        """Every node's state, epoch and last heartbeat (None if never heard), by name."""
        with self._read("listing heartbeats") as s:
            rows = s.execute(select(NodeRow.name, NodeRow.state, NodeRow.epoch, NodeRow.last_heartbeat))
            out = [NodeHeartbeat(name, NodeState(state), epoch, last) for name, state, epoch, last in rows]
        return sorted(out, key=lambda h: h.name)

    # --- replicas -------------------------------------------------------------------------

    def get_replica(self, name: str) -> Replica:
        with self._read(f"reading replica {name}") as s:
            row = s.get(ReplicaRow, name)
            if row is None:
                raise UnknownReplica(f"no replica named {name!r} is allocated")
            return _replica(row.spec, row.state)

    def set_replica_state(self, name: str, state: ReplicaState) -> Replica:
        """Record where a replica is in its life; raises UnknownReplica."""
        with self._write(f"setting replica {name} {state}") as s:
            row = s.scalars(select(ReplicaRow).where(ReplicaRow.name == name).with_for_update()).one_or_none()
            if row is None:
                raise UnknownReplica(f"no replica named {name!r} is allocated")
            row.state = ReplicaState(state).value
            return _replica(row.spec, row.state)

    def placement_epochs(self, name: str) -> dict[str, int]:
        """Per node of the replica, the node's epoch when the replica was placed (fencing)."""
        with self._read(f"reading replica {name}") as s:
            if s.get(ReplicaRow, name) is None:
                raise UnknownReplica(f"no replica named {name!r} is allocated")
            rows = s.execute(
                select(ReplicaShardRow.node, ReplicaShardRow.node_epoch).where(
                    ReplicaShardRow.replica == name
                )
            )
            return {node: epoch for node, epoch in rows}

    # --- models ---------------------------------------------------------------------------

    def put_model(self, model: Model) -> None:
        with self._write(f"storing model {model.name}") as s:
            self._put(s, ModelRow, model.name, _doc(model))

    def get_model(self, name: str) -> Model:
        with self._read(f"reading model {name}") as s:
            row = s.get(ModelRow, name)
            if row is None:
                raise NotFound(f"no model named {name!r} is stored")
            return Model.model_validate(row.spec)

    def list_models(self) -> list[Model]:
        with self._read("listing models") as s:
            out = [Model.model_validate(r.spec) for r in s.scalars(select(ModelRow))]
        return sorted(out, key=lambda m: m.name)

    def delete_model(self, name: str) -> None:
        with self._write(f"deleting model {name}") as s:
            self._delete(s, ModelRow, name, "model")

    # --- deployments ----------------------------------------------------------------------

    def put_deployment(self, deployment: Deployment) -> int:
        """Create or replace a deployment; its generation: 1 when new, +1 when the spec changed,
        unchanged when the same spec is applied again."""
        with self._write(f"storing deployment {deployment.name}") as s:
            return self._put_deployment(s, deployment)[0]

    def _put_deployment(self, s: Session, deployment: Deployment) -> tuple[int, str]:
        spec = _doc(deployment)
        if self._insert_new(s, DeploymentRow, name=deployment.name, spec=spec, generation=1, status={}):
            return 1, "created"
        row = s.scalars(
            select(DeploymentRow).where(DeploymentRow.name == deployment.name).with_for_update()
        ).one()
        if row.spec == spec:
            return row.generation, "unchanged"
        row.spec = spec
        row.generation += 1
        return row.generation, "configured"

    def get_deployment(self, name: str) -> StoredDeployment:
        with self._read(f"reading deployment {name}") as s:
            row = s.get(DeploymentRow, name)
            if row is None:
                raise NotFound(f"no deployment named {name!r} is stored")
            return _stored_deployment(row)

    def list_deployments(self) -> list[StoredDeployment]:
        with self._read("listing deployments") as s:
            out = [_stored_deployment(r) for r in s.scalars(select(DeploymentRow))]
        return sorted(out, key=lambda d: d.deployment.name)

    def set_deployment_status(self, name: str, status: Mapping[str, Any]) -> None:
        """Replace a deployment's status (JSON-serialisable); raises NotFound."""
        with self._write(f"setting the status of deployment {name}") as s:
            result = s.connection().execute(
                update(DeploymentRow).where(DeploymentRow.name == name).values(status=dict(status))
            )
            if result.rowcount == 0:
                raise NotFound(f"no deployment named {name!r} is stored")

    def delete_deployment(self, name: str) -> None:
        """Forget a deployment. Its replicas stay allocated until released (stopping them is the
        reconciler's job, not the store's)."""
        with self._write(f"deleting deployment {name}") as s:
            self._delete(s, DeploymentRow, name, "deployment")

    # --- decisions ------------------------------------------------------------------------

    def record_decision(self, deployment: str, explanation: Mapping[str, Any], now: datetime) -> int:
        """Keep a placement decision or explanation (JSON-serialisable); its id."""
        when = stamp(now)
        with self._write(f"recording a decision for {deployment}") as s:
            row = DecisionRow(deployment=deployment, created_at=when, explanation=dict(explanation))
            s.add(row)
            s.flush()
            return row.id

    def list_decisions(self, deployment: str | None = None, limit: int = 100) -> list[Decision]:
        """The most recent decisions (of one deployment, if named), newest first."""
        query = (
            select(DecisionRow).order_by(DecisionRow.created_at.desc(), DecisionRow.id.desc()).limit(limit)
        )
        if deployment is not None:
            query = query.where(DecisionRow.deployment == deployment)
        with self._read("listing decisions") as s:
            return [Decision(r.id, r.deployment, r.created_at, r.explanation) for r in s.scalars(query)]

    def prune_decisions(self, before: datetime) -> int:
        """Forget decisions recorded before ``before``; how many."""
        when = stamp(before)
        with self._write("pruning decisions") as s:
            return s.connection().execute(delete(DecisionRow).where(DecisionRow.created_at < when)).rowcount

    # --- tokens ---------------------------------------------------------------------------

    def create_token(self, kind: TokenKind, now: datetime) -> IssuedToken:
        """A new random token of ``kind``. Its plaintext is in the result only; the store keeps
        its sha256 (tokens are 256 random bits, so a fast hash is enough)."""
        kind = TokenKind(kind)
        when = stamp(now)
        plaintext = f"fs_{kind.value}_{secrets.token_urlsafe(32)}"
        with self._write(f"creating a {kind.value} token") as s:
            row = TokenRow(kind=kind.value, token_hash=_hash(plaintext), created_at=when, revoked=False)
            s.add(row)
            s.flush()
            return IssuedToken(row.id, kind, plaintext)

    def verify_token(self, plaintext: str, kind: TokenKind) -> bool:
        """Whether ``plaintext`` is a stored, unrevoked token of ``kind``."""
        query = select(TokenRow.id).where(
            TokenRow.token_hash == _hash(plaintext),
            TokenRow.kind == TokenKind(kind).value,
            TokenRow.revoked.is_(False),
        )
        with self._read("verifying a token") as s:
            return s.scalar(query) is not None

    def revoke_token(self, token_id: int) -> None:
        """Revoke a token for good; raises NotFound."""
        with self._write(f"revoking token {token_id}") as s:
            result = s.connection().execute(
                update(TokenRow).where(TokenRow.id == token_id).values(revoked=True)
            )
            if result.rowcount == 0:
                raise NotFound(f"no token with id {token_id} is stored")

    def list_tokens(self) -> list[TokenRecord]:
        with self._read("listing tokens") as s:
            rows = s.scalars(select(TokenRow).order_by(TokenRow.id))
            return [TokenRecord(r.id, TokenKind(r.kind), r.created_at, r.revoked) for r in rows]

    # --- gateway API keys -------------------------------------------------------------------

    def create_api_key(
        self, name: str, models: Sequence[str], rpm: int | None, tpm: int | None, now: datetime
    ) -> tuple[ApiKey, str]:
        """A new API key; the plaintext is returned this once, only its sha256 is stored."""
        plaintext = f"fs_key_{secrets.token_urlsafe(32)}"
        when = stamp(now)
        with self._write(f"creating API key {name}") as s:
            row = ApiKeyRow(
                name=name, key_hash=_hash(plaintext), models=list(models), rpm=rpm, tpm=tpm,
                created_at=when, revoked=False,
            )  # fmt: skip
            s.add(row)
            s.flush()
            return _api_key(row), plaintext

    def list_api_keys(self) -> list[ApiKey]:
        """Every API key (no secrets), by id."""
        with self._read("listing API keys") as s:
            return [_api_key(r) for r in s.scalars(select(ApiKeyRow).order_by(ApiKeyRow.id))]

    def revoke_api_key(self, key_id: int) -> None:
        """Revoke an API key for good; raises NotFound."""
        with self._write(f"revoking API key {key_id}") as s:
            result = s.connection().execute(
                update(ApiKeyRow).where(ApiKeyRow.id == key_id).values(revoked=True)
            )
            if result.rowcount == 0:
                raise NotFound(f"no API key with id {key_id}")

    def verify_api_key(self, plaintext: str) -> ApiKey | None:
        """The unrevoked key ``plaintext`` is, or None."""
        with self._read("verifying an API key") as s:
            row = s.scalars(
                select(ApiKeyRow).where(ApiKeyRow.key_hash == _hash(plaintext), ApiKeyRow.revoked.is_(False))
            ).one_or_none()
            return _api_key(row) if row is not None else None

    def replica_endpoints(self) -> list[tuple[Replica, str, dict[str, Any]]]:
        """Every replica with the address of its first shard's node and its reported status."""
        with self._read("listing replica endpoints") as s:
            addresses = {r.name: r.spec.get("address", "") for r in s.scalars(select(NodeRow))}
            out = []
            for row in s.scalars(select(ReplicaRow)):
                replica = _replica(row.spec, row.state)
                out.append((replica, addresses.get(replica.shards[0].node, ""), dict(row.status or {})))
        return sorted(out, key=lambda t: t[0].name)

    # --- leadership -----------------------------------------------------------------------

    def try_acquire_leadership(self, name: str, holder: str, now: datetime, ttl: timedelta) -> bool:
        """Take or renew the lease ``name`` for ``holder`` until ``now + ttl``. False while another
        holder's lease has not expired. Call again well within ``ttl`` to keep it."""
        if ttl <= timedelta(0):
            raise ValueError(f"a lease needs a positive ttl, got {ttl}")
        when = stamp(now)
        with self._write(f"acquiring lease {name}") as s:
            if self._insert_new(s, LeaderLeaseRow, name=name, holder=holder, expires_at=when + ttl):
                return True
            row = s.scalars(select(LeaderLeaseRow).where(LeaderLeaseRow.name == name).with_for_update()).one()
            if row.holder != holder and row.expires_at > when:
                return False
            row.holder, row.expires_at = holder, when + ttl
            return True

    def release_leadership(self, name: str, holder: str) -> bool:
        """Give the lease up if ``holder`` has it (so a successor need not wait); whether it did."""
        with self._write(f"releasing lease {name}") as s:
            result = s.connection().execute(
                delete(LeaderLeaseRow).where(LeaderLeaseRow.name == name, LeaderLeaseRow.holder == holder)
            )
            return result.rowcount == 1

    def leader(self, name: str, now: datetime) -> str | None:
        """Who holds the lease ``name`` at ``now``; None if nobody or it expired."""
        when = stamp(now)
        with self._read(f"reading lease {name}") as s:
            row = s.get(LeaderLeaseRow, name)
            return row.holder if row is not None and row.expires_at > when else None


def _stored_deployment(row: DeploymentRow) -> StoredDeployment:
    return StoredDeployment(
        Deployment.model_validate(row.spec), row.generation, MappingProxyType(dict(row.status))
    )


if TYPE_CHECKING:

    def _conforms(store: SqlStore) -> Inventory:
        return store  # mypy checks that SqlStore implements the Inventory protocol
