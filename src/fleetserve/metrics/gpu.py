"""GPU metrics mapped to fleetserve's canonical names, one table row per source.

Canonical labels: node, device, driver, class. Per metric, the DCGM exporter's source; the AMD
device-metrics-exporter's source:

    fleetserve_gpu_utilization_ratio     gauge    DCGM_FI_DEV_GPU_UTIL (%, /100); gpu_gfx_activity (%, /100)
    fleetserve_gpu_memory_used_bytes     gauge    DCGM_FI_DEV_FB_USED (MiB, *2^20); gpu_used_vram (MiB, *2^20)
    fleetserve_gpu_power_watts           gauge    DCGM_FI_DEV_POWER_USAGE (W); gpu_power_usage (W)
    fleetserve_gpu_energy_joules_total   counter  DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION (mJ, /10^3);
                                                  gpu_energy_consumed (uJ, /10^6)
    fleetserve_gpu_temperature_celsius   gauge    DCGM_FI_DEV_GPU_TEMP; gpu_junction_temperature, else
                                                  gpu_edge_temperature
    fleetserve_gpu_tensor_active_ratio   gauge    DCGM_FI_PROF_PIPE_TENSOR_ACTIVE; none (NVIDIA only: absent)

Where no exporter runs, the agent reads the same numbers itself (design.md, Metrics): NVML for
NVIDIA (``NvmlReading``, in NVML's units) and sysfs for AMD (``AmdSysfsReading``, in the kernel's
units). ``from_nvml`` and ``from_amd_sysfs`` turn those readings into the same canonical samples
through the same table, so nothing downstream can tell an exporter node from a homelab box.

Apple Silicon has no exporter: the agent reads ``ioreg``'s ``PerformanceStatistics`` of the GPU
(``AppleIoregReading``, no root needed): utilisation and memory in use. macOS exposes no power,
energy or temperature of the GPU without root (``powermetrics`` needs it), so those are absent.

Labels. ``device`` is the driver's ordinal (DCGM ``gpu``, AMD ``gpu_id``, the reading's
``index``), as fleetserve's inventory numbers devices. ``node`` is the caller's node name; without
one, the exporter's hostname label (in Kubernetes often the exporter pod's name, so callers that
know the node should pass it). ``class`` is the fleetserve device class the caller maps each device
to; without one, the exporter's model label (``modelName``, ``card_model``). DCGM rows of a MIG
instance (``GPU_I_ID`` set) are not whole devices and are left out.

Temperature on AMD: Instinct MI3xx export junction (hotspot) temperature and read 0 at the edge,
so junction is taken where exported and edge otherwise.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from enum import StrEnum
from types import MappingProxyType

from fleetserve.drivers import Driver
from fleetserve.inventory.hardware import GpuFacts
from fleetserve.metrics.promtext import COUNTER, GAUGE, Sample, samples_of, series


class GpuSignal(StrEnum):
    """A canonical GPU signal."""

    UTILIZATION = "utilization"
    MEMORY_USED = "memory_used"
    POWER = "power"
    ENERGY = "energy"
    TEMPERATURE = "temperature"
    TENSOR_ACTIVE = "tensor_active"


@dataclass(frozen=True)
class GpuMetric:
    """A canonical GPU metric: its sample name and Prometheus type."""

    name: str
    kind: str

    @property
    def family(self) -> str:
        """The family name: the sample name without a counter's ``_total``."""
        return self.name.removesuffix("_total") if self.kind == COUNTER else self.name


GPU_CANONICAL: Mapping[GpuSignal, GpuMetric] = MappingProxyType(
    {
        GpuSignal.UTILIZATION: GpuMetric("fleetserve_gpu_utilization_ratio", GAUGE),
        GpuSignal.MEMORY_USED: GpuMetric("fleetserve_gpu_memory_used_bytes", GAUGE),
        GpuSignal.POWER: GpuMetric("fleetserve_gpu_power_watts", GAUGE),
        GpuSignal.ENERGY: GpuMetric("fleetserve_gpu_energy_joules_total", COUNTER),
        GpuSignal.TEMPERATURE: GpuMetric("fleetserve_gpu_temperature_celsius", GAUGE),
        GpuSignal.TENSOR_ACTIVE: GpuMetric("fleetserve_gpu_tensor_active_ratio", GAUGE),
    }
)


