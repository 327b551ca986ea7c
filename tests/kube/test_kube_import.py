"""``fleetserve.kube.importer``: a cluster's Nodes and ResourceSlices → fleetserve nodes.

The cluster is tests/fixtures/kube (NOT recorded from a live cluster: see its README): two NVIDIA
H100 nodes, one AMD MI300X node, a CPU node with dra.cpu slices, a NotReady node and a cordoned
node. Reading it through the official client goes to the fake API server (conftest.py).
"""

from __future__ import annotations

import copy
import json
import re
import time
from decimal import Decimal
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
from fake_apiserver import FakeApiServer
from kubernetes import client

from fleetserve.kube.apply import KubeError, api_client
from fleetserve.kube.importer import (
    CORDON_REASON,
    ImportResult,
    dump_nodes,
    nodes_from_cluster,
    parse_quantity,
    quantity_bytes,
    quantity_cores,
    read_cluster_inventory,
)
from fleetserve.spec.loader import load_files, load_text
from fleetserve.spec.nodeparts import Hca
from fleetserve.spec.resources import DeviceClass, DeviceMatch, Node, NodeState

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "kube"
GIB, MIB, KIB = 2**30, 2**20, 2**10

# Matches the AMD GPUs by the product name their DRA driver publishes. The datacenter example's
# amd-mi325x class matches by pciVendorId + gfxTarget, which a ResourceSlice does not give.
AMD_MI300X = DeviceClass(
    name="amd-mi300x",
    driver="gpu.amd.com",
    memory=192 * GIB,
    match=DeviceMatch(product_name="AMD_Instinct_MI300X_OAM"),
)


def items(name: str) -> list[dict[str, Any]]:
    data = json.loads((FIXTURES / name).read_text(encoding="utf-8"))
    assert data["kind"] == "List"
    return list(data["items"])


@pytest.fixture(scope="module")
def datacenter_classes() -> dict[str, DeviceClass]:
    docs = load_files([ROOT / "examples" / "datacenter" / "fleet.yaml"])
    return {c.name: c for c in docs.classes}


@pytest.fixture(scope="module")
def classes(datacenter_classes: dict[str, DeviceClass]) -> dict[str, DeviceClass]:
    return {**datacenter_classes, AMD_MI300X.name: AMD_MI300X}


@pytest.fixture
def nodes() -> list[dict[str, Any]]:
    return items("nodes.json")


@pytest.fixture
def slices() -> list[dict[str, Any]]:
    return items("resourceslices.json")


def by_name(result: ImportResult) -> dict[str, Node]:
    return {n.name: n for n in result.nodes}


@pytest.mark.parametrize("name", ["nodes.json", "resourceslices.json"])
def test_fixtures_follow_the_official_schema(name: str) -> None:
    """The fixtures are written by hand (README.md): every item must be valid Kubernetes 1.37."""
    for item in items(name):
        kubernetes_validate.validate(item, "1.37.0", strict=True)


# --- quantities ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("112", Decimal(112)),
        ("111500m", Decimal("111.5")),
        ("2113290Mi", Decimal(2113290 * MIB)),
        ("512Gi", Decimal(512 * GIB)),
        ("1024Ki", Decimal(1024 * KIB)),
        ("549755813888", Decimal(549755813888)),
        ("1.5Gi", Decimal(3 * GIB // 2)),
        ("2k", Decimal(2000)),
        ("3M", Decimal(3_000_000)),
        ("1G", Decimal(10**9)),
        ("1E", Decimal(10**18)),
        ("1e3", Decimal(1000)),
        ("12E-1", Decimal("1.2")),
        (".5", Decimal("0.5")),
        ("250u", Decimal("0.00025")),
        (96, Decimal(96)),
    ],
)
def test_parse_quantity(text: str | int, value: Decimal) -> None:
    assert parse_quantity(text) == value


