"""Placement rules from design.md, one table-driven case per rule, run by both searches.

Hardware comes from tests/builders.py, named after its shape, e.g. ``nvidia_h100_80gb_x8`` is an HGX H100 board.
"""

from __future__ import annotations

from functools import partial
from types import MappingProxyType

import pytest

from builders import (
    amd_mi325x_x8,
    cpu_32c_128g,
    gpu_server_64c_512g,
    node,
    nvidia_h100_80gb_x8,
)
from builders import deployment as build_deployment
from fleetserve.drivers import RuntimeVariant
from fleetserve.engines.spec import EngineKind
from fleetserve.modelfacts import ModelFacts
from fleetserve.placement.demand import demand_for
from fleetserve.placement.filters import runs_engine
from fleetserve.placement.placer import DeploymentDecision, Placer, SearchKind, Unplaced, plan
from fleetserve.placement.report import Reason, render_report
from fleetserve.placement.state import WorkingState
from fleetserve.snapshot import ClusterSnapshot
from fleetserve.spec.nodeparts import EngineFingerprint
from fleetserve.spec.resources import Deployment, DeviceClass, Fabric, Node, Profile, Replica, Shard
from fleetserve.validation import gate, resolve_profile

GiB = 1 << 30
CLASSES = {
    "h100": DeviceClass(name="h100", driver="gpu.nvidia.com", memory=80 * GiB),
    "mi325x": DeviceClass(name="mi325x", driver="gpu.amd.com", memory=256 * GiB),
}
FABRICS = {"ib-a": Fabric(name="ib-a"), "ib-b": Fabric(name="ib-b")}
SMALL = ModelFacts("small", weight_bytes=2 * GiB, kv_bytes_per_token=0, context_length=4096)
BIG = ModelFacts("big", weight_bytes=100 * GiB, kv_bytes_per_token=0, context_length=4096)
# This suite's deployments serve the small model unless they say otherwise.
deployment = partial(build_deployment, model="small")


def running(name: str, dep: str, *shards: tuple[str, tuple[int, ...]]) -> Replica:
    return Replica(
        name=name,
        deployment=dep,
        profile="p",
        device_class="h100",
        shards=tuple(Shard(node=n, devices=d) for n, d in shards),
    )


def decide(
    nodes: list[Node], deps: list[Deployment], kind: SearchKind, replicas: tuple[Replica, ...] = ()
) -> list[DeploymentDecision]:
    snap = ClusterSnapshot(
        classes=MappingProxyType(CLASSES),
        nodes=tuple(nodes),
        fabrics=MappingProxyType(FABRICS),
        replicas=replicas,
        models=MappingProxyType({"small": SMALL, "big": BIG}),
    )
    return plan(deps, snap, kind)


def where(decision: DeploymentDecision) -> list[list[tuple[str, tuple[int, ...]]]]:
    return [[(s.node, s.devices) for s in p.replica.shards] for p in decision.placed]


both = pytest.mark.parametrize("kind", list(SearchKind))


@both
def test_gpus_are_bin_packed_onto_partly_used_nodes_first(kind):
    nodes = [nvidia_h100_80gb_x8("a"), nvidia_h100_80gb_x8("b")]
    used = running("x-0", "x", ("b", (0, 1, 2, 3)))
    [d] = decide(nodes, [deployment()], kind, (used,))
    assert where(d) == [[("b", (4,))]]


@both
def test_a_multi_node_replica_takes_the_emptiest_machines_on_one_fabric_and_only_its_hcas(kind):
    nodes = [
        nvidia_h100_80gb_x8("a1", fabrics=("ib-a",)),
        nvidia_h100_80gb_x8("a2", fabrics=("ib-a", "ib-b")),
        nvidia_h100_80gb_x8("a3", fabrics=("ib-a",)),
        nvidia_h100_80gb_x8("b1", fabrics=("ib-b",)),
    ]
    used = running("x-0", "x", ("a1", (0, 1, 2, 3)))
    prof = {"name": "p", "engine": "vllm", "deviceClass": "h100", "devicesPerNode": 4, "nodes": 2}
    [d] = decide(nodes, [deployment("d", 1, prof)], kind, (used,))
    [placed] = d.placed
    assert placed.replica.fabric == "ib-a"
    assert [s.node for s in placed.replica.shards] == ["a2", "a3"]
    assert all(set(s.hcas) == {"hca-ib-a-0", "hca-ib-a-1"} for s in placed.replica.shards)


