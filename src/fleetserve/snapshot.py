"""The immutable view of the cluster one placement or reconcile cycle decides from."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from functools import cached_property
from types import MappingProxyType

from fleetserve.drivers import Driver, RuntimeVariant, host_driver, parse_driver
from fleetserve.engines.spec import EngineKind
from fleetserve.modelfacts import ModelFacts
from fleetserve.spec.resources import Deployment, DeviceClass, Fabric, Node, NodeState, Replica


def _empty() -> Mapping[str, object]:
    return MappingProxyType({})


def replica_ordinal(deployment: str, replica: str) -> int | None:
    """The ordinal N of a replica named ``{deployment}-{N}``, else None."""
    prefix = deployment + "-"
    tail = replica[len(prefix) :] if replica.startswith(prefix) else ""
    return int(tail) if tail.isdigit() else None


@dataclass(frozen=True)
class ReplicaFacts:
    """What the store knows of a replica beyond its document: its agent's last message and count
    of in-flight requests, when that count was read, and since when the replica drains."""

    message: str = ""
    in_flight: int | None = None
    reported_at: datetime | None = None
    draining_since: datetime | None = None


NO_FACTS = ReplicaFacts()


@dataclass(frozen=True)
class ClusterSnapshot:
    """Classes, nodes, fabrics, allocated replicas and model facts, frozen for one cycle."""

    classes: Mapping[str, DeviceClass]
    nodes: tuple[Node, ...]
    fabrics: Mapping[str, Fabric] = field(default_factory=_empty)  # type: ignore[arg-type]
    replicas: tuple[Replica, ...] = ()
    models: Mapping[str, ModelFacts] = field(default_factory=_empty)  # type: ignore[arg-type]
    # Per deployment, the lowest replica ordinal never used: new replicas are named from it.
    next_ordinals: Mapping[str, int] = field(default_factory=_empty)  # type: ignore[arg-type]
    # Per replica, what its agent reported and its drain (absent: nothing known).
    replica_facts: Mapping[str, ReplicaFacts] = field(default_factory=_empty)  # type: ignore[arg-type]

    @cached_property
    def replicas_by_deployment(self) -> Mapping[str, tuple[Replica, ...]]:
        """Per deployment, its replicas in snapshot order: one pass, instead of a scan of every
        replica per deployment (tens of thousands, times every deployment, each cycle)."""
        out: dict[str, list[Replica]] = {}
        for replica in self.replicas:
            out.setdefault(replica.deployment, []).append(replica)
        return MappingProxyType({name: tuple(rs) for name, rs in out.items()})

    def replicas_of(self, deployment: str) -> tuple[Replica, ...]:
        """The replicas of one deployment, in snapshot order."""
        return self.replicas_by_deployment.get(deployment, ())

    @cached_property
    def node_states(self) -> Mapping[str, NodeState]:
        """Every node's state, by name."""
        return MappingProxyType({n.name: n.state for n in self.nodes})

    @cached_property
    def _lost_nodes(self) -> frozenset[str]:
        return frozenset(n.name for n in self.nodes if n.state is NodeState.LOST)

    def on_lost_node(self, replica: Replica) -> bool:
        """Whether a shard of ``replica`` is on a Lost node, or on a node no longer known."""
        lost, states = self._lost_nodes, self.node_states
        return any(s.node in lost or s.node not in states for s in replica.shards)

    def revision_of(self, deployment: Deployment) -> str:
        """The revision a replica of ``deployment`` is placed for: its template and the weights its
        model names now (``Deployment.template_revision``); computed from the snapshot alone."""
        facts = self.models.get(deployment.model)
        return deployment.template_revision(facts.weights if facts is not None else "")

    @cached_property
    def _engine_nodes(self) -> Mapping[str, Node]:
        return MappingProxyType({n.name: n for n in self.nodes if n.engines is not None})

    def without_build(self, replica: Replica, engine: EngineKind, variant: RuntimeVariant) -> bool:
        """Whether a node under ``replica`` reported its engines without ``engine``'s ``variant``
        (its binary removed or replaced by another build): the replica cannot run there."""
        nodes = self._engine_nodes
        return any(not nodes[s.node].runs(engine, variant) for s in replica.shards if s.node in nodes)

    def facts_of(self, replica: str) -> ReplicaFacts:
        """What is known of a replica beyond its document (empty facts when nothing is)."""
        return self.replica_facts.get(replica, NO_FACTS)

    def node_taints(self, node: Node) -> frozenset[str]:
        """The driver names whose pools the node is in: its devices' drivers, known or not.

        A node with no device is a CPU node. A device whose class claims a driver outside the
        table still taints its node, so a GPU box never passes for a CPU node.
        """
        out = {cls.driver for d in node.devices if (cls := self.classes.get(d.device_class)) is not None}
        return frozenset(out) if out else frozenset({host_driver().value})

    def served_drivers(self) -> frozenset[Driver]:
        """Drivers of the table some node that is not Lost can serve (CPU wherever a CPU node is)."""
        out: set[Driver] = set()
        for node in self.nodes:
            if node.state is not NodeState.LOST:
                out |= {d for name in self.node_taints(node) if (d := parse_driver(name)) is not None}
        return frozenset(out)
