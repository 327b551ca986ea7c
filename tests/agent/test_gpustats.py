"""The agent's own GPU readings become canonical samples; with no GPU there are none."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pynvml  # type: ignore[import-untyped]
import pytest

from fleetserve.agent.discovery.nvml_replay import NvmlReplay, ReplayMemory
from fleetserve.agent.gpustats import make_reader
from fleetserve.spec.resources import Node

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures/discovery"
STRIX_HALO = FIXTURES / "sysfs/linux_amd_1_strix_halo_gfx1151"
# Recorded by us on a lent H200 while llama-server held the GPU; "readings" are the gpustats calls.
H200 = FIXTURES / "nvml/linux_nvidia_1_h200_141gx1.json"


def test_a_strix_halo_read_from_recorded_sysfs_gives_canonical_amd_samples():
    node = Node.model_validate(
        {
            "name": "halo",
            "cpu": {"cores": 16, "memory": "128GiB"},
            "devices": [{"index": 0, "class": "amd-gfx1151"}],
        }
    )
    samples = {s.name: s.model_dump() for s in make_reader(STRIX_HALO)(node)}
    labels = {"node": "halo", "device": "0", "driver": "gpu.amd.com", "class": "amd-gfx1151"}
    assert samples["fleetserve_gpu_utilization_ratio"]["labels"] == labels
    assert 0.0 <= samples["fleetserve_gpu_utilization_ratio"]["value"] <= 1.0
    assert samples["fleetserve_gpu_memory_used_bytes"]["value"] > 0
    assert "fleetserve_gpu_tensor_active_ratio" not in samples, "an NVIDIA-only signal is never faked for AMD"


def test_this_machine_without_a_gpu_reports_no_gpu_samples():
    node = Node.model_validate({"name": "cpu", "cpu": {"cores": 2, "memory": "8GiB"}})
    assert make_reader()(node) == []


@dataclass(frozen=True)
class _Memory(ReplayMemory):
    used: int
    free: int


@dataclass(frozen=True)
class _Utilization:
    gpu: int
    memory: int


class _RecordedReadings(NvmlReplay):
    """The replay, also answering the calls gpustats makes from the recording's ``readings``."""

    NVMLError = pynvml.NVMLError

    def _readings(self, handle: object) -> dict[str, Any]:
        readings: dict[str, Any] = self._device(handle)["readings"]
        return readings

    def nvmlDeviceGetMemoryInfo(self, handle: object, /) -> _Memory:
        r = self._readings(handle)
        return _Memory(
            total=int(self._device(handle)["memory_total"]), used=r["memory_used"], free=r["memory_free"]
        )

    def nvmlDeviceGetUtilizationRates(self, handle: object, /) -> _Utilization:
        r = self._readings(handle)
        return _Utilization(gpu=r["utilization_gpu"], memory=r["utilization_memory"])

    def nvmlDeviceGetPowerUsage(self, handle: object, /) -> int:
        return int(self._readings(handle)["power_usage"])

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: object, /) -> int:
        return int(self._readings(handle)["total_energy_consumption"])

    def nvmlDeviceGetTemperature(self, handle: object, sensor: int, /) -> int:
        assert sensor == pynvml.NVML_TEMPERATURE_GPU
        return int(self._readings(handle)["temperature_gpu"])


