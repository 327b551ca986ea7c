"""AMD discovery from sysfs (recorded MI325X and Strix Halo trees) and the optional amdsmi enrichment."""

from __future__ import annotations

import importlib.util
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from fleetserve.agent.discovery.amd import AmdDiscoverer, AmdSysfsDiscoverer, gfx_target_from_version
from fleetserve.agent.discovery.amd_smi import load_amdsmi
from fleetserve.drivers import Driver
from fleetserve.inventory.hardware import Discovery, HostFacts
from fleetserve.inventory.matching import FabricMap, to_node
from fleetserve.spec.nodeparts import DeviceHealth
from fleetserve.spec.resources import DeviceClass

SYSFS = Path(__file__).parent.parent / "fixtures/discovery/sysfs"
MI325X = SYSFS / "linux_amd_8_mi325x_256gx8"
STRIX_HALO = SYSFS / "linux_amd_1_strix_halo_gfx1151"
GiB = 2**30
HOST = HostFacts(
    "amd-01", physical_cores=128, logical_cpus=256, numa_nodes=2, memory_total=2**41, memory_available=2**40
)


def amd_class(name: str, match: dict[str, Any]) -> DeviceClass:
    return DeviceClass.model_validate(
        {"name": name, "driver": "gpu.amd.com", "memory": "1GiB", "match": match}
    )


CLASSES = {
    "amd-mi325x": amd_class("amd-mi325x", {"gfxTarget": "gfx942", "pciDeviceIds": ["0x74a5"]}),
    "amd-mi300x": amd_class("amd-mi300x", {"gfxTarget": "gfx942", "pciDeviceIds": ["0x74a1"]}),
    "amd-gfx1151": amd_class("amd-gfx1151", {"gfxTarget": "gfx1151"}),
}


@pytest.mark.parametrize(
    ("index", "bus_id", "render_node", "uuid"),
    [
        (0, "0000:05:00.0", "/dev/dri/renderD128", "0000:05:00.0"),
        (1, "0000:15:00.0", "/dev/dri/renderD136", "0000:15:00.0"),
        (2, "0000:65:00.0", "/dev/dri/renderD144", "GPU-817b556575393fca"),
        (3, "0000:75:00.0", "/dev/dri/renderD152", "0000:75:00.0"),
        (4, "0000:85:00.0", "/dev/dri/renderD160", "0000:85:00.0"),
        (5, "0000:95:00.0", "/dev/dri/renderD168", "0000:95:00.0"),
        (6, "0000:e5:00.0", "/dev/dri/renderD176", "0000:e5:00.0"),
        (7, "0000:f5:00.0", "/dev/dri/renderD184", "0000:f5:00.0"),
    ],
)
def test_each_mi325x_is_found_with_256_gib_gfx942_and_its_render_node(
    index: int, bus_id: str, render_node: str, uuid: str
) -> None:
    found = AmdSysfsDiscoverer(MI325X).discover()
    assert found.problems == ()
    assert len(found.gpus) == 8  # card0, the BMC's ASPEED VGA, is not AMD and is skipped
    gpu = found.gpus[index]
    assert (gpu.index, gpu.pci_bus_id, gpu.render_node, gpu.uuid) == (index, bus_id, render_node, uuid)
    assert (gpu.driver, gpu.memory, gpu.gfx_target, gpu.integrated) == (
        Driver.AMD,
        256 * GiB,
        "gfx942",
        False,
    )
    assert (gpu.pci_vendor_id, gpu.pci_device_id, gpu.ecc_uncorrected, gpu.compute_pids) == (
        "0x1002",
        "0x74a5",
        0,
        (),
    )


def test_an_mi325x_node_matches_the_mi325x_class_not_the_mi300x_one() -> None:
    gpus = AmdSysfsDiscoverer(MI325X).discover().gpus
    node, unmatched = to_node(Discovery(HOST, gpus, (), ()), CLASSES, FabricMap(), "amd-01", {}, frozenset())
    assert unmatched == ()
    assert [(d.index, d.device_class) for d in node.devices] == [(i, "amd-mi325x") for i in range(8)]
    assert node.nvlink_domains == ()


