"""Placement benchmark: decisions per second and decision latency, indexed search against full scan.

Run from the repository root::

    .venv/bin/python bench/placement.py            # 5,000 nodes, 40,000 GPUs, 50,000 replicas
    .venv/bin/python bench/placement.py --quick    # a small smoke run

This prints figures; it asserts nothing about time (the machine may be shared and noisy). It does
check, cheaply and at the end, that no device was allocated twice.

The fleet is synthetic and deterministic (``random.Random(seed)``), built from the pydantic
documents directly: H100, A100-40GB, MI300X and MI325X nodes of 4, 8 or 16 GPUs (one class per
node) plus CPU-only nodes; four fabrics, every GPU node attached by its HCAs to one of them; NVLink
domains of the whole node, two halves, or unknown; about 1% faulty devices (uncorrected ECC errors
or foreign processes); about 2% of nodes cordoned or NotReady; some nodes' model caches holding a
model. The workload is a seeded interleaving of fixed-size deployments — shapes of 1, 2, 4 and 8
GPUs, multi-node 2 x 8, and CPU replicas, most with fallback profiles — far more than the fleet
holds, so the later decisions are mostly "does not fit" with a full explanation.

Each replica is placed with ``Placer.place_one`` (``time.perf_counter`` around each call). The
full-scan baseline (``SearchKind.NAIVE``) is far slower, so it runs on a prefix of the same replica
sequence, and the indexed search runs on the same prefix too for a like-for-like comparison.

Stranded GPUs, measured on the state a run ends with: the smallest pending multi-GPU shape ``s``
is the fewest devices per node of any multi-GPU profile (2 or more devices per node) that a
replica left unplaced asked for (when none is pending, the smallest multi-GPU shape in the
workload). A free GPU is stranded when its node has fewer than ``s`` free GPUs of its class. The
stranded fraction is stranded GPUs over all free GPUs, both counted over healthy, unallocated
GPUs on Ready, uncordoned nodes.
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from fleetserve.drivers import Driver
from fleetserve.engines.spec import EngineKind
from fleetserve.modelfacts import ModelFacts
from fleetserve.placement.demand import Demand, demand_for
from fleetserve.placement.placer import Placement, Placer, SearchKind, Unplaced
from fleetserve.placement.state import WorkingState
from fleetserve.snapshot import ClusterSnapshot
from fleetserve.spec.nodeparts import Cordon, CpuCapacity, Device, DeviceHealth, Hca
from fleetserve.spec.resources import (
    CpuRequest,
    Deployment,
    DeviceClass,
    Fabric,
    FabricType,
    Node,
    NodeState,
    Profile,
)
from fleetserve.validation import gate

GiB = 1 << 30
GB = 10**9

# --- the fleet ------------------------------------------------------------------------------------

CLASSES: dict[str, tuple[str, int]] = {
    "nvidia-h100-80gb": (Driver.NVIDIA.value, 80 * GiB),
    "nvidia-a100-40gb": (Driver.NVIDIA.value, 40 * GiB),
    "amd-mi300x": (Driver.AMD.value, 192 * GiB),
    "amd-mi325x": (Driver.AMD.value, 256 * GiB),
}
FABRICS: tuple[tuple[str, FabricType], ...] = (
    ("ib-east", FabricType.INFINIBAND),
    ("ib-west", FabricType.INFINIBAND),
    ("roce-north", FabricType.ROCE),
    ("roce-south", FabricType.ROCE),
)
# Device class weights per node size: 4-GPU boxes are PCIe A100s/H100s, 16-GPU boxes HGX-2 style.
CLASS_BY_SIZE: dict[int, tuple[tuple[str, int], ...]] = {
    4: (("nvidia-a100-40gb", 3), ("nvidia-h100-80gb", 1)),
    8: (("nvidia-h100-80gb", 40), ("nvidia-a100-40gb", 20), ("amd-mi300x", 25), ("amd-mi325x", 15)),
    16: (("nvidia-a100-40gb", 1), ("nvidia-h100-80gb", 1)),
}
CPU_NODE_SHARE = 0.02
FOUR_GPU_SHARE = 0.10
FAULTY_DEVICE_RATE = 0.01
CORDONED_RATE = 0.01
NOT_READY_RATE = 0.01


def gpu_counts(gpu_nodes: int, gpus: int, rng: random.Random) -> list[int]:
    """Per GPU node, how many GPUs it has (4, 8 or 16), summing to exactly ``gpus``."""
    if gpus > 16 * gpu_nodes or gpus < gpu_nodes:
        raise SystemExit(f"cannot spread {gpus} GPUs over {gpu_nodes} GPU nodes (1 to 16 each)")
    counts = [4 if rng.random() < FOUR_GPU_SHARE else 8 for _ in range(gpu_nodes)]
    order = list(range(gpu_nodes))
    rng.shuffle(order)
    # Grow (8 → 16, then 4 → 8) or shrink (16 → 8 → 4 → 2 → 1) nodes until the total is exact.
    grow = {8: 16, 4: 8}
    shrink = {16: 8, 8: 4, 4: 2, 2: 1}
    total = sum(counts)
    while total != gpus:
        changed = False
        for i in order:
            diff = gpus - total
            if diff == 0:
                break
            step = grow if diff > 0 else shrink
            new = step.get(counts[i])
            if new is None or abs(new - counts[i]) > abs(diff):
                continue
            total += new - counts[i]
            counts[i] = new
            changed = True
        if not changed:  # only odd remainders left: take single GPUs off or add them
            for i in order:
                diff = gpus - total
                if diff == 0:
                    break
                if (diff > 0 and counts[i] < 16) or (diff < 0 and counts[i] > 1):
                    d = 1 if diff > 0 else -1
                    counts[i] += d
                    total += d
    return counts


def pick(rng: random.Random, weighted: Sequence[tuple[str, int]]) -> str:
    return rng.choices([w[0] for w in weighted], weights=[w[1] for w in weighted])[0]


def domains_for(count: int, rng: random.Random) -> tuple[tuple[int, ...], ...]:
    """NVLink domains: the whole node, two halves, or unknown (the lowest free indices are used)."""
    roll = rng.random()
    if count < 2 or roll < 0.1:
        return ()
    if count == 16 or roll < 0.3:
        half = count // 2
        return (tuple(range(half)), tuple(range(half, count)))
    return (tuple(range(count)),)


def health(rng: random.Random) -> DeviceHealth:
    if rng.random() >= FAULTY_DEVICE_RATE:
        return DeviceHealth()
    if rng.random() < 0.5:
        return DeviceHealth(ecc_uncorrected=rng.randint(1, 12))
    return DeviceHealth(foreign_processes=(rng.randint(1000, 99999),))


def build_snapshot(n_nodes: int, n_gpus: int, models: dict[str, ModelFacts], seed: int) -> ClusterSnapshot:
    """A deterministic synthetic fleet of ``n_nodes`` nodes (CPU-only ones included) and ``n_gpus`` GPUs."""
    rng = random.Random(seed)
    classes = {
        name: DeviceClass(name=name, driver=driver, memory=memory)
        for name, (driver, memory) in CLASSES.items()
    }
    fabrics = {name: Fabric(name=name, type=kind) for name, kind in FABRICS}
    n_cpu = max(1, round(n_nodes * CPU_NODE_SHARE))
    counts = gpu_counts(n_nodes - n_cpu, n_gpus, rng)
    gpu_models = [m for m in models if not m.endswith("gguf")]
    nodes: list[Node] = []
    for i, count in enumerate(counts):
        size = min((4, 8, 16), key=lambda s: abs(s - count))
        cls = pick(rng, CLASS_BY_SIZE[size])
        name = f"gpu-{i:05d}"
        fabric = rng.choice(FABRICS)[0]
        devices = tuple(
            Device.model_validate(
                {"index": d, "uuid": f"{name}-gpu-{d}", "class": cls, "health": health(rng)}
            )
            for d in range(count)
        )
        cache = tuple(rng.sample(gpu_models, k=rng.choice((0, 0, 0, 1, 1, 2))))
        cores = rng.choice((96, 112, 128, 192))
        domains = domains_for(count, rng)
        state, cordon = node_condition(rng)
        nodes.append(
            Node(
                name=name,
                labels={"rack": f"r{i // 32:03d}"},
                state=state,
                cordon=cordon,
                cpu=CpuCapacity(cores=cores, memory=2048 * GiB),
                devices=devices,
                hcas=tuple(Hca(name=f"mlx5_{h}", fabric=fabric) for h in range(max(1, count // 2))),
                nvlink_domains=domains,
                model_cache=cache,
            )
        )
    cpu_models = [m for m in models if m.endswith("gguf")]
    for i in range(n_cpu):
        cpu = CpuCapacity(cores=rng.choice((64, 96, 128, 192)), memory=rng.choice((256, 512, 768)) * GiB)
        cache = tuple(rng.sample(cpu_models, k=rng.choice((0, 1))))
        state, cordon = node_condition(rng)
        nodes.append(
            Node(
                name=f"cpu-{i:04d}",
                labels={"rack": f"c{i // 32:03d}"},
                state=state,
                cordon=cordon,
                cpu=cpu,
                model_cache=cache,
            )
        )
    return ClusterSnapshot(
        classes=MappingProxyType(classes),
        nodes=tuple(nodes),
        fabrics=MappingProxyType(fabrics),
        models=MappingProxyType(models),
    )


def node_condition(rng: random.Random) -> tuple[NodeState, Cordon | None]:
    """About 1% of nodes cordoned, 1% NotReady, the rest Ready and open."""
    roll = rng.random()
    if roll < CORDONED_RATE:
        return NodeState.READY, Cordon(reason="burn-in after repair", by="bench")
    if roll < CORDONED_RATE + NOT_READY_RATE:
        return NodeState.NOT_READY, None
    return NodeState.READY, None


# --- the workload ---------------------------------------------------------------------------------


def kv(layers: int, kv_heads: int, head_dim: int = 128, dtype: int = 2) -> int:
    return layers * kv_heads * 2 * head_dim * dtype


MODELS: dict[str, ModelFacts] = {
    m.name: m
    for m in (
        ModelFacts("llama-3.1-405b", 810 * GB, kv(126, 8), 131072),
        ModelFacts("mixtral-8x22b", 281 * GB, kv(56, 8), 65536),
        ModelFacts("llama-3.3-70b", 141 * GB, kv(80, 8), 32768),
        ModelFacts("qwen2.5-32b", 65 * GB, kv(64, 8), 32768),
        ModelFacts("gemma-2-27b", 54 * GB, kv(46, 16), 8192),
        ModelFacts("llama-3.1-8b", 16 * GB, kv(32, 8), 8192),
        ModelFacts("qwen2.5-7b-gguf", 4700 * 10**6, kv(28, 4), 32768),
        ModelFacts("llama-3.3-70b-gguf", 43 * GB, kv(80, 8), 32768),
    )
}


def vllm(name: str, cls: str, tp: int, nodes: int = 1, context: int | None = None) -> Profile:
    return Profile(
        name=name, engine=EngineKind.VLLM, device_class=cls, devices_per_node=tp, nodes=nodes, context=context
    )


# (deployment, model, weight in the replica mix, profiles in priority order)
DEPLOYMENTS: tuple[tuple[str, str, int, tuple[Profile, ...]], ...] = (
    (
        "chat-8b",
        "llama-3.1-8b",
        22,
        (
            vllm("a100-tp1", "nvidia-a100-40gb", 1),
            vllm("h100-tp1", "nvidia-h100-80gb", 1),
            vllm("mi300x-tp1", "amd-mi300x", 1),
        ),
    ),
    (
        "gemma-27b",
        "gemma-2-27b",
        8,
        (
            # A GPU profile that claims host CPU too, so the host checks run on GPU nodes.
            Profile(
                name="mi300x-vulkan",
                engine=EngineKind.LLAMACPP,
                device_class="amd-mi300x",
                cpu=CpuRequest(cores=8, memory=64 * GiB),
                context=8192,
            ),
            vllm("h100-tp1", "nvidia-h100-80gb", 1, context=8192),
        ),
    ),
    (
        "code-32b",
        "qwen2.5-32b",
        20,
        (
            vllm("h100-tp2", "nvidia-h100-80gb", 2, context=16384),
            vllm("mi300x-tp2", "amd-mi300x", 2, context=16384),
            vllm("a100-tp2", "nvidia-a100-40gb", 2, context=16384),
        ),
    ),
    (
        "llama-70b",
        "llama-3.3-70b",
        15,
        (
            vllm("h100-tp4", "nvidia-h100-80gb", 4),
            vllm("a100-tp4", "nvidia-a100-40gb", 4),
            vllm("mi325x-tp2", "amd-mi325x", 2),
        ),
    ),
    (
        "mixtral",
        "mixtral-8x22b",
        10,
        (
            vllm("mi300x-tp8", "amd-mi300x", 8, context=32768),
            vllm("h100-tp8", "nvidia-h100-80gb", 8, context=32768),
        ),
    ),
    (
        "llama-405b",
        "llama-3.1-405b",
        5,
        (
            vllm("h100-tp8-pp2", "nvidia-h100-80gb", 8, nodes=2, context=32768),
            # 40 GB cards are too small even across two nodes: DeviceMemoryTooSmall every time.
            vllm("a100-tp8-pp2", "nvidia-a100-40gb", 8, nodes=2, context=32768),
            vllm("mi325x-tp8", "amd-mi325x", 8, context=32768),
        ),
    ),
    (
        "embed-7b",
        "qwen2.5-7b-gguf",
        12,
        (Profile(name="cpu", engine=EngineKind.LLAMACPP, cpu=CpuRequest(cores=8), context=8192),),
    ),
    (
        "chat-70b-cpu",
        "llama-3.3-70b-gguf",
        8,
        (
            Profile(name="cpu-big", engine=EngineKind.LLAMACPP, cpu=CpuRequest(cores=32), context=16384),
            Profile(name="cpu-small", engine=EngineKind.LLAMACPP, cpu=CpuRequest(cores=16), context=4096),
        ),
    ),
)


@dataclass(frozen=True)
class Request:
    """One replica to place: its name, deployment and demands (one per usable profile, in order)."""

    name: str
    deployment: str
    demands: tuple[Demand, ...]


def build_workload(snapshot: ClusterSnapshot, n_replicas: int, seed: int) -> list[Request]:
    """A seeded interleaving of every deployment's replicas, ``n_replicas`` in all."""
    rng = random.Random(seed + 1)
    served = snapshot.served_drivers()
    demands: dict[str, tuple[Demand, ...]] = {}
    for name, model, _, profiles in DEPLOYMENTS:
        dep = Deployment(name=name, model=model, replicas=0, profiles=profiles)
        result = gate(dep, snapshot.classes, served)
        if not result.usable:  # a tiny fleet may lack a driver: its profiles are gated off
            raise SystemExit(f"benchmark deployment {name} is not accepted: {result.accepted.message}")
        facts = snapshot.models[model]
        demands[name] = tuple(
            demand_for(p, facts, snapshot.classes.get(p.device_class or "")) for p in result.usable
        )
    weights = [d[2] for d in DEPLOYMENTS]
    sequence = rng.choices([d[0] for d in DEPLOYMENTS], weights=weights, k=n_replicas)
    ordinal: dict[str, int] = {}
    out = []
    for dep_name in sequence:
        i = ordinal.get(dep_name, 0)
        ordinal[dep_name] = i + 1
        out.append(Request(f"{dep_name}-{i}", dep_name, demands[dep_name]))
    return out


