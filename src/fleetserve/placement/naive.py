"""The full-scan search: every filter on every node, every decision.

It is the reference the indexed search must agree with (same choice, same explanation) and the
baseline the placement benchmark measures against.
"""

from __future__ import annotations

from collections import Counter

from fleetserve.placement.choose import (
    Found,
    cpu_key,
    emptiest_key,
    found_group,
    found_single,
    gpu_key,
    group_score,
)
from fleetserve.placement.demand import Demand
from fleetserve.placement.filters import first_failure
from fleetserve.placement.report import ProfileReport, Reason, report_for
from fleetserve.placement.state import NodeWork, WorkingState
from fleetserve.spec.resources import Replica


class NaiveSearch:
    """Finds a place for a demand by scanning every node through the filter chain."""

    def __init__(self, state: WorkingState) -> None:
        self.state = state

    def commit(self, replica: Replica) -> None:
        """Allocate a replica found by ``find``."""
        self.state.allocate(replica)

    def release(self, name: str) -> None:
        """Give back a replica's every shard."""
        self.state.release(name)

    def find(self, demand: Demand) -> Found | ProfileReport:
        """Where ``demand`` fits, or a report of why no node does."""
        counts: Counter[tuple[Reason, int | None]] = Counter()
        fit: list[NodeWork] = []
        for node in self.state.nodes:
            rejection = first_failure(node, demand)
            if rejection is None:
                fit.append(node)
            else:
                counts[rejection] += 1
        if demand.nodes == 1:
            if fit:
                key = cpu_key if demand.device_class is None else gpu_key
                return found_single(min(fit, key=lambda n: key(n, demand)), demand)
            return self._report(demand, counts, 0, {})
        per_fabric: dict[str, list[NodeWork]] = {}
        for node in fit:
            for fabric in node.fabrics:
                per_fabric.setdefault(fabric, []).append(node)
        best: tuple[tuple[int, str], list[NodeWork], str] | None = None
        for fabric, members in per_fabric.items():
            if len(members) < demand.nodes:
                continue
            chosen = sorted(members, key=lambda n: emptiest_key(n, demand))[: demand.nodes]
            score = group_score(chosen, demand, fabric)
            if best is None or score < best[0]:
                best = (score, chosen, fabric)
        if best is not None:
            return found_group(best[1], demand, best[2])
        if fit:
            counts[(Reason.FABRIC_TOO_SMALL, None)] += len(fit)
        fabric_fit = {f: len(m) for f, m in per_fabric.items()}
        return self._report(demand, counts, len(fit), fabric_fit)

    def _report(
        self,
        demand: Demand,
        counts: Counter[tuple[Reason, int | None]],
        n_fit: int,
        fabric_fit: dict[str, int],
    ) -> ProfileReport:
        return report_for(demand, len(self.state.nodes), counts, n_fit, fabric_fit)
