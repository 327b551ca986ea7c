"""The driver table: the single source of every fact that varies by device stack.

A driver is named as Kubernetes DRA names it. Adding a device type is adding a row to
``DRIVERS``; no other module branches on a vendor. Pool label and taint are derived from the
driver by one rule (``pool_label``/``pool_taint``), never spelled per vendor.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from types import MappingProxyType


class Driver(StrEnum):
    """A device stack, named as its Kubernetes DRA driver."""

    NVIDIA = "gpu.nvidia.com"
    AMD = "gpu.amd.com"
    # No DRA driver exists for Apple GPUs; the name follows the GPU rows' gpu.<vendor>.com.
    APPLE = "gpu.apple.com"
    CPU = "dra.cpu"


class RuntimeVariant(StrEnum):
    """The build of an engine: which device API it computes with."""

    CPU = "cpu"
    CUDA = "cuda"
    ROCM = "rocm"
    VULKAN = "vulkan"
    METAL = "metal"


@dataclass(frozen=True)
class Taint:
    """A Kubernetes-style node taint: only workloads that tolerate it land on the node."""

    key: str
    value: str
    effect: str = "NoSchedule"

    def __str__(self) -> str:
        return f"{self.key}={self.value}:{self.effect}"


@dataclass(frozen=True)
class SliceFormat:
    """How a GPU driver's DRA plugin describes its devices in a ResourceSlice."""

    # The attribute holding the driver's ordinal of the device.
    index_attribute: str
    pci_vendor_id: str
    # Values of the ``type`` attribute that mark a partition of a GPU, not a whole one.
    partition_types: tuple[str, ...]


@dataclass(frozen=True)
class MetricsExporter:
    """The GPU metrics exporter a driver's stack runs on each node, and how to find and read it.

    On Kubernetes it is found by its pods (any one of ``pod_selectors``, each a ``k=v`` label
    selector, picks them) and their container port named ``port_name``; an agent beside it probes
    ``127.0.0.1:default_port``. ``source`` names its output format: a ``GpuSource`` value of
    ``fleetserve.metrics.gpu`` (a string here, as this module imports nothing of fleetserve's).
    """

    name: str
    pod_selectors: tuple[str, ...]
    port_name: str
    default_port: int
    source: str
    path: str = "/metrics"


@dataclass(frozen=True)
class DriverSpec:
    """Every per-driver fact: pool role, env, device-plugin resource, stack, accelerator or host."""

    pool_role: str
    # Which environment variables restrict an engine to its devices, per runtime variant.
    visible_devices_env: Mapping[RuntimeVariant, tuple[str, ...]]
    # The Kubernetes device-plugin resource, per runtime variant (Vulkan uses the DRI render node).
    device_plugin_resource: Mapping[RuntimeVariant, str]
    stack_components: tuple[str, ...]
    is_accelerator: bool
    # How its ResourceSlices describe a GPU (``fleetserve kube import``); None: it publishes none.
    resource_slice: SliceFormat | None = None
    # The GPU metrics exporter its stack runs (design.md, Metrics); None: it has none.
    metrics_exporter: MetricsExporter | None = None
    # Whether Kubernetes can give a pod its devices (a DRA driver or device plugin exists); False:
    # served by agents only, and the Kubernetes backend refuses what claims it.
    kube_supported: bool = True


POOL_LABEL_KEY = "fleetserve.io/pool"
TAINT_PREFIX = "fleetserve.io/"


def _frozen(d: dict[RuntimeVariant, tuple[str, ...]]) -> Mapping[RuntimeVariant, tuple[str, ...]]:
    return MappingProxyType(d)


