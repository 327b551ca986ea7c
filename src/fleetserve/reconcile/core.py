"""One reconcile cycle as a pure function: (deployments, snapshot) → a plan of changes.

- Replicas that run stay where they are; replicas on Lost nodes are released and replaced
  under new identities (their agent, when it returns, is told to stop them: fencing).
- Replicas beyond the desired count are stopped, newest first.
- Replicas of deployments that no longer exist are stopped.
- The multi-accelerator gate only sets conditions: a deployment that is not Accepted keeps
  every replica it has; only new placements are withheld.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from fleetserve.placement.placer import DeploymentDecision, Placer
from fleetserve.snapshot import ClusterSnapshot
from fleetserve.spec.resources import Deployment, Replica


@dataclass(frozen=True)
class ReconcilePlan:
    """What one cycle decided: replicas to allocate, replicas to release, and every decision."""

    allocate: tuple[Replica, ...]
    release: tuple[str, ...]
    decisions: tuple[DeploymentDecision, ...]

    @property
    def changes(self) -> bool:
        return bool(self.allocate or self.release)


def reconcile(deployments: Sequence[Deployment], snapshot: ClusterSnapshot) -> ReconcilePlan:
    """Decide one cycle. No I/O: the caller commits the plan (and rejects it if state moved)."""
    placer = Placer(snapshot)
    wanted = {d.name for d in deployments}
    release: list[str] = []
    # Free what is going away first, so its capacity can serve this cycle's placements.
    orphans = [r.name for r in snapshot.replicas if r.deployment not in wanted]
    decisions: list[DeploymentDecision] = []
    for name in orphans:
        placer.release(name)
        release.append(name)
    for dep in deployments:
        # Lost and surplus replicas go before placement so their room is reusable.
        pre = placer.preview(dep)
        for name in (*pre.lost, *pre.surplus):
            placer.release(name)
            release.append(name)
        decisions.append(placer.plan(dep))
    allocate = tuple(p.replica for d in decisions for p in d.placed)
    return ReconcilePlan(allocate=allocate, release=tuple(release), decisions=tuple(decisions))
