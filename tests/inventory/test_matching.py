"""Discovered GPUs onto device classes, NVLink domains, health, indices, fabric maps and CPU capacity."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from fleetserve.agent.discovery import (
    AmdDiscoverer,
    CpuDiscoverer,
    InfinibandDiscoverer,
    NvidiaDiscoverer,
    discover,
)
from fleetserve.agent.discovery.nvml_replay import NvmlReplay
from fleetserve.drivers import Driver
from fleetserve.errors import ConfigError
from fleetserve.inventory.hardware import Discovery, GpuFacts, HcaFacts, HostFacts
from fleetserve.inventory.matching import (
    FabricMap,
    Mismatch,
    Unmatched,
    UnmatchedReason,
    match_gpu,
    normalize_guid,
    normalize_subnet_prefix,
    to_node,
)
from fleetserve.spec.nodeparts import CpuCapacity, DeviceHealth
from fleetserve.spec.resources import DeviceClass

HOST = HostFacts(
    "n1", physical_cores=32, logical_cpus=64, numa_nodes=2, memory_total=256 * 2**30, memory_available=1
)
# Identities as the recorded fixtures report them (tests/fixtures/discovery/README.md).
H100 = GpuFacts(
    driver=Driver.NVIDIA,
    index=0,
    uuid="GPU-b42dd28e-ffdd-8720-1df0-98bd8cdc05b1",
    name="NVIDIA H100 80GB HBM3",
    memory=81559 * 2**20,
    pci_vendor_id="0x10de",
    pci_device_id="0x2330",
    gfx_target=None,
    ecc_uncorrected=0,
    compute_pids=(),
    render_node=None,
    nvlink_peers=(),
    source="nvml",
)
MI325X = replace(
    H100,
    driver=Driver.AMD,
    uuid="GPU-817b556575393fca",
    name="AMD gfx942",
    memory=256 * 2**30,
    pci_vendor_id="0x1002",
    pci_device_id="0x74a5",
    gfx_target="gfx942:sramecc+:xnack-",
    source="sysfs",
)


def cls(name: str, match: dict[str, Any], driver: str = "gpu.nvidia.com") -> DeviceClass:
    return DeviceClass.model_validate({"name": name, "driver": driver, "memory": "80GiB", "match": match})


def classes(*items: DeviceClass) -> dict[str, DeviceClass]:
    return {c.name: c for c in items}


@pytest.mark.parametrize(
    ("gpu", "catalog", "winner"),
    [
        pytest.param(
            H100,
            classes(
                cls("h100-any", {"productName": "NVIDIA H100.*"}),
                cls("h100-sxm", {"productName": "NVIDIA H100.*", "pciDeviceIds": ["0x2330"]}),
            ),
            "h100-sxm",
            id="the-class-with-more-rules-that-hold-wins",
        ),
        pytest.param(
            MI325X,
            classes(
                cls("gfx942", {"gfxTarget": "gfx942"}, "gpu.amd.com"),
                cls("mi325x", {"gfxTarget": "gfx942", "pciDeviceIds": ["0x74a1", "0x74a5"]}, "gpu.amd.com"),
            ),
            "mi325x",
            id="gfx-target-and-device-id-beat-gfx-target-alone",
        ),
        pytest.param(
            H100,
            classes(cls("h100", {"pciVendorId": "10DE", "pciDeviceIds": ["2330"]})),
            "h100",
            id="pci-ids-compare-as-numbers-whatever-their-spelling",
        ),
        pytest.param(
            MI325X,
            classes(cls("gfx942", {"gfxTarget": "gfx942"}, "gpu.amd.com")),
            "gfx942",
            id="a-gfx-target-with-feature-flags-matches-the-bare-target",
        ),
    ],
)
def test_the_most_specific_matching_class_wins(
    gpu: GpuFacts, catalog: dict[str, DeviceClass], winner: str
) -> None:
    assert match_gpu(gpu, catalog) == winner


@pytest.mark.parametrize(
    ("catalog", "mismatches"),
    [
        pytest.param(
            classes(cls("a100", {"productName": "NVIDIA A100.*"})),
            [Mismatch.PRODUCT_NAME],
            id="a-product-name-that-does-not-match",
        ),
        pytest.param(
            classes(cls("h100", {"productName": "H100"})),
            [Mismatch.PRODUCT_NAME],
            id="the-regex-must-match-the-whole-name",
        ),
        pytest.param(
            classes(cls("amd-h100", {"productName": "NVIDIA H100 80GB HBM3"}, driver="gpu.amd.com")),
            [Mismatch.DRIVER],
            id="the-class-claims-another-driver",
        ),
        pytest.param(
            classes(cls("typo", {"productName": "NVIDIA H100 80GB HBM3"}, driver="gpu.nvidia.con")),
            [Mismatch.UNKNOWN_DRIVER],
            id="the-class-claims-a-driver-that-does-not-exist",
        ),
        pytest.param(classes(cls("declared-only", {})), [Mismatch.NO_RULES], id="a-class-without-rules"),
        pytest.param(
            classes(cls("broken", {"productName": "NVIDIA H100 ("})),
            [Mismatch.BAD_PATTERN],
            id="a-broken-regex",
        ),
        pytest.param(
            classes(cls("h200", {"pciDeviceIds": ["0x2335"]}), cls("amd", {"pciVendorId": "0x1002"})),
            [Mismatch.PCI_DEVICE_ID, Mismatch.PCI_VENDOR_ID],
            id="pci-ids-that-differ",
        ),
        pytest.param(classes(), [], id="no-class-at-all"),
    ],
)
def test_a_gpu_no_class_matches_is_reported_with_each_class_rejection(
    catalog: dict[str, DeviceClass], mismatches: list[Mismatch]
) -> None:
    outcome = match_gpu(H100, catalog)
    assert isinstance(outcome, Unmatched)
    assert outcome.reason is UnmatchedReason.NO_MATCHING_CLASS
    assert [r.mismatch for r in outcome.rejections] == mismatches
    assert outcome.gpu == H100


def test_a_driver_mismatch_is_explained_in_the_report() -> None:
    outcome = match_gpu(
        H100, classes(cls("amd-h100", {"productName": "NVIDIA H100.*"}, driver="gpu.amd.com"))
    )
    assert str(outcome) == (
        "gpu.nvidia.com GPU 0 (NVIDIA H100 80GB HBM3, GPU-b42dd28e-ffdd-8720-1df0-98bd8cdc05b1): no device class "
        "matches; amd-h100: claims driver gpu.amd.com, the GPU is driven by gpu.nvidia.com"
    )


def test_two_classes_matching_equally_well_are_ambiguous_and_the_gpu_is_left_off_the_node() -> None:
    catalog = classes(
        cls("h100-a", {"productName": "NVIDIA H100.*", "pciVendorId": "0x10de"}),
        cls("h100-b", {"pciVendorId": "0x10de", "pciDeviceIds": ["0x2330"]}),
        cls("h100-loose", {"pciVendorId": "0x10de"}),
    )
    node, unmatched = to_node(Discovery(HOST, (H100,), (), ()), catalog, FabricMap(), "n1", {}, frozenset())
    assert node.devices == ()
    (report,) = unmatched
    assert (report.reason, report.candidates) == (UnmatchedReason.AMBIGUOUS_CLASS, ("h100-a", "h100-b"))
    assert "h100-a, h100-b match it equally well (2 rules each)" in report.detail


def gpu(index: int, peers: tuple[int, ...] = (), driver: Driver = Driver.NVIDIA, **kw: Any) -> GpuFacts:
    base = H100 if driver is Driver.NVIDIA else MI325X
    return replace(base, index=index, uuid=f"{driver.value}-{index}", nvlink_peers=peers, **kw)


H100_CLASS = cls("h100", {"pciDeviceIds": ["0x2330"]})
MI325X_CLASS = cls("mi325x", {"pciDeviceIds": ["0x74a5"]}, driver="gpu.amd.com")


@pytest.mark.parametrize(
    ("gpus", "domains"),
    [
        pytest.param(
            (gpu(0, (1,)), gpu(1, (0,)), gpu(2, (3,)), gpu(3, (2,))),
            ((0, 1), (2, 3)),
            id="two-bridged-pairs-are-two-domains",
        ),
        pytest.param((gpu(0, (1,)), gpu(1, (2,)), gpu(2, ())), ((0, 1, 2),), id="a-chain-is-one-domain"),
        pytest.param((gpu(0), gpu(1)), (), id="gpus-without-nvlink-make-no-domain"),
        pytest.param(
            (gpu(0, (1, 2)), gpu(1, (0, 2), pci_device_id="0x9999"), gpu(2, (0, 1))),
            ((0, 2),),
            id="an-unmatched-gpu-is-in-no-domain",
        ),
        pytest.param(
            (gpu(0, (1,)), gpu(1, (0,), ecc_uncorrected=5)), ((0, 1),), id="an-unhealthy-gpu-keeps-its-links"
        ),
    ],
)
def test_nvlink_domains_are_the_connected_components_of_matched_gpus(
    gpus: tuple[GpuFacts, ...], domains: tuple[tuple[int, ...], ...]
) -> None:
    node, _ = to_node(Discovery(HOST, gpus, (), ()), classes(H100_CLASS), FabricMap(), "n1", {}, frozenset())
    assert node.nvlink_domains == domains


@pytest.mark.parametrize(
    ("facts", "own", "health"),
    [
        pytest.param(
            {"compute_pids": (10, 20)}, {10}, DeviceHealth(foreign_processes=(20,)), id="foreign-pids-only"
        ),
        pytest.param({"compute_pids": (10,)}, {10}, DeviceHealth(), id="own-pids-keep-it-free"),
        pytest.param(
            {"ecc_uncorrected": 2**40}, set(), DeviceHealth(ecc_uncorrected=2**31 - 1), id="ecc-is-capped"
        ),
    ],
)
def test_health_comes_from_ecc_counts_and_processes_fleetserve_did_not_start(
    facts: dict[str, Any], own: set[int], health: DeviceHealth
) -> None:
    discovery = Discovery(HOST, (replace(H100, **facts),), (), ())
    node, _ = to_node(discovery, classes(H100_CLASS), FabricMap(), "n1", {}, frozenset(own))
    assert node.devices[0].health == health


def test_a_node_with_two_gpu_drivers_numbers_them_one_after_the_other_in_driver_table_order() -> None:
    gpus = (gpu(0, driver=Driver.AMD), gpu(1, driver=Driver.AMD), gpu(0), gpu(1))
    node, unmatched = to_node(
        Discovery(HOST, gpus, (), ()), classes(H100_CLASS, MI325X_CLASS), FabricMap(), "n1", {}, frozenset()
    )
    assert unmatched == ()
    assert [(d.index, d.uuid, d.device_class) for d in node.devices] == [
        (0, "gpu.nvidia.com-0", "h100"),
        (1, "gpu.nvidia.com-1", "h100"),
        (2, "gpu.amd.com-0", "mi325x"),
        (3, "gpu.amd.com-1", "mi325x"),
    ]


def test_an_unmatched_gpu_keeps_its_index_free_so_indices_stay_driver_ordinals() -> None:
    gpus = (gpu(0), gpu(1, pci_device_id="0x9999"), gpu(2))
    node, unmatched = to_node(
        Discovery(HOST, gpus, (), ()), classes(H100_CLASS), FabricMap(), "n1", {}, frozenset()
    )
    assert [d.index for d in node.devices] == [0, 2]
    assert [u.gpu.index for u in unmatched if u.gpu] == [1]


def test_cpu_capacity_labels_and_model_cache_come_from_host_facts_and_arguments() -> None:
    node, _ = to_node(
        Discovery(HOST, (), (), ()),
        {},
        FabricMap(),
        "n1",
        {"rack": "r1"},
        frozenset(),
        model_cache=("llama",),
    )
    assert node.cpu == CpuCapacity(cores=32, memory=256 * 2**30, numa_nodes=2)
    assert (node.name, node.labels, node.model_cache) == ("n1", {"rack": "r1"}, ("llama",))


def test_a_node_name_that_is_not_a_valid_name_is_a_config_error() -> None:
    with pytest.raises(ConfigError) as info:
        to_node(Discovery(HOST, (), (), ()), {}, FabricMap(), "Bad_Host", {}, frozenset())
    assert "name: 'Bad_Host' is not a valid name" in str(info.value)


def test_an_hca_whose_ports_map_to_two_fabrics_is_not_attached() -> None:
    hca = HcaFacts(
        "mlx5_0",
        ("1070:fd03:008e:b580", "1070:fd03:008e:b581"),
        ("fe80:0000:0000:0000", "fe80:0000:0000:0000"),
        "InfiniBand",
        "ACTIVE",
    )
    fabric_map = FabricMap.from_dict(
        {"portGuids": {"0x1070fd03008eb580": "ib-a", "0x1070fd03008eb581": "ib-b"}}
    )
    node, unmatched = to_node(Discovery(HOST, (), (hca,), ()), {}, fabric_map, "n1", {}, frozenset())
    assert node.hcas == ()
    assert [(u.reason, u.candidates) for u in unmatched] == [
        (UnmatchedReason.CONFLICTING_FABRICS, ("ib-a", "ib-b"))
    ]


@pytest.mark.parametrize(
    ("text", "normalized"),
    [
        ("0x1070fd03008eb580", "1070:fd03:008e:b580"),
        ("1070:FD03:008E:B580", "1070:fd03:008e:b580"),
        ("1070fd03008eb580", "1070:fd03:008e:b580"),
    ],
)
def test_port_guids_are_accepted_as_ibstat_or_sysfs_writes_them(text: str, normalized: str) -> None:
    assert normalize_guid(text) == normalized


@pytest.mark.parametrize(
    ("text", "normalized"),
    [
        ("fe80::/64", "fe80:0000:0000:0000"),
        ("fe80::", "fe80:0000:0000:0000"),
        ("FE80:0:0:0", "fe80:0000:0000:0000"),
        ("fec0:0000:0000:0001", "fec0:0000:0000:0001"),
    ],
)
def test_subnet_prefixes_are_accepted_in_gid_or_ipv6_notation(text: str, normalized: str) -> None:
    assert normalize_subnet_prefix(text) == normalized


def test_a_fabric_map_reports_every_bad_entry_at_once() -> None:
    with pytest.raises(ConfigError) as info:
        FabricMap.from_dict(
            {
                "portGUIDs": {},
                "portGuids": {"0x12": "ib-a", "0x1070fd03008eb580": "IB_A"},
                "subnetPrefixes": {"fe80::1": "ib-a"},
            },
            location="agent.yaml",
        )
    assert [f"{p.field}: {p.message}" for p in info.value.problems] == [
        "portGUIDs: unknown field; valid fields: portGuids, subnetPrefixes",
        "portGuids.0x12: '0x12' is not a 64-bit GUID; write 0x1070fd03008eb580 or 1070:fd03:008e:b580",
        "portGuids.0x1070fd03008eb580: 'IB_A' is not a valid name: use 1-63 lower-case letters, digits, '-' or "
        "'.', starting and ending with a letter or digit",
        "subnetPrefixes.fe80::1: 'fe80::1' sets bits past the 64-bit subnet prefix",
    ]
    assert all(p.location == "agent.yaml" for p in info.value.problems)


def test_a_mixed_machine_discovered_from_recordings_becomes_one_node() -> None:
    fixtures = Path(__file__).parent.parent / "fixtures/discovery"
    discovery = discover(
        [
            CpuDiscoverer(),
            NvidiaDiscoverer(NvmlReplay.from_file(fixtures / "nvml/linux_nvidia_8_h100_80gx8.json")),
            AmdDiscoverer(fixtures / "sysfs/linux_amd_1_strix_halo_gfx1151", amdsmi=False),
            InfinibandDiscoverer(fixtures / "sysfs/linux_infiniband_3_mlx5"),
        ]
    )
    catalog = classes(H100_CLASS, cls("halo", {"gfxTarget": "gfx1151"}, driver="gpu.amd.com"))
    fabric_map = FabricMap.from_dict({"subnetPrefixes": {"fe80::/64": "ib-a"}})
    node, unmatched = to_node(discovery, catalog, fabric_map, "mixed", {}, frozenset({31337, 2841}))
    assert [(d.index, d.device_class) for d in node.devices] == [(i, "h100") for i in range(8)] + [
        (8, "halo")
    ]
    assert node.nvlink_domains == (tuple(range(8)),)
    assert [d.index for d in node.devices if not d.health.healthy] == [3, 5]
    assert [h.name for h in node.hcas] == ["mlx5_0", "mlx5_2"]
    assert [(u.subject, u.reason) for u in unmatched] == [("HCA mlx5_1", UnmatchedReason.HCA_NOT_ACTIVE)]
    assert node.cpu.memory == discovery.host.memory_total
