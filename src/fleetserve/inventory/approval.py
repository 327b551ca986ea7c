"""A node's hardware is not its word: what a registration claims, judged against what an operator
approved.

The facts an approval is about (``Hardware``) are the ones placement spends: devices per device
class, CPU cores, host memory. A claim with more of any of them than approved, or devices of a
class the approval has none of, is ``MORE``: it waits for an operator (``fleetserve nodes approve
NAME``), and until then the node is placed as ``cap`` makes it — the claim cut down to the
approved facts, so it draws nothing beyond what was approved. A claim with less of some and more
of none is ``LESS``: accepted as it is (a GPU fell off the bus, memory was pulled), logged, and the
approved facts stay the ceiling a later claim is judged against. Pure: no store, no clock.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field

from fleetserve.spec.resources import Node
from fleetserve.units import format_bytes


class Hardware(BaseModel):
    """The hardware facts an approval covers: CPU cores, host memory in bytes, devices per class."""

    model_config = ConfigDict(frozen=True)

    cores: int = Field(ge=0)
    memory: int = Field(ge=0)
    devices: dict[str, int] = Field(default_factory=dict)

    @classmethod
    def of(cls, node: Node) -> Hardware:
        """The facts ``node`` claims."""
        per_class = Counter(d.device_class for d in node.devices)
        return cls(cores=node.cpu.cores, memory=node.cpu.memory, devices=dict(sorted(per_class.items())))

    def describe(self) -> str:
        """One line for an operator: ``16 cores, 64.0GiB, 4 h100``."""
        parts = [f"{self.cores} cores", format_bytes(self.memory)]
        parts += [f"{n} {cls}" for cls, n in sorted(self.devices.items()) if n]
        return ", ".join(parts)


class Fact(StrEnum):
    """Which fact of a claim differs from its approval."""

    CORES = "cores"
    MEMORY = "memory"
    DEVICES = "devices"  # of one device class


@dataclass(frozen=True)
class Difference:
    """One fact where the claim and the approval differ (``device_class`` for ``DEVICES``)."""

    fact: Fact
    claimed: int
    approved: int
    device_class: str | None = None

    @property
    def more(self) -> bool:
        return self.claimed > self.approved

    def describe(self) -> str:
        """``cores 1000 (approved 16)``, ``devices of class h100 8 (approved 0)``."""
        if self.fact is Fact.MEMORY:
            claimed, approved = format_bytes(self.claimed), format_bytes(self.approved)
        else:
            claimed, approved = str(self.claimed), str(self.approved)
        what = f"devices of class {self.device_class}" if self.fact is Fact.DEVICES else self.fact.value
        return f"{what} {claimed} (approved {approved})"


class Verdict(StrEnum):
    """What becomes of a claim."""

    SAME = "same"  # the approved facts exactly
    LESS = "less"  # less of some, more of none: accepted, logged
    MORE = "more"  # more of something, or a class not approved: held for an operator


@dataclass(frozen=True)
class Judgement:
    """A claim judged against its approval: the verdict and every fact that differs."""

    verdict: Verdict
    differences: tuple[Difference, ...]

    @property
    def excess(self) -> tuple[Difference, ...]:
        """The facts the claim has more of than approved (what waits)."""
        return tuple(d for d in self.differences if d.more)

    def describe(self) -> str:
        return "; ".join(d.describe() for d in (self.excess or self.differences))


def judge(claimed: Hardware, approved: Hardware) -> Judgement:
    """Judge ``claimed`` against ``approved``: ``MORE`` if any fact exceeds it (a device class the
    approval lacks counts as approved 0), else ``LESS`` if any falls short, else ``SAME``."""
    differences = [
        Difference(fact, c, a)
        for fact, c, a in (
            (Fact.CORES, claimed.cores, approved.cores),
            (Fact.MEMORY, claimed.memory, approved.memory),
        )
        if c != a
    ]
    for cls in sorted(set(claimed.devices) | set(approved.devices)):
        c, a = claimed.devices.get(cls, 0), approved.devices.get(cls, 0)
        if c != a:
            differences.append(Difference(Fact.DEVICES, c, a, cls))
    if any(d.more for d in differences):
        verdict = Verdict.MORE
    elif differences:
        verdict = Verdict.LESS
    else:
        verdict = Verdict.SAME
    return Judgement(verdict, tuple(differences))


def cap(node: Node, approved: Hardware) -> Node:
    """``node`` as placement may use it under ``approved``: cores and memory at most the approved,
    of each class's devices the lowest-numbered up to the approved count (none of a class not
    approved), NVLink domains narrowed to the devices kept. Facts within the approval are kept."""
    kept = []
    taken: Counter[str] = Counter()
    for device in sorted(node.devices, key=lambda d: d.index):
        if taken[device.device_class] < approved.devices.get(device.device_class, 0):
            taken[device.device_class] += 1
            kept.append(device)
    indices = {d.index for d in kept}
    domains = tuple(t for t in (tuple(i for i in dom if i in indices) for dom in node.nvlink_domains) if t)
    cpu = node.cpu.model_copy(
        update={
            "cores": max(1, min(node.cpu.cores, approved.cores)),
            "memory": min(node.cpu.memory, approved.memory),
        }
    )
    return node.model_copy(update={"cpu": cpu, "devices": tuple(kept), "nvlink_domains": domains})


class HardwareHeld(BaseModel):
    """A registration's claim held for an operator: the facts approved (what the node is placed
    with meanwhile) and those claimed."""

    model_config = ConfigDict(frozen=True)

    approved: Hardware
    claimed: Hardware
