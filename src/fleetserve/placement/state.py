"""The working state of one placement cycle: per node, what is free right now.

Built once from a ``ClusterSnapshot`` (existing replicas applied), then changed only by
``allocate`` and ``release`` — whole replicas, every shard at once.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from fleetserve.drivers import Driver, RuntimeVariant
from fleetserve.engines.registry import ENGINES
from fleetserve.engines.spec import EngineKind
from fleetserve.errors import AllocationConflict, UnknownReplica
from fleetserve.snapshot import ClusterSnapshot
from fleetserve.spec.resources import Node, NodeState, Replica, Shard


@dataclass(eq=False)
class NodeWork:
    """One node's static facts and its free capacity in this cycle."""

    name: str
    ready: bool
    cordoned: bool
    taints: frozenset[str]  # driver names of the pools the node is in
    # class → every device index of that class on the node, healthy or not
    devices_of: dict[str, tuple[int, ...]]
    # class → healthy, unallocated device indices
    free: dict[str, set[int]]
    # fabric → this node's HCAs on it
    fabrics: dict[str, tuple[str, ...]]
    domains: tuple[frozenset[int], ...]
    cores: int
    memory: int
    cache: frozenset[str]
    # The (engine, variant) builds the node's agent found; None: never reported (not filtered).
    runs: frozenset[tuple[EngineKind, RuntimeVariant]] | None = None
    used_cores: int = 0
    used_memory: int = 0
    class_of: dict[int, str] = field(default_factory=dict)

    @property
    def free_cores(self) -> int:
        return self.cores - self.used_cores

    @property
    def free_memory(self) -> int:
        return self.memory - self.used_memory

    def free_count(self, device_class: str) -> int:
        """Free devices of a class on this node."""
        free = self.free.get(device_class)
        return len(free) if free else 0

    def lacks(self, engine: EngineKind, variant: RuntimeVariant) -> bool:
        """Whether the node reported its engines and ``engine``'s ``variant`` is not among them."""
        return self.runs is not None and (engine, variant) not in self.runs

    def tolerates(self, driver: Driver) -> bool:
        """Whether a workload of ``driver`` tolerates every taint this node carries."""
        return self.taints <= {driver.value}


# Every (engine, variant) an engine row has: what a node's fingerprints can lack.
ENGINE_VARIANTS: tuple[tuple[EngineKind, RuntimeVariant], ...] = tuple(
    (kind, variant) for kind, spec in ENGINES.items() for variant in spec.variants
)


def runs_of(node: Node) -> frozenset[tuple[EngineKind, RuntimeVariant]] | None:
    """The (engine, variant) builds a node runs (``Node.runs``), None where it never said."""
    if node.engines is None:
        return None
    return frozenset(p for p in ENGINE_VARIANTS if node.runs(*p))


def node_work(node: Node, snapshot: ClusterSnapshot) -> NodeWork:
    """The starting working state of one node: every healthy device free."""
    devices_of: dict[str, list[int]] = {}
    free: dict[str, set[int]] = {}
    class_of: dict[int, str] = {}
    for device in node.devices:
        devices_of.setdefault(device.device_class, []).append(device.index)
        class_of[device.index] = device.device_class
        if device.health.healthy:
            free.setdefault(device.device_class, set()).add(device.index)
    fabrics: dict[str, list[str]] = {}
    for hca in node.hcas:
        fabrics.setdefault(hca.fabric, []).append(hca.name)
    return NodeWork(
        name=node.name,
        ready=node.state is NodeState.READY,
        cordoned=node.cordon is not None,
        taints=snapshot.node_taints(node),
        devices_of={c: tuple(sorted(ix)) for c, ix in devices_of.items()},
        free=free,
        fabrics={f: tuple(h) for f, h in fabrics.items()},
        domains=tuple(frozenset(d) for d in node.nvlink_domains),
        cores=node.cpu.cores,
        memory=node.cpu.memory,
        cache=frozenset(node.model_cache),
        runs=runs_of(node),
        class_of=class_of,
    )