@both
def test_multi_node_shards_never_straddle_fabrics_and_the_report_says_per_fabric(kind):
    nodes = [
        nvidia_h100_80gb_x8("a1", fabrics=("ib-a",)),
        nvidia_h100_80gb_x8("b1", fabrics=("ib-b",)),
        nvidia_h100_80gb_x8("none"),
    ]
    prof = {"name": "p", "engine": "vllm", "deviceClass": "h100", "devicesPerNode": 8, "nodes": 2}
    [d] = decide(nodes, [deployment("d", 1, prof)], kind)
    [report] = d.unplaced[0].reports
    assert report.counts() == {(Reason.FABRIC_TOO_SMALL, None): 2, (Reason.NO_FABRIC, None): 1}
    assert dict(report.fabric_fit) == {"ib-a": 1, "ib-b": 1}


@both
def test_cpu_replicas_spread_across_nodes(kind):
    prof = {"name": "cpu", "engine": "llama.cpp", "cpu": {"cores": 4, "memory": "4GiB"}}
    [d] = decide(
        [cpu_32c_128g("c1"), cpu_32c_128g("c2"), cpu_32c_128g("c3")], [deployment("d", 3, prof)], kind
    )
    assert sorted(s[0][0] for s in where(d)) == ["c1", "c2", "c3"]


@pytest.mark.parametrize(
    ("taken", "k", "expected"),
    [
        pytest.param((0, 1), 4, (4, 5, 6, 7), id="tp4-goes-to-the-whole-domain"),
        pytest.param((0, 1), 2, (2, 3), id="tp2-takes-the-tightest-domain-that-fits"),
        pytest.param((0, 4), 4, (1, 2, 3, 5), id="no-domain-fits-so-lowest-free-indices"),
    ],
)
@both
def test_a_tensor_parallel_group_stays_inside_one_nvlink_domain(kind, taken, k, expected):
    node = gpu_server_64c_512g("pcie", "h100", 8, domains=((0, 1, 2, 3), (4, 5, 6, 7)))
    prof = {"name": "p", "engine": "vllm", "deviceClass": "h100", "devicesPerNode": k}
    [d] = decide([node], [deployment("d", 1, prof)], kind, (running("x-0", "x", ("pcie", taken)),))
    assert where(d) == [[("pcie", expected)]]


@both
def test_without_topology_the_lowest_free_indices_are_used(kind):
    prof = {"name": "p", "engine": "vllm", "deviceClass": "h100", "devicesPerNode": 2}
    [d] = decide(
        [gpu_server_64c_512g("n", "h100", 4)],
        [deployment("d", 1, prof)],
        kind,
        (running("x-0", "x", ("n", (1,))),),
    )
    assert where(d) == [[("n", (0, 2))]]


@both
def test_among_equal_nodes_the_one_caching_the_model_wins(kind):
    nodes = [
        nvidia_h100_80gb_x8("a"),
        nvidia_h100_80gb_x8("b", modelCache=["small"]),
        nvidia_h100_80gb_x8("c"),
    ]
    [d] = decide(nodes, [deployment()], kind)
    assert where(d) == [[("b", (0,))]]
    assert d.placed[0].scores["cache"] == 1.0


@both
def test_a_device_with_an_ecc_fault_or_a_foreign_process_is_never_used(kind):
    [d] = decide([gpu_server_64c_512g("n", "h100", 3, ecc=(0,), foreign=(1,))], [deployment("d", 2)], kind)
    assert where(d) == [[("n", (2,))]]
    [report] = d.unplaced[0].reports
    assert report.counts() == {(Reason.INSUFFICIENT_FREE_DEVICES, 0): 1}


