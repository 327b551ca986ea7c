"""The inventory aggregate over SQL: device classes, fabrics, nodes (registration, cordons,
states, draining) and the cluster snapshot placement reads.

``SqlInventory`` is the store's ``Inventory``: it composes the replicas' allocation onto devices
(``store.allocation``) and their reads and states (``store.replicas``). ``drain`` cordons a node and
releases its replicas in one transaction.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from types import MappingProxyType

from pydantic import ValidationError as PydanticValidationError
from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from fleetserve.errors import AllocationConflict, ConfigError, Problem, UnknownNode
from fleetserve.inventory.base import Registration
from fleetserve.modelfacts import ModelFacts
from fleetserve.snapshot import ClusterSnapshot
from fleetserve.spec.nodeparts import Cordon
from fleetserve.spec.resources import DeviceClass, Fabric, Node, NodeState, Replica, ReplicaState
from fleetserve.store.allocation import SqlAllocation
from fleetserve.store.base import as_text, doc, move_node, node_of, replica_of
from fleetserve.store.replicas import SqlReplicas
from fleetserve.store.tables import (
    DeviceClassRow,
    FabricRow,
    NodeCredentialRow,
    NodeRow,
    ReplicaOrdinalRow,
    ReplicaRow,
    ReplicaShardRow,
    stamp,
)


class SqlInventory(SqlAllocation, SqlReplicas):
    """Classes, fabrics, nodes, the snapshot and draining over SQL, with allocation and replicas."""

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
            move_node(row, state)
            return node_of(row)

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
