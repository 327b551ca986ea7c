"""Placement decisions for deployments: a pure function of (deployments, snapshot).

For each deployment: the gate decides which profiles may be used; replicas that already run
stay where they are; replicas on Lost nodes are replaced under new names (a replica never runs
twice under one identity); missing replicas are placed one at a time, each trying profiles in
priority order — the highest that fits wins — and every profile that did not fit says why.
No I/O, no clock, no randomness: the same inputs give the same decision.
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol

from fleetserve.conditions import Condition, ConditionReason, ConditionType
from fleetserve.drivers import Driver
from fleetserve.engines.registry import formats_text
from fleetserve.modelfacts import ModelFacts
from fleetserve.placement.choose import Found
from fleetserve.placement.demand import Demand, demand_for
from fleetserve.placement.index import IndexedSearch
from fleetserve.placement.naive import NaiveSearch
from fleetserve.placement.report import ProfileReport, render_report
from fleetserve.placement.state import WorkingState
from fleetserve.snapshot import ClusterSnapshot
from fleetserve.spec.resources import Deployment, Replica, ReplicaState
from fleetserve.validation import ResolvedProfile, gate

# Unplaced replicas a stored decision explains one by one; the rest are counted (``to_record``).
RECORDED_UNPLACED = 20


class Search(Protocol):
    """A strategy that finds where a demand fits and keeps its view of free capacity current."""

    def find(self, demand: Demand) -> Found | ProfileReport: ...
    def commit(self, replica: Replica) -> None: ...
    def release(self, name: str) -> None: ...


class SearchKind(StrEnum):
    """Which search a Placer uses: the indexed one, or the full-scan baseline."""

    INDEXED = "indexed"
    NAIVE = "naive"


@dataclass(frozen=True)
class Existing:
    """A deployment's replicas before this cycle places anything."""

    names: frozenset[str]
    kept: tuple[str, ...]
    lost: tuple[str, ...]
    surplus: tuple[str, ...]


@dataclass(frozen=True)
class Placement:
    """A new replica and why it went there: its scores, and the profiles tried before it."""

    replica: Replica
    scores: Mapping[str, float]
    skipped: tuple[ProfileReport, ...] = ()


@dataclass(frozen=True, slots=True)
class Unplaced:
    """A replica that fits nowhere, with every profile's explanation."""

    name: str
    reports: tuple[ProfileReport, ...]


@dataclass(frozen=True)
class DeploymentDecision:
    """Everything placement decided for one deployment in one cycle."""

    deployment: str
    desired: int
    accepted: Condition
    kept: tuple[str, ...] = ()
    placed: tuple[Placement, ...] = ()
    unplaced: tuple[Unplaced, ...] = ()
    lost: tuple[str, ...] = ()  # replicas on Lost nodes, replaced by new identities
    surplus: tuple[str, ...] = ()  # running replicas beyond the desired count, to stop
    conditions: tuple[Condition, ...] = field(default=())

    @property
    def schedulable(self) -> bool:
        return not self.unplaced

    def conditions_data(self) -> list[dict[str, Any]]:
        """The conditions (Accepted first) as plain data, as ``to_dict`` has them."""
        return [
            {"type": c.type.value, "status": c.status, "reason": c.reason.value, "message": c.message}
            for c in (self.accepted, *self.conditions)
        ]

    def _placed_data(self) -> list[dict[str, Any]]:
        return [
            {
                "replica": p.replica.name,
                "profile": p.replica.profile,
                "deviceClass": p.replica.device_class,
                "fabric": p.replica.fabric,
                "shards": [s.model_dump(by_alias=True) for s in p.replica.shards],
                "scores": dict(p.scores),
                "skipped": [r.to_dict() for r in p.skipped],
            }
            for p in self.placed
        ]

    def to_dict(self) -> dict[str, Any]:
        """Plain data for JSON output (every unplaced replica)."""
        explain = _Explainer()
        return {
            "deployment": self.deployment,
            "desired": self.desired,
            "conditions": self.conditions_data(),
            "kept": list(self.kept),
            "lost": list(self.lost),
            "surplus": list(self.surplus),
            "placed": self._placed_data(),
            "unplaced": [{"replica": u.name, "reports": explain(u.reports)} for u in self.unplaced],
        }

    def to_record(self) -> dict[str, Any]:
        """``to_dict`` as the decision log stores it: the first ``RECORDED_UNPLACED`` unplaced
        replicas with their explanations and ``unplacedTotal``, the count of all of them. At a
        large fleet a deployment's replicas beyond what fits number thousands, nearly all with one
        explanation; storing each made a record megabytes, written again at each new condition."""
        data = self.to_dict()
        data["unplaced"] = data["unplaced"][:RECORDED_UNPLACED]
        data["unplacedTotal"] = len(self.unplaced)
        return data

    def outcome(self) -> dict[str, Any]:
        """What ``to_dict`` says of conditions, placements, unplaced replicas, lost and surplus,
        in a form equal for two decisions exactly when those parts of their ``to_dict`` are —
        without one dict per unplaced replica (tens of thousands at a large fleet, every cycle):
        the unplaced names, and the runs of names that share one explanation."""
        explain = _Explainer()
        runs: list[tuple[int, list[dict[str, Any]]]] = []
        for i, u in enumerate(self.unplaced):
            rendered = explain(u.reports)
            if not runs or runs[-1][1] != rendered:
                runs.append((i, rendered))
        return {
            "conditions": self.conditions_data(),
            "placed": self._placed_data(),
            "unplaced": (tuple(u.name for u in self.unplaced), runs),
            "lost": list(self.lost),
            "surplus": list(self.surplus),
        }