def test_a_strix_halo_apu_is_found_with_carve_out_plus_gtt_as_gpu_memory_and_its_render_node() -> None:
    found = AmdSysfsDiscoverer(STRIX_HALO).discover()
    assert found.problems == ()
    (gpu,) = found.gpus  # card1-DP-1, card1-DP-2, card1-HDMI-A-1 and renderD128 are not cards
    assert gpu.memory == 4 * GiB + 96 * GiB  # BIOS carve-out + GTT ceiling
    assert (gpu.integrated, gpu.gfx_target, gpu.pci_device_id) == (True, "gfx1151", "0x1586")
    assert (gpu.render_node, gpu.pci_bus_id, gpu.uuid) == (
        "/dev/dri/renderD128",
        "0000:c3:00.0",
        "0000:c3:00.0",
    )
    assert (gpu.memory_used, gpu.busy_percent) == (256 * 2**20 + GiB, 3)
    assert (gpu.name, gpu.compute_pids) == ("AMD gfx1151", (2841,))


@pytest.mark.parametrize(
    ("own_pids", "health"),
    [
        pytest.param(
            frozenset(), DeviceHealth(foreign_processes=(2841,)), id="a-rocm-process-it-did-not-start"
        ),
        pytest.param(frozenset({2841}), DeviceHealth(), id="its-own-engine-leaves-the-gpu-free"),
    ],
)
def test_the_strix_halo_gpu_matches_gfx1151_and_its_kfd_processes_decide_its_health(
    own_pids: frozenset[int], health: DeviceHealth
) -> None:
    gpus = AmdSysfsDiscoverer(STRIX_HALO).discover().gpus
    node, unmatched = to_node(Discovery(HOST, gpus, (), ()), CLASSES, FabricMap(), "halo", {}, own_pids)
    assert unmatched == ()
    (device,) = node.devices
    assert (device.index, device.device_class, device.health) == (0, "amd-gfx1151", health)


@pytest.mark.parametrize(
    ("version", "target"),
    [
        (90402, "gfx942"),
        (90010, "gfx90a"),
        (110501, "gfx1151"),
        (100300, "gfx1030"),
        (120001, "gfx1201"),
        (90012, "gfx90c"),
        (0, None),
        (91600, None),
    ],
)
def test_kfd_gfx_target_versions_become_llvm_target_names(version: int, target: str | None) -> None:
    assert gfx_target_from_version(version) == target


def _copy(tree: Path, tmp_path: Path) -> Path:
    root = tmp_path / tree.name
    shutil.copytree(tree, root)
    return root


def test_a_connector_entry_is_skipped_even_if_it_looks_like_an_amd_device(tmp_path: Path) -> None:
    root = _copy(STRIX_HALO, tmp_path)
    fake = root / "sys/class/drm/card1-DP-1/device"
    fake.mkdir()
    (fake / "vendor").write_text("0x1002\n")
    assert len(AmdSysfsDiscoverer(root).discover().gpus) == 1


def test_a_card_without_a_kfd_node_is_reported_without_a_gfx_target(tmp_path: Path) -> None:
    root = _copy(STRIX_HALO, tmp_path)
    shutil.rmtree(root / "sys/class/kfd")
    found = AmdSysfsDiscoverer(root).discover()
    (gpu,) = found.gpus
    assert (gpu.gfx_target, gpu.integrated, gpu.memory, gpu.compute_pids) == (None, False, 4 * GiB, ())
    assert found.problems == (
        "amd: card1 (0000:c3:00.0): no KFD topology node has its render node; ROCm cannot use it and its gfx "
        "target is unknown",
    )


def test_a_discrete_gpu_counts_only_its_vram_even_with_a_larger_gtt_pool(tmp_path: Path) -> None:
    root = _copy(MI325X, tmp_path)
    (root / "sys/class/drm/card1/device/mem_info_gtt_total").write_text(str(1024 * GiB))
    assert AmdSysfsDiscoverer(root).discover().gpus[0].memory == 256 * GiB


