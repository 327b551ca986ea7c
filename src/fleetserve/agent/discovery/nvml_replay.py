"""A recorded NVML: per-device values from a JSON file, answered through the ``NvmlLibrary`` calls.

It stands in for ``pynvml`` wherever no NVIDIA driver is present (tests, demos of the agent on a
laptop) and fails the way NVML fails: ``pynvml.NVMLError`` with NVML's error code. The format::

    {"init_error": null,                      # or an NVML error name, e.g. "LIBRARY_NOT_FOUND"
     "devices": [
       {"uuid": "GPU-…", "name": "NVIDIA H100 80GB HBM3",
        "memory_total": 85520809984,            # bytes, nvmlMemory_t.total
        "pci_bus_id": "00000000:18:00.0",
        "pci_device_id": "0x233010DE",          # nvmlPciInfo_t.pciDeviceId: device << 16 | vendor
        "ecc_uncorrected_volatile": 0,          # null: NOT_SUPPORTED (a GPU without ECC)
        "compute_processes": [{"pid": 4242, "used_gpu_memory": 1048576}],   # null: NOT_SUPPORTED
        "nvlinks": [                            # list position = link number; later links: INVALID_ARGUMENT
          {"state": 1, "remote_bus_id": "00000000:07:00.0", "remote_type": 2}  # type null: FUNCTION_NOT_FOUND
        ]}]}
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pynvml  # type: ignore[import-untyped]


@dataclass(frozen=True)
class ReplayMemory:
    """A recorded ``nvmlMemory_t``."""

    total: int


@dataclass(frozen=True)
class ReplayPci:
    """A recorded ``nvmlPciInfo_t``."""

    busId: bytes
    pciDeviceId: int


@dataclass(frozen=True)
class ReplayProcess:
    """A recorded entry of the running-process list."""

    pid: int
    usedGpuMemory: int | None = None


def _error(name: str) -> Exception:
    code = getattr(pynvml, f"NVML_ERROR_{name}", None)
    if not isinstance(code, int):
        raise ValueError(f"unknown NVML error name {name!r} in a replay")
    error: Exception = pynvml.NVMLError(code)
    return error


class NvmlReplay:
    """Answers the NVML calls discovery makes from recorded per-device values."""

    def __init__(self, recording: Mapping[str, Any]) -> None:
        self._init_error: str | None = recording.get("init_error")
        self._devices: Sequence[Mapping[str, Any]] = list(recording.get("devices", []))
        self.initialized = False
        self.calls = 0

    @classmethod
    def from_file(cls, path: Path | str) -> NvmlReplay:
        """Load a recording written in the module's JSON format."""
        return cls(json.loads(Path(path).read_text(encoding="utf-8")))

    def _device(self, handle: object) -> Mapping[str, Any]:
        self.calls += 1
        if not self.initialized:
            raise _error("UNINITIALIZED")
        if not isinstance(handle, int) or not 0 <= handle < len(self._devices):
            raise _error("INVALID_ARGUMENT")
        return self._devices[handle]

    def _link(self, handle: object, link: int) -> Mapping[str, Any]:
        links: Sequence[Mapping[str, Any]] = self._device(handle).get("nvlinks") or []
        if not 0 <= link < len(links):
            raise _error("INVALID_ARGUMENT" if links else "NOT_SUPPORTED")
        return links[link]

    def nvmlInit(self) -> None:
        if self._init_error:
            raise _error(self._init_error)
        self.initialized = True

    def nvmlShutdown(self) -> None:
        self.initialized = False

    def nvmlDeviceGetCount(self) -> int:
        if not self.initialized:
            raise _error("UNINITIALIZED")
        return len(self._devices)

    def nvmlDeviceGetHandleByIndex(self, index: int, /) -> object:
        self._device(index)
        return index

    def nvmlDeviceGetUUID(self, handle: object, /) -> str:
        return str(self._device(handle)["uuid"])

    def nvmlDeviceGetName(self, handle: object, /) -> str:
        return str(self._device(handle)["name"])

    def nvmlDeviceGetMemoryInfo(self, handle: object, /) -> ReplayMemory:
        return ReplayMemory(total=int(self._device(handle)["memory_total"]))

    def nvmlDeviceGetPciInfo(self, handle: object, /) -> ReplayPci:
        device = self._device(handle)
        return ReplayPci(
            busId=str(device["pci_bus_id"]).encode(), pciDeviceId=int(device["pci_device_id"], 16)
        )

    def nvmlDeviceGetTotalEccErrors(self, handle: object, error_type: int, counter_type: int, /) -> int:
        if (error_type, counter_type) != (
            pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
            pynvml.NVML_VOLATILE_ECC,
        ):
            raise _error("NOT_SUPPORTED")  # only the volatile uncorrected count is recorded
        count = self._device(handle).get("ecc_uncorrected_volatile")
        if count is None:
            raise _error("NOT_SUPPORTED")
        return int(count)

    def nvmlDeviceGetComputeRunningProcesses(self, handle: object, /) -> list[ReplayProcess]:
        processes = self._device(handle).get("compute_processes")
        if processes is None:
            raise _error("NOT_SUPPORTED")
        return [ReplayProcess(pid=int(p["pid"]), usedGpuMemory=p.get("used_gpu_memory")) for p in processes]

    def nvmlDeviceGetNvLinkState(self, handle: object, link: int, /) -> int:
        return int(self._link(handle, link)["state"])

    def nvmlDeviceGetNvLinkRemotePciInfo(self, handle: object, link: int, /) -> ReplayPci:
        remote = str(self._link(handle, link)["remote_bus_id"])
        return ReplayPci(busId=remote.encode(), pciDeviceId=0)

    def nvmlDeviceGetNvLinkRemoteDeviceType(self, handle: object, link: int, /) -> int:
        kind = self._link(handle, link).get("remote_type")
        if kind is None:
            raise _error("FUNCTION_NOT_FOUND")  # a driver older than the call
        return int(kind)
