"""The agent's own GPU readings, for nodes where no DCGM or AMD exporter runs: NVML for NVIDIA,
sysfs for AMD, ``ioreg`` for an Apple GPU on macOS, turned into the canonical ``fleetserve_gpu_*``
samples it reports to the server."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from fleetserve.agent.discovery.amd import AmdSysfsDiscoverer
from fleetserve.agent.discovery.macos import MacDiscoverer
from fleetserve.drivers import Driver
from fleetserve.metrics.gpu import (
    AppleIoregReading,
    GpuContext,
    NvmlReading,
    from_amd_sysfs,
    from_apple_ioreg,
    from_nvml,
)
from fleetserve.metrics.promtext import Sample
from fleetserve.protocol import GpuSample
from fleetserve.spec.resources import Node

GpuReader = Callable[[Node], list[GpuSample]]


def _read(nvml: Any, call: str, *args: Any) -> Any:
    """One NVML call; None where the device does not support it."""
    try:
        return getattr(nvml, call)(*args)
    except nvml.NVMLError:
        return None


def _memory_used(nvml: Any, handle: Any) -> int | None:
    """Bytes in use on the device as ``nvidia-smi`` and DCGM's FB_USED count them: NVML's v2
    memory info, whose ``used`` leaves out what the driver reserves (615 MiB on an H200, read on
    one: the v1 ``used`` is v2's ``used`` plus ``reserved``). Drivers without v2 answer v1."""
    version = getattr(nvml, "nvmlMemory_v2", None)
    if version is not None:
        memory = _read(nvml, "nvmlDeviceGetMemoryInfo", handle, version)
        if memory is not None:
            return int(memory.used)
    memory = _read(nvml, "nvmlDeviceGetMemoryInfo", handle)
    return None if memory is None else int(memory.used)


def _nvml_readings() -> list[NvmlReading]:
    """One reading per NVIDIA GPU; none when NVML cannot start (no driver, as on CPU machines)."""
    try:
        import pynvml  # type: ignore[import-untyped]

        pynvml.nvmlInit()
    except Exception:  # no library or no driver: this node has no NVIDIA GPU to read
        return []
    out = []
    try:
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            util = _read(pynvml, "nvmlDeviceGetUtilizationRates", handle)
            out.append(
                NvmlReading(
                    index=index,
                    utilization_gpu=None if util is None else int(util.gpu),
                    memory_used=_memory_used(pynvml, handle),
                    power_usage=_read(pynvml, "nvmlDeviceGetPowerUsage", handle),
                    total_energy_consumption=_read(pynvml, "nvmlDeviceGetTotalEnergyConsumption", handle),
                    temperature_gpu=_read(pynvml, "nvmlDeviceGetTemperature", handle, 0),
                )
            )
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()
    return out


def _apple_readings(mac: MacDiscoverer) -> list[AppleIoregReading]:
    """The Apple GPU's reading on a Mac (one GPU, index 0); none elsewhere."""
    stats = mac.statistics()
    if stats is None:
        return []
    return [
        AppleIoregReading(
            index=0, device_utilization_percent=stats.busy_percent, in_use_system_memory=stats.memory_used
        )
    ]


def _context(node: Node) -> GpuContext:
    return GpuContext(node=node.name, classes={str(d.index): d.device_class for d in node.devices})


def _as_reported(samples: Iterable[Sample]) -> list[GpuSample]:
    return [GpuSample(name=s.name, labels=dict(s.labels), value=s.value) for s in samples]


def own_readers(root: Path = Path("/"), mac: MacDiscoverer | None = None) -> dict[Driver, GpuReader]:
    """Per driver, how the agent reads that driver's GPUs itself: NVML, sysfs (under ``root``),
    ioreg on macOS (``mac``: the macOS source, a recording in tests)."""
    apple = mac or MacDiscoverer()

    def nvml(node: Node) -> list[GpuSample]:
        return _as_reported(from_nvml(_nvml_readings(), _context(node)))

    def amd_sysfs(node: Node) -> list[GpuSample]:
        amd = AmdSysfsDiscoverer(root).discover().gpus
        return _as_reported(from_amd_sysfs(amd, _context(node))) if amd else []

    def apple_ioreg(node: Node) -> list[GpuSample]:
        return _as_reported(from_apple_ioreg(_apple_readings(apple), _context(node)))

    return {Driver.NVIDIA: nvml, Driver.AMD: amd_sysfs, Driver.APPLE: apple_ioreg}


def make_reader(root: Path = Path("/"), mac: MacDiscoverer | None = None) -> GpuReader:
    """A function reading this machine's GPUs as canonical samples, labelled for ``node``."""
    readers = own_readers(root, mac)

    def read(node: Node) -> list[GpuSample]:
        return [sample for reader in readers.values() for sample in reader(node)]

    return read
