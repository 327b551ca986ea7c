"""Why a profile did or did not fit: reason codes, per-reason counts, and one renderer.

Reasons are data (a closed enum plus an optional number); sentences are made from data in
``render_report`` only. Tests compare codes and counts, never the prose.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fleetserve.placement.demand import Demand


class Reason(StrEnum):
    """The first constraint a node failed, in filter-chain order."""

    NOT_READY = "NotReady"
    CORDONED = "Cordoned"
    NO_DEVICE_OF_CLASS = "NoDeviceOfClass"
    TAINT_NOT_TOLERATED = "TaintNotTolerated"
    ENGINE_NOT_INSTALLED = "EngineNotInstalled"
    DEVICE_MEMORY_TOO_SMALL = "DeviceMemoryTooSmall"
    NO_FABRIC = "NoFabric"
    INSUFFICIENT_FREE_DEVICES = "InsufficientFreeDevices"
    INSUFFICIENT_CPU = "InsufficientCpu"
    INSUFFICIENT_MEMORY = "InsufficientMemory"
    FABRIC_TOO_SMALL = "FabricTooSmall"


# Filtered: the node can never fit this profile. Exhausted: it is full right now, so waiting,
# releasing or preempting could help (Nomad's split; Kubernetes' Unschedulable vs ...Unresolvable).
EXHAUSTED: frozenset[Reason] = frozenset(
    {
        Reason.INSUFFICIENT_FREE_DEVICES,
        Reason.INSUFFICIENT_CPU,
        Reason.INSUFFICIENT_MEMORY,
        Reason.FABRIC_TOO_SMALL,
    }
)


@dataclass(frozen=True, order=True)
class ReasonCount:
    """How many nodes failed with one reason; ``have`` carries the free amount where it matters."""

    reason: Reason
    count: int
    have: int | None = None

    @property
    def exhausted(self) -> bool:
        return self.reason in EXHAUSTED


@dataclass(frozen=True)
class ProfileReport:
    """One profile's attempt for one replica: nodes evaluated, nodes that fit, and every reason."""

    profile: str
    device_class: str | None
    needed: int
    nodes_needed: int
    nodes_evaluated: int
    nodes_fit: int
    reasons: tuple[ReasonCount, ...]
    # The engine build the profile needs, ENGINE/VARIANT (``llama.cpp/cuda``): EngineNotInstalled's detail.
    engine: str = ""
    # Multi-node: per fabric, how many nodes fit individually (only filled when the group failed).
    fabric_fit: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))

    @property
    def fits(self) -> bool:
        return not self.reasons and self.nodes_fit >= self.nodes_needed

    def counts(self) -> dict[tuple[Reason, int | None], int]:
        """Reason counts keyed by (reason, have), for tests and aggregation."""
        return {(r.reason, r.have): r.count for r in self.reasons}

    def to_dict(self) -> dict[str, Any]:
        """Plain data for JSON output and storage."""
        return {
            "profile": self.profile,
            "deviceClass": self.device_class,
            "engine": self.engine,
            "devicesNeeded": self.needed,
            "nodesNeeded": self.nodes_needed,
            "nodesEvaluated": self.nodes_evaluated,
            "nodesFit": self.nodes_fit,
            "reasons": [
                {"reason": r.reason.value, "count": r.count, "have": r.have, "exhausted": r.exhausted}
                for r in self.reasons
            ],
            "fabricFit": dict(self.fabric_fit),
            "message": render_report(self),
        }


def report_for(
    demand: Demand,
    nodes_evaluated: int,
    counts: Mapping[tuple[Reason, int | None], int],
    nodes_fit: int = 0,
    fabric_fit: Mapping[str, int] | None = None,
) -> ProfileReport:
    """The report of one failed attempt to place ``demand``, from its counted reasons."""
    return ProfileReport(
        profile=demand.profile,
        device_class=demand.device_class,
        needed=demand.devices_per_node,
        nodes_needed=demand.nodes,
        nodes_evaluated=nodes_evaluated,
        nodes_fit=nodes_fit,
        reasons=sort_counts(counts),
        engine=f"{demand.engine.value}/{demand.variant.value}",
        fabric_fit=MappingProxyType(dict(fabric_fit or {})),
    )


def sort_counts(counts: Mapping[tuple[Reason, int | None], int]) -> tuple[ReasonCount, ...]:
    """Counts as ReasonCounts, largest first, then by reason and amount: a stable order."""
    items = [ReasonCount(r, n, h) for (r, h), n in counts.items() if n > 0]
    items.sort(key=lambda rc: (-rc.count, rc.reason.value, -1 if rc.have is None else rc.have))
    return tuple(items)


def _phrase(rc: ReasonCount, report: ProfileReport) -> str:
    cls = report.device_class or "cpu"
    match rc.reason:
        case Reason.NOT_READY:
            return "not ready"
        case Reason.CORDONED:
            return "cordoned"
        case Reason.NO_DEVICE_OF_CLASS:
            return f"no device of class {cls}"
        case Reason.TAINT_NOT_TOLERATED:
            return "in another driver's pool (taint not tolerated)"
        case Reason.ENGINE_NOT_INSTALLED:
            return f"without the {report.engine} engine build (not installed)"
        case Reason.DEVICE_MEMORY_TOO_SMALL:
            return f"{cls} memory too small for the model"
        case Reason.NO_FABRIC:
            return "attached to no fabric"
        case Reason.INSUFFICIENT_FREE_DEVICES:
            return f"have {rc.have} of {report.needed} devices free"
        case Reason.INSUFFICIENT_CPU:
            return "have too few free CPU cores"
        case Reason.INSUFFICIENT_MEMORY:
            return "too little free host memory"
        case Reason.FABRIC_TOO_SMALL:
            return f"fit alone but no fabric has {report.nodes_needed} such nodes"


def render_report(report: ProfileReport) -> str:
    """The one sentence for a report, e.g. ``profile p: 0/50 nodes fit: 48 cordoned, 2 ...``."""
    head = f"profile {report.profile}: {report.nodes_fit}/{report.nodes_evaluated} nodes fit"
    if report.nodes_needed > 1:
        head += f" (needs {report.nodes_needed} on one fabric)"
    if not report.reasons:
        return head
    parts = [f"{rc.count} {_phrase(rc, report)}" for rc in report.reasons]
    text = f"{head}: {', '.join(parts)}"
    if report.fabric_fit:
        per = ", ".join(f"{f} {n}" for f, n in sorted(report.fabric_fit.items()))
        text += f" [per fabric: {per}]"
    return text