def test_cores_and_bytes_round_down() -> None:
    assert quantity_cores("111500m") == 111
    assert quantity_cores("112") == 112
    assert quantity_cores("500m") == 0
    assert quantity_bytes("2113290Mi") == 2113290 * MIB
    # The kubelet may write memory in milli-bytes.
    assert quantity_bytes("129590276097500m") == 129590276097


@pytest.mark.parametrize("bad", ["", "abc", "12XB", "1e", "Gi", "1.2.3", "12 Gi", "0x10", None, True, [1]])
def test_parse_quantity_refuses_what_is_no_quantity(bad: object) -> None:
    with pytest.raises(ValueError, match=re.escape(repr(bad))):
        parse_quantity(bad)


@pytest.mark.parametrize("func", [quantity_cores, quantity_bytes])
def test_negative_quantities_are_refused(func: Any) -> None:
    with pytest.raises(ValueError, match=r"'-2Gi' is negative"):
        func("-2Gi")


@pytest.mark.parametrize("absurd", ["1e400000", "1e9999999999", "1" * 5000, "9e20", "100000Ei"])
def test_an_absurd_quantity_is_refused_fast_before_it_is_expanded(absurd: str) -> None:
    started = time.process_time()
    with pytest.raises(ValueError, match=r"larger than any Kubernetes quantity|out of range"):
        quantity_cores(absurd)
    assert time.process_time() - started < 0.05  # 4 s of CPU for 1e400000 before


def test_an_absurd_quantity_in_a_node_names_the_field(
    nodes: list[dict[str, Any]], slices: list[dict[str, Any]], classes: dict[str, DeviceClass]
) -> None:
    nodes[3]["status"]["allocatable"]["memory"] = "1e400000"
    result = nodes_from_cluster(nodes, slices, classes)
    assert "cpu-a" not in [n.name for n in result.nodes]
    assert any(
        "node cpu-a: cannot be imported: status.allocatable.memory: '1e400000' is larger" in line
        for line in result.unmatched
    )


# --- the fixture cluster -------------------------------------------------------------------


def test_every_node_is_imported_and_every_gpu_matched(
    nodes: list[dict[str, Any]], slices: list[dict[str, Any]], classes: dict[str, DeviceClass]
) -> None:
    result = nodes_from_cluster(nodes, slices, classes)
    assert result.unmatched == []
    got = by_name(result)
    assert list(got) == ["h100-a", "h100-b", "mi300x-a", "cpu-a", "cpu-b", "cpu-c"]
    for name in ("h100-a", "h100-b"):
        devices = got[name].devices
        assert [d.index for d in devices] == list(range(8))
        assert {d.device_class for d in devices} == {"nvidia-h100-80gb"}
        assert all(re.fullmatch(r"GPU-[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12}", d.uuid) for d in devices)
    assert got["h100-a"].devices[3].uuid != got["h100-b"].devices[3].uuid
    amd = got["mi300x-a"].devices
    # Index from cardIndex; the AMD driver publishes no uuid attribute: node/device name instead.
    assert [(d.index, d.uuid, d.device_class) for d in amd] == [
        (i, f"mi300x-a/gpu-{i}-{128 + i}", "amd-mi300x") for i in range(8)
    ]
    for name in ("cpu-a", "cpu-b", "cpu-c"):
        assert got[name].devices == ()


def test_uuids_are_the_drivers(
    nodes: list[dict[str, Any]], slices: list[dict[str, Any]], classes: dict[str, DeviceClass]
) -> None:
    published = {
        (s["spec"]["nodeName"], d["attributes"]["index"]["int"]): d["attributes"]["uuid"]["string"]
        for s in slices
        if s["spec"]["driver"] == "gpu.nvidia.com"
        for d in s["spec"]["devices"]
    }
    result = nodes_from_cluster(nodes, slices, classes)
    imported = {
        (n.name, d.index): d.uuid for n in result.nodes for d in n.devices if n.name.startswith("h100")
    }
    assert imported == published