@both
def test_every_rejected_node_is_counted_once_by_its_first_failed_constraint(kind):
    nodes = (
        [cpu_32c_128g(f"cpu-{i}") for i in range(4)]
        + [amd_mi325x_x8(f"amd-{i}") for i in range(1)]
        + [nvidia_h100_80gb_x8(f"cord-{i}", cordon={"reason": "bad NVSwitch"}) for i in range(3)]
        + [nvidia_h100_80gb_x8("gone", state="NotReady")]
        + [nvidia_h100_80gb_x8(f"busy-{i}", ecc=(0, 1, 2, 3, 4)) for i in range(2)]
    )
    prof = {"name": "h100-tp8", "engine": "vllm", "deviceClass": "h100", "devicesPerNode": 8}
    [d] = decide(nodes, [deployment("d", 1, prof)], kind)
    [report] = d.unplaced[0].reports
    assert report.counts() == {
        (Reason.NO_DEVICE_OF_CLASS, None): 5,
        (Reason.CORDONED, None): 3,
        (Reason.NOT_READY, None): 1,
        (Reason.INSUFFICIENT_FREE_DEVICES, 3): 2,
    }
    assert sum(r.count for r in report.reasons) == report.nodes_evaluated == 11
    assert render_report(report) == (
        "profile h100-tp8: 0/11 nodes fit: 5 no device of class h100, 3 cordoned, "
        "2 have 3 of 8 devices free, 1 not ready"
    )
    assert report.to_dict()["reasons"][2] == {
        "reason": "InsufficientFreeDevices",
        "count": 2,
        "have": 3,
        "exhausted": True,
    }


@pytest.mark.parametrize(
    ("per_node", "fits"),
    [
        pytest.param(1, False, id="100GB-on-one-80GiB-device-does-not-fit"),
        pytest.param(2, True, id="split-over-two-devices-fits"),
    ],
)
@both
def test_weights_must_fit_device_memory(kind, per_node, fits):
    prof = {"name": "p", "engine": "vllm", "deviceClass": "h100", "devicesPerNode": per_node}
    [d] = decide([nvidia_h100_80gb_x8("n")], [deployment("d", 1, prof, model="big")], kind)
    assert bool(d.placed) is fits
    if not fits:
        assert d.unplaced[0].reports[0].counts() == {(Reason.DEVICE_MEMORY_TOO_SMALL, None): 1}


@both
def test_cpu_replicas_need_host_memory_and_gpu_pools_are_tainted(kind):
    prof = {"name": "cpu", "engine": "llama.cpp", "cpu": {"cores": 2}}
    [d] = decide([node("tiny", 32, "1GiB"), nvidia_h100_80gb_x8("gpu")], [deployment("d", 1, prof)], kind)
    assert d.unplaced[0].reports[0].counts() == {
        (Reason.INSUFFICIENT_MEMORY, None): 1,
        (Reason.TAINT_NOT_TOLERATED, None): 1,
    }


@both
def test_the_highest_priority_profile_that_fits_wins_and_the_others_explain(kind):
    amd = {"name": "amd", "engine": "vllm", "deviceClass": "mi325x", "priority": 1}
    nv = {"name": "nv", "engine": "vllm", "deviceClass": "h100", "priority": 9}
    [d] = decide([amd_mi325x_x8("m"), nvidia_h100_80gb_x8("h")], [deployment("d", 1, amd, nv)], kind)
    assert d.placed[0].replica.profile == "nv" and not d.placed[0].skipped
    [d] = decide(
        [amd_mi325x_x8("m"), nvidia_h100_80gb_x8("h", cordon={"reason": "x"})],
        [deployment("d", 1, amd, nv)],
        kind,
    )
    assert d.placed[0].replica.profile == "amd"
    assert [r.profile for r in d.placed[0].skipped] == ["nv"]


@both
def test_running_replicas_stay_lost_ones_are_replaced_under_new_names(kind):
    nodes = [nvidia_h100_80gb_x8("a"), nvidia_h100_80gb_x8("lost", state="Lost"), nvidia_h100_80gb_x8("b")]
    existing = (running("d-0", "d", ("b", (5,))), running("d-1", "d", ("lost", (0,))))
    [d] = decide(nodes, [deployment("d", 2)], kind, existing)
    assert d.kept == ("d-0",)
    assert d.lost == ("d-1",)
    assert [p.replica.name for p in d.placed] == ["d-2"], "a lost identity is never reused"
    assert where(d) == [[("b", (0,))]]


@both
def test_replicas_beyond_the_desired_count_are_surplus(kind):
    existing = tuple(running(f"d-{i}", "d", ("a", (i,))) for i in range(3))
    [d] = decide([nvidia_h100_80gb_x8("a")], [deployment("d", 1)], kind, existing)
    assert (d.kept, d.surplus, d.placed) == (("d-0",), ("d-1", "d-2"), ())


