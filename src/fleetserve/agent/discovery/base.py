"""How discovery finds a machine's hardware (the facts themselves: ``fleetserve.inventory.hardware``).

Every source (``cpu``, ``nvidia``, ``amd``, ``infiniband``) is a ``Discoverer``: it reads its part of
the machine and returns ``Findings``. A source never raises for hardware that is absent or a driver
that is not loaded: it returns what it found, says what it could not read in ``problems`` (shown on
the node, in red), and what is simply not there in ``facts`` (a vendor's library missing where none
of that vendor's devices is: a CPU-only machine without NVIDIA's driver is no fault).
``fleetserve.agent.discovery.discover`` runs several sources and combines them into one
``Discovery``; ``fleetserve.inventory.matching`` turns that into a ``Node``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from fleetserve.inventory.hardware import Discovery, GpuFacts, HcaFacts, HostFacts


@dataclass(frozen=True)
class Findings:
    """What one source found: host facts (the CPU source only), GPUs, HCAs, what it could not read
    (problems) and what is not there and need not be (facts)."""

    host: HostFacts | None = None
    gpus: tuple[GpuFacts, ...] = ()
    hcas: tuple[HcaFacts, ...] = ()
    problems: tuple[str, ...] = ()
    facts: tuple[str, ...] = ()


class Discoverer(Protocol):
    """One source of hardware facts; ``discover`` never raises for absent hardware or drivers."""

    def discover(self) -> Findings: ...


def combine(findings: Iterable[Findings]) -> Discovery:
    """Merge several sources' findings; exactly one of them must carry the host facts."""
    hosts: list[HostFacts] = []
    gpus: list[GpuFacts] = []
    hcas: list[HcaFacts] = []
    problems: list[str] = []
    facts: list[str] = []
    for found in findings:
        if found.host is not None:
            hosts.append(found.host)
        gpus.extend(found.gpus)
        hcas.extend(found.hcas)
        problems.extend(found.problems)
        facts.extend(found.facts)
    if len(hosts) != 1:
        raise ValueError(f"exactly one discovery source must report the host; {len(hosts)} did")
    return Discovery(
        host=hosts[0], gpus=tuple(gpus), hcas=tuple(hcas), problems=tuple(problems), facts=tuple(facts)
    )