def test_node_facts(
    nodes: list[dict[str, Any]], slices: list[dict[str, Any]], classes: dict[str, DeviceClass]
) -> None:
    got = by_name(nodes_from_cluster(nodes, slices, classes))
    h100 = got["h100-a"]
    assert h100.cpu.cores == 111  # allocatable "111500m", rounded down
    assert h100.cpu.memory == 2113290 * MIB
    assert got["h100-b"].cpu.cores == 112
    assert got["cpu-a"].cpu.memory == 805306368 * KIB
    assert got["cpu-c"].cpu.memory == 549755813888  # plain bytes
    assert h100.address == "10.20.0.11"
    assert h100.hcas == (Hca(name="ib-east", fabric="ib-east"),)
    assert got["mi300x-a"].hcas == (Hca(name="roce-amd", fabric="roce-amd"),)
    assert got["cpu-a"].hcas == ()
    # The noisy Kubernetes labels are left out; the operator's and other add-ons' stay.
    assert "kubernetes.io/hostname" not in h100.labels
    assert not [
        k for k in h100.labels if k.startswith(("node.kubernetes.io/", "feature.node.kubernetes.io/"))
    ]
    assert h100.labels["rack"] == "r1"
    assert h100.labels["topology.kubernetes.io/zone"] == "dc1-a"
    assert h100.labels["nvidia.com/gpu.present"] == "true"
    # dra.cpu publishes one grouped device per NUMA node: cpu-a has two; nodes without: one.
    assert got["cpu-a"].cpu.numa_nodes == 2
    assert got["cpu-b"].cpu.numa_nodes == 1


def test_not_ready_and_cordoned_nodes(
    nodes: list[dict[str, Any]], slices: list[dict[str, Any]], classes: dict[str, DeviceClass]
) -> None:
    got = by_name(nodes_from_cluster(nodes, slices, classes))
    assert got["cpu-b"].state is NodeState.NOT_READY  # Ready condition "Unknown"
    assert got["cpu-b"].cordon is None
    assert got["cpu-c"].state is NodeState.READY
    assert got["cpu-c"].cordon is not None
    assert got["cpu-c"].cordon.reason == CORDON_REASON == "cordoned in Kubernetes (spec.unschedulable)"
    for name in ("h100-a", "h100-b", "mi300x-a", "cpu-a"):
        assert got[name].state is NodeState.READY
        assert got[name].cordon is None


def test_with_only_the_datacenter_classes_the_amd_gpus_are_unmatched_with_the_reason(
    nodes: list[dict[str, Any]], slices: list[dict[str, Any]], datacenter_classes: dict[str, DeviceClass]
) -> None:
    result = nodes_from_cluster(nodes, slices, datacenter_classes)
    got = by_name(result)
    assert got["mi300x-a"].devices == ()
    assert len(got["h100-a"].devices) == 8
    assert len(result.unmatched) == 8
    for i, line in enumerate(result.unmatched):
        assert line.startswith(
            f"node mi300x-a: device gpu-{i}-{128 + i}: gpu.amd.com GPU {i} (AMD_Instinct_MI300X_OAM"
        )
        assert "no device class matches" in line
        assert "amd-mi325x: gfxTarget gfx942 is not the GPU's unknown target" in line


def test_ready_condition_missing_means_not_ready(
    nodes: list[dict[str, Any]], classes: dict[str, DeviceClass]
) -> None:
    node = copy.deepcopy(nodes[0])
    node["status"]["conditions"] = [c for c in node["status"]["conditions"] if c["type"] != "Ready"]
    assert nodes_from_cluster([node], [], classes).nodes[0].state is NodeState.NOT_READY


# --- what is not imported, and says so -------------------------------------------------------


