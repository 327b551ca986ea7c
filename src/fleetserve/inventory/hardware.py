"""Hardware facts of one machine, as its drivers report them, before any of it is matched to a
device class or a fabric: the host, its GPUs and its RDMA adapters.

The agent's discovery sources (``fleetserve.agent.discovery``) produce them; class matching
(``fleetserve.inventory.matching``), GPU metrics (``fleetserve.metrics.gpu``) and the Kubernetes
importer (``fleetserve.kube.importer``) read them.
"""

from __future__ import annotations

from dataclasses import dataclass

from fleetserve.drivers import Driver


@dataclass(frozen=True)
class HostFacts:
    """The machine itself: name, CPU cores, NUMA nodes and host memory in bytes."""

    hostname: str
    physical_cores: int
    logical_cpus: int
    numa_nodes: int
    memory_total: int
    memory_available: int


@dataclass(frozen=True)
class GpuFacts:
    """One GPU as its driver reports it.

    ``index`` is the driver's own ordinal (what ``CUDA_VISIBLE_DEVICES`` or ``HIP_VISIBLE_DEVICES``
    count), ``memory`` is the GPU-visible memory in bytes, PCI ids are lower-case ``0x`` hex
    (``"0x10de"``, ``"0x2330"``), ``nvlink_peers`` are the driver ordinals of the GPUs this one has an
    active NVLink to (directly or through an NVSwitch), ``source`` names what read it (``"nvml"``,
    ``"sysfs"``, ``"amdsmi+sysfs"``).
    """

    driver: Driver
    index: int
    uuid: str
    name: str
    memory: int
    pci_vendor_id: str
    pci_device_id: str
    gfx_target: str | None
    ecc_uncorrected: int
    compute_pids: tuple[int, ...]
    render_node: str | None
    nvlink_peers: tuple[int, ...]
    source: str
    pci_bus_id: str = ""
    memory_used: int | None = None
    busy_percent: int | None = None
    # An APU whose GPU shares the host's memory (its ``memory`` includes the GTT pool).
    integrated: bool = False
    # GPU cores where the driver counts them (Apple Silicon: system_profiler's sppci_cores).
    gpu_cores: int | None = None
    # Bytes of ``memory`` that are the host's own RAM, not on top of it (unified memory: all of
    # it on Apple Silicon): the node's host memory is offered without them, so none counts twice.
    host_memory_shared: int = 0


@dataclass(frozen=True)
class HcaFacts:
    """One RDMA host channel adapter: its ports' GUIDs and subnet prefixes, link layer and state.

    GUIDs and prefixes are written as sysfs writes them: four groups of four lower-case hex digits
    (``"1070:fd03:008e:b580"``, ``"fe80:0000:0000:0000"``), one per port, in port order. ``state`` is
    ``"ACTIVE"`` when any port is active, else the first port's state (``"DOWN"``, ``"INIT"``, ...).
    """

    name: str
    port_guids: tuple[str, ...]
    subnet_prefixes: tuple[str, ...]
    link_layer: str
    state: str
    node_guid: str = ""

    @property
    def active(self) -> bool:
        return self.state == "ACTIVE"


@dataclass(frozen=True)
class Discovery:
    """Everything discovery found on one machine, with every problem met on the way and the facts
    of what is not there (no fault: a vendor's library missing where none of its devices is)."""

    host: HostFacts
    gpus: tuple[GpuFacts, ...]
    hcas: tuple[HcaFacts, ...]
    problems: tuple[str, ...]
    facts: tuple[str, ...] = ()
