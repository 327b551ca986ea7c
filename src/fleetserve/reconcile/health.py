"""Node liveness from heartbeats: Ready, then NotReady after a deadline, then Lost after a longer one.

A pure function of (last heartbeat, now, policy): the caller passes the clock in.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from fleetserve.spec.resources import NodeState


@dataclass(frozen=True)
class DisruptionPolicy:
    """When the fleet's silence makes the control plane suspect itself (disruption mode: NotReady
    marked, nothing re-placed), and how fast Lost nodes' replicas are re-placed otherwise
    (``reconcile/disruption.py`` has the rules)."""

    unhealthy_share: float = 0.55  # of the fleet silent at once (Kubernetes' --unhealthy-zone-threshold)
    min_nodes: int = 3  # ... and at least this many nodes silent (Kubernetes' floor)
    replace_rate: float = 0.1  # nodes per second judged Lost outside the mode (--node-eviction-rate)

    def __post_init__(self) -> None:
        if not 0 < self.unhealthy_share <= 1:
            raise ValueError(f"unhealthy_share must be in (0, 1], not {self.unhealthy_share}")
        if self.min_nodes < 1:
            raise ValueError(f"min_nodes must be at least 1, not {self.min_nodes}")
        if self.replace_rate <= 0:
            raise ValueError(f"replace_rate must be positive, not {self.replace_rate}")


@dataclass(frozen=True)
class HeartbeatPolicy:
    """How long a node may stay silent before it is NotReady, and before it is Lost; and when the
    fleet's silence is the control plane's suspicion instead."""

    not_ready_after: timedelta = timedelta(seconds=40)
    lost_after: timedelta = timedelta(minutes=5)
    disruption: DisruptionPolicy = field(default_factory=DisruptionPolicy)

    def __post_init__(self) -> None:
        if self.lost_after <= self.not_ready_after:
            raise ValueError("lost_after must be longer than not_ready_after")


def classify(last_heartbeat: datetime, now: datetime, policy: HeartbeatPolicy) -> NodeState:
    """The state a node's silence since ``last_heartbeat`` puts it in."""
    silent = now - last_heartbeat
    if silent >= policy.lost_after:
        return NodeState.LOST
    if silent >= policy.not_ready_after:
        return NodeState.NOT_READY
    return NodeState.READY


SEVERITY = {NodeState.READY: 0, NodeState.NOT_READY: 1, NodeState.LOST: 2}
"""How far from serving each node state is: a state only moves up by silence."""


def least_healthy(states: Iterable[NodeState]) -> NodeState:
    """The worst of ``states`` (Lost over NotReady over Ready); Ready when there are none."""
    return max(states, key=SEVERITY.__getitem__, default=NodeState.READY)


@dataclass(frozen=True)
class Transition:
    """A node whose state changes in this cycle; ``heard`` the last heartbeat its judgement saw
    (the store leaves a node heard since as it is: ``mark_silent``); not part of its identity."""

    node: str
    old: NodeState
    new: NodeState
    heard: datetime | None = field(default=None, compare=False)


def transitions(
    nodes: Iterable[tuple[str, NodeState, datetime | None]], now: datetime, policy: HeartbeatPolicy
) -> list[Transition]:
    """Every node whose heartbeat age moves it to another state.

    Only silence is judged here: a NotReady node comes back to Ready through its agent's
    registration (which bumps its epoch), not through this function, so a heartbeat from a
    fenced agent cannot revive the node on its own.
    """
    out = []
    for name, state, last in nodes:
        if last is None:
            # Declared by an operator and never run by an agent: there is no heartbeat to miss,
            # so the declared state stands until an agent registers the node.
            continue
        new = classify(last, now, policy)
        # Silence only ever worsens a state: Ready → NotReady/Lost, NotReady → Lost.
        if SEVERITY[new] > SEVERITY[state]:
            out.append(Transition(name, state, new, last))
    return out