def test_amd_partitions_are_skipped_with_a_sentence(
    nodes: list[dict[str, Any]], slices: list[dict[str, Any]], classes: dict[str, DeviceClass]
) -> None:
    amd = next(s for s in slices if s["spec"]["driver"] == "gpu.amd.com")
    partition = copy.deepcopy(amd["spec"]["devices"][7])
    partition["name"] = "gpu-32-160"
    partition["attributes"]["type"] = {"string": "amdgpu-partition"}
    partition["attributes"]["partitionProfile"] = {"string": "cpx_nps1"}
    amd["spec"]["devices"][7] = partition
    result = nodes_from_cluster(nodes, slices, classes)
    assert [d.index for d in by_name(result)["mi300x-a"].devices] == list(range(7))
    assert result.unmatched == [
        f"node mi300x-a: gpu.amd.com device gpu-32-160 (AMD_Instinct_MI300X_OAM) in ResourceSlice "
        f"{amd['metadata']['name']} is a GPU partition (type amdgpu-partition); partitions are not imported"
    ]


def test_slices_of_unknown_nodes_and_other_drivers_say_so(
    nodes: list[dict[str, Any]], slices: list[dict[str, Any]], classes: dict[str, DeviceClass]
) -> None:
    ghost = copy.deepcopy(slices[0])
    ghost["metadata"]["name"] = "h100-z-gpu.nvidia.com-abcde"
    ghost["spec"]["nodeName"] = "h100-z"
    other = copy.deepcopy(slices[0])
    other["metadata"]["name"] = "h100-a-compute-domain.nvidia.com-xyz"
    other["spec"]["driver"] = "compute-domain.nvidia.com"
    other["spec"]["devices"] = [{"name": "channel-0", "attributes": {"type": {"string": "channel"}}}]
    unbound = copy.deepcopy(slices[0])
    unbound["metadata"]["name"] = "fabric-pool-gpu.nvidia.com-1"
    del unbound["spec"]["nodeName"]
    unbound["spec"]["allNodes"] = True
    result = nodes_from_cluster(nodes, [*slices, ghost, other, unbound], classes)
    assert len(result.nodes) == 6
    assert len(by_name(result)["h100-a"].devices) == 8
    assert result.unmatched == [
        "ResourceSlice h100-z-gpu.nvidia.com-abcde (gpu.nvidia.com) names node h100-z, which the cluster "
        "does not list; its 8 device(s) (gpu-0, gpu-1, gpu-2, gpu-3, gpu-4, gpu-5, gpu-6, gpu-7) are not imported",
        "ResourceSlice h100-a-compute-domain.nvidia.com-xyz: driver compute-domain.nvidia.com is not one whose "
        "devices fleetserve imports (gpu.nvidia.com, gpu.amd.com); its 1 device(s) (channel-0) are not imported",
        "ResourceSlice fabric-pool-gpu.nvidia.com-1 (gpu.nvidia.com) is not bound to one node (no spec.nodeName); "
        "its 8 device(s) (gpu-0, gpu-1, gpu-2, gpu-3, gpu-4, gpu-5, gpu-6, gpu-7) are not imported",
    ]


def test_colliding_indices_are_renumbered_and_said(
    nodes: list[dict[str, Any]], slices: list[dict[str, Any]], classes: dict[str, DeviceClass]
) -> None:
    nvidia = slices[0]
    nvidia["spec"]["devices"][5]["attributes"]["index"] = {"int": 2}
    result = nodes_from_cluster(nodes[:1], slices[:1], classes)
    devices = result.nodes[0].devices
    assert [d.index for d in devices] == [0, 1, 2, 3, 4, 6, 7, 8]
    moved = next(d for d in devices if d.index == 8)
    assert moved.uuid == nvidia["spec"]["devices"][5]["attributes"]["uuid"]["string"]
    assert len(result.unmatched) == 1
    assert result.unmatched[0].startswith(
        "node h100-a: gpu.nvidia.com device gpu-5 has index 2, which another device of the node already has; "
        "imported as index 8"
    )