@both
def test_replicas_of_one_cycle_never_share_a_device(kind):
    [d1, d2] = decide([gpu_server_64c_512g("n", "h100", 2)], [deployment("a"), deployment("b", 2)], kind)
    assert where(d1) == [[("n", (0,))]]
    assert where(d2) == [[("n", (1,))]]
    assert len(d2.unplaced) == 1


@both
def test_a_gpu_box_whose_class_claims_an_unknown_driver_never_passes_for_a_cpu_node(kind):
    CLASSES["gaudi"] = DeviceClass(name="gaudi", driver="gaudi.intel.com", memory=128 * GiB)
    try:
        prof = {"name": "cpu", "engine": "llama.cpp", "cpu": {"cores": 2, "memory": "1GiB"}}
        [d] = decide(
            [gpu_server_64c_512g("g", "gaudi", 8), node("small", 1, "128GiB")],
            [deployment("d", 1, prof)],
            kind,
        )
    finally:
        del CLASSES["gaudi"]
    assert d.unplaced[0].reports[0].counts() == {
        (Reason.TAINT_NOT_TOLERATED, None): 1,
        (Reason.INSUFFICIENT_CPU, None): 1,
    }


@both
def test_too_few_cores_renders_without_an_amount(kind):
    prof = {"name": "cpu", "engine": "llama.cpp", "cpu": {"cores": 64, "memory": "1GiB"}}
    [d] = decide([node("c", 8, "128GiB")], [deployment("d", 1, prof)], kind)
    assert (
        render_report(d.unplaced[0].reports[0]) == "profile cpu: 0/1 nodes fit: 1 have too few free CPU cores"
    )


def test_two_shards_on_one_node_add_up_against_its_cpu():
    from fleetserve.errors import AllocationConflict
    from fleetserve.placement.state import WorkingState

    snap = ClusterSnapshot(classes=MappingProxyType(CLASSES), nodes=(node("c", 8, "128GiB"),))
    state = WorkingState(snap)
    double = Replica(
        name="r",
        deployment="d",
        profile="p",
        shards=(Shard(node="c", cpu_cores=5), Shard(node="c", cpu_cores=5)),
    )
    with pytest.raises(AllocationConflict, match="lacks CPU"):
        state.allocate(double)


@both
def test_a_cpu_memory_claim_below_what_the_model_needs_is_raised_to_it(kind):
    prof = {"name": "cpu", "engine": "llama.cpp", "cpu": {"cores": 2, "memory": "8GiB"}}
    [d] = decide([node("small", 32, "16GiB")], [deployment("d", 1, prof, model="big")], kind)
    assert d.unplaced[0].reports[0].counts() == {(Reason.INSUFFICIENT_MEMORY, None): 1}
    [d] = decide([node("large", 32, "256GiB")], [deployment("d", 1, prof, model="big")], kind)
    assert d.placed[0].replica.shards[0].memory > 100 * GiB


@both
def test_replicas_beyond_what_fits_are_all_unplaced_with_the_explanation_one_by_one_would_give(kind):
    nodes = [nvidia_h100_80gb_x8("g1"), nvidia_h100_80gb_x8("g2")]
    whole = deployment("chat", 5, {"name": "p", "engine": "vllm", "deviceClass": "h100", "devicesPerNode": 8})
    [d] = decide(nodes, [whole], kind)
    snap = ClusterSnapshot(
        classes=MappingProxyType(CLASSES), nodes=tuple(nodes), fabrics=MappingProxyType(FABRICS)
    )
    placer = Placer(snap, kind)
    usable = gate(whole, snap.classes, snap.served_drivers()).usable
    demands = [demand_for(p, SMALL, CLASSES["h100"]) for p in usable]
    one_by_one = [placer.place_one(f"chat-{i}", "chat", demands) for i in range(5)]

    assert [p.replica.name for p in d.placed] == ["chat-0", "chat-1"]
    assert [u.name for u in d.unplaced] == ["chat-2", "chat-3", "chat-4"]
    expected = [o for o in one_by_one if isinstance(o, Unplaced)]
    assert len(expected) == 3
    assert [[r.to_dict() for r in u.reports] for u in d.unplaced] == [
        [r.to_dict() for r in u.reports] for u in expected
    ]