class GpuSource(StrEnum):
    """Where a node's GPU numbers come from: an exporter, or the agent's own reads."""

    DCGM = "dcgm"
    AMD_EXPORTER = "amd-exporter"
    NVML = "nvml"
    AMD_SYSFS = "amd-sysfs"
    APPLE_IOREG = "apple-ioreg"


@dataclass(frozen=True)
class Reading:
    """The source metrics that feed one canonical signal (preferred first) and the unit change.

    canonical = source * multiply / divide; kept as two exact factors so that 57 % becomes 0.57
    and not 0.5700000000000001.
    """

    metrics: tuple[str, ...]
    multiply: int = 1
    divide: int = 1


@dataclass(frozen=True)
class SourceSpec:
    """Everything that varies by GPU metrics source: driver, label names and the signal readings."""

    driver: Driver
    device_labels: tuple[str, ...]
    node_labels: tuple[str, ...]
    model_labels: tuple[str, ...]
    # A row with any of these labels set is a slice of a device (a MIG instance), not a device.
    partial_labels: tuple[str, ...]
    readings: Mapping[GpuSignal, Reading]


MiB = 2**20

SOURCES: Mapping[GpuSource, SourceSpec] = MappingProxyType(
    {
        GpuSource.DCGM: SourceSpec(
            driver=Driver.NVIDIA,
            device_labels=("gpu",),
            # dcgm-exporter wrote "Hostname" for years; newer builds write "hostname".
            node_labels=("Hostname", "hostname"),
            model_labels=("modelName",),
            partial_labels=("GPU_I_ID",),
            readings=MappingProxyType(
                {
                    GpuSignal.UTILIZATION: Reading(("DCGM_FI_DEV_GPU_UTIL",), divide=100),
                    GpuSignal.MEMORY_USED: Reading(("DCGM_FI_DEV_FB_USED",), multiply=MiB),
                    GpuSignal.POWER: Reading(("DCGM_FI_DEV_POWER_USAGE",)),
                    GpuSignal.ENERGY: Reading(("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION",), divide=10**3),
                    GpuSignal.TEMPERATURE: Reading(("DCGM_FI_DEV_GPU_TEMP",)),
                    GpuSignal.TENSOR_ACTIVE: Reading(("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE",)),
                }
            ),
        ),
        GpuSource.AMD_EXPORTER: SourceSpec(
            driver=Driver.AMD,
            device_labels=("gpu_id",),
            node_labels=("hostname",),
            # card_model is often empty (ROCm/device-metrics-exporter#171); the series then names it.
            model_labels=("card_model", "card_series"),
            partial_labels=(),
            readings=MappingProxyType(
                {
                    GpuSignal.UTILIZATION: Reading(("gpu_gfx_activity",), divide=100),
                    GpuSignal.MEMORY_USED: Reading(("gpu_used_vram",), multiply=MiB),
                    GpuSignal.POWER: Reading(("gpu_power_usage",)),
                    GpuSignal.ENERGY: Reading(("gpu_energy_consumed",), divide=10**6),
                    GpuSignal.TEMPERATURE: Reading(("gpu_junction_temperature", "gpu_edge_temperature")),
                }
            ),
        ),
        GpuSource.NVML: SourceSpec(
            driver=Driver.NVIDIA,
            device_labels=("index",),
            node_labels=(),
            model_labels=("name",),
            partial_labels=(),
            readings=MappingProxyType(
                {
                    GpuSignal.UTILIZATION: Reading(("utilization_gpu",), divide=100),
                    GpuSignal.MEMORY_USED: Reading(("memory_used",)),
                    GpuSignal.POWER: Reading(("power_usage",), divide=10**3),
                    GpuSignal.ENERGY: Reading(("total_energy_consumption",), divide=10**3),
                    GpuSignal.TEMPERATURE: Reading(("temperature_gpu",)),
                }
            ),
        ),
        GpuSource.AMD_SYSFS: SourceSpec(
            driver=Driver.AMD,
            device_labels=("index",),
            node_labels=(),
            model_labels=("name",),
            partial_labels=(),
            readings=MappingProxyType(
                {
                    GpuSignal.UTILIZATION: Reading(("gpu_busy_percent",), divide=100),
                    GpuSignal.MEMORY_USED: Reading(("mem_info_vram_used",)),
                    # Older kernels and discrete cards have power1_average, newer ones power1_input.
                    GpuSignal.POWER: Reading(("power1_average", "power1_input"), divide=10**6),
                    GpuSignal.ENERGY: Reading(("energy1_input",), divide=10**6),
                    # amdgpu's hwmon: temp1 is edge, temp2 junction; junction first, as above.
                    GpuSignal.TEMPERATURE: Reading(("temp2_input", "temp1_input"), divide=10**3),
                }
            ),
        ),
        GpuSource.APPLE_IOREG: SourceSpec(
            driver=Driver.APPLE,
            device_labels=("index",),
            node_labels=(),
            model_labels=("name",),
            partial_labels=(),
            readings=MappingProxyType(
                {
                    GpuSignal.UTILIZATION: Reading(("device_utilization_percent",), divide=100),
                    GpuSignal.MEMORY_USED: Reading(("in_use_system_memory",)),
                }
            ),
        ),
    }
)


