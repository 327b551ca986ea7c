"""NVIDIA discovery through NVML: a recorded 8-GPU HGX H100 and a single H200 we recorded ourselves,
replayed, and this machine (no driver) for real."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pynvml  # type: ignore[import-untyped]
import pytest

from fleetserve.agent.discovery.base import Findings, combine
from fleetserve.agent.discovery.nvidia import NvidiaDiscoverer, nvidia_gpu_on_pci_bus
from fleetserve.agent.discovery.nvml_replay import NvmlReplay
from fleetserve.drivers import Driver
from fleetserve.inventory.hardware import Discovery, HostFacts
from fleetserve.inventory.matching import FabricMap, to_node
from fleetserve.spec.nodeparts import DeviceHealth
from fleetserve.spec.resources import DeviceClass

HGX = Path(__file__).parent.parent / "fixtures/discovery/nvml/linux_nvidia_8_h100_80gx8.json"
# Recorded by us on a lent H200 machine while llama-server held the GPU (fixtures README).
H200_RECORDING = Path(__file__).parent.parent / "fixtures/discovery/nvml/linux_nvidia_1_h200_141gx1.json"
HOST = HostFacts(
    "hgx-01", physical_cores=112, logical_cpus=224, numa_nodes=2, memory_total=2**41, memory_available=2**40
)
H100 = DeviceClass.model_validate(
    {
        "name": "nvidia-h100-80gb",
        "driver": "gpu.nvidia.com",
        "memory": "80GiB",
        "match": {
            "productName": "NVIDIA H100 80GB HBM3",
            "pciVendorId": "0x10de",
            "pciDeviceIds": ["0x2330"],
        },
    }
)
OWN_PID = 31337  # the fixture's process on GPU 1 that fleetserve started
FOREIGN_PID = 48213  # the fixture's process on GPU 3 that it did not


def recording() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(HGX.read_text())
    return data


def discover(data: dict[str, Any] | None = None, **kwargs: Any) -> Any:
    return NvidiaDiscoverer(NvmlReplay(data if data is not None else recording()), **kwargs).discover()


@pytest.mark.parametrize(
    ("index", "uuid", "bus_id"),
    [
        (0, "GPU-b42dd28e-ffdd-8720-1df0-98bd8cdc05b1", "0000:18:00.0"),
        (1, "GPU-7c3cadbd-17e5-0913-f69b-c618122ea0cd", "0000:2a:00.0"),
        (2, "GPU-2d50cdf6-dd67-9f2e-855e-0d4d6d395a2f", "0000:3a:00.0"),
        (3, "GPU-d1838e76-90e6-4408-711d-aeeaa2e1fd14", "0000:5d:00.0"),
        (4, "GPU-72be6e5d-3c1b-0d37-98ac-d3ef159f2589", "0000:9a:00.0"),
        (5, "GPU-52378fbc-3124-3895-13b6-1dd179563e0f", "0000:ab:00.0"),
        (6, "GPU-83a5aebb-b71c-c570-aa83-185e1233fe97", "0000:ba:00.0"),
        (7, "GPU-33135771-a848-ece1-b61e-489e221d663c", "0000:db:00.0"),
    ],
)
def test_each_recorded_h100_is_found_with_its_identity_memory_and_pci_ids(
    index: int, uuid: str, bus_id: str
) -> None:
    found = discover()
    assert found.problems == ()
    gpu = found.gpus[index]
    assert (gpu.index, gpu.uuid, gpu.pci_bus_id) == (index, uuid, bus_id)
    assert (gpu.driver, gpu.name, gpu.memory) == (Driver.NVIDIA, "NVIDIA H100 80GB HBM3", 81559 * 2**20)
    assert (gpu.pci_vendor_id, gpu.pci_device_id, gpu.gfx_target, gpu.source) == (
        "0x10de",
        "0x2330",
        None,
        "nvml",
    )
    assert gpu.nvlink_peers == tuple(i for i in range(8) if i != index)


def test_an_hgx_h100_node_has_all_eight_gpus_in_one_nvlink_domain_through_its_nvswitches() -> None:
    node, unmatched = to_node(
        Discovery(HOST, discover().gpus, (), ()),
        {"nvidia-h100-80gb": H100},
        FabricMap(),
        "hgx-01",
        {},
        frozenset(),
    )
    assert unmatched == ()
    assert [d.index for d in node.devices] == list(range(8))
    assert {d.device_class for d in node.devices} == {"nvidia-h100-80gb"}
    assert node.nvlink_domains == ((0, 1, 2, 3, 4, 5, 6, 7),)


@pytest.mark.parametrize(
    ("index", "health"),
    [
        pytest.param(5, DeviceHealth(ecc_uncorrected=2), id="uncorrected-ecc-errors-make-it-unhealthy"),
        pytest.param(
            3, DeviceHealth(foreign_processes=(FOREIGN_PID,)), id="a-process-fleetserve-did-not-start"
        ),
        pytest.param(1, DeviceHealth(), id="a-process-fleetserve-started-leaves-it-free"),
        pytest.param(0, DeviceHealth(), id="an-idle-gpu-is-free"),
    ],
)
def test_gpu_health_comes_from_ecc_counts_and_processes_not_in_own_pids(
    index: int, health: DeviceHealth
) -> None:
    node, _ = to_node(
        Discovery(HOST, discover().gpus, (), ()),
        {"nvidia-h100-80gb": H100},
        FabricMap(),
        "hgx-01",
        {},
        frozenset({OWN_PID}),
    )
    device = node.devices[index]
    assert device.health == health
    assert device.health.healthy is (health == DeviceHealth())


# PCI (vendor, class) of the devices tests put on a machine's bus.
NVIDIA_3D = ("0x10de", "0x030200")  # an H100: a 3D controller
NVIDIA_VGA = ("0x10de", "0x030000")  # a GeForce: a VGA controller
NVSWITCH = ("0x10de", "0x068000")  # a bridge, not a GPU
AMD_GPU = ("0x1002", "0x038000")
VIRTIO_NET = ("0x1af4", "0x020000")


def pci_bus(root: Path, *devices: tuple[str, str]) -> Path:
    """A machine under ``root`` whose PCI bus holds ``devices`` (sysfs ``vendor`` and ``class``)."""
    bus = root / "sys/bus/pci/devices"
    bus.mkdir(parents=True)
    for i, (vendor, pci_class) in enumerate(devices):
        device = bus / f"0000:{i + 0x18:02x}:00.0"
        device.mkdir()
        (device / "vendor").write_text(vendor + "\n")
        (device / "class").write_text(pci_class + "\n")
    return root


def test_without_an_nvidia_driver_or_gpu_this_machine_has_a_fact_not_a_problem() -> None:
    if NvidiaDiscoverer().discover().gpus:  # the real pynvml
        pytest.skip("this machine has an NVIDIA driver; the no-driver path cannot be seen here")
    if nvidia_gpu_on_pci_bus() is not False:
        pytest.skip("this machine's PCI bus shows an NVIDIA GPU, or cannot be listed")
    found = NvidiaDiscoverer().discover()
    assert (found.gpus, found.problems) == ((), ())
    assert len(found.facts) == 1
    assert found.facts[0].startswith("nvidia: no NVIDIA GPU on the PCI bus, and no NVIDIA driver (NVML: ")


@pytest.mark.parametrize("error", ["LIBRARY_NOT_FOUND", "DRIVER_NOT_LOADED", "NO_PERMISSION"])
def test_an_nvml_that_cannot_start_gives_no_gpu_and_one_problem_naming_the_error(
    error: str, tmp_path: Path
) -> None:
    root = pci_bus(tmp_path, VIRTIO_NET, NVIDIA_3D)
    found = discover({"init_error": error, "devices": recording()["devices"]}, root=root)
    assert found.gpus == ()
    assert len(found.problems) == 1
    assert str(pynvml.NVMLError(getattr(pynvml, f"NVML_ERROR_{error}"))) in found.problems[0]


@pytest.mark.parametrize(
    ("devices", "problem"),
    [
        pytest.param((VIRTIO_NET,), False, id="a-cpu-only-machine-has-a-fact"),
        pytest.param((AMD_GPU, VIRTIO_NET), False, id="an-amd-only-machine-has-a-fact"),
        pytest.param((NVSWITCH,), False, id="an-nvswitch-is-no-gpu-so-a-fact"),
        pytest.param((VIRTIO_NET, NVIDIA_3D), True, id="an-nvidia-3d-controller-makes-it-a-problem"),
        pytest.param((NVIDIA_VGA,), True, id="an-nvidia-vga-controller-makes-it-a-problem"),
        pytest.param(None, True, id="a-pci-bus-that-cannot-be-listed-leaves-it-a-problem"),
    ],
)
def test_nvml_that_cannot_start_is_a_problem_only_where_an_nvidia_gpu_is_on_the_pci_bus(
    devices: tuple[tuple[str, str], ...] | None, problem: bool, tmp_path: Path
) -> None:
    root = tmp_path if devices is None else pci_bus(tmp_path, *devices)
    found = discover({"init_error": "LIBRARY_NOT_FOUND", "devices": []}, root=root)
    assert found.gpus == ()
    assert (len(found.problems), len(found.facts)) == ((1, 0) if problem else (0, 1))
    said = (found.problems or found.facts)[0]
    assert str(pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)) in said


def test_on_macos_a_missing_nvml_is_a_fact_though_no_pci_bus_can_be_listed(tmp_path: Path) -> None:
    nvml = NvmlReplay({"init_error": "LIBRARY_NOT_FOUND", "devices": []})
    found = NvidiaDiscoverer(nvml, root=tmp_path, system="Darwin").discover()
    assert (found.gpus, found.problems) == ((), ())
    (fact,) = found.facts
    assert fact.startswith("nvidia: macOS has no NVIDIA driver (NVML: ")


def test_a_machine_without_an_nvidia_gpu_reports_no_problem_to_its_node(tmp_path: Path) -> None:
    """What the node shows (and the dashboard paints red) is the discovery's problems: a CPU-only
    machine has none from NVIDIA."""
    root = pci_bus(tmp_path, VIRTIO_NET)
    found = combine(
        [
            Findings(host=HOST),
            NvidiaDiscoverer(
                NvmlReplay({"init_error": "DRIVER_NOT_LOADED", "devices": []}), root=root
            ).discover(),
        ]
    )
    assert found.problems == ()
    assert [f.partition(":")[0] for f in found.facts] == ["nvidia"]


def _edit(change: str) -> dict[str, Any]:
    data = copy.deepcopy(recording())
    devices = data["devices"]
    if change == "no-ecc":
        devices[0]["ecc_uncorrected_volatile"] = None
    elif change == "no-process-list":
        devices[0]["compute_processes"] = None
    elif change == "links-idle":
        for link in devices[0]["nvlinks"]:
            link["state"] = 0
    elif change == "no-nvlink":
        for device in devices:
            device["nvlinks"] = []
    return data


@pytest.mark.parametrize(
    ("change", "ecc", "pids", "peers_of_0", "peers_of_1"),
    [
        pytest.param(
            "no-ecc", 0, (), (1, 2, 3, 4, 5, 6, 7), (0, 2, 3, 4, 5, 6, 7), id="a-gpu-without-ecc-counts-zero"
        ),
        pytest.param(
            "no-process-list", 0, (), (1, 2, 3, 4, 5, 6, 7), (0, 2, 3, 4, 5, 6, 7), id="no-process-list"
        ),
        pytest.param("links-idle", 0, (), (), (2, 3, 4, 5, 6, 7), id="idle-links-make-no-peers"),
        pytest.param("no-nvlink", 0, (), (), (), id="a-gpu-without-nvlink-has-no-peers"),
    ],
)
def test_absent_features_are_quietly_empty_not_problems(
    change: str, ecc: int, pids: tuple[int, ...], peers_of_0: tuple[int, ...], peers_of_1: tuple[int, ...]
) -> None:
    found = discover(_edit(change))
    assert found.problems == ()
    assert (found.gpus[0].ecc_uncorrected, found.gpus[0].compute_pids) == (ecc, pids)
    assert (found.gpus[0].nvlink_peers, found.gpus[1].nvlink_peers) == (peers_of_0, peers_of_1)


def _bridged_pair(remote_type: int | None, second_remote: str) -> dict[str, Any]:
    """Two GPUs joined by an NVLink bridge (no switch), as on workstation boards."""
    devices = copy.deepcopy(recording()["devices"][:2])
    devices[0]["nvlinks"] = [
        {"state": 1, "remote_bus_id": devices[1]["pci_bus_id"], "remote_type": remote_type}
    ]
    devices[1]["nvlinks"] = [{"state": 1, "remote_bus_id": second_remote, "remote_type": remote_type}]
    return {"devices": devices}


@pytest.mark.parametrize(
    ("remote_type", "second_remote", "peers"),
    [
        pytest.param(0, "00000000:18:00.0", [(1,), (0,)], id="gpu-to-gpu-links-are-peers"),
        pytest.param(
            None, "00000000:18:00.0", [(1,), (0,)], id="an-old-driver-without-remote-type-still-finds-them"
        ),
        pytest.param(None, "00000000:07:00.0", [(1,), (0,)], id="one-side-seeing-the-other-is-enough"),
        pytest.param(1, "00000000:18:00.0", [(), ()], id="links-to-an-ibm-npu-are-not-gpu-peers"),
    ],
)
def test_direct_nvlinks_between_gpus_make_peers(
    remote_type: int | None, second_remote: str, peers: list[tuple[int, ...]]
) -> None:
    found = discover(_bridged_pair(remote_type, second_remote))
    assert found.problems == ()
    assert [g.nvlink_peers for g in found.gpus] == peers


class _FailingUuid(NvmlReplay):
    def nvmlDeviceGetUUID(self, handle: object, /) -> str:
        if handle == 2:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        return super().nvmlDeviceGetUUID(handle)


def test_a_gpu_nvml_cannot_read_is_reported_and_the_others_keep_their_indices() -> None:
    found = NvidiaDiscoverer(_FailingUuid(recording())).discover()
    assert [g.index for g in found.gpus] == [0, 1, 3, 4, 5, 6, 7]
    assert found.problems == ("nvidia: GPU 2: NVML cannot read it (GPU is lost); it is not reported",)
    assert found.gpus[0].nvlink_peers == (1, 3, 4, 5, 6, 7)


def test_the_replay_shuts_nvml_down_after_discovery() -> None:
    replay = NvmlReplay(recording())
    NvidiaDiscoverer(replay).discover()
    assert replay.initialized is False


# The lent H200, as NVML answered while llama-server (-ngl 99) ran on it.
H200_UUID = "GPU-e9d758e2-ec1d-89f3-c1bf-35fef897fa79"
LLAMA_SERVER_PID = 4888
H200_HOST = HostFacts(
    "h200-01", physical_cores=16, logical_cpus=16, numa_nodes=1, memory_total=2**37, memory_available=2**36
)
H200 = DeviceClass.model_validate(
    {
        "name": "nvidia-h200-141gb",
        "driver": "gpu.nvidia.com",
        "memory": "141GB",
        "match": {"productName": "NVIDIA H200", "pciVendorId": "0x10de", "pciDeviceIds": ["0x2335"]},
    }
)


def h200() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(H200_RECORDING.read_text())
    return data


def test_the_recorded_h200_is_found_as_the_real_device_showed_it() -> None:
    found = discover(h200())
    assert found.problems == ()
    assert len(found.gpus) == 1
    gpu = found.gpus[0]
    assert (gpu.index, gpu.uuid, gpu.pci_bus_id) == (0, H200_UUID, "0000:00:06.0")
    # nvidia-smi on the same machine: "NVIDIA H200", 143771 MiB, driver 580.159.04.
    assert (gpu.driver, gpu.name, gpu.memory) == (Driver.NVIDIA, "NVIDIA H200", 143771 * 2**20)
    assert (gpu.pci_vendor_id, gpu.pci_device_id, gpu.gfx_target, gpu.source) == (
        "0x10de",
        "0x2335",
        None,
        "nvml",
    )
    assert gpu.ecc_uncorrected == 0
    assert gpu.compute_pids == (LLAMA_SERVER_PID,), "llama-server's process while it held the GPU"
    assert gpu.nvlink_peers == (), "a single GPU has no NVLink peer (NVML: NVLink NOT_SUPPORTED)"


def test_the_h200_recording_says_which_driver_answered_and_that_nvlink_was_not_supported() -> None:
    data = h200()
    assert (data["driver_version"], data["cuda_driver_version"]) == ("580.159.04", 13000)
    assert data["devices"][0]["nvlinks"] == []
    assert data["nvml_errors"] == {"gpu0.nvlink0.state": "NOT_SUPPORTED"}


@pytest.mark.parametrize(
    ("own_pids", "health"),
    [
        pytest.param(frozenset({LLAMA_SERVER_PID}), DeviceHealth(), id="llama-server-started-by-fleetserve"),
        pytest.param(
            frozenset(),
            DeviceHealth(foreign_processes=(LLAMA_SERVER_PID,)),
            id="the-same-process-not-started-by-fleetserve",
        ),
    ],
)
def test_a_single_h200_node_has_one_device_no_nvlink_domain_and_health_from_its_process(
    own_pids: frozenset[int], health: DeviceHealth
) -> None:
    node, unmatched = to_node(
        Discovery(H200_HOST, discover(h200()).gpus, (), ()),
        {"nvidia-h200-141gb": H200},
        FabricMap(),
        "h200-01",
        {},
        own_pids,
    )
    assert unmatched == ()
    assert [(d.index, d.device_class) for d in node.devices] == [(0, "nvidia-h200-141gb")]
    assert node.nvlink_domains == ()
    assert node.devices[0].health == health
