"""What discovery finds on a machine, before any of it is matched to a device class or a fabric.

Every source (``cpu``, ``nvidia``, ``amd``, ``infiniband``) is a ``Discoverer``: it reads its part of
the machine and returns ``Findings``. A source never raises for hardware that is absent or a driver
that is not loaded: it returns what it found and says what it could not read in ``problems``.
``fleetserve.agent.discovery.discover`` runs several sources and combines them into one
``Discovery``; ``fleetserve.agent.matching`` turns that into a ``Node``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

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
class Findings:
    """What one source found: host facts (the CPU source only), GPUs, HCAs and what it could not read."""

    host: HostFacts | None = None
    gpus: tuple[GpuFacts, ...] = ()
    hcas: tuple[HcaFacts, ...] = ()
    problems: tuple[str, ...] = ()


@dataclass(frozen=True)
class Discovery:
    """Everything discovery found on one machine, with every problem met on the way."""

    host: HostFacts
    gpus: tuple[GpuFacts, ...]
    hcas: tuple[HcaFacts, ...]
    problems: tuple[str, ...]


class Discoverer(Protocol):
    """One source of hardware facts; ``discover`` never raises for absent hardware or drivers."""

    def discover(self) -> Findings: ...


def combine(findings: Iterable[Findings]) -> Discovery:
    """Merge several sources' findings; exactly one of them must carry the host facts."""
    hosts: list[HostFacts] = []
    gpus: list[GpuFacts] = []
    hcas: list[HcaFacts] = []
    problems: list[str] = []
    for found in findings:
        if found.host is not None:
            hosts.append(found.host)
        gpus.extend(found.gpus)
        hcas.extend(found.hcas)
        problems.extend(found.problems)
    if len(hosts) != 1:
        raise ValueError(f"exactly one discovery source must report the host; {len(hosts)} did")
    return Discovery(host=hosts[0], gpus=tuple(gpus), hcas=tuple(hcas), problems=tuple(problems))