def engines(*builds: str) -> tuple[EngineFingerprint, ...]:
    """What an agent reports having: ``llama.cpp/cpu``, ``vllm/cuda``…, one fingerprint each."""
    out = []
    for build in builds:
        engine, _, variant = build.partition("/")
        out.append(
            EngineFingerprint(engine=EngineKind(engine), version="test", variants=(RuntimeVariant(variant),))
        )
    return tuple(out)


@pytest.mark.parametrize(
    ("reported", "filtered"),
    [
        pytest.param(None, False, id="a-node-that-never-reported-engines-is-not-filtered"),
        pytest.param((), True, id="a-node-that-reported-no-engine-is-filtered"),
        pytest.param(("llama.cpp/cuda",), False, id="a-node-with-the-build-passes"),
        pytest.param(
            ("llama.cpp/cpu", "vllm/cuda"), True, id="other-builds-of-the-engine-or-variant-do-not-count"
        ),
    ],
)
def test_the_engine_filter_passes_a_node_only_with_the_profiles_build_or_unknown_engines(reported, filtered):
    fingerprints = None if reported is None else engines(*reported)
    snap = ClusterSnapshot(
        classes=MappingProxyType(CLASSES),
        nodes=(nvidia_h100_80gb_x8("n", engines=fingerprints),),
        models=MappingProxyType({"small": SMALL}),
    )
    work = WorkingState(snap).nodes[0]
    prof = {"name": "p", "engine": "llama.cpp", "deviceClass": "h100"}
    demand = demand_for(resolve_profile(Profile.model_validate(prof), CLASSES), SMALL, CLASSES["h100"])
    expected = (Reason.ENGINE_NOT_INSTALLED, None) if filtered else None
    assert runs_engine(work, demand) == expected


@both
def test_nodes_without_the_profiles_engine_build_are_counted_before_any_capacity_check(kind):
    nodes = [
        # Busy and without the build: counted as lacking the engine, not as full.
        nvidia_h100_80gb_x8("busy-no-cuda", ecc=(0, 1, 2, 3, 4, 5, 6, 7), engines=engines("llama.cpp/cpu")),
        nvidia_h100_80gb_x8("no-engines", engines=()),
        nvidia_h100_80gb_x8("vllm-only", engines=engines("vllm/cuda")),
        nvidia_h100_80gb_x8("busy", ecc=(0, 1, 2, 3, 4, 5, 6, 7), engines=engines("llama.cpp/cuda")),
        cpu_32c_128g("cpu", engines=engines("llama.cpp/cpu")),
    ]
    prof = {"name": "gpu", "engine": "llama.cpp", "deviceClass": "h100"}
    [d] = decide(nodes, [deployment("d", 1, prof)], kind)
    [report] = d.unplaced[0].reports
    assert report.counts() == {
        (Reason.ENGINE_NOT_INSTALLED, None): 3,
        (Reason.INSUFFICIENT_FREE_DEVICES, 0): 1,
        (Reason.NO_DEVICE_OF_CLASS, None): 1,
    }
    assert render_report(report) == (
        "profile gpu: 0/5 nodes fit: 3 without the llama.cpp/cuda engine build (not installed), "
        "1 have 0 of 1 devices free, 1 no device of class h100"
    )
    assert report.to_dict()["engine"] == "llama.cpp/cuda"


@both
def test_a_replica_goes_to_the_node_with_the_build_not_the_emptier_one_without(kind):
    nodes = [
        nvidia_h100_80gb_x8("empty-no-cuda", engines=engines("llama.cpp/cpu")),
        nvidia_h100_80gb_x8("half-used", ecc=(0, 1, 2, 3), engines=engines("llama.cpp/cuda")),
        cpu_32c_128g("cpu-no-engine", engines=()),
        cpu_32c_128g("cpu-unknown"),
    ]
    gpu = {"name": "gpu", "engine": "llama.cpp", "deviceClass": "h100"}
    cpu = {"name": "cpu", "engine": "llama.cpp", "cpu": {"cores": 4}}
    [g, c] = decide(nodes, [deployment("g", 1, gpu), deployment("c", 2, cpu)], kind)
    assert [s[0][0] for s in where(g)] == ["half-used"]
    assert [s[0][0] for s in where(c)] == ["cpu-unknown", "cpu-unknown"]