def test_uncorrected_ras_errors_and_an_unreadable_vram_size_are_reported(tmp_path: Path) -> None:
    root = _copy(MI325X, tmp_path)
    device = root / "sys/class/drm/card2/device"
    (device / "ras/umc_err_count").write_text("ue: 3\nce: 17\n")
    (device / "mem_info_vram_total").unlink()
    found = AmdSysfsDiscoverer(root).discover()
    assert (found.gpus[1].ecc_uncorrected, found.gpus[1].memory) == (3, 0)
    assert found.problems == (
        "amd: card2 (0000:15:00.0): mem_info_vram_total cannot be read; its memory is reported as 0",
    )


def test_a_machine_without_amdgpu_has_no_amd_gpu_and_no_problem(tmp_path: Path) -> None:
    found = AmdDiscoverer(tmp_path, amdsmi=False).discover()
    assert (found.gpus, found.problems) == ((), ())


def test_without_an_importable_amdsmi_sysfs_is_used_alone() -> None:
    if importlib.util.find_spec("amdsmi") is not None:
        pytest.skip("amdsmi is installed on this machine")
    assert load_amdsmi() is None
    found = AmdDiscoverer(STRIX_HALO).discover()
    assert found.gpus[0].source == "sysfs"


class FakeAmdSmi:
    """A stand-in for the amdsmi module (synthetic answers, not a recording) for the first MI325X."""

    def __init__(self, fail_init: bool = False) -> None:
        self.fail_init = fail_init
        self.shut_down = False

    def amdsmi_init(self) -> None:
        if self.fail_init:
            raise RuntimeError("AMDSMI_STATUS_INIT_ERROR")

    def amdsmi_shut_down(self) -> None:
        self.shut_down = True

    def amdsmi_get_processor_handles(self) -> Sequence[object]:
        return ["h0", "h1"]

    def amdsmi_get_gpu_device_bdf(self, handle: object, /) -> str:
        return {"h0": "0000:05:00.0", "h1": "0000:15:00.0"}[str(handle)]

    def amdsmi_get_gpu_device_uuid(self, handle: object, /) -> str:
        return "74ff74a5-0000-1000-8000-000000000000"

    def amdsmi_get_gpu_asic_info(self, handle: object, /) -> Mapping[str, Any]:
        return {"market_name": "AMD Instinct MI325X", "target_graphics_version": "gfx942"}

    def amdsmi_get_gpu_process_list(self, handle: object, /) -> Sequence[Any]:
        if handle == "h1":
            raise RuntimeError("AMDSMI_STATUS_NO_PERM")
        return [{"pid": 7001, "name": "python3"}]

    def amdsmi_get_gpu_total_ecc_count(self, handle: object, /) -> Mapping[str, Any]:
        return {"correctable_count": 4, "uncorrectable_count": 1 if handle == "h0" else 0}


def test_amdsmi_adds_uuid_market_name_processes_and_ecc_to_the_sysfs_facts() -> None:
    fake = FakeAmdSmi()
    found = AmdDiscoverer(MI325X, amdsmi=fake).discover()
    first, second, third = found.gpus[:3]
    assert (first.uuid, first.name, first.compute_pids, first.ecc_uncorrected, first.source) == (
        "74ff74a5-0000-1000-8000-000000000000",
        "AMD Instinct MI325X",
        (7001,),
        1,
        "amdsmi+sysfs",
    )
    assert (first.memory, first.gfx_target, first.render_node) == (256 * GiB, "gfx942", "/dev/dri/renderD128")
    assert (second.compute_pids, second.source) == ((), "amdsmi+sysfs")
    assert (third.uuid, third.source) == ("GPU-817b556575393fca", "sysfs")
    assert found.problems == (
        "amd: 0000:15:00.0: amdsmi cannot read its pids (AMDSMI_STATUS_NO_PERM); the sysfs value stays",
    )
    assert fake.shut_down


def test_an_amdsmi_that_cannot_start_leaves_the_sysfs_facts_and_says_so() -> None:
    found = AmdDiscoverer(MI325X, amdsmi=FakeAmdSmi(fail_init=True)).discover()
    assert [g.source for g in found.gpus] == ["sysfs"] * 8
    assert found.problems == ("amd: amdsmi could not start (AMDSMI_STATUS_INIT_ERROR); using sysfs alone",)