# --- running and measuring ---------------------------------------------------------------------


class GcWatch:
    """Counts the full (generation 2) cyclic-GC passes while active, and how long they took."""

    def __init__(self) -> None:
        self.passes = 0
        self.total_s = 0.0
        self.longest_s = 0.0
        self._start = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            self._start = time.perf_counter()
        else:
            took = time.perf_counter() - self._start
            self.passes += 1
            self.total_s += took
            self.longest_s = max(self.longest_s, took)


@dataclass
class Run:
    """One search over one replica sequence: outcomes, latencies and the state it ended with."""

    label: str
    outcomes: list[Placement | Unplaced]
    latencies: list[float]  # seconds per place_one call, in call order
    cpu_s: float  # process CPU time over the loop
    loop_s: float  # wall time over the loop, bookkeeping included
    setup_s: float  # Placer construction: working state and indexes
    gc: GcWatch
    state: WorkingState

    @property
    def attempted(self) -> int:
        return len(self.outcomes)

    @property
    def placed(self) -> int:
        return sum(1 for o in self.outcomes if isinstance(o, Placement))

    @property
    def wall_s(self) -> float:
        """Time spent inside place_one."""
        return sum(self.latencies)


def run(snapshot: ClusterSnapshot, requests: Sequence[Request], kind: SearchKind, label: str) -> Run:
    """Place ``requests`` one by one with a fresh Placer of ``kind``, timing every call."""
    gc.collect()
    watch = GcWatch()
    gc.callbacks.append(watch)
    clock = time.perf_counter
    t0 = clock()
    placer = Placer(snapshot, kind)
    setup = clock() - t0
    latencies: list[float] = []
    outcomes: list[Placement | Unplaced] = []
    last_note = clock()
    cpu0 = time.process_time()
    loop0 = clock()
    for i, req in enumerate(requests, 1):
        start = clock()
        outcome = placer.place_one(req.name, req.deployment, req.demands)
        end = clock()
        latencies.append(end - start)
        outcomes.append(outcome)
        if i % 10_000 == 0 or end - last_note > 10:  # the slow baseline reports every 10 s too
            last_note = end
            print(f"  [{label}] {i:,}/{len(requests):,} replicas", file=sys.stderr, flush=True)
    loop = clock() - loop0
    cpu = time.process_time() - cpu0
    gc.callbacks.remove(watch)
    return Run(label, outcomes, latencies, cpu, loop, setup, watch, placer.state)


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of already sorted values."""
    if not sorted_values:
        return 0.0
    rank = max(1, round(q / 100 * len(sorted_values)))
    return sorted_values[min(rank, len(sorted_values)) - 1]


def smallest_pending_shape(outcomes: Sequence[Placement | Unplaced], requests: Sequence[Request]) -> int:
    """The fewest devices per node of any multi-GPU profile a still-unplaced replica asked for.

    When no multi-GPU replica is pending, the smallest multi-GPU shape in the workload.
    """
    pending = [
        r.needed
        for o in outcomes
        if isinstance(o, Unplaced)
        for r in o.reports
        if r.device_class is not None and r.needed >= 2
    ]
    if pending:
        return min(pending)
    shapes = [
        d.devices_per_node
        for q in requests
        for d in q.demands
        if d.device_class is not None and d.devices_per_node >= 2
    ]
    return min(shapes, default=2)


def stranded(state: WorkingState, shape: int) -> tuple[int, int]:
    """(stranded, free) GPUs: healthy, unallocated, on Ready uncordoned nodes; stranded if < shape."""
    free_total = stranded_total = 0
    for node in state.nodes:
        if not node.ready or node.cordoned:
            continue
        for devices in node.free.values():
            free_total += len(devices)
            if len(devices) < shape:
                stranded_total += len(devices)
    return stranded_total, free_total


def schedulable_gpus(snapshot: ClusterSnapshot) -> int:
    """Healthy GPUs on Ready, uncordoned nodes: the most a placement could ever use."""
    return sum(
        1
        for n in snapshot.nodes
        if n.state is NodeState.READY and n.cordon is None
        for d in n.devices
        if d.health.healthy
    )


def check_allocations(state: WorkingState) -> list[str]:
    """Problems in an end state: a device held twice, held yet listed free, unhealthy, overcommitted."""
    problems: list[str] = []
    holder: dict[tuple[str, int], str] = {}
    healthy = {(n.name, d.index) for n in state.snapshot.nodes for d in n.devices if d.health.healthy}
    cores: dict[str, int] = {}
    memory: dict[str, int] = {}
    for replica in state.replicas.values():
        for shard in replica.shards:
            node = state.by_name[shard.node]
            cores[shard.node] = cores.get(shard.node, 0) + shard.cpu_cores
            memory[shard.node] = memory.get(shard.node, 0) + shard.memory
            for index in shard.devices:
                key = (shard.node, index)
                if key in holder:
                    problems.append(f"{shard.node}/{index} held by {holder[key]} and {replica.name}")
                holder[key] = replica.name
                if key not in healthy:
                    problems.append(f"{shard.node}/{index} is unhealthy but held by {replica.name}")
                if index in node.free.get(node.class_of[index], ()):
                    problems.append(f"{shard.node}/{index} is held by {replica.name} yet listed free")
    for name, used in cores.items():
        node = state.by_name[name]
        if used > node.cores or memory[name] > node.memory:
            problems.append(f"{name} is overcommitted: {used}/{node.cores} cores")
    return problems


def differing_decisions(a: Sequence[Placement | Unplaced], b: Sequence[Placement | Unplaced]) -> int:
    """How many outcomes differ between two runs of one sequence: replica, scores and reports."""

    def key(o: Placement | Unplaced) -> object:
        if isinstance(o, Placement):
            return (o.replica, dict(o.scores), [r.to_dict() for r in o.skipped])
        return (o.name, [r.to_dict() for r in o.reports])

    return sum(1 for x, y in zip(a, b, strict=True) if key(x) != key(y))


def table(runs: Sequence[Run], requests: Sequence[Request], usable_gpus: int) -> list[str]:
    """The figures of every run, one column each."""
    rows: list[tuple[str, list[str]]] = []

    def row(name: str, values: Iterable[str]) -> None:
        rows.append((name, list(values)))

    def rate(n: int, s: float) -> str:
        return f"{n / s:,.0f}" if s else "-"

    lat = [sorted(r.latencies) for r in runs]
    shapes = [smallest_pending_shape(r.outcomes, requests) for r in runs]
    strand = [stranded(r.state, s) for r, s in zip(runs, shapes, strict=True)]
    row("placements attempted", (f"{r.attempted:,}" for r in runs))
    row("placed", (f"{r.placed:,}" for r in runs))
    row("unplaced (explained)", (f"{r.attempted - r.placed:,}" for r in runs))
    row("setup: Placer(snapshot) s", (f"{r.setup_s:.3f}" for r in runs))
    row("wall time in place_one s", (f"{r.wall_s:.3f}" for r in runs))
    row("CPU time (process) s", (f"{r.cpu_s:.3f}" for r in runs))
    row("CPU / wall over the loop", (f"{r.cpu_s / r.loop_s:.0%}" if r.loop_s else "-" for r in runs))
    row("decisions/s (wall)", (rate(r.attempted, r.wall_s) for r in runs))
    row("decisions/s (CPU)", (rate(r.attempted, r.cpu_s) for r in runs))
    row("latency p50 ms", (f"{percentile(v, 50) * 1e3:.3f}" for v in lat))
    row("latency p99 ms", (f"{percentile(v, 99) * 1e3:.3f}" for v in lat))
    row("latency max ms", (f"{(v[-1] if v else 0.0) * 1e3:.3f}" for v in lat))
    # The two paths apart: a placement commits and updates indexes; a "no" builds an explanation.
    for placed, what in ((True, "placed"), (False, "unplaced")):
        split = [
            sorted(
                t for t, o in zip(r.latencies, r.outcomes, strict=True) if isinstance(o, Placement) == placed
            )
            for r in runs
        ]
        row(
            f"  {what}: p50 / p99 ms",
            (f"{percentile(v, 50) * 1e3:.3f} / {percentile(v, 99) * 1e3:.3f}" if v else "-" for v in split),
        )
    row("full GC passes (longest ms)", (f"{r.gc.passes} ({r.gc.longest_s * 1e3:.1f})" for r in runs))
    row("smallest pending multi-GPU s", (str(s) for s in shapes))
    row("free GPUs (of schedulable)", (f"{free:,} ({free / usable_gpus:.1%})" for _, free in strand))
    row(
        "stranded GPUs (of free)",
        (f"{s:,} ({s / free:.1%})" if free else "0 (none free)" for s, free in strand),
    )
    width = max(len(name) for name, _ in rows)
    cols = [max(len(r.label), *(len(v[i]) for _, v in rows)) for i, r in enumerate(runs)]
    lines = [" " * width + "".join(f"  {r.label:>{c}}" for r, c in zip(runs, cols, strict=True))]
    for name, values in rows:
        lines.append(f"{name:<{width}}" + "".join(f"  {v:>{c}}" for v, c in zip(values, cols, strict=True)))
    return lines


def describe(snapshot: ClusterSnapshot, requests: Sequence[Request], seed: int, quick: bool) -> list[str]:
    """What is being measured: the fleet and the replica mix."""
    nodes = snapshot.nodes
    gpus = sum(len(n.devices) for n in nodes)
    faulty = sum(1 for n in nodes for d in n.devices if not d.health.healthy)
    cpu_only = sum(1 for n in nodes if not n.devices)
    cordoned = sum(1 for n in nodes if n.cordon is not None)
    not_ready = sum(1 for n in nodes if n.state is not NodeState.READY)
    sizes: dict[int, int] = {}
    for n in nodes:
        if n.devices:
            sizes[len(n.devices)] = sizes.get(len(n.devices), 0) + 1
    per_class: dict[str, int] = {}
    for n in nodes:
        for d in n.devices:
            per_class[d.device_class] = per_class.get(d.device_class, 0) + 1
    lines = [
        f"fleetserve placement benchmark (seed {seed}{', quick' if quick else ''})",
        f"fleet: {len(nodes):,} nodes ({cpu_only:,} CPU-only; {cordoned:,} cordoned, "
        f"{not_ready:,} NotReady), {gpus:,} GPUs ({faulty:,} faulty), {len(snapshot.fabrics)} fabrics",
        "  GPU nodes by size: " + ", ".join(f"{sizes[s]:,} x {s}" for s in sorted(sizes)),
        "  GPUs by class: " + ", ".join(f"{c} {n:,}" for c, n in sorted(per_class.items())),
        f"workload: {len(requests):,} replicas, one place_one call each (profiles in priority order)",
    ]
    mix: dict[str, int] = {}
    for q in requests:
        mix[q.deployment] = mix.get(q.deployment, 0) + 1
    profiles = {name: p for name, _, _, p in DEPLOYMENTS}
    for dep, count in sorted(mix.items(), key=lambda kv: -kv[1]):
        shape = ", ".join(
            f"{p.name} {p.devices_per_node}x{p.nodes}" if p.device_class else f"{p.name} cpu"
            for p in profiles[dep]
        )
        lines.append(f"  {dep:<13}{count:>8,}  [{shape}]")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Placement benchmark: indexed search against full scan.")
    parser.add_argument("--nodes", type=int, help="nodes in the fleet, CPU-only ones included (5000)")
    parser.add_argument("--gpus", type=int, help="GPUs in the fleet (8 per node: 40000)")
    parser.add_argument("--replicas", type=int, help="replicas to place one by one (50000)")
    parser.add_argument("--seed", type=int, default=1, help="seed of the fleet and the workload (1)")
    parser.add_argument(
        "--baseline-sample",
        type=int,
        help="how many replicas, from the start of the sequence, the full-scan baseline places (2000)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="a small smoke run: 500 nodes, 5,000 replicas, sample 500"
    )
    args = parser.parse_args(argv)
    nodes = args.nodes or (500 if args.quick else 5000)
    gpus = args.gpus or 8 * nodes
    replicas = args.replicas or (5000 if args.quick else 50_000)
    sample = min(replicas, args.baseline_sample or (500 if args.quick else 2000))

    snapshot = build_snapshot(nodes, gpus, MODELS, args.seed)
    requests = build_workload(snapshot, replicas, args.seed)
    for line in describe(snapshot, requests, args.seed, args.quick):
        print(line, flush=True)
    # The fleet's documents live as long as the process: freeze them so that full GC passes do
    # not walk them again and again, as a long-running control plane would after start-up.
    gc.collect()
    gc.freeze()

    full = run(snapshot, requests, SearchKind.INDEXED, "indexed, all")
    prefix = requests[:sample]
    indexed = run(snapshot, prefix, SearchKind.INDEXED, "indexed, sample")
    naive = run(snapshot, prefix, SearchKind.NAIVE, "naive, sample")
    runs = [full, indexed, naive]

    print()
    print(f"python {sys.version.split()[0]}, one thread; latency: time.perf_counter() around each place_one")
    print("GC: the fleet's documents are frozen (gc.freeze) before timing; full GC passes are counted")
    print(
        f"SAMPLE: the naive full scan is too slow for all {replicas:,} replicas; it places the first "
        f"{sample:,}\nonly, and the indexed search places the same prefix too, for a like-for-like column"
    )
    for line in table(runs, requests, schedulable_gpus(snapshot)):
        print(line)
    print()
    if naive.wall_s and indexed.wall_s:
        print(f"indexed vs naive on the sample: {naive.wall_s / indexed.wall_s:,.0f}x faster per decision")
    diff = differing_decisions(indexed.outcomes, naive.outcomes)
    print(
        f"indexed vs naive on the sample: {sample - diff:,}/{sample:,} decisions identical "
        "(replica, devices, scores, explanations)"
    )
    print(
        "stranded GPUs: free GPUs on nodes with fewer than s free GPUs of their class, s being the\n"
        "  fewest devices per node of any multi-GPU profile a still-unplaced replica asked for;\n"
        "  free GPUs: healthy and unallocated, on Ready uncordoned nodes (the 'of schedulable' share\n"
        "  is over every healthy GPU on Ready uncordoned nodes)"
    )
    ok = diff == 0
    for r in runs:
        problems = check_allocations(r.state)
        held = sum(len(s.devices) for rep in r.state.replicas.values() for s in rep.shards)
        verdict = "OK" if not problems else f"FAILED: {len(problems)} problems, e.g. {problems[0]}"
        print(
            f"allocation check [{r.label}]: {len(r.state.replicas):,} replicas hold {held:,} devices; "
            f"no device held twice, held while listed free, or unhealthy; no node overcommitted: {verdict}"
        )
        ok = ok and not problems
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