def test_a_node_with_nvidia_and_amd_gpus_numbers_amd_after_nvidia(
    nodes: list[dict[str, Any]], slices: list[dict[str, Any]], classes: dict[str, DeviceClass]
) -> None:
    amd = copy.deepcopy(next(s for s in slices if s["spec"]["driver"] == "gpu.amd.com"))
    amd["spec"]["nodeName"] = "h100-a"
    amd["spec"]["devices"] = amd["spec"]["devices"][:2]
    result = nodes_from_cluster(nodes[:1], [amd, slices[0]], classes)
    devices = result.nodes[0].devices
    assert [(d.index, d.device_class) for d in devices] == [
        *[(i, "nvidia-h100-80gb") for i in range(8)],
        (8, "amd-mi300x"),
        (9, "amd-mi300x"),
    ]
    assert len(result.unmatched) == 2  # each renumbered AMD device is said


def test_missing_index_and_uuid_fall_back_to_order_and_name(
    nodes: list[dict[str, Any]], slices: list[dict[str, Any]], classes: dict[str, DeviceClass]
) -> None:
    for device in slices[0]["spec"]["devices"]:
        del device["attributes"]["index"]
        del device["attributes"]["uuid"]
    result = nodes_from_cluster(nodes[:1], slices[:1], classes)
    assert [(d.index, d.uuid) for d in result.nodes[0].devices] == [(i, f"h100-a/gpu-{i}") for i in range(8)]
    assert result.unmatched == []


def test_ambiguous_classes_are_said(nodes: list[dict[str, Any]], slices: list[dict[str, Any]]) -> None:
    twin = {
        name: DeviceClass(
            name=name,
            driver="gpu.nvidia.com",
            memory=80 * GIB,
            match=DeviceMatch(product_name="NVIDIA H100.*"),
        )
        for name in ("h100-a-class", "h100-b-class")
    }
    result = nodes_from_cluster(nodes[:1], slices[:1], twin)
    assert result.nodes[0].devices == ()
    assert len(result.unmatched) == 8
    assert "device classes h100-a-class, h100-b-class match it equally well" in result.unmatched[0]


def test_v1beta1_slices_with_basic_devices_are_read(
    nodes: list[dict[str, Any]], slices: list[dict[str, Any]], classes: dict[str, DeviceClass]
) -> None:
    old = slices[0]
    old["apiVersion"] = "resource.k8s.io/v1beta1"
    old["spec"]["devices"] = [
        {"name": d["name"], "basic": {"attributes": d["attributes"], "capacity": d["capacity"]}}
        for d in old["spec"]["devices"]
    ]
    result = nodes_from_cluster(nodes[:1], [old], classes)
    assert len(result.nodes[0].devices) == 8


def test_an_unreadable_node_is_left_out_with_a_sentence(
    nodes: list[dict[str, Any]], slices: list[dict[str, Any]], classes: dict[str, DeviceClass]
) -> None:
    nodes[3]["status"]["allocatable"]["cpu"] = "lots"
    nodes[4]["metadata"]["name"] = "x" * 70
    nodes[1]["metadata"]["labels"]["fabric.fleetserve.io/ib-east"] = "maybe"
    result = nodes_from_cluster(nodes, slices, classes)
    assert [n.name for n in result.nodes] == ["h100-a", "h100-b", "mi300x-a", "cpu-c"]
    assert by_name(result)["h100-b"].hcas == ()
    assert result.unmatched[0] == (
        "node h100-b: label fabric.fleetserve.io/ib-east=maybe is not fabric.fleetserve.io/ib-east=attached; "
        "no HCA on fabric ib-east is imported"
    )
    assert result.unmatched[1].startswith(
        "node cpu-a: cannot be imported: status.allocatable.cpu: 'lots' is not a Kubernetes quantity"
    )
    assert result.unmatched[2].startswith(f"node {'x' * 70}: cannot be imported: name: ")
    assert "is not a valid name" in result.unmatched[2]
    assert len(result.unmatched) == 3


