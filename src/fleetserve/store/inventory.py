"""The inventory aggregate over SQL: device classes, fabrics, nodes (registration, cordons,
states), the allocation of replicas onto devices, and the cluster snapshot placement reads.

An allocation locks the rows of the nodes it touches (in name order, so two allocations never
deadlock), then checks free capacity, then inserts its device rows — whose primary key
(node, device_index) makes the database refuse a doubly allocated device even if every check above
were wrong. ``drain`` cordons a node and releases its replicas in one transaction.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from types import MappingProxyType

from pydantic import ValidationError as PydanticValidationError
from sqlalchemy import delete, func, insert, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from fleetserve.errors import (
    AllocationConflict,
    ConfigError,
    Problem,
    StoreError,
    UnknownNode,
    UnknownReplica,
)
from fleetserve.inventory.base import Registration, allocate_each
from fleetserve.modelfacts import ModelFacts
from fleetserve.placement.state import WorkingState
from fleetserve.routing import new_engine_key
from fleetserve.snapshot import ClusterSnapshot, replica_ordinal
from fleetserve.spec.nodeparts import Cordon
from fleetserve.spec.resources import (
    DeviceClass,
    Fabric,
    Node,
    NodeState,
    Replica,
    ReplicaState,
)
from fleetserve.store.base import IN_CHUNK, SqlBase, as_text, doc, node_of, replica_of
from fleetserve.store.db import describe
from fleetserve.store.tables import (
    DeviceAllocationRow,
    DeviceClassRow,
    FabricRow,
    NodeCredentialRow,
    NodeRow,
    ReplicaOrdinalRow,
    ReplicaRow,
    ReplicaShardRow,
    stamp,
)

# Replicas per transaction in ``allocate_all``: short enough that nodes stay locked only briefly.
ALLOCATE_BATCH = 200


class _BatchRefused(StoreError):
    """The database refused a batch the checks accepted (a concurrent writer): take it one by one."""


class SqlInventory(SqlBase):
    """Classes, fabrics, nodes, allocations and the snapshot, over SQL."""

    def put_class(self, cls: DeviceClass) -> None:
        with self._write(f"storing device class {cls.name}") as s:
            self._put(s, DeviceClassRow, cls.name, doc(cls))

    def put_fabric(self, fabric: Fabric) -> None:
        with self._write(f"storing fabric {fabric.name}") as s:
            self._put(s, FabricRow, fabric.name, doc(fabric))

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
        row.spec = doc(node, exclude={"state", "cordon"})
        row.state = NodeState.READY.value
        row.epoch += 1
        return Registration(node_of(row), row.epoch, created)

    def get_node(self, name: str) -> Node:
        with self._read(f"reading node {name}") as s:
            row = s.get(NodeRow, name)
            if row is None:
                raise UnknownNode(f"no node named {name!r} is registered")
            return node_of(row)

    def nodes(self) -> list[Node]:
        with self._read("listing nodes") as s:
            return sorted((node_of(r) for r in s.scalars(select(NodeRow))), key=lambda n: n.name)

    def device_classes(self) -> dict[str, DeviceClass]:
        """Every device class, by name."""
        with self._read("listing device classes") as s:
            return {r.name: DeviceClass.model_validate(r.spec) for r in s.scalars(select(DeviceClassRow))}

    def node_addresses(self, names: Sequence[str]) -> dict[str, str]:
        """The addresses of the named nodes that are registered (one read of those rows only)."""
        wanted = sorted(set(names))
        if not wanted:
            return {}
        with self._read("reading node addresses") as s:
            rows = s.execute(select(NodeRow.name, NodeRow.spec).where(NodeRow.name.in_(wanted)))
            return {name: str(spec.get("address", "")) for name, spec in rows}

    def epoch(self, name: str) -> int:
        """The node's registration epoch (0 if never registered)."""
        with self._read(f"reading node {name}") as s:
            return s.scalar(select(NodeRow.epoch).where(NodeRow.name == name)) or 0

    @staticmethod
    def _cordon(name: str, reason: str, by: str) -> Cordon:
        """The cordon to record, validated before anything touches the database."""
        try:
            return Cordon(reason=reason, by=by)
        except PydanticValidationError as exc:
            raise ConfigError(
                [Problem(f"Node {name}", "cordon.reason", "give a reason for the cordon")]
            ) from exc

    def cordon(self, name: str, reason: str, by: str = "operator") -> Node:
        cordon = self._cordon(name, reason, by)
        with self._write(f"cordoning node {name}") as s:
            row = self._locked_node(s, name)
            row.cordon_reason, row.cordon_by = cordon.reason, cordon.by
            return node_of(row)

    def uncordon(self, name: str) -> Node:
        with self._write(f"uncordoning node {name}") as s:
            row = self._locked_node(s, name)
            row.cordon_reason = row.cordon_by = None
            return node_of(row)

    def set_state(self, name: str, state: NodeState) -> Node:
        with self._write(f"setting node {name} {state}") as s:
            row = self._locked_node(s, name)
            row.state = NodeState(state).value
            if row.state != NodeState.READY.value and row.agent_status and row.agent_status.get("gpuMetrics"):
                # A node that left Ready speaks for its GPUs no more: its last samples are dropped.
                row.agent_status = {**row.agent_status, "gpuMetrics": []}
            return node_of(row)

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
                        spec=doc(replica, exclude={"state"}),
                        state=replica.state.value,
                        engine_key=new_engine_key(),
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

    def allocate_all(self, replicas: Sequence[Replica]) -> list[AllocationConflict | None]:
        """Take each replica whole, in order, ``ALLOCATE_BATCH`` to a transaction; per replica,
        None or the conflict that refused it (it then takes nothing).

        One transaction per replica cost a cycle ten round trips each, which at thousands of new
        replicas made the commit phase the longest of a cycle (``bench/controlplane.py``). Within a
        batch every replica is checked against the capacity the ones before it left, exactly as
        one ``allocate`` after another would be; the database's keys still refuse a device taken
        twice, and should that ever fire, the batch is rolled back and taken one by one."""
        out: list[AllocationConflict | None] = []
        for i in range(0, len(replicas), ALLOCATE_BATCH):
            batch = replicas[i : i + ALLOCATE_BATCH]
            try:
                with self._write(f"allocating {len(batch)} replicas") as s:
                    out += self._allocate_batch(s, batch)
            except _BatchRefused:
                out += allocate_each(self.allocate, batch)
        return out

    def _allocate_batch(self, s: Session, batch: Sequence[Replica]) -> list[AllocationConflict | None]:
        names = sorted({shard.node for replica in batch for shard in replica.shards})
        rows: list[NodeRow] = []
        for i in range(0, len(names), IN_CHUNK):
            # Lock the nodes first, in name order (chunks are in order too): no deadlock with others.
            chunk = names[i : i + IN_CHUNK]
            query = select(NodeRow).where(NodeRow.name.in_(chunk)).order_by(NodeRow.name).with_for_update()
            rows += s.scalars(query).all()
        wanted = [replica.name for replica in batch]
        existing: set[str] = set()
        for i in range(0, len(wanted), IN_CHUNK):
            chunk = wanted[i : i + IN_CHUNK]
            existing |= set(s.scalars(select(ReplicaRow.name).where(ReplicaRow.name.in_(chunk))))
        state = self._free_capacity(s, rows)
        epochs = {row.name: row.epoch for row in rows}
        outcomes: list[AllocationConflict | None] = []
        taken: list[Replica] = []
        for replica in batch:
            try:
                if replica.name in existing:
                    raise AllocationConflict(f"replica {replica.name} is already allocated")
                state.allocate(replica)  # checks against what the batch took before it
            except AllocationConflict as exc:
                outcomes.append(exc)
                continue
            existing.add(replica.name)
            taken.append(replica)
            outcomes.append(None)
        if not taken:
            return outcomes
        conn = s.connection()
        replica_rows = [
            {
                "name": r.name,
                "deployment": r.deployment,
                "profile": r.profile,
                "spec": doc(r, exclude={"state"}),
                "state": r.state.value,
                "engine_key": new_engine_key(),
            }
            for r in taken
        ]
        shard_rows = [
            {
                "replica": r.name,
                "shard": i,
                "node": shard.node,
                "cpu_cores": shard.cpu_cores,
                "memory": shard.memory,
                "node_epoch": epochs[shard.node],
            }
            for r in taken
            for i, shard in enumerate(r.shards)
        ]
        devices = [
            {"node": shard.node, "device_index": index, "replica": r.name}
            for r in taken
            for shard in r.shards
            for index in shard.devices
        ]
        ordinals: dict[str, int] = {}
        for r in taken:
            ordinal = replica_ordinal(r.deployment, r.name)
            if ordinal is not None:
                ordinals[r.deployment] = max(ordinals.get(r.deployment, 0), ordinal + 1)
        try:
            conn.execute(insert(ReplicaRow), replica_rows)
            conn.execute(insert(ReplicaShardRow), shard_rows)
            if devices:
                conn.execute(insert(DeviceAllocationRow), devices)
            for deployment, at_least in sorted(ordinals.items()):
                self._bump_ordinal(s, deployment, at_least)
        except IntegrityError as exc:
            raise _BatchRefused(describe(exc)) from exc
        return outcomes

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
        state = WorkingState(ClusterSnapshot(classes=MappingProxyType({}), nodes=tuple(map(node_of, rows))))
        all_names = [row.name for row in rows]
        for i in range(0, len(all_names), IN_CHUNK):
            names = all_names[i : i + IN_CHUNK]
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
                    ReplicaShardRow.node,
                    func.sum(ReplicaShardRow.cpu_cores),
                    func.sum(ReplicaShardRow.memory),
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
            return replica_of(row.spec, row.state)

    def replicas(self, deployment: str | None = None) -> list[Replica]:
        """Every allocated replica (of one deployment, if named), by name."""
        query = select(ReplicaRow)
        if deployment is not None:
            query = query.where(ReplicaRow.deployment == deployment)
        with self._read("listing replicas") as s:
            out = [replica_of(r.spec, r.state) for r in s.scalars(query)]
        return sorted(out, key=lambda r: r.name)

    def snapshot(self, models: Mapping[str, ModelFacts] | None = None) -> ClusterSnapshot:
        with self._read("taking a snapshot") as s:
            classes = {r.name: DeviceClass.model_validate(r.spec) for r in s.scalars(select(DeviceClassRow))}
            fabrics = {r.name: Fabric.model_validate(r.spec) for r in s.scalars(select(FabricRow))}
            # Unchanged rows are not parsed again (``doccache``): at thousands of nodes and tens of
            # thousands of replicas, parsing was most of a cycle.
            node_rows = s.execute(
                select(
                    NodeRow.name,
                    as_text(NodeRow.spec),
                    NodeRow.state,
                    NodeRow.cordon_reason,
                    NodeRow.cordon_by,
                )
            )
            by_name = self._node_docs.parse_all((r[0], (r[1], r[2], r[3], r[4])) for r in node_rows)
            nodes = sorted(by_name.values(), key=lambda n: n.name)
            rows = s.execute(
                select(
                    ReplicaRow.name,
                    ReplicaRow.engine_key,
                    ReplicaRow.state,
                    as_text(ReplicaRow.status).label("status"),
                    ReplicaRow.reported_at,
                    ReplicaRow.draining_since,
                )
            ).all()
            docs = self._replicas_of(s, [(r.name, r.engine_key, r.state) for r in rows])
            replicas = sorted(docs.values(), key=lambda r: r.name)
            # Kept per replica while its status and times are unchanged (most, in a steady fleet).
            facts = self._replica_facts.parse_all(
                (r.name, (r.status, r.reported_at, r.draining_since)) for r in rows
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
            replica_facts=MappingProxyType(facts),
        )

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
            # Its credential goes with it: the name enrols anew (with the join token) or not at all.
            s.connection().execute(delete(NodeCredentialRow).where(NodeCredentialRow.node == name))

    def get_replica(self, name: str) -> Replica:
        with self._read(f"reading replica {name}") as s:
            row = s.get(ReplicaRow, name)
            if row is None:
                raise UnknownReplica(f"no replica named {name!r} is allocated")
            return replica_of(row.spec, row.state)

    def set_replica_state(self, name: str, state: ReplicaState) -> Replica:
        """Record where a replica is in its life; raises UnknownReplica."""
        with self._write(f"setting replica {name} {state}") as s:
            row = s.scalars(select(ReplicaRow).where(ReplicaRow.name == name).with_for_update()).one_or_none()
            if row is None:
                raise UnknownReplica(f"no replica named {name!r} is allocated")
            row.state = ReplicaState(state).value
            return replica_of(row.spec, row.state)

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

    def start_draining(self, names: Sequence[str], now: datetime) -> list[str]:
        """Turn replicas Draining (out of every route) from ``now``, in one transaction; the names
        that were allocated and not already draining."""
        when = stamp(now)
        with self._write("draining replicas") as s:
            return self._start_draining(s, names, when)

    @staticmethod
    def _start_draining(s: Session, names: Sequence[str], when: datetime) -> list[str]:
        rows = s.scalars(
            select(ReplicaRow)
            .where(ReplicaRow.name.in_(list(names)), ReplicaRow.state != ReplicaState.DRAINING.value)
            .with_for_update()
        ).all()
        for row in rows:
            row.state, row.draining_since = ReplicaState.DRAINING.value, when
        s.flush()  # before any Core statement of the same transaction reads the states
        return sorted(row.name for row in rows)

    def drain(
        self, name: str, reason: str, by: str = "operator", now: datetime | None = None
    ) -> tuple[Node, list[Replica], list[str]]:
        """Cordon ``name`` and move every replica with a shard on it away, in ONE transaction: the
        node and its replicas are never seen half drained. A Running replica turns Draining (out of
        the routes; the reconciler places its replacement and releases it once its requests are
        done); one that serves nothing is released at once. The node, the released replicas, and
        the names of those now draining."""
        cordon = self._cordon(name, reason, by)
        when = stamp(now or datetime.now(UTC))
        with self._write(f"draining node {name}") as s:
            row = self._locked_node(s, name)
            row.cordon_reason, row.cordon_by = cordon.reason, cordon.by
            held = select(ReplicaShardRow.replica).where(ReplicaShardRow.node == name)
            serving = list(
                s.scalars(
                    select(ReplicaRow.name).where(
                        ReplicaRow.name.in_(held), ReplicaRow.state == ReplicaState.RUNNING.value
                    )
                )
            )
            draining = self._start_draining(s, serving, when)
            # Shards and device rows go with each replica (ON DELETE CASCADE).
            gone = delete(ReplicaRow).where(
                ReplicaRow.name.in_(held), ReplicaRow.state != ReplicaState.DRAINING.value
            )
            released = s.connection().execute(gone.returning(ReplicaRow.spec, ReplicaRow.state))
            replicas = sorted((replica_of(r.spec, r.state) for r in released), key=lambda r: r.name)
            return node_of(row), replicas, draining