class _Explainer:
    """Renders explanations, each shared one once: replicas beyond what fits share one (``plan``)."""

    def __init__(self) -> None:
        self._done: dict[int, tuple[tuple[ProfileReport, ...], list[dict[str, Any]]]] = {}

    def __call__(self, reports: tuple[ProfileReport, ...]) -> list[dict[str, Any]]:
        hit = self._done.get(id(reports))
        if hit is None:
            # The reports are kept beside their rendering, so their id is never reused meanwhile.
            hit = self._done[id(reports)] = (reports, [r.to_dict() for r in reports])
        return hit[1]


def _unplaced_message(unplaced: Unplaced) -> str:
    if not unplaced.reports:
        return "no profile may be used: see the Accepted condition"
    return "; ".join(render_report(r) for r in unplaced.reports)


def _ordinal_names(dep: str, taken: Sequence[Container[str]], start: int) -> Iterator[str]:
    """``dep-N`` for N from ``start`` on, skipping names in any of ``taken`` (looked up live, not
    copied: a copy of every allocated name per deployment was a fleet-sized set each time)."""
    i = start
    while True:
        name = f"{dep}-{i}"
        if not any(name in names for names in taken):
            yield name
        i += 1


class Placer:
    """Places deployments against one snapshot, keeping free capacity current across them."""

    def __init__(
        self,
        snapshot: ClusterSnapshot,
        search: SearchKind = SearchKind.INDEXED,
        kept: tuple[WorkingState, IndexedSearch] | None = None,
        served: frozenset[Driver] | None = None,
    ) -> None:
        """``kept``: a working state and its index already equal to ``snapshot``'s free capacity
        (``kept.KeptCapacity``), used and changed in place of building them; ``served``: the
        snapshot's ``served_drivers()``, when the caller knows them."""
        self.snapshot = snapshot
        self.state: WorkingState
        self.search: Search
        if kept is not None:
            self.state, self.search = kept
        else:
            self.state = WorkingState(snapshot)
            self.search = (
                IndexedSearch(self.state) if search is SearchKind.INDEXED else NaiveSearch(self.state)
            )
        self._served = snapshot.served_drivers() if served is None else served

    def place_one(
        self, name: str, deployment: str, demands: Iterable[Demand], revision: str | None = None
    ) -> Placement | Unplaced:
        """Place one replica: the first demand (profile) that fits wins; commit it."""
        reports: list[ProfileReport] = []
        for demand in demands:
            found = self.search.find(demand)
            if isinstance(found, ProfileReport):
                reports.append(found)
                continue
            replica = Replica(
                name=name,
                deployment=deployment,
                profile=demand.profile,
                device_class=demand.device_class,
                shards=found.shards,
                state=ReplicaState.PENDING,
                fabric=found.fabric,
                revision=revision,
            )
            self.search.commit(replica)
            return Placement(replica, found.scores, tuple(reports))
        return Unplaced(name, tuple(reports))

    def _draft_facts(self, profile: ResolvedProfile) -> ModelFacts | None:
        """The facts of the weights of ``profile``'s draft model its engine serves; None where
        the draft is not in the snapshot or its engine loads none of its formats."""
        facts = self.snapshot.models.get(profile.draft or "")
        return facts.for_engine(profile.engine) if facts is not None else None

    def _is_lost(self, replica: Replica) -> bool:
        return self.snapshot.on_lost_node(replica)

    def preview(self, dep: Deployment) -> Existing:
        """How a deployment's existing replicas stand: kept, on Lost nodes, or surplus."""
        existing = list(self.snapshot.replicas_of(dep.name))
        lost = tuple(r.name for r in existing if self._is_lost(r))
        alive = [r for r in existing if r.name not in lost and r.state is not ReplicaState.FAILED]
        # Keep the lowest ordinals; stop the rest (a scale-down removes the newest).
        alive.sort(key=lambda r: (len(r.name), r.name))
        desired = dep.desired_replicas
        return Existing(
            names=frozenset(r.name for r in existing),
            kept=tuple(r.name for r in alive[:desired]),
            lost=lost,
            surplus=tuple(r.name for r in alive[desired:]),
        )

    def release(self, name: str) -> None:
        """Give a replica's capacity back within this cycle (a scale-down, a stop, a lost node).

        A replica this cycle never allocated (its devices were already taken) has nothing to give.
        """
        if name in self.state.replicas:
            self.search.release(name)

    def plan(
        self,
        dep: Deployment,
        existing: Existing | None = None,
        place: int | None = None,
        conditions: tuple[Condition, ...] = (),
    ) -> DeploymentDecision:
        """Decide placement for one deployment against the capacity left in this cycle.

        The reconciler's lifecycle passes which replicas stay (``existing``), how many to add
        (``place``) and its conditions; without them, replicas that run stay and the missing ones
        are placed.
        """
        result = gate(dep, self.snapshot.classes, self._served)
        pre = existing or self.preview(dep)
        desired = dep.desired_replicas
        kept, lost, surplus = pre.kept, pre.lost, pre.surplus
        missing = desired - len(kept) if place is None else place
        facts = self.snapshot.models.get(dep.model)
        extra: list[Condition] = []
        if facts is None:
            extra.append(
                Condition(
                    ConditionType.MODEL_KNOWN,
                    False,
                    ConditionReason.UNKNOWN_MODEL,
                    f"model {dep.model} is not defined or its size is unknown",
                )
            )
        placed: list[Placement] = []
        unplaced: list[Unplaced] = []
        # Each profile measures the weights its engine serves (a model's alternate, maybe).
        served = {p.name: facts.for_engine(p.engine) for p in result.usable} if facts is not None else {}
        unloadable = [p for p in result.usable if p.name in served and served[p.name] is None]
        if unloadable:
            extra.append(
                Condition(
                    ConditionType.MODEL_KNOWN,
                    False,
                    ConditionReason.NO_LOADABLE_WEIGHTS,
                    "; ".join(
                        f"profile {p.name}: engine {p.engine.value} loads none of model {dep.model}'s "
                        f"formats; add an alternate of format {formats_text(p.engine)} to model {dep.model}"
                        for p in unloadable
                    ),
                )
            )
        # A speculative profile's draft, measured as its engine serves it (None: not measurable).
        drafts = {p.name: self._draft_facts(p) for p in result.usable if p.draft is not None}
        undrafted = [p for p in result.usable if p.name in drafts and drafts[p.name] is None]
        if undrafted:
            extra.append(
                Condition(
                    ConditionType.MODEL_KNOWN,
                    False,
                    ConditionReason.UNKNOWN_MODEL,
                    "; ".join(
                        f"profile {p.name}: draft model {p.draft} is not defined, its size is unknown "
                        f"or engine {p.engine.value} loads none of its formats"
                        for p in undrafted
                    ),
                )
            )
        # The deployment's LoRA adapters, loaded by every replica: their bytes join its memory.
        adapters = [self.snapshot.models.get(a) for a in dep.adapters]
        unmeasured = [a for a, f in zip(dep.adapters, adapters, strict=True) if f is None]
        if unmeasured:
            extra.append(
                Condition(
                    ConditionType.MODEL_KNOWN,
                    False,
                    ConditionReason.UNKNOWN_MODEL,
                    f"adapters {', '.join(unmeasured)}: not defined, or their size is unknown",
                )
            )
        adapter_bytes = sum(f.weight_bytes for f in adapters if f is not None)
        if missing > 0:
            demands = [
                demand_for(
                    p,
                    weights,
                    self.snapshot.classes.get(p.device_class or ""),
                    drafts.get(p.name),
                    adapter_bytes,
                )
                for p in result.usable
                if (weights := served.get(p.name)) is not None and p not in undrafted and not unmeasured
            ]
            names = _ordinal_names(
                dep.name,
                (pre.names, self.state.replicas),
                self.snapshot.next_ordinals.get(dep.name, 0),
            )
            failed: Unplaced | None = None
            for _ in range(missing):
                name = next(names)
                if failed is not None:
                    # Nothing was taken since the last replica failed: the search would see the same
                    # state and explain the same way, so every later replica gets that explanation
                    # (at a large fleet, thousands of searches a cycle saved).
                    unplaced.append(Unplaced(name, failed.reports))
                    continue
                outcome = self.place_one(name, dep.name, demands, self.snapshot.revision_of(dep))
                if isinstance(outcome, Placement):
                    placed.append(outcome)
                else:
                    unplaced.append(outcome)
                    failed = outcome
        ok = not unplaced
        extra.append(
            Condition(
                ConditionType.SCHEDULED,
                ok,
                ConditionReason.PLACED if ok else ConditionReason.UNSCHEDULABLE,
                f"{len(kept) + len(placed)}/{desired} replicas placed"
                if ok
                else _unplaced_message(unplaced[0]),
            )
        )
        return DeploymentDecision(
            deployment=dep.name,
            desired=desired,
            accepted=result.accepted,
            kept=kept,
            placed=tuple(placed),
            unplaced=tuple(unplaced),
            lost=lost,
            surplus=surplus,
            conditions=(*extra, *conditions),
        )


def plan(
    deployments: Iterable[Deployment],
    snapshot: ClusterSnapshot,
    search: SearchKind = SearchKind.INDEXED,
) -> list[DeploymentDecision]:
    """Place every deployment, in order, against one snapshot."""
    placer = Placer(snapshot, search)
    return [placer.plan(d) for d in deployments]
