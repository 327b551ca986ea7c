"""Property-based tests of placement over random clusters (design.md, "Placement rules").

Random clusters mix NVIDIA, AMD and CPU nodes (plus nodes whose devices claim a driver no row
of the driver table has), several fabrics, NVLink domains, unhealthy devices, cordons,
NotReady/Lost nodes, model caches and pre-existing replicas (valid ones, picked by hand or
placed first; and stale ones: on a device that faulted since, on a node that shrank or is gone).
Every decision is checked against an independent model written here from the design's rules,
not from the placement code: a ledger of what is held, a per-node "first failed constraint" and
a brute-force search over node and device subsets.

Every property runs derandomized (the same examples on every run) with no example database;
a failure prints the whole scenario and a ``@reproduce_failure`` blob.
"""

from __future__ import annotations

import functools
import itertools
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from builders import cpu_32c_128g, deployment, gpu_server_64c_512g
from builders import node as build_node
from fleetserve.engines.registry import ENGINES
from fleetserve.engines.spec import EngineKind
from fleetserve.modelfacts import ModelFacts
from fleetserve.placement.choose import Found
from fleetserve.placement.demand import Demand, demand_for
from fleetserve.placement.placer import (
    DeploymentDecision,
    Placement,
    Placer,
    SearchKind,
    Unplaced,
    plan,
)
from fleetserve.placement.report import ProfileReport, Reason, render_report
from fleetserve.snapshot import ClusterSnapshot
from fleetserve.spec.nodeparts import Cordon, CpuCapacity, Device, DeviceHealth, EngineFingerprint, Hca
from fleetserve.spec.policies import ReplicaRange
from fleetserve.spec.resources import (
    CpuRequest,
    Deployment,
    DeviceClass,
    Fabric,
    FabricType,
    Node,
    NodeState,
    Profile,
    Replica,
    ReplicaState,
    Shard,
)
from fleetserve.validation import gate

GiB = 1 << 30

NVIDIA = "gpu.nvidia.com"
AMD = "gpu.amd.com"

NV_CLASSES = ("nvidia-h100-80gb", "nvidia-l4-24gb")
AMD_CLASSES = ("amd-mi300x", "amd-gfx1151")
ODD_CLASS = "intel-arc-b580"  # a driver no row of the table has: gated, yet it taints its node

CLASSES: Mapping[str, DeviceClass] = MappingProxyType(
    {
        "nvidia-h100-80gb": DeviceClass(name="nvidia-h100-80gb", driver=NVIDIA, memory=80 * GiB),
        "nvidia-l4-24gb": DeviceClass(name="nvidia-l4-24gb", driver=NVIDIA, memory=24 * GiB),
        "amd-mi300x": DeviceClass(name="amd-mi300x", driver=AMD, memory=192 * GiB),
        "amd-gfx1151": DeviceClass(name="amd-gfx1151", driver=AMD, memory=32 * GiB),
        ODD_CLASS: DeviceClass(name=ODD_CLASS, driver="gpu.intel.com", memory=12 * GiB),
    }
)
FABRICS: Mapping[str, Fabric] = MappingProxyType(
    {
        "ib-a": Fabric(name="ib-a"),
        "ib-b": Fabric(name="ib-b"),
        "roce-c": Fabric(name="roce-c", type=FabricType.ROCE),
    }
)
MODEL_NAMES = ("m0", "m1", "m2")