def test_an_index_fleetserve_cannot_store_is_said(
    nodes: list[dict[str, Any]], slices: list[dict[str, Any]], classes: dict[str, DeviceClass]
) -> None:
    slices[0]["spec"]["devices"][7]["attributes"]["index"] = {"int": 5000}
    result = nodes_from_cluster(nodes[:1], slices[:1], classes)
    assert [d.index for d in result.nodes[0].devices] == list(range(7))
    assert result.unmatched == [
        "node h100-a: device gpu-7 (index 5000): Input should be less than or equal to 4095; not imported"
    ]


# --- output ----------------------------------------------------------------------------------


def test_dump_loads_back(
    nodes: list[dict[str, Any]], slices: list[dict[str, Any]], datacenter_classes: dict[str, DeviceClass]
) -> None:
    result = nodes_from_cluster(nodes, slices, datacenter_classes)
    text = dump_nodes(result)
    header = [line for line in text.splitlines() if line.startswith("#")]
    assert header[0] == "# 6 node(s) imported from Kubernetes by fleetserve."
    assert header[1] == "# Not imported (8):"
    assert header[2:] == [f"#   - {line}" for line in result.unmatched]
    docs = load_text(text, "imported.yaml")
    assert docs.nodes == result.nodes
    assert (docs.classes, docs.fabrics, docs.deployments) == ([], [], [])
    first = text.split("---")[0]
    assert "\nkind: Node\nname: h100-a\n" in first
    assert "state:" not in first  # defaults are left out


def test_dump_of_an_empty_cluster_loads_back() -> None:
    text = dump_nodes(ImportResult(nodes=[], unmatched=[]))
    assert text == "# 0 node(s) imported from Kubernetes by fleetserve.\n"
    assert load_text(text).nodes == []


# --- through the (fake) API server -------------------------------------------------------------


def test_read_cluster_inventory_through_the_api(
    fake_api: FakeApiServer,
    kube_api: client.ApiClient,
    nodes: list[dict[str, Any]],
    slices: list[dict[str, Any]],
    classes: dict[str, DeviceClass],
) -> None:
    for obj in [*nodes, *slices]:
        fake_api.add(obj)
    got_nodes, got_slices = read_cluster_inventory(kube_api)
    assert [r.path for r in fake_api.requests] == ["/api/v1/nodes", "/apis/resource.k8s.io/v1/resourceslices"]
    assert sorted(n["metadata"]["name"] for n in got_nodes) == sorted(n["metadata"]["name"] for n in nodes)
    assert all(n["apiVersion"] == "v1" and n["kind"] == "Node" for n in got_nodes)
    assert all(s["apiVersion"] == "resource.k8s.io/v1" and s["kind"] == "ResourceSlice" for s in got_slices)
    # camelCase plain data, quantities as the API writes them.
    h100 = next(n for n in got_nodes if n["metadata"]["name"] == "h100-a")
    assert h100["status"]["allocatable"]["cpu"] == "111500m"
    assert h100["spec"]["podCIDR"] == "10.244.11.0/24"
    through_api = nodes_from_cluster(got_nodes, got_slices, classes)
    from_files = nodes_from_cluster(nodes, slices, classes)
    assert sorted(through_api.nodes, key=lambda n: n.name) == sorted(from_files.nodes, key=lambda n: n.name)
    assert through_api.unmatched == []


def test_a_cluster_without_the_dra_api_has_no_slices(
    fake_api: FakeApiServer, kube_api: client.ApiClient, nodes: list[dict[str, Any]]
) -> None:
    for obj in nodes:
        fake_api.add(obj)
    fake_api.dra_api = False
    got_nodes, got_slices = read_cluster_inventory(kube_api)
    assert len(got_nodes) == 6
    assert got_slices == []


def test_api_errors_raise_kube_error(fake_api: FakeApiServer, tmp_path: Path) -> None:
    api = api_client(kubeconfig=fake_api.write_kubeconfig(tmp_path / "kubeconfig", token="wrong"))
    try:
        with pytest.raises(KubeError, match=r"^listing the cluster's nodes: HTTP 401 Unauthorized"):
            read_cluster_inventory(api)
    finally:
        api.close()