@dataclass(frozen=True)
class GpuContext:
    """Who the GPU samples belong to: the node, and each device's fleetserve class by ordinal."""

    node: str | None = None
    classes: Mapping[str, str] = field(default_factory=dict, hash=False)


def _first(labels: Mapping[str, str], names: tuple[str, ...]) -> str:
    return next((labels[n] for n in names if labels.get(n)), "")


def _order(device: str) -> tuple[int, int | str]:
    return (0, int(device)) if device.isdigit() else (1, device)


def normalize_gpu(
    source_text: str | Iterable[Sample], source: GpuSource, context: GpuContext | None = None
) -> tuple[Sample, ...]:
    """The canonical GPU samples of one scrape (or of readings turned into samples).

    Per device and signal the first source metric with a finite value wins, so a preferred name
    shadows its fallback. A signal the source has no row for yields no sample.
    """
    context = context or GpuContext()
    spec = SOURCES[source]
    samples = samples_of(source_text)
    values: dict[tuple[str, GpuSignal], float] = {}
    seen: dict[str, Mapping[str, str]] = {}
    for signal, reading in spec.readings.items():
        for metric in reading.metrics:
            for s in series(samples, metric):
                device = _first(s.labels, spec.device_labels)
                if not device or _first(s.labels, spec.partial_labels) or not math.isfinite(s.value):
                    continue
                seen.setdefault(device, s.labels)
                # Rows repeated per pod (dcgm-exporter's Kubernetes mode) carry one reading.
                values.setdefault((device, signal), s.value * reading.multiply / reading.divide)
    out: list[Sample] = []
    for device in sorted(seen, key=_order):
        labels = {
            "node": context.node or _first(seen[device], spec.node_labels),
            "device": device,
            "driver": spec.driver.value,
            "class": context.classes.get(device) or _first(seen[device], spec.model_labels),
        }
        for signal, canonical in GPU_CANONICAL.items():
            if (device, signal) in values:
                value = values[device, signal]
                out.append(Sample(canonical.name, labels, value, canonical.family, canonical.kind))
    return tuple(out)


@dataclass(frozen=True)
class NvmlReading:
    """One NVIDIA GPU as NVML reports it, in NVML's units; ``None`` where the call is unsupported."""

    index: int
    name: str = ""
    utilization_gpu: int | None = None  # nvmlDeviceGetUtilizationRates().gpu, percent
    memory_used: int | None = None  # nvmlDeviceGetMemoryInfo(nvmlMemory_v2).used (v1 where absent), bytes
    power_usage: int | None = None  # nvmlDeviceGetPowerUsage, milliwatts
    total_energy_consumption: int | None = None  # nvmlDeviceGetTotalEnergyConsumption, millijoules
    temperature_gpu: int | None = None  # nvmlDeviceGetTemperature(NVML_TEMPERATURE_GPU), Celsius


