"""The kept free capacity (``Planner``, ``placement.kept``) decides exactly as a fresh ``reconcile``.

A small mixed fleet (NVIDIA, AMD and CPU nodes, two fabrics, NVLink domains) and a few
deployments live through a random sequence of changes — nodes going NotReady, Lost and back,
cordons, device faults and repairs, model caches, hardware re-registered smaller or larger, nodes
added and removed, a class's memory edited, deployments scaled, added, removed and rolled out,
replicas Running, failing and drained, the clock moving, and commits the store refused — and
after each change both plan the cycle: the plans must be equal, field by field (every
placement, explanation, drain, release, failure history and condition). Each cycle's plan is
then committed as the store would (drains, releases, allocations; sometimes only part of it).
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from types import MappingProxyType
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from builders import cpu_32c_128g, deployment, gpu_server_64c_512g
from fleetserve.modelfacts import ModelFacts
from fleetserve.reconcile.core import Planner, ReconcilePlan, reconcile
from fleetserve.reconcile.lifecycle import FailureHistory
from fleetserve.snapshot import ClusterSnapshot, ReplicaFacts
from fleetserve.spec.nodeparts import Cordon, DeviceHealth
from fleetserve.spec.resources import Deployment, DeviceClass, Node, NodeState, Replica, ReplicaState

GiB = 1 << 30
T0 = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
CLASSES = {
    "h100": DeviceClass(name="h100", driver="gpu.nvidia.com", memory=80 * GiB),
    "mi300x": DeviceClass(name="mi300x", driver="gpu.amd.com", memory=192 * GiB),
}
MODELS = MappingProxyType(
    {
        "small": ModelFacts("small", 8 * GiB, 0, 4096),
        "big": ModelFacts("big", 140 * GiB, 0, 4096),
        "cpu": ModelFacts("cpu", 2 * GiB, 0, 4096),
    }
)
GPU = {"name": "nv", "engine": "vllm", "deviceClass": "h100"}
AMD = {"name": "amd", "engine": "vllm", "deviceClass": "mi300x"}
CPU = {"name": "cpu", "engine": "llama.cpp", "cpu": {"cores": 8, "memory": "8GiB"}}


def deployment_shapes() -> dict[str, Deployment]:
    return {
        "chat": deployment("chat", 6, GPU, AMD, model="small", drainSeconds=20),
        "tp2": deployment(
            "tp2", 3, {**GPU, "name": "nv2", "devicesPerNode": 2}, {**AMD, "name": "amd2"}, model="big"
        ),
        "wide": deployment(
            "wide", 1, {**GPU, "name": "pp", "devicesPerNode": 4, "nodes": 2}, model="big", drainSeconds=5
        ),
        "embed": deployment("embed", 4, CPU, model="cpu"),
    }


def gpu_node(name: str, rng: random.Random, count: int | None = None) -> Node:
    cls = rng.choice(("h100", "h100", "mi300x"))
    count = count or rng.choice((2, 4, 8))
    domains = ((tuple(range(count)),), (tuple(range(count // 2)), tuple(range(count // 2, count))), ())
    return gpu_server_64c_512g(
        name,
        cls,
        count,
        domains=rng.choice(domains) if count > 1 else (),
        fabrics=rng.choice(((), ("ib-a",), ("ib-b",))),
        modelCache=rng.sample(["small", "big"], k=rng.randint(0, 1)),
    )


@dataclass
class World:
    """The state a store would hold, changed at random and by committed plans."""

    rng: random.Random
    nodes: dict[str, Node] = field(default_factory=dict)
    replicas: dict[str, Replica] = field(default_factory=dict)
    facts: dict[str, ReplicaFacts] = field(default_factory=dict)
    ordinals: dict[str, int] = field(default_factory=dict)
    deployments: dict[str, Deployment] = field(default_factory=dict)
    status: dict[str, Any] = field(default_factory=dict)
    classes: dict[str, DeviceClass] = field(default_factory=lambda: dict(CLASSES))
    now: datetime = T0
    added: int = 0

    @classmethod
    def new(cls, seed: int) -> World:
        rng = random.Random(seed)
        world = cls(rng)
        for i in range(rng.randint(3, 7)):
            world.nodes[f"g{i}"] = gpu_node(f"g{i}", rng)
        for i in range(rng.randint(1, 2)):
            world.nodes[f"c{i}"] = cpu_32c_128g(f"c{i}")
        shapes = deployment_shapes()
        for name in rng.sample(sorted(shapes), k=rng.randint(2, 4)):
            world.deployments[name] = shapes[name]
        return world

    def snapshot(self) -> ClusterSnapshot:
        return ClusterSnapshot(
            classes=MappingProxyType(dict(self.classes)),
            nodes=tuple(self.nodes[n] for n in sorted(self.nodes)),
            replicas=tuple(self.replicas[n] for n in sorted(self.replicas)),
            models=MODELS,
            next_ordinals=MappingProxyType(dict(self.ordinals)),
            replica_facts=MappingProxyType(dict(self.facts)),
        )

    def failures(self) -> Mapping[str, FailureHistory]:
        return {n: FailureHistory.from_status(self.status.get(n)) for n in self.deployments}

    def commit(self, plan: ReconcilePlan, refuse: float) -> None:
        """Write the plan as the store would; each allocation refused with probability ``refuse``."""
        for name in plan.drain:
            r = self.replicas.get(name)
            if r is not None and r.state is not ReplicaState.DRAINING:
                self.replicas[name] = r.model_copy(update={"state": ReplicaState.DRAINING})
                self.facts[name] = ReplicaFacts(in_flight=3, draining_since=self.now)
        for name in plan.release:
            self.replicas.pop(name, None)
            self.facts.pop(name, None)
        for replica in plan.allocate:
            if self.rng.random() < refuse:
                continue  # a concurrent writer took it: the next snapshot lacks it
            self.replicas[replica.name] = replica
            ordinal = int(replica.name.rsplit("-", 1)[1])
            self.ordinals[replica.deployment] = max(self.ordinals.get(replica.deployment, 0), ordinal + 1)
        for name, life in plan.lifecycles.items():
            self.status[name] = life.failures.to_dict()

    # --- random changes ------------------------------------------------------------------------

    def change(self, op: str) -> None:
        rng = self.rng
        names = sorted(self.nodes)
        node = self.nodes[rng.choice(names)]
        reps = sorted(self.replicas)
        if op == "node-state":
            state = rng.choice((NodeState.READY, NodeState.NOT_READY, NodeState.LOST))
            self.nodes[node.name] = node.model_copy(update={"state": state})
        elif op == "cordon":
            cordon = None if node.cordon else Cordon(reason="repair", by="test")
            self.nodes[node.name] = node.model_copy(update={"cordon": cordon})
        elif op == "device-health" and node.devices:
            i = rng.randrange(len(node.devices))
            health = DeviceHealth(ecc_uncorrected=rng.choice((0, 0, 3)))
            devices = list(node.devices)
            devices[i] = devices[i].model_copy(update={"health": health})
            self.nodes[node.name] = node.model_copy(update={"devices": tuple(devices)})
        elif op == "cache":
            cache = tuple(rng.sample(["small", "big", "cpu"], k=rng.randint(0, 2)))
            self.nodes[node.name] = node.model_copy(update={"model_cache": cache})
        elif op == "same-node-anew":
            # Parsed again from its row: an equal document, another object.
            self.nodes[node.name] = Node.model_validate(node.model_dump(by_alias=True))
        elif op == "reregister" and node.devices:
            # The same node back with fewer or more devices (its replicas keep what they hold).
            self.nodes[node.name] = gpu_node(node.name, rng, rng.choice((1, 2, 8, 16)))
        elif op == "add-node":
            self.added += 1
            name = f"n{self.added}"
            self.nodes[name] = gpu_node(name, rng) if rng.random() < 0.7 else cpu_32c_128g(name)
        elif op == "remove-node":
            held = {s.node for r in self.replicas.values() for s in r.shards}
            free = [n for n in names if n not in held]
            if free and len(self.nodes) > 2:
                del self.nodes[rng.choice(free)]
        elif op == "class-memory":
            cls = self.classes["h100"]
            memory = 80 * GiB if cls.memory != 80 * GiB else 24 * GiB
            self.classes["h100"] = cls.model_copy(update={"memory": memory})
        elif op == "scale":
            name = rng.choice(sorted(self.deployments))
            dep = self.deployments[name]
            self.deployments[name] = dep.model_copy(
                update={"replicas": max(0, dep.desired_replicas + rng.randint(-3, 3))}
            )
        elif op == "rollout":
            name = rng.choice(sorted(self.deployments))
            dep = self.deployments[name]
            model = "small" if dep.model != "small" else "big"
            self.deployments[name] = dep.model_copy(update={"model": model})
        elif op == "add-remove-deployment":
            shapes = deployment_shapes()
            missing = [n for n in shapes if n not in self.deployments]
            if missing and rng.random() < 0.5:
                name = rng.choice(missing)
                self.deployments[name] = shapes[name]
            elif len(self.deployments) > 1:
                del self.deployments[rng.choice(sorted(self.deployments))]
        elif op == "running" and reps:
            for name in rng.sample(reps, k=min(len(reps), rng.randint(1, 6))):
                r = self.replicas[name]
                if r.state is ReplicaState.PENDING:
                    self.replicas[name] = r.model_copy(update={"state": ReplicaState.RUNNING})
        elif op == "fail" and reps:
            name = rng.choice(reps)
            r = self.replicas[name]
            if r.state is not ReplicaState.DRAINING:
                self.replicas[name] = r.model_copy(update={"state": ReplicaState.FAILED})
                self.facts[name] = ReplicaFacts(message="engine exited 1")
        elif op == "drained":
            for name, r in self.replicas.items():
                if r.state is ReplicaState.DRAINING and rng.random() < 0.5:
                    since = self.facts[name].draining_since
                    self.facts[name] = ReplicaFacts(in_flight=0, reported_at=self.now, draining_since=since)
        elif op == "time":
            self.now += timedelta(seconds=rng.choice((1, 3, 6, 25, 400)))


OPS = (
    "node-state",
    "cordon",
    "device-health",
    "cache",
    "same-node-anew",
    "reregister",
    "add-node",
    "remove-node",
    "class-memory",
    "scale",
    "rollout",
    "add-remove-deployment",
    "running",
    "fail",
    "drained",
    "time",
    "nothing",
)


@settings(max_examples=150, deadline=None, derandomize=True, database=None, print_blob=True)
@given(
    seed=st.integers(0, 2**32 - 1),
    steps=st.lists(
        st.tuples(st.sampled_from(OPS), st.sampled_from((0.0, 0.0, 0.5))), min_size=1, max_size=25
    ),
)
def test_the_kept_capacity_plans_exactly_as_a_fresh_reconcile(
    seed: int, steps: list[tuple[str, float]]
) -> None:
    world = World.new(seed)
    planner = Planner()
    for op, refuse in [("nothing", 0.0), *steps]:
        world.change(op)
        deployments = [world.deployments[n] for n in sorted(world.deployments)]
        snapshot = world.snapshot()
        fresh = reconcile(deployments, snapshot, world.now, world.failures())
        kept = planner.plan(deployments, snapshot, world.now, world.failures())
        assert kept == fresh, op
        world.commit(fresh, refuse)
        world.now += timedelta(seconds=1)


def test_a_steady_fleet_is_patched_not_rebuilt() -> None:
    """The point of keeping it: after the first cycle, changes are patched in place."""
    world = World.new(7)
    planner = Planner()
    for op in (
        "nothing",
        "running",
        "cordon",
        "device-health",
        "node-state",
        "cache",
        "scale",
        "fail",
        "time",
    ):
        world.change(op)
        deployments = [world.deployments[n] for n in sorted(world.deployments)]
        snapshot = world.snapshot()
        plan = planner.plan(deployments, snapshot, world.now, world.failures())
        assert plan == reconcile(deployments, snapshot, world.now, world.failures())
        world.commit(plan, 0.0)
    assert planner.capacity.rebuilds == 1
    assert planner.capacity.patched_nodes >= 3