def test_the_recorded_h200_read_through_nvml_gives_canonical_nvidia_samples(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # gpustats imports pynvml itself, so the recording stands in for the module; tmp_path holds no
    # AMD sysfs.
    monkeypatch.setitem(sys.modules, "pynvml", _RecordedReadings(json.loads(H200.read_text())))
    node = Node.model_validate(
        {
            "name": "h200-01",
            "cpu": {"cores": 16, "memory": "128GiB"},
            "devices": [{"index": 0, "class": "nvidia-h200-141gb"}],
        }
    )
    samples = {s.name: s.model_dump() for s in make_reader(tmp_path)(node)}
    labels = {"node": "h200-01", "device": "0", "driver": "gpu.nvidia.com", "class": "nvidia-h200-141gb"}
    assert all(s["labels"] == labels for s in samples.values())
    # NVML's units (%, bytes, mW, mJ, °C) as the H200 answered, in canonical units. The recording
    # holds v1 memory info only, so the replay answers as a driver without v2 (the v2 test below).
    assert {name: s["value"] for name, s in samples.items()} == {
        "fleetserve_gpu_utilization_ratio": 0.0,
        "fleetserve_gpu_memory_used_bytes": 1308491776.0,
        "fleetserve_gpu_power_watts": 123.289,
        "fleetserve_gpu_energy_joules_total": 20442.366,
        "fleetserve_gpu_temperature_celsius": 34.0,
    }, "and no tensor-active ratio: NVML has no such reading (DCGM profiling only)"


# NVML's memory info, v1 and v2, read on the lent H200 (idle, then holding 1 GiB): fixtures README.
H200_MEMORY = FIXTURES / "nvml/linux_nvidia_1_h200_141gx1.memory.json"


@dataclass(frozen=True)
class _MemoryV2:
    total: int
    reserved: int
    free: int
    used: int


class _RecordedMemory:
    """pynvml as the H200 answered its memory calls in one state; every other reading unsupported.
    ``v2`` False: a driver without ``nvmlDeviceGetMemoryInfo_v2`` (pynvml then raises
    FUNCTION_NOT_FOUND)."""

    NVMLError = pynvml.NVMLError
    nvmlMemory_v2 = pynvml.nvmlMemory_v2

    def __init__(self, state: dict[str, Any], v2: bool = True) -> None:
        self.state, self.v2 = state, v2

    def nvmlInit(self) -> None: ...

    def nvmlShutdown(self) -> None: ...

    def nvmlDeviceGetCount(self) -> int:
        return 1

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetMemoryInfo(self, handle: int, version: int | None = None) -> object:
        if version is None:
            return _Memory(
                total=self.state["v1"]["total"], used=self.state["v1"]["used"], free=self.state["v1"]["free"]
            )
        if not self.v2:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        assert version == pynvml.nvmlMemory_v2
        v2 = self.state["v2"]
        return _MemoryV2(total=v2["total"], reserved=v2["reserved"], free=v2["free"], used=v2["used"])

    def __getattr__(self, call: str) -> Any:
        def unsupported(*args: object) -> None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)

        return unsupported


@pytest.mark.parametrize(
    ("state", "v2", "used"),
    [
        # nvidia-smi said 1551 MiB used (and 616 MiB reserved) while the process held its GiB …
        ("holding_1GiB", True, 1_626_144_768),
        # … and 0 MiB idle, where NVML's v1 "used" is the driver's reservation alone.
        ("idle", True, 0),
        # A driver without v2: v1's used, reservation included, rather than nothing.
        ("holding_1GiB", False, 2_271_084_544),
    ],
)
def test_gpu_memory_used_leaves_out_what_the_driver_reserves_as_nvidia_smi_and_dcgm_do(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, state: str, v2: bool, used: int
) -> None:
    recorded = json.loads(H200_MEMORY.read_text())[state]
    if v2:
        assert recorded["v1"]["used"] == recorded["v2"]["used"] + recorded["v2"]["reserved"]
    monkeypatch.setitem(sys.modules, "pynvml", _RecordedMemory(recorded, v2))
    node = Node.model_validate(
        {
            "name": "h200-01",
            "cpu": {"cores": 16, "memory": "128GiB"},
            "devices": [{"index": 0, "class": "h200"}],
        }
    )
    samples = {s.name: s.value for s in make_reader(tmp_path)(node)}
    assert samples == {"fleetserve_gpu_memory_used_bytes": float(used)}


def test_an_apple_gpu_read_from_recorded_ioreg_gives_utilisation_and_memory_and_nothing_else():
    from fleetserve.agent.discovery.macos import MacDiscoverer

    recording = json.loads((FIXTURES / "macos/darwin_apple_1_m4_max_128g.json").read_text())["commands"]
    mac = MacDiscoverer(lambda argv: recording.get(" ".join(argv)), system="Darwin")
    node = Node.model_validate(
        {
            "name": "studio",
            "cpu": {"cores": 16, "memory": "16GiB"},
            "devices": [{"index": 0, "class": "apple-m4-max"}],
        }
    )
    samples = {s.name: s.model_dump() for s in make_reader(Path("/nonexistent"), mac=mac)(node)}
    labels = {"node": "studio", "device": "0", "driver": "gpu.apple.com", "class": "apple-m4-max"}
    assert samples["fleetserve_gpu_utilization_ratio"] == {
        "name": "fleetserve_gpu_utilization_ratio",
        "labels": labels,
        "value": 0.87,
    }
    assert samples["fleetserve_gpu_memory_used_bytes"]["value"] == 61203578880
    # macOS shows power, energy and temperature of the GPU only to root (powermetrics): absent.
    assert set(samples) == {"fleetserve_gpu_utilization_ratio", "fleetserve_gpu_memory_used_bytes"}


def test_off_macos_the_apple_source_adds_no_sample():
    from fleetserve.agent.discovery.macos import MacDiscoverer

    mac = MacDiscoverer(lambda argv: pytest.fail(f"ran {argv} off macOS"), system="Linux")
    node = Node.model_validate({"name": "cpu", "cpu": {"cores": 2, "memory": "8GiB"}})
    assert make_reader(Path("/nonexistent"), mac=mac)(node) == []