class WorkingState:
    """Every node's free capacity for one cycle, with whole-replica allocate and release."""

    def __init__(self, snapshot: ClusterSnapshot) -> None:
        self.snapshot = snapshot
        self.nodes: list[NodeWork] = [node_work(n, snapshot) for n in snapshot.nodes]
        self.by_name: dict[str, NodeWork] = {n.name: n for n in self.nodes}
        self.replicas: dict[str, Replica] = {}
        self._healthy = {
            n.name: frozenset(d.index for d in n.devices if d.health.healthy) for n in snapshot.nodes
        }
        for replica in snapshot.replicas:
            self.hold(replica)

    def hold(self, replica: Replica) -> list[NodeWork]:
        """Count what an existing replica holds, whether or not it would fit today; return the
        nodes touched.

        A replica keeps its devices, cores and memory even after a device under it faulted or
        its node was cordoned: they are not free until the replica is released.
        """
        touched = []
        for shard in replica.shards:
            node = self.by_name.get(shard.node)
            if node is None:
                continue
            self._take(node, shard)
            touched.append(node)
        self.replicas[replica.name] = replica
        return touched

    @staticmethod
    def _take(node: NodeWork, shard: Shard) -> None:
        for index in shard.devices:
            cls = node.class_of.get(index)
            if cls is not None and cls in node.free:
                node.free[cls].discard(index)
        node.used_cores += shard.cpu_cores
        node.used_memory += shard.memory

    def replace_node(self, node: Node, snapshot: ClusterSnapshot) -> tuple[NodeWork, NodeWork]:
        """Take ``node``'s new facts (same name): its working state built anew, with what every
        replica held here holds on it; (the old working state, the new one)."""
        old = self.by_name[node.name]
        new = node_work(node, snapshot)
        for replica in self.replicas.values():
            for shard in replica.shards:
                if shard.node == node.name:
                    self._take(new, shard)
        self.nodes[self.nodes.index(old)] = new
        self.by_name[node.name] = new
        self._healthy[node.name] = frozenset(d.index for d in node.devices if d.health.healthy)
        return old, new

    def check(self, replica: Replica) -> None:
        """Raise AllocationConflict unless every shard of ``replica`` is free now."""
        if replica.name in self.replicas:
            raise AllocationConflict(f"replica {replica.name} is already allocated")
        seen: set[tuple[str, int]] = set()
        cores: dict[str, int] = {}
        memory: dict[str, int] = {}
        for shard in replica.shards:
            node = self.by_name.get(shard.node)
            if node is None:
                raise AllocationConflict(f"replica {replica.name}: node {shard.node} does not exist")
            # A plan made before a cordon or a missed heartbeat must not land there.
            if node.cordoned or not node.ready:
                raise AllocationConflict(
                    f"replica {replica.name}: node {shard.node} is cordoned or not Ready"
                )
            for index in shard.devices:
                cls = node.class_of.get(index)
                if cls is None or index not in node.free.get(cls, ()) or (shard.node, index) in seen:
                    raise AllocationConflict(
                        f"replica {replica.name}: device {shard.node}/{index} is not free"
                    )
                seen.add((shard.node, index))
            # Two shards on one node add up.
            cores[shard.node] = cores.get(shard.node, 0) + shard.cpu_cores
            memory[shard.node] = memory.get(shard.node, 0) + shard.memory
            if cores[shard.node] > node.free_cores or memory[shard.node] > node.free_memory:
                raise AllocationConflict(f"replica {replica.name}: node {shard.node} lacks CPU or memory")

    def allocate(self, replica: Replica) -> list[NodeWork]:
        """Take every shard of ``replica`` at once, or nothing; return the nodes touched."""
        self.check(replica)
        touched = []
        for shard in replica.shards:
            node = self.by_name[shard.node]
            for index in shard.devices:
                node.free[node.class_of[index]].discard(index)
            node.used_cores += shard.cpu_cores
            node.used_memory += shard.memory
            touched.append(node)
        self.replicas[replica.name] = replica
        return touched

    def release(self, name: str) -> list[NodeWork]:
        """Give back every shard of a replica at once; return the nodes touched."""
        replica = self.replicas.pop(name, None)
        if replica is None:
            raise UnknownReplica(f"no replica named {name} is allocated")
        touched = []
        for shard in replica.shards:
            node = self.by_name.get(shard.node)
            if node is None:
                continue
            healthy = self._healthy.get(shard.node, frozenset())
            for index in shard.devices:
                if index in healthy:
                    node.free[node.class_of[index]].add(index)
            node.used_cores -= shard.cpu_cores
            node.used_memory -= shard.memory
            touched.append(node)
        return touched

    def names(self) -> Iterable[str]:
        """Names of every replica allocated in this state."""
        return self.replicas.keys()
