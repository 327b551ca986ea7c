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
    # NVML's units (%, bytes, mW, mJ, °C) as the H200 answered, in canonical units.
    assert {name: s["value"] for name, s in samples.items()} == {
        "fleetserve_gpu_utilization_ratio": 0.0,
        "fleetserve_gpu_memory_used_bytes": 1308491776.0,
        "fleetserve_gpu_power_watts": 123.289,
        "fleetserve_gpu_energy_joules_total": 20442.366,
        "fleetserve_gpu_temperature_celsius": 34.0,
    }, "and no tensor-active ratio: NVML has no such reading (DCGM profiling only)"