@dataclass(frozen=True)
class AmdSysfsReading:
    """One AMD GPU as sysfs reports it (``device/`` and its ``hwmon/hwmon*/``), in the kernel's units."""

    index: int
    name: str = ""
    gpu_busy_percent: int | None = None  # percent
    mem_info_vram_used: int | None = None  # bytes
    power1_average: int | None = None  # microwatts
    power1_input: int | None = None  # microwatts
    energy1_input: int | None = None  # microjoules
    temp1_input: int | None = None  # edge, millidegrees Celsius
    temp2_input: int | None = None  # junction, millidegrees Celsius

    @classmethod
    def from_facts(cls, facts: GpuFacts) -> AmdSysfsReading:
        """The readings discovery already took: busy percent and memory used."""
        if facts.driver is not Driver.AMD:
            raise ValueError(f"GPU {facts.index} ({facts.name}) is not an AMD GPU: {facts.driver}")
        return cls(
            index=facts.index,
            name=facts.name,
            gpu_busy_percent=facts.busy_percent,
            mem_info_vram_used=facts.memory_used,
        )


@dataclass(frozen=True)
class AppleIoregReading:
    """An Apple GPU's ``PerformanceStatistics`` in ``ioreg -c IOAccelerator``: ``"Device
    Utilization %"`` (percent) and ``"In use system memory"`` (bytes)."""

    index: int
    name: str = ""
    device_utilization_percent: int | None = None
    in_use_system_memory: int | None = None

    @classmethod
    def from_facts(cls, facts: GpuFacts) -> AppleIoregReading:
        """The readings discovery took (``fleetserve.agent.discovery.macos``)."""
        if facts.driver is not Driver.APPLE:
            raise ValueError(f"GPU {facts.index} ({facts.name}) is not an Apple GPU: {facts.driver}")
        return cls(
            index=facts.index,
            name=facts.name,
            device_utilization_percent=facts.busy_percent,
            in_use_system_memory=facts.memory_used,
        )


def _as_samples(readings: Iterable[NvmlReading | AmdSysfsReading | AppleIoregReading]) -> list[Sample]:
    # A reading becomes samples named after its fields, so the SOURCES rows apply unchanged.
    out: list[Sample] = []
    for reading in readings:
        labels = {"index": str(reading.index), "name": reading.name}
        for f in fields(reading):
            value = getattr(reading, f.name)
            if f.name not in labels and value is not None:
                out.append(Sample(f.name, labels, float(value)))
    return out


def from_nvml(readings: Iterable[NvmlReading], context: GpuContext | None = None) -> tuple[Sample, ...]:
    """Canonical GPU samples from the agent's own NVML reads (no DCGM exporter on the node)."""
    return normalize_gpu(_as_samples(readings), GpuSource.NVML, context)


def from_amd_sysfs(
    readings: Iterable[AmdSysfsReading | GpuFacts], context: GpuContext | None = None
) -> tuple[Sample, ...]:
    """Canonical GPU samples from the agent's own sysfs reads (no AMD exporter on the node)."""
    as_readings = [r if isinstance(r, AmdSysfsReading) else AmdSysfsReading.from_facts(r) for r in readings]
    return normalize_gpu(_as_samples(as_readings), GpuSource.AMD_SYSFS, context)


def from_apple_ioreg(
    readings: Iterable[AppleIoregReading | GpuFacts], context: GpuContext | None = None
) -> tuple[Sample, ...]:
    """Canonical GPU samples from the agent's own ioreg reads of an Apple GPU (utilisation, memory)."""
    as_readings = [
        r if isinstance(r, AppleIoregReading) else AppleIoregReading.from_facts(r) for r in readings
    ]
    return normalize_gpu(_as_samples(as_readings), GpuSource.APPLE_IOREG, context)