PROPS = settings(
    max_examples=400,
    deadline=None,
    derandomize=True,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


# --- strategies ------------------------------------------------------------------------------

# Strategies are built once and reused: building one per draw would dominate the run time.
BOOLS = st.booleans()


@functools.cache
def ints(low: int, high: int) -> st.SearchStrategy[int]:
    return st.integers(low, high)


@functools.cache
def pick(values: tuple[Any, ...]) -> st.SearchStrategy[Any]:
    return st.sampled_from(values)


@functools.cache
def unique_lists(elements: st.SearchStrategy[Any], low: int, high: int) -> st.SearchStrategy[list[Any]]:
    return st.lists(elements, unique=True, min_size=low, max_size=high)


@st.composite
def engine_fingerprints(draw: st.DrawFn) -> tuple[EngineFingerprint, ...] | None:
    """What a node's agent found: never reported (None), every build, some builds, or none."""
    kind = draw(pick(("unknown", "unknown", "all", "all", "some", "none")))
    if kind == "unknown":
        return None
    if kind == "none":
        return ()
    out = []
    for engine, spec in ENGINES.items():
        variants = tuple(spec.variants)
        if kind == "some":
            variants = tuple(draw(unique_lists(pick(variants), 0, len(variants))))
        out.append(EngineFingerprint(engine=engine, version="test", variants=variants))
    return tuple(out)


@st.composite
def nodes(
    draw: st.DrawFn,
    name: str,
    max_devices: int,
    theme: Sequence[str],
    primary: str,
    models: Sequence[str],
    dense: bool = False,
) -> Node:
    """One node: a CPU box, a GPU box of the fleet's classes, a box with NVIDIA and AMD both,
    or one whose devices claim a driver the table does not know (tainted by it all the same). A dense
    fleet is mostly large, healthy GPU boxes, where multi-node replicas fit."""
    if dense:
        kind = draw(pick(("cpu", "gpu", "gpu", "gpu", "gpu", "gpu", "gpu", "mixed")))
    else:
        kind = draw(pick(("cpu", "cpu", "gpu", "gpu", "gpu", "gpu", "mixed", "odd")))
    devices: list[Device] = []
    domains: tuple[tuple[int, ...], ...] = ()
    if kind != "cpu":
        sizes = (2, 4, 4, 8, 8, 8) if dense else (1, 2, 3, 4, 4, 8, 8)
        n = draw(pick(tuple(k for k in sizes if k <= max_devices)))
        if draw(ints(0, 3)):
            indices = list(range(n))
        else:
            indices = sorted(draw(unique_lists(ints(0, max_devices + 2), n, n)))
        main = {"gpu": draw(pick(tuple(theme))), "mixed": NV_CLASSES[0], "odd": ODD_CLASS}[kind]
        driver = CLASSES[main].driver
        same_driver = [c for c in CLASSES if CLASSES[c].driver == driver]
        other = {"mixed": AMD_CLASSES[0]}.get(kind)
        varied = kind == "mixed" or draw(ints(0, 5)) == 0
        for i in indices:
            cls = main
            if varied:
                cls = draw(pick((other,) if other else tuple(same_driver))) if draw(BOOLS) else main
            roll = draw(ints(0, 47 if dense else 15))
            health = DeviceHealth()
            if roll == 0:
                health = DeviceHealth(ecc_uncorrected=draw(ints(1, 3)))
            elif roll == 1:
                health = DeviceHealth(foreign_processes=(4242,))
            devices.append(Device(index=i, uuid=f"{name}-gpu-{i}", device_class=cls, health=health))
        if draw(BOOLS):
            groups: dict[int, list[int]] = {}
            for i in indices:
                g = draw(ints(-1, 1))
                if g >= 0:
                    groups.setdefault(g, []).append(i)
            domains = tuple(tuple(g) for _, g in sorted(groups.items()))
    # Most GPU nodes sit on the fleet's primary fabric; some on none, another, or two.
    roll = draw(ints(0, 6))
    others = [f for f in sorted(FABRICS) if f != primary]
    if roll == 0 or (kind == "cpu" and roll < 5):
        attached: list[str] = []
    elif roll == 1:
        attached = [primary, draw(pick(tuple(others)))]
    elif roll == 2:
        attached = [draw(pick(tuple(others)))]
    else:
        attached = [primary]
    hcas: list[Hca] = []
    for fabric in attached:
        for _ in range(draw(ints(1, 2))):
            hcas.append(Hca(name=f"mlx5_{len(hcas)}", fabric=fabric))
    state = draw(pick((NodeState.READY,) * 10 + (NodeState.NOT_READY, NodeState.LOST)))
    cordon = Cordon(reason="ecc storm") if draw(ints(0, 11)) == 0 else None
    cache = draw(unique_lists(pick(tuple(models)), 0, 2)) if models else []
    return Node(
        engines=draw(engine_fingerprints()),
        name=name,
        state=state,
        cordon=cordon,
        cpu=CpuCapacity(
            cores=draw(pick((4, 8, 16, 32, 64, 128))),
            memory=draw(pick((16, 64, 256, 1024))) * GiB,
        ),
        devices=tuple(devices),
        hcas=tuple(hcas),
        nvlink_domains=domains,
        model_cache=tuple(sorted(cache)),
    )


@st.composite
def model_facts(draw: st.DrawFn) -> dict[str, ModelFacts]:
    """Facts for some of the model names (a missing one is an unknown model)."""
    out = {}
    for name in MODEL_NAMES:
        if draw(ints(0, 19)) == 0:
            continue
        out[name] = ModelFacts(
            name=name,
            weight_bytes=draw(pick((1, 2, 4, 8, 16, 40, 70, 140, 400))) * GiB,
            kv_bytes_per_token=draw(pick((0, 128 * 1024, 320 * 1024))),
            context_length=draw(pick((2048, 4096, 32768))),
        )
    return out


@st.composite
def profiles(draw: st.DrawFn, name: str, theme: Sequence[str]) -> Profile:
    """vLLM (cuda/rocm, tensor parallel, multi-node) or llama.cpp (CPU or one GPU)."""
    kind = draw(pick(("vllm", "vllm", "llama-cpu", "llama-gpu")))
    priority = draw(ints(0, 3))
    context = draw(pick((None, None, 2048, 8192)))
    if kind == "llama-cpu":
        cpu = None
        if draw(ints(0, 3)):
            memory = draw(pick((None, None, 8 * GiB, 48 * GiB, 300 * GiB)))
            cpu = CpuRequest(
                cores=draw(pick((1, 2, 4, 8, 16, 32))),
                memory=memory,
            )
        runtime = draw(pick((None, "cpu")))
        return Profile(
            name=name,
            engine=EngineKind.LLAMACPP,
            runtime=runtime,
            cpu=cpu,
            priority=priority,
            context=context,
        )
    # Mostly the fleet's classes; sometimes another, or the one whose driver no engine serves.
    cls = draw(pick((*theme * 8, *NV_CLASSES, *AMD_CLASSES, ODD_CLASS)))
    driver = CLASSES[cls].driver
    cpu = None
    if draw(ints(0, 4)) == 0:
        cpu = CpuRequest(
            cores=draw(pick((1, 4, 16))),
            memory=draw(pick((None, 8 * GiB, 200 * GiB))),
        )
    if kind == "vllm":
        runtimes = {NVIDIA: [None, "cuda"], AMD: [None, "rocm"]}.get(driver, [None])
        return Profile(
            name=name,
            engine=EngineKind.VLLM,
            runtime=draw(pick(tuple(runtimes))),
            device_class=cls,
            devices_per_node=draw(pick((1, 1, 2, 2, 4, 8, 3))),
            nodes=draw(pick((1, 1, 1, 2, 2, 3))),
            priority=priority,
            cpu=cpu,
            context=context,
        )
    runtimes = {NVIDIA: [None, "cuda"], AMD: [None, "vulkan", "rocm"]}.get(driver, [None])
    return Profile(
        name=name,
        engine=EngineKind.LLAMACPP,
        runtime=draw(pick(tuple(runtimes))),
        device_class=cls,
        priority=priority,
        cpu=cpu,
        context=context,
    )


@st.composite
def deployments(
    draw: st.DrawFn, theme: Sequence[str], prefix: str = "d", max_deployments: int = 3
) -> list[Deployment]:
    out = []
    for i in range(draw(ints(1, max_deployments))):
        n_profiles = draw(ints(1, 3))
        replicas: int | ReplicaRange = draw(pick((1, 2, 1, 2, 3, 0)))
        if draw(ints(0, 5)) == 0:
            low = draw(pick((1, 2, 0)))
            replicas = ReplicaRange(min=low, max=low + draw(ints(1, 3)))
        out.append(
            Deployment(
                name=f"{prefix}{i}",
                model=draw(pick(MODEL_NAMES)),
                replicas=replicas,
                profiles=tuple(draw(profiles(f"p{j}", theme)) for j in range(n_profiles)),
            )
        )
    return out


def _free_devices(node: Node, used: set[tuple[str, int]], stale: bool) -> dict[str, list[int]]:
    free: dict[str, list[int]] = {}
    for d in node.devices:
        if (stale or d.health.healthy) and (node.name, d.index) not in used:
            free.setdefault(d.device_class, []).append(d.index)
    return free


@st.composite
def existing_replicas(
    draw: st.DrawFn, node_list: Sequence[Node], owners: Sequence[str], stale: bool = False
) -> tuple[Replica, ...]:
    """Replicas already allocated: free healthy devices and capacity picked by hand.

    Stale ones (``stale``) are what a running fleet also holds: a replica on a device that has
    since faulted, on a node that re-registered with fewer cores or less memory than its replicas
    claim, or on a node that is gone from the inventory.
    """
    out: list[Replica] = []
    used: set[tuple[str, int]] = set()
    if stale and draw(ints(0, 3)) == 0:
        shard = Shard(node="gone", devices=(0,), cpu_cores=2)
        out.append(
            Replica(
                name="bg-gone", deployment="bg", profile="p0", device_class=NV_CLASSES[0], shards=(shard,)
            )
        )
    for node in node_list:
        if draw(ints(0, 3)):
            continue
        free = _free_devices(node, used, stale)
        owner = draw(pick(tuple(owners)))
        state = draw(pick((ReplicaState.RUNNING, ReplicaState.PENDING, ReplicaState.STARTING)))
        name = f"{owner}-{len(out)}"
        if stale:
            cores = draw(ints(0, node.cpu.cores * 2))
            memory = draw(pick((0, 4 * GiB, node.cpu.memory // 2, node.cpu.memory * 2)))
        else:
            cores = draw(ints(0, node.cpu.cores // 2))
            memory = draw(pick((0, 0, 4 * GiB, node.cpu.memory // 2)))
        if free:
            cls = draw(pick(tuple(sorted(free))))
            k = draw(ints(1, len(free[cls])))
            picked = draw(unique_lists(pick(tuple(free[cls])), k, k))
            used.update((node.name, i) for i in picked)
            shard = Shard(node=node.name, devices=tuple(sorted(picked)), cpu_cores=cores, memory=memory)
            out.append(
                Replica(
                    name=name, deployment=owner, profile="p0", device_class=cls, shards=(shard,), state=state
                )
            )
        elif not node.devices:
            shard = Shard(node=node.name, cpu_cores=max(cores, 1), memory=memory)
            out.append(Replica(name=name, deployment=owner, profile="p0", shards=(shard,), state=state))
    return tuple(out)


@dataclass(frozen=True, repr=False)
class Scenario:
    snapshot: ClusterSnapshot
    deployments: list[Deployment]

    def __repr__(self) -> str:  # a failing example prints the whole cluster, one item a line
        lines = ["Scenario(", "  nodes="]
        lines += [f"    {n!r}," for n in self.snapshot.nodes]
        lines += ["  replicas="] + [f"    {r!r}," for r in self.snapshot.replicas]
        lines += [f"  models={dict(self.snapshot.models)!r},", "  deployments="]
        lines += [f"    {d!r}," for d in self.deployments]
        return "\n".join([*lines, ")"])


@st.composite
def scenarios(
    draw: st.DrawFn, max_nodes: int = 12, max_devices: int = 8, max_deployments: int = 3, stale: bool = False
) -> Scenario:
    facts = draw(model_facts())
    # The fleet's GPU classes: most GPU nodes and most GPU profiles use one of them.
    size = draw(pick((1, 1, 2)))
    theme = draw(unique_lists(pick((*NV_CLASSES, *AMD_CLASSES)), size, size))
    n = draw(pick(tuple(range(1, max_nodes + 1))))
    primary = draw(pick(tuple(sorted(FABRICS))))
    dense = draw(BOOLS)
    node_list = [draw(nodes(f"n{i}", max_devices, theme, primary, MODEL_NAMES, dense)) for i in range(n)]
    deps = draw(deployments(theme, "d", max_deployments))
    owners = ["bg", *(d.name for d in deps)]
    replicas = draw(existing_replicas(node_list, owners, stale))
    snapshot = ClusterSnapshot(
        classes=CLASSES,
        nodes=tuple(node_list),
        fabrics=FABRICS,
        replicas=replicas,
        models=MappingProxyType(facts),
    )
    if draw(BOOLS):
        # Warm the cluster by placing first: pre-existing multi-node replicas with HCAs too.
        warm = draw(deployments(theme, "warm", 2))
        placed = [
            p.replica.model_copy(update={"state": ReplicaState.RUNNING})
            for d in plan(warm, snapshot, SearchKind.NAIVE)
            for p in d.placed
        ]
        snapshot = replace(snapshot, replicas=(*replicas, *placed))
    return Scenario(snapshot, deps)


# --- the independent model -------------------------------------------------------------------


def pool_drivers(node: Node) -> set[str]:
    """The drivers of a node's devices, known to the table or not: its taints. None: a CPU node."""
    return {CLASSES[d.device_class].driver for d in node.devices}


def tolerated(node: Node, demand: Demand) -> bool:
    drivers = pool_drivers(node)
    if demand.device_class is None:
        return not drivers
    return drivers <= {demand.driver.value}


@dataclass
class Ledger:
    """What is allocated: device by device, cores and host memory per node."""

    snapshot: ClusterSnapshot
    used: set[tuple[str, int]] = field(default_factory=set)
    cores: Counter[str] = field(default_factory=Counter)
    memory: Counter[str] = field(default_factory=Counter)

    @classmethod
    def of(cls, snapshot: ClusterSnapshot) -> Ledger:
        """Existing replicas hold what they claim, whether or not it would fit today."""
        ledger = cls(snapshot)
        for replica in snapshot.replicas:
            for shard in replica.shards:
                for index in shard.devices:
                    assert (shard.node, index) not in ledger.used, "the generated replicas overlap"
                    ledger.used.add((shard.node, index))
                ledger.cores[shard.node] += shard.cpu_cores
                ledger.memory[shard.node] += shard.memory
        return ledger

    def node(self, name: str) -> Node:
        return next(n for n in self.snapshot.nodes if n.name == name)

    def apply(self, replica: Replica) -> None:
        """Allocate a new replica, asserting nothing is taken twice and no capacity is exceeded."""
        for shard in replica.shards:
            node = self.node(shard.node)
            for index in shard.devices:
                assert (shard.node, index) not in self.used, f"{shard.node}/{index} allocated twice"
                self.used.add((shard.node, index))
            self.cores[shard.node] += shard.cpu_cores
            self.memory[shard.node] += shard.memory
            assert self.cores[shard.node] <= node.cpu.cores, f"{shard.node}: cores over capacity"
            assert self.memory[shard.node] <= node.cpu.memory, f"{shard.node}: memory over capacity"

    def free_of(self, node: Node, device_class: str) -> list[int]:
        return [
            d.index
            for d in node.devices
            if d.device_class == device_class and d.health.healthy and (node.name, d.index) not in self.used
        ]


def first_failure(ledger: Ledger, node: Node, demand: Demand) -> tuple[Reason, int | None] | None:
    """The first constraint ``node`` fails for ``demand``, in the filter chain's order."""
    if node.state is not NodeState.READY:
        return (Reason.NOT_READY, None)
    if node.cordon is not None:
        return (Reason.CORDONED, None)
    if demand.device_class is not None and not any(
        d.device_class == demand.device_class for d in node.devices
    ):
        return (Reason.NO_DEVICE_OF_CLASS, None)
    if not tolerated(node, demand):
        return (Reason.TAINT_NOT_TOLERATED, None)
    if not node.runs(demand.engine, demand.variant):
        return (Reason.ENGINE_NOT_INSTALLED, None)
    if demand.device_class is not None and demand.device_memory > CLASSES[demand.device_class].memory:
        return (Reason.DEVICE_MEMORY_TOO_SMALL, None)
    if demand.nodes > 1 and not node.hcas:
        return (Reason.NO_FABRIC, None)
    if demand.device_class is not None:
        have = len(ledger.free_of(node, demand.device_class))
        if have < demand.devices_per_node:
            return (Reason.INSUFFICIENT_FREE_DEVICES, have)
    if node.cpu.cores - ledger.cores[node.name] < demand.cpu_cores:
        return (Reason.INSUFFICIENT_CPU, None)
    if node.cpu.memory - ledger.memory[node.name] < demand.host_memory:
        return (Reason.INSUFFICIENT_MEMORY, None)
    return None


def shard_choices(ledger: Ledger, node: Node, demand: Demand) -> Iterable[tuple[int, ...]]:
    """Brute force: every device subset of the node that could be this replica's shard."""
    if node.state is not NodeState.READY or node.cordon is not None or not tolerated(node, demand):
        return
    if not node.runs(demand.engine, demand.variant):
        return
    if node.cpu.cores - ledger.cores[node.name] < demand.cpu_cores:
        return
    if node.cpu.memory - ledger.memory[node.name] < demand.host_memory:
        return
    if demand.device_class is None:
        yield ()
        return
    if demand.device_memory > CLASSES[demand.device_class].memory:
        return
    for subset in itertools.combinations(node.devices, demand.devices_per_node):
        if all(
            d.device_class == demand.device_class
            and d.health.healthy
            and (node.name, d.index) not in ledger.used
            for d in subset
        ):
            yield tuple(d.index for d in subset)


def brute_force_fits(ledger: Ledger, demand: Demand) -> bool:
    """Whether any set of nodes and devices satisfies every rule for one new replica."""
    usable = [
        n for n in ledger.snapshot.nodes if next(iter(shard_choices(ledger, n, demand)), None) is not None
    ]
    for group in itertools.combinations(usable, demand.nodes):
        if demand.nodes == 1:
            return True
        common = set.intersection(*({h.fabric for h in n.hcas} for n in group))
        if common:
            return True
    return False


def expected_report(ledger: Ledger, demand: Demand) -> tuple[dict[tuple[Reason, int | None], int], int, dict]:
    """Reason counts, nodes that fit alone, and per-fabric fit, computed node by node."""
    counts: Counter[tuple[Reason, int | None]] = Counter()
    fit: list[Node] = []
    for node in ledger.snapshot.nodes:
        rejection = first_failure(ledger, node, demand)
        if rejection is None:
            fit.append(node)
        else:
            counts[rejection] += 1
    fabric_fit: Counter[str] = Counter()
    if demand.nodes > 1:
        for node in fit:
            for fabric in {h.fabric for h in node.hcas}:
                fabric_fit[fabric] += 1
        if fit:
            counts[(Reason.FABRIC_TOO_SMALL, None)] += len(fit)
    return dict(counts), len(fit) if demand.nodes > 1 else 0, dict(fabric_fit)


def check_replica(ledger: Ledger, demand: Demand, replica: Replica) -> None:
    """Every hard rule on one new replica, against the capacity in ``ledger``; then allocate it."""
    snapshot = ledger.snapshot
    assert replica.profile == demand.profile
    assert replica.device_class == demand.device_class
    assert len(replica.shards) == demand.nodes
    assert len({s.node for s in replica.shards}) == demand.nodes, "two shards on one node"
    if demand.nodes > 1:
        assert replica.fabric is not None and replica.fabric in snapshot.fabrics
    else:
        assert replica.fabric is None
    for shard in replica.shards:
        node = ledger.node(shard.node)
        assert node.state is NodeState.READY, f"{node.name} is {node.state}"
        assert node.cordon is None, f"{node.name} is cordoned"
        assert node.runs(demand.engine, demand.variant), f"{node.name} lacks {demand.engine}/{demand.variant}"
        drivers = pool_drivers(node)
        if demand.device_class is None:
            assert not drivers, f"CPU replica on {node.name}, a {drivers} node"
            assert shard.devices == ()
        else:
            assert drivers <= {demand.driver.value}, f"{demand.driver} replica on a {drivers} node"
            assert demand.device_memory <= CLASSES[demand.device_class].memory
            assert len(shard.devices) == demand.devices_per_node
            assert len(set(shard.devices)) == len(shard.devices)
            by_index = {d.index: d for d in node.devices}
            for index in shard.devices:
                device = by_index[index]
                assert device.device_class == demand.device_class, f"{node.name}/{index} of another class"
                assert device.health.healthy, f"{node.name}/{index} is unhealthy"
        assert shard.cpu_cores == demand.cpu_cores
        assert shard.memory == demand.host_memory
        if replica.fabric is None:
            assert shard.hcas == ()
        else:
            own = [h.name for h in node.hcas if h.fabric == replica.fabric]
            assert own, f"{node.name} is not attached to {replica.fabric}"
            assert sorted(shard.hcas) == sorted(own), f"{node.name}: HCAs {shard.hcas} vs {own}"
    ledger.apply(replica)  # no double allocation, capacity never exceeded


def check_preferences(ledger: Ledger, demand: Demand, replica: Replica) -> None:
    """The soft rules, against the capacity before ``replica``: bin packing, emptiest machines,
    spread, cache among equals, NVLink domain else lowest free indices."""
    fit = [n for n in ledger.snapshot.nodes if first_failure(ledger, n, demand) is None]
    by_name = {n.name: n for n in fit}
    chosen = [by_name[s.node] for s in replica.shards]  # KeyError: a node that does not fit

    def cached(node: Node) -> bool:
        return demand.model in node.model_cache

    def free(node: Node) -> int:
        assert demand.device_class is not None
        return len(ledger.free_of(node, demand.device_class))

    if demand.nodes == 1:
        if demand.device_class is None:  # CPU replicas spread: the most free cores
            cores = {n.name: n.cpu.cores - ledger.cores[n.name] for n in fit}
            best = max(cores.values())
            assert cores[chosen[0].name] == best
            equals = [n for n in fit if cores[n.name] == best]
        else:  # GPUs bin packed: the fewest free devices that still fit
            best = min(free(n) for n in fit)
            assert free(chosen[0]) == best
            equals = [n for n in fit if free(n) == best]
        if any(cached(n) for n in equals):
            assert cached(chosen[0]), "among equals, a node caching the model"
    else:  # the emptiest machines of the fabric whose chosen machines are emptiest together
        tops = {}
        for fabric in {h.fabric for n in fit for h in n.hcas}:
            counts = sorted((free(n) for n in fit if any(h.fabric == fabric for h in n.hcas)), reverse=True)
            if len(counts) >= demand.nodes:
                tops[fabric] = counts[: demand.nodes]
        assert sorted((free(n) for n in chosen), reverse=True) == tops[replica.fabric]
        assert sum(tops[replica.fabric]) == max(sum(t) for t in tops.values())
    if demand.device_class is None:
        return
    for shard, node in zip(replica.shards, chosen, strict=True):
        available = set(ledger.free_of(node, demand.device_class))
        k = demand.devices_per_node
        domains = [set(d) & available for d in node.nvlink_domains]
        if any(len(d) >= k for d in domains):
            assert any(set(shard.devices) <= d for d in domains), "TP group outside one NVLink domain"
        else:
            assert sorted(shard.devices) == sorted(available)[:k], "not the lowest free indices"


def usable_demands(snapshot: ClusterSnapshot, dep: Deployment) -> list[Demand]:
    """The deployment's demands in the order placement must try them."""
    facts = snapshot.models.get(dep.model)
    if facts is None:
        return []
    result = gate(dep, snapshot.classes, snapshot.served_drivers())
    demands = [demand_for(p, facts, snapshot.classes.get(p.device_class or "")) for p in result.usable]
    # Priority order, independently: higher first, then as written.
    position = {p.name: (-p.priority, i) for i, p in enumerate(dep.profiles)}
    assert [d.profile for d in demands] == sorted((d.profile for d in demands), key=position.__getitem__)
    return demands


def check_report(ledger: Ledger, demand: Demand, report: ProfileReport) -> None:
    """Explanations are complete and exact: each node counted once, by its first failed rule."""
    assert report.profile == demand.profile
    assert report.nodes_evaluated == len(ledger.snapshot.nodes)
    total = sum(r.count for r in report.reasons)
    assert total == report.nodes_evaluated, render_report(report)
    counts, n_fit, fabric_fit = expected_report(ledger, demand)
    assert report.counts() == counts, render_report(report)
    assert report.nodes_fit == n_fit
    assert dict(report.fabric_fit) == fabric_fit
    assert not report.fits


def check_decisions(
    snapshot: ClusterSnapshot, deps: Sequence[Deployment], decisions: Sequence[DeploymentDecision]
) -> Ledger:
    """Replay the decisions against the independent model; return the final ledger."""
    ledger = Ledger.of(snapshot)
    assert [d.deployment for d in decisions] == [d.name for d in deps]
    names_taken = {r.name for r in snapshot.replicas}
    for dep, decision in zip(deps, decisions, strict=True):
        demands = usable_demands(snapshot, dep)
        names = [d.profile for d in demands]
        assert len(decision.kept) + len(decision.placed) + len(decision.unplaced) == dep.desired_replicas
        for placement in decision.placed:
            chosen = names.index(placement.replica.profile)
            # Priority: every profile tried before the winner truly does not fit, and says why.
            assert [r.profile for r in placement.skipped] == names[:chosen]
            for demand, report in zip(demands[:chosen], placement.skipped, strict=True):
                assert not brute_force_fits(ledger, demand), render_report(report)
                check_report(ledger, demand, report)
            assert placement.replica.deployment == dep.name
            assert placement.replica.state is ReplicaState.PENDING
            assert placement.replica.name not in names_taken, "a replica name used twice"
            names_taken.add(placement.replica.name)
            check_preferences(ledger, demands[chosen], placement.replica)
            check_replica(ledger, demands[chosen], placement.replica)
        for unplaced in decision.unplaced:
            assert [r.profile for r in unplaced.reports] == names
            for demand, report in zip(demands, unplaced.reports, strict=True):
                assert not brute_force_fits(ledger, demand), render_report(report)
                check_report(ledger, demand, report)
    return ledger


def showing_the_scenario(test: Callable[..., None]) -> Callable[..., None]:
    """On failure, add the whole scenario to the error, one node, replica or deployment a line."""

    @functools.wraps(test)
    def wrapper(*args: Any, **kwargs: Any) -> None:
        try:
            test(*args, **kwargs)
        except BaseException as exc:
            exc.add_note(repr(kwargs.get("sc", args[0] if args else None)))
            raise

    return wrapper


# --- properties ------------------------------------------------------------------------------


@PROPS
@given(scenarios())
@showing_the_scenario
def test_every_placement_obeys_the_hard_rules(sc: Scenario) -> None:
    """Properties 1, 3 and 5 over at least 400 random clusters, replayed against the model."""
    decisions = plan(sc.deployments, sc.snapshot, SearchKind.INDEXED)
    check_decisions(sc.snapshot, sc.deployments, decisions)


@PROPS
@given(scenarios())
@showing_the_scenario
def test_indexed_and_full_scan_decide_identically(sc: Scenario) -> None:
    """Property 2: same replicas, same devices, same scores, same explanations."""
    indexed = [d.to_dict() for d in plan(sc.deployments, sc.snapshot, SearchKind.INDEXED)]
    naive = [d.to_dict() for d in plan(sc.deployments, sc.snapshot, SearchKind.NAIVE)]
    assert indexed == naive


@PROPS
@given(scenarios())
@showing_the_scenario
def test_explanations_count_every_node_once(sc: Scenario) -> None:
    """Property 3, per demand on a fresh placer: counts sum to the nodes evaluated."""
    for dep in sc.deployments:
        for demand in usable_demands(sc.snapshot, dep):
            for kind in SearchKind:
                outcome = Placer(sc.snapshot, kind).place_one("probe-0", "probe", [demand])
                if isinstance(outcome, Placement):
                    continue
                (report,) = outcome.reports
                counted = sum(r.count for r in report.reasons)
                assert counted == report.nodes_evaluated == len(sc.snapshot.nodes), render_report(report)
                if demand.nodes > 1:
                    too_small = report.counts().get((Reason.FABRIC_TOO_SMALL, None), 0)
                    assert too_small == report.nodes_fit
                    assert all(n < demand.nodes for n in report.fabric_fit.values())
                check_report(Ledger.of(sc.snapshot), demand, report)


@PROPS
@given(scenarios(max_nodes=6, max_devices=4))
@showing_the_scenario
def test_brute_force_agrees_on_small_clusters(sc: Scenario) -> None:
    """Property 4: a fit exists (exhaustive search) iff place_one finds one, for every profile."""
    ledger = Ledger.of(sc.snapshot)
    for dep in sc.deployments:
        for demand in usable_demands(sc.snapshot, dep):
            exists = brute_force_fits(ledger, demand)
            for kind in SearchKind:
                outcome = Placer(sc.snapshot, kind).place_one("probe-0", "probe", [demand])
                assert isinstance(outcome, Placement) == exists, (kind, demand, outcome)
                if isinstance(outcome, Placement):
                    check_replica(Ledger.of(sc.snapshot), demand, outcome.replica)


@PROPS
@given(scenarios(max_deployments=1))
@showing_the_scenario
def test_highest_priority_profile_that_fits_wins(sc: Scenario) -> None:
    """Property 5: if the first demand fits alone, the placement uses it; else the first that fits."""
    demands = usable_demands(sc.snapshot, sc.deployments[0])
    assume(demands)
    alone = [isinstance(Placer(sc.snapshot).place_one("probe-0", "probe", [d]), Placement) for d in demands]
    outcome = Placer(sc.snapshot).place_one("probe-0", "probe", demands)
    if any(alone):
        assert isinstance(outcome, Placement)
        assert outcome.replica.profile == demands[alone.index(True)].profile
        assert len(outcome.skipped) == alone.index(True)
    else:
        assert isinstance(outcome, Unplaced)
        assert len(outcome.reports) == len(demands)


@PROPS
@given(scenarios())
@showing_the_scenario
def test_running_replicas_stay(sc: Scenario) -> None:
    """Property 6: re-planning with the placed replicas running keeps them and places nothing."""
    first = plan(sc.deployments, sc.snapshot)
    new = [p.replica.model_copy(update={"state": ReplicaState.RUNNING}) for d in first for p in d.placed]
    again = replace(sc.snapshot, replicas=(*sc.snapshot.replicas, *new))
    Ledger.of(again)  # nothing held twice
    second = plan(sc.deployments, again)
    for d1, d2 in zip(first, second, strict=True):
        assert d2.placed == ()
        assert set(d2.kept) == set(d1.kept) | {p.replica.name for p in d1.placed}
        assert len(d2.unplaced) == len(d1.unplaced)
        assert d2.lost == d1.lost
        assert d2.surplus == d1.surplus
    assert [d.to_dict() for d in second] == [
        d.to_dict() for d in plan(sc.deployments, again, SearchKind.NAIVE)
    ]


@PROPS
@given(scenarios(stale=True))
@showing_the_scenario
def test_stale_replicas_keep_what_they_hold(sc: Scenario) -> None:
    """Existing replicas on faulted devices, shrunken or vanished nodes keep what they hold:
    nothing they hold is placed again, capacity is never exceeded further, both searches agree."""
    indexed = plan(sc.deployments, sc.snapshot, SearchKind.INDEXED)
    naive = plan(sc.deployments, sc.snapshot, SearchKind.NAIVE)
    assert [d.to_dict() for d in indexed] == [d.to_dict() for d in naive]
    check_decisions(sc.snapshot, sc.deployments, indexed)


def _same(a: Found | ProfileReport, b: Found | ProfileReport) -> bool:
    if isinstance(a, ProfileReport) or isinstance(b, ProfileReport):
        return isinstance(a, ProfileReport) and isinstance(b, ProfileReport) and a.to_dict() == b.to_dict()
    return (a.shards, a.fabric, dict(a.scores)) == (b.shards, b.fabric, dict(b.scores))


@PROPS
@given(scenarios(max_deployments=2), st.lists(st.integers(0, 1000), max_size=14))
@showing_the_scenario
def test_place_and_release_keep_the_searches_current(sc: Scenario, ops: list[int]) -> None:
    """Whole replicas placed and released in any order: the indexed search, kept current
    incrementally, answers like the full scan and like a placer built afresh from what is left."""
    demands = [d for dep in sc.deployments for d in usable_demands(sc.snapshot, dep)]
    assume(demands)
    placers = [Placer(sc.snapshot, kind) for kind in SearchKind]
    live = {r.name: r for r in sc.snapshot.replicas}
    for step, op in enumerate(ops):
        if live and op % 3 == 0:
            name = sorted(live)[op % len(live)]
            del live[name]
            for placer in placers:
                placer.release(name)
            continue
        demand = demands[op % len(demands)]
        indexed, naive = (p.place_one(f"r-{step}", "r", [demand]) for p in placers)
        if isinstance(indexed, Placement):
            assert isinstance(naive, Placement)
            assert indexed.replica == naive.replica
            assert dict(indexed.scores) == dict(naive.scores)
            live[indexed.replica.name] = indexed.replica
        else:
            assert isinstance(naive, Unplaced)
            assert [r.to_dict() for r in indexed.reports] == [r.to_dict() for r in naive.reports]
    afresh = Placer(replace(sc.snapshot, replicas=tuple(live.values())))
    ledger = Ledger.of(afresh.snapshot)
    for demand in demands:
        answers = [p.search.find(demand) for p in (*placers, afresh)]
        assert _same(answers[0], answers[2]) and _same(answers[1], answers[2]), demand
        assert isinstance(answers[2], Found) == brute_force_fits(ledger, demand)


# --- examples --------------------------------------------------------------------------------


FACTS = MappingProxyType({"m0": ModelFacts("m0", 40 * GiB, 0, 4096)})


def _snapshot(*node_list: Node, replicas: tuple[Replica, ...] = ()) -> ClusterSnapshot:
    return ClusterSnapshot(CLASSES, tuple(node_list), FABRICS, replicas, FACTS)


H100 = "nvidia-h100-80gb"
TP2 = Profile(name="tp2", engine=EngineKind.VLLM, device_class=H100, devices_per_node=2)
TP2X2 = Profile(name="tp2x2", engine=EngineKind.VLLM, device_class=H100, devices_per_node=2, nodes=2)
CPU = Profile(name="cpu", engine=EngineKind.LLAMACPP, cpu=CpuRequest(cores=8))


@pytest.mark.parametrize(
    ("node_list", "profile", "expected"),
    [
        pytest.param(
            (
                gpu_server_64c_512g("a", H100, 2, uuid="{node}-{i}", cordon=Cordon(reason="x")),
                gpu_server_64c_512g("b", H100, 1, uuid="{node}-{i}"),
                gpu_server_64c_512g("c", H100, 2, uuid="{node}-{i}", state=NodeState.NOT_READY),
                cpu_32c_128g("d"),
                gpu_server_64c_512g("e", "amd-mi300x", 4, uuid="{node}-{i}"),
            ),
            TP2,
            {
                (Reason.CORDONED, None): 1,
                (Reason.INSUFFICIENT_FREE_DEVICES, 1): 1,
                (Reason.NOT_READY, None): 1,
                (Reason.NO_DEVICE_OF_CLASS, None): 2,
            },
            id="single-node-reasons",
        ),
        pytest.param(
            (
                gpu_server_64c_512g(
                    "a", H100, 2, uuid="{node}-{i}", hcas=(Hca(name="mlx5_0", fabric="ib-a"),)
                ),
                gpu_server_64c_512g(
                    "b", H100, 2, uuid="{node}-{i}", hcas=(Hca(name="mlx5_0", fabric="ib-b"),)
                ),
                gpu_server_64c_512g("c", H100, 2, uuid="{node}-{i}"),
            ),
            TP2X2,
            {(Reason.FABRIC_TOO_SMALL, None): 2, (Reason.NO_FABRIC, None): 1},
            id="two-fabrics-never-one-group",
        ),
        pytest.param(
            (
                gpu_server_64c_512g("a", H100, 1, uuid="{node}-{i}"),
                build_node("b", 4, 128 * GiB),
                build_node("c", 32, 8 * GiB),
            ),
            CPU,
            {
                (Reason.TAINT_NOT_TOLERATED, None): 1,
                (Reason.INSUFFICIENT_CPU, None): 1,
                (Reason.INSUFFICIENT_MEMORY, None): 1,
            },
            id="cpu-reasons",
        ),
    ],
)
def test_explanation_examples(
    node_list: tuple[Node, ...], profile: Profile, expected: dict[tuple[Reason, int | None], int]
) -> None:
    snapshot = _snapshot(*node_list)
    results = [plan([deployment("d0", 1, profile, model="m0")], snapshot, kind)[0] for kind in SearchKind]
    assert results[0].to_dict() == results[1].to_dict()
    (unplaced,) = results[0].unplaced
    (report,) = unplaced.reports
    assert report.counts() == expected
    check_report(
        Ledger.of(snapshot), usable_demands(snapshot, deployment("d0", 1, profile, model="m0"))[0], report
    )


def test_multi_node_replica_uses_one_fabric_and_only_its_hcas() -> None:
    both = (Hca(name="mlx5_0", fabric="ib-a"), Hca(name="mlx5_1", fabric="ib-b"))
    snapshot = _snapshot(
        gpu_server_64c_512g("a", H100, 2, uuid="{node}-{i}", hcas=both),
        gpu_server_64c_512g("b", H100, 2, uuid="{node}-{i}", hcas=(Hca(name="mlx5_7", fabric="ib-b"),)),
        gpu_server_64c_512g("c", H100, 2, uuid="{node}-{i}", hcas=(Hca(name="mlx5_0", fabric="ib-a"),)),
    )
    for kind in SearchKind:
        (decision,) = plan([deployment("d0", 1, TP2X2, model="m0")], snapshot, kind)
        (placement,) = decision.placed
        check_replica(
            Ledger.of(snapshot),
            usable_demands(snapshot, deployment("d0", 1, TP2X2, model="m0"))[0],
            placement.replica,
        )


def test_falls_back_to_lower_priority_profile() -> None:
    low_cpu = CPU.model_copy(update={"priority": 0})
    high_gpu = TP2.model_copy(update={"priority": 5})
    snapshot = _snapshot(gpu_server_64c_512g("a", H100, 1, uuid="{node}-{i}"), cpu_32c_128g("b"))
    for kind in SearchKind:
        (decision,) = plan([deployment("d0", 1, low_cpu, high_gpu, model="m0")], snapshot, kind)
        (placement,) = decision.placed
        assert placement.replica.profile == "cpu"
        assert [r.profile for r in placement.skipped] == ["tp2"]


TP1 = Profile(name="tp1", engine=EngineKind.VLLM, device_class=H100)


def test_a_replica_on_a_faulted_device_keeps_its_other_devices() -> None:
    """A running replica whose device faulted still holds its healthy device and its cores."""
    node = gpu_server_64c_512g("a", H100, 2, ecc=(1,))
    old = Replica(
        name="old-0",
        deployment="old",
        profile="p",
        device_class=H100,
        shards=(Shard(node="a", devices=(0, 1), cpu_cores=60),),
    )
    snapshot = _snapshot(node, replicas=(old,))
    for kind in SearchKind:
        (decision,) = plan([deployment("d0", 1, TP1, model="m0")], snapshot, kind)
        assert decision.placed == ()
        (unplaced,) = decision.unplaced
        assert unplaced.reports[0].counts() == {(Reason.INSUFFICIENT_FREE_DEVICES, 0): 1}


@pytest.mark.parametrize(
    "held",
    [
        pytest.param({"cpu_cores": 8}, id="replicas-hold-more-cores-than-the-node-has"),
        pytest.param({"memory": 128 * GiB}, id="replicas-hold-more-memory-than-the-node-has"),
    ],
)
def test_a_node_whose_replicas_hold_more_than_it_has(held: dict[str, int]) -> None:
    """Found by test_stale_replicas_keep_what_they_hold (shrunk): a node re-registered with fewer
    cores (or less memory) than its running replicas hold, so its free cores (memory) are negative.
    A GPU profile that claims no host CPU: the full scan says InsufficientCpu (InsufficientMemory);
    the indexed search picks the node without a host check and ``plan`` raises AllocationConflict
    from WorkingState.check. Both searches must decide the same, and ``plan`` must not raise."""
    node = Node(
        name="a",
        cpu=CpuCapacity(cores=4, memory=64 * GiB),
        devices=tuple(Device(index=i, device_class=H100) for i in range(2)),
    )
    old = Replica(
        name="old-0",
        deployment="old",
        profile="p",
        device_class=H100,
        shards=(Shard(node="a", devices=(0,), **held),),
    )
    snapshot = _snapshot(node, replicas=(old,))
    naive = plan([deployment("d0", 1, TP1, model="m0")], snapshot, SearchKind.NAIVE)[0].to_dict()
    indexed = plan([deployment("d0", 1, TP1, model="m0")], snapshot, SearchKind.INDEXED)[0].to_dict()
    assert indexed == naive
