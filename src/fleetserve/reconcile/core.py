"""One reconcile cycle as a pure function: (deployments, snapshot, now) → a plan of changes.

- Replicas that run stay where they are; replicas on Lost nodes are released and replaced
  under new identities (their agent, when it returns, is told to stop them: fencing).
- Replicas that must stop — beyond the desired count (newest first), of a deployment that no
  longer exists, replaced by a rollout — drain first when they serve (``lifecycle``): out of the
  routes, then released once their in-flight requests are done or ``drainSeconds`` passed.
- Failed replicas count toward the desired number; after a backoff each is released and replaced.
- The multi-accelerator gate only sets conditions: a deployment that is not Accepted keeps
  every replica it has; only new placements are withheld.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from types import MappingProxyType

from fleetserve.placement.kept import KeptCapacity
from fleetserve.placement.placer import DeploymentDecision, Existing, Placer
from fleetserve.reconcile.lifecycle import FailureHistory, Lifecycle, plan_lifecycle, plan_orphans
from fleetserve.snapshot import ClusterSnapshot
from fleetserve.spec.resources import Deployment, Replica


def _no_lifecycles() -> Mapping[str, Lifecycle]:
    return MappingProxyType({})


@dataclass(frozen=True)
class ReconcilePlan:
    """What one cycle decided: replicas to allocate, to drain and to release, and every decision."""

    allocate: tuple[Replica, ...]
    release: tuple[str, ...]
    decisions: tuple[DeploymentDecision, ...]
    drain: tuple[str, ...] = ()
    # Per deployment: its lifecycle decision (failures, rollout progress) for its status.
    lifecycles: Mapping[str, Lifecycle] = field(default_factory=_no_lifecycles)

    @property
    def stamps(self) -> dict[str, tuple[str, ...]]:
        """Per revision, the kept replicas to stamp with it (placed before it counted the weights)."""
        return {
            life.progress.revision: life.stamp
            for life in self.lifecycles.values()
            if life.stamp and life.progress is not None
        }

    @property
    def changes(self) -> bool:
        return bool(self.allocate or self.release or self.drain or self.stamps)


def reconcile(
    deployments: Sequence[Deployment],
    snapshot: ClusterSnapshot,
    now: datetime | None = None,
    failures: Mapping[str, FailureHistory] | None = None,
) -> ReconcilePlan:
    """Decide one cycle. No I/O: the caller commits the plan (and rejects it if state moved).

    ``now`` times drains and failure backoffs (without it none ends); ``failures`` is each
    deployment's failure history from its status.
    """
    return decide(deployments, snapshot, Placer(snapshot), now, failures)


class Planner:
    """``reconcile``, cycle after cycle, with the free capacity kept between cycles
    (``placement.kept``): the same plan, without building the fleet's working state each time."""

    def __init__(self) -> None:
        self.capacity = KeptCapacity()

    def plan(
        self,
        deployments: Sequence[Deployment],
        snapshot: ClusterSnapshot,
        now: datetime | None = None,
        failures: Mapping[str, FailureHistory] | None = None,
    ) -> ReconcilePlan:
        """What ``reconcile`` decides for the same arguments."""
        return decide(deployments, snapshot, self.capacity.placer(snapshot), now, failures)


def decide(
    deployments: Sequence[Deployment],
    snapshot: ClusterSnapshot,
    placer: Placer,
    now: datetime | None = None,
    failures: Mapping[str, FailureHistory] | None = None,
) -> ReconcilePlan:
    """One cycle's plan, placing with ``placer`` (whose free capacity is ``snapshot``'s)."""
    wanted = frozenset(d.name for d in deployments)
    # Free what is going away first, so its capacity can serve this cycle's placements.
    drain, release = plan_orphans(snapshot, wanted, now)
    released = list(release)
    drains = list(drain)
    for name in released:
        placer.release(name)
    decisions: list[DeploymentDecision] = []
    lifecycles: dict[str, Lifecycle] = {}
    for dep in deployments:
        life = plan_lifecycle(dep, snapshot, (failures or {}).get(dep.name), now)
        lifecycles[dep.name] = life
        # Released replicas go before placement so their room is reusable (a failed replica's
        # replacement lands in the allocation it left).
        for name in life.release:
            placer.release(name)
            released.append(name)
        drains += life.drain
        names = frozenset(r.name for r in snapshot.replicas_of(dep.name))
        existing = Existing(names=names, kept=life.kept, lost=life.lost, surplus=life.surplus)
        decisions.append(placer.plan(dep, existing, life.place, life.conditions))
    allocate = tuple(p.replica for d in decisions for p in d.placed)
    return ReconcilePlan(
        allocate=allocate,
        release=tuple(released),
        decisions=tuple(decisions),
        drain=tuple(drains),
        lifecycles=MappingProxyType(lifecycles),
    )