DRIVERS: Mapping[Driver, DriverSpec] = MappingProxyType(
    {
        Driver.NVIDIA: DriverSpec(
            pool_role="nvidia-gpu",
            visible_devices_env=_frozen({RuntimeVariant.CUDA: ("CUDA_VISIBLE_DEVICES",)}),
            device_plugin_resource=MappingProxyType({RuntimeVariant.CUDA: "nvidia.com/gpu"}),
            stack_components=("nvidia-dra-driver-gpu", "nvidia-gpu-operator", "dcgm-exporter", "nfd"),
            is_accelerator=True,
            resource_slice=SliceFormat(
                index_attribute="index", pci_vendor_id="0x10de", partition_types=("mig",)
            ),
            # The GPU operator labels its DaemonSet's pods app=nvidia-dcgm-exporter; the
            # dcgm-exporter Helm chart app.kubernetes.io/name=dcgm-exporter. Both name the port metrics.
            metrics_exporter=MetricsExporter(
                name="dcgm-exporter",
                pod_selectors=("app=nvidia-dcgm-exporter", "app.kubernetes.io/name=dcgm-exporter"),
                port_name="metrics",
                default_port=9400,
                source="dcgm",
            ),
        ),
        Driver.AMD: DriverSpec(
            pool_role="amd-gpu",
            visible_devices_env=_frozen(
                {
                    RuntimeVariant.ROCM: ("HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES"),
                    RuntimeVariant.VULKAN: ("GGML_VK_VISIBLE_DEVICES",),
                }
            ),
            device_plugin_resource=MappingProxyType(
                {RuntimeVariant.ROCM: "amd.com/gpu", RuntimeVariant.VULKAN: "squat.ai/dri"}
            ),
            stack_components=("amd-gpu-operator", "amd-device-metrics-exporter", "nfd"),
            is_accelerator=True,
            # cardIndex is the DRM card number (/dev/dri/cardN), the closest ordinal the slice has.
            resource_slice=SliceFormat(
                index_attribute="cardIndex", pci_vendor_id="0x1002", partition_types=("amdgpu-partition",)
            ),
            # The AMD GPU operator's metrics exporter DaemonSet: its pods and their exporter-port.
            metrics_exporter=MetricsExporter(
                name="amd-device-metrics-exporter",
                pod_selectors=("app.kubernetes.io/name=metrics-exporter",),
                port_name="exporter-port",
                default_port=5000,
                source="amd-exporter",
            ),
        ),
        # Apple Silicon (Metal, unified memory): agents on macOS only. No DRA driver or device
        # plugin publishes its GPU, so there is nothing to claim, render or install on Kubernetes.
        Driver.APPLE: DriverSpec(
            pool_role="apple-gpu",
            # Metal has no visible-devices variable: a Mac has one GPU and llama-server takes it.
            visible_devices_env=_frozen({RuntimeVariant.METAL: ()}),
            device_plugin_resource=MappingProxyType({}),
            stack_components=(),
            is_accelerator=True,
            # No exporter exists: the agent reads the GPU through ioreg (agent.discovery.macos).
            metrics_exporter=None,
            kube_supported=False,
        ),
        Driver.CPU: DriverSpec(
            pool_role="cpu",
            visible_devices_env=_frozen({RuntimeVariant.CPU: ()}),
            device_plugin_resource=MappingProxyType({RuntimeVariant.CPU: "cpu"}),
            stack_components=("dra-driver-cpu",),
            is_accelerator=False,
        ),
    }
)


def kube_drivers() -> frozenset[Driver]:
    """The drivers the Kubernetes backend can claim devices of (the rest are served by agents)."""
    return frozenset(d for d, spec in DRIVERS.items() if spec.kube_supported)


def parse_driver(name: str) -> Driver | None:
    """Return the Driver named ``name``, or None if no row of the table has that name."""
    try:
        return Driver(name)
    except ValueError:
        return None


def host_driver() -> Driver:
    """The driver of the host's own CPUs and memory: the one row that is not an accelerator.

    It serves profiles without a device class and nodes without devices."""
    (host,) = (d for d, spec in DRIVERS.items() if not spec.is_accelerator)
    return host


def pool_label(driver: Driver) -> tuple[str, str]:
    """The node label (key, value) of the pool that serves ``driver``."""
    return (POOL_LABEL_KEY, DRIVERS[driver].pool_role)


def pool_taint(driver: Driver) -> Taint:
    """The taint every node of ``driver``'s pool carries; only that driver's workloads tolerate it."""
    return Taint(key=TAINT_PREFIX + driver.value, value="present")


def metrics_exporters() -> dict[Driver, MetricsExporter]:
    """Every driver whose stack runs a GPU metrics exporter, with it, in table order."""
    return {d: spec.metrics_exporter for d, spec in DRIVERS.items() if spec.metrics_exporter is not None}


def stack_for(drivers: list[Driver]) -> tuple[str, ...]:
    """The serving-stack components for a list of claimed drivers (empty list, empty stack)."""
    seen: dict[str, None] = {}
    for driver in drivers:
        for component in DRIVERS[driver].stack_components:
            seen.setdefault(component, None)
    return tuple(seen)
