"""Hardware discovery for the node agent: one module per source, combined by ``discover``.

    discovery = discover()                       # this machine: CPU, NVIDIA, AMD, Apple, InfiniBand
    node, unmatched = to_node(discovery, ...)    # fleetserve.inventory.matching

No source raises for hardware or drivers that are absent; what could not be read is listed in
``Discovery.problems``, what is simply not there (no NVIDIA driver on a machine without an NVIDIA
GPU) in ``Discovery.facts``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from fleetserve.agent.discovery.amd import AmdDiscoverer, AmdSysfsDiscoverer
from fleetserve.agent.discovery.base import Discoverer, Findings, combine
from fleetserve.agent.discovery.cpu import CpuDiscoverer
from fleetserve.agent.discovery.infiniband import InfinibandDiscoverer
from fleetserve.agent.discovery.macos import MacDiscoverer
from fleetserve.agent.discovery.nvidia import NvidiaDiscoverer, NvmlLibrary
from fleetserve.inventory.hardware import Discovery

__all__ = [
    "AmdDiscoverer",
    "AmdSysfsDiscoverer",
    "CpuDiscoverer",
    "Discoverer",
    "Findings",
    "InfinibandDiscoverer",
    "MacDiscoverer",
    "NvidiaDiscoverer",
    "NvmlLibrary",
    "default_discoverers",
    "discover",
]


def default_discoverers(root: Path | str = "/") -> tuple[Discoverer, ...]:
    """Every source, reading the machine under ``root``: CPU, NVIDIA (NVML), AMD, Apple Silicon
    (macOS only: elsewhere it finds nothing), InfiniBand."""
    return (
        CpuDiscoverer(root),
        NvidiaDiscoverer(root=root),
        AmdDiscoverer(root),
        MacDiscoverer(),
        InfinibandDiscoverer(root),
    )


def discover(sources: Sequence[Discoverer] | None = None) -> Discovery:
    """Run ``sources`` (default: every source on this machine) and combine what they found."""
    chosen = default_discoverers() if sources is None else sources
    return combine(source.discover() for source in chosen)
