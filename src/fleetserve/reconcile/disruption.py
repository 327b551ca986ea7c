"""The fleet's liveness judged as a whole, each cycle: which nodes go NotReady or Lost, whether the
control plane should suspect itself instead (disruption mode), and how fast Lost nodes' replicas
may be re-placed. Pure: the reconciler passes the heartbeats, the wall clock and its own monotonic
tick in, and keeps the ``Liveness`` this returns for the next cycle.

The rules, after Kubernetes' node lifecycle controller (``--unhealthy-zone-threshold``,
``--node-eviction-rate``; fleetserve has one zone, the fleet):

- **Counted from arrival.** A node's silence runs from its last heartbeat's *arrival* (stamped
  when the request reached the server, not when its write ran) or from the end of the server's
  last stall, whichever is later (``grace_from``).
- **The server's own stall.** When more than the NotReady deadline (and at least two loop
  intervals) passed between two of the loop's cycles on its monotonic clock, the server itself was
  not running — stopped (SIGSTOP), starved, or suspended — and heartbeats sent meanwhile could not
  arrive. Nobody is judged on that time: every node's grace restarts at the end of the gap, as
  Kubernetes restarts it when its controller starts. (A shorter stall may still cost a node whose
  beat was due in it a NotReady mark, never more: its next heartbeat makes it Ready, and a mass
  of them is disruption mode.)
- **Disruption mode.** The fleet is every node an agent has run on that is not Lost. When at least
  ``unhealthy_share`` of it (default 0.55) is silent past the NotReady deadline, and at least
  ``min_nodes`` nodes (default 3, Kubernetes' floor), the fault is more likely the control
  plane's or the network's than the nodes': nodes are still marked NotReady (out of the routes),
  but none is judged Lost, so no replica is re-placed, and a NotReady node's next heartbeat makes
  it Ready again without registering anew (``store/acceptance.py``). The mode ends when the share
  falls below the threshold; then every node's grace restarts (judgement resumes counting from
  there, as Kubernetes does leaving its disruption mode), so the stragglers of a recovery are not
  all judged Lost at once.
- **Rate-limited re-placement.** Outside the mode, nodes are judged Lost (their replicas released
  and placed elsewhere) at most ``replace_rate`` per second: a token bucket refilled by the wall
  clock, holding one node or one elapsed interval's worth, whichever is more. The longest silent
  go first; the others stay NotReady until a token is theirs.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime

from pydantic import BaseModel, ConfigDict, Field

from fleetserve.reconcile.health import SEVERITY, HeartbeatPolicy, Transition, classify
from fleetserve.spec.resources import NodeState


@dataclass(frozen=True)
class Liveness:
    """What one cycle's judgement leaves for the next: the loop's last tick (monotonic seconds),
    since when silence counts for everyone (None: since each node's last heartbeat), since when
    disruption mode holds (None: off), and the re-placement bucket (tokens, refilled at)."""

    tick: float | None = None
    grace_from: datetime | None = None
    disrupted_since: datetime | None = None
    tokens: float = 1.0
    refilled: datetime | None = None


class Disruption(BaseModel):
    """Disruption mode as it holds: ``silent`` of ``fleet`` nodes silent, the mode on since
    ``since``. A typed value: a reconciler in a process of its own sends it to the server's, and the
    admin API serves it (``GET /api/v1/fleet``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    silent: int = Field(ge=0)
    fleet: int = Field(ge=0)
    since: datetime

    def message(self) -> str:
        """The condition's sentence, as ``fleetserve get nodes`` shows it."""
        return (
            f"{self.silent} of {self.fleet} nodes silent since {self.since.isoformat(timespec='seconds')}; "
            "not re-placing"
        )


@dataclass(frozen=True)
class FleetJudgement:
    """One cycle's judgement: the nodes whose state changes, those past the Lost deadline but not
    judged Lost (``held``: disruption mode or the rate limit), the mode, the stall this cycle found
    (seconds; None: none), and the state for the next cycle."""

    transitions: tuple[Transition, ...]
    held: tuple[str, ...]
    disruption: Disruption | None
    stalled: float | None
    liveness: Liveness = field(default_factory=Liveness)


def stall_after(policy: HeartbeatPolicy, interval: float) -> float:
    """The longest gap (seconds) between two of the loop's cycles that is not a stall of the
    server's own: the NotReady deadline, and at least two loop intervals."""
    return max(policy.not_ready_after.total_seconds(), 2 * interval)


def judge(
    nodes: Iterable[tuple[str, NodeState, datetime | None]],
    now: datetime,
    tick: float,
    policy: HeartbeatPolicy,
    before: Liveness,
    interval: float = 0.0,
) -> FleetJudgement:
    """The fleet's liveness at ``now`` (wall clock) and ``tick`` (the loop's monotonic clock):
    ``nodes`` as (name, stored state, last heartbeat's arrival or None), ``before`` what the
    previous cycle left, ``interval`` the loop's pause between cycles."""
    rules = policy.disruption
    heard = [(name, state, last) for name, state, last in nodes if last is not None]
    grace_from = before.grace_from
    stalled = None
    if before.tick is not None and tick - before.tick > stall_after(policy, interval):
        stalled = tick - before.tick
        grace_from = now
    judged = _by_silence(heard, now, policy, grace_from)
    fleet = [j for j in judged if j.state is not NodeState.LOST]
    silent = sum(1 for j in fleet if j.silent)
    disrupted = silent >= rules.min_nodes and silent / max(1, len(fleet)) >= rules.unhealthy_share
    since = before.disrupted_since
    if disrupted:
        since = since or now
    elif since is not None:
        since = None
        grace_from = now  # leaving the mode: judgement resumes, counted from here
        judged = _by_silence(heard, now, policy, grace_from)
    # The bucket, refilled by the wall clock since the last refill.
    tokens = before.tokens
    if before.refilled is not None:
        earned = rules.replace_rate * max(0.0, (now - before.refilled).total_seconds())
        tokens = min(max(1.0, earned), tokens + earned)
    out: list[Transition] = []
    held: list[str] = []
    # The longest silent first: they are the likeliest gone for good.
    for j in sorted(judged, key=lambda j: (j.counted, j.name)):
        new = j.by_silence
        if new is NodeState.LOST and j.state is not NodeState.LOST:
            if not disrupted and tokens >= 1.0:
                tokens -= 1.0
            else:
                held.append(j.name)
                new = NodeState.NOT_READY
        # Silence only ever worsens a state: Ready → NotReady/Lost, NotReady → Lost.
        if SEVERITY[new] > SEVERITY[j.state]:
            out.append(Transition(j.name, j.state, new, j.heard))
    mode = Disruption(silent=silent, fleet=len(fleet), since=since) if since is not None else None
    return FleetJudgement(
        tuple(sorted(out, key=lambda t: t.node)),
        tuple(sorted(held)),
        mode,
        stalled,
        Liveness(tick, grace_from, since, tokens, now),
    )


@dataclass(frozen=True)
class _Judged:
    """One heard node: its stored state, the state its silence alone says, and since when that
    silence is counted."""

    name: str
    state: NodeState
    by_silence: NodeState
    counted: datetime
    heard: datetime

    @property
    def silent(self) -> bool:
        """Past the NotReady deadline, by its stored state or by its silence now."""
        return self.state is not NodeState.READY or self.by_silence is not NodeState.READY


def _by_silence(
    heard: list[tuple[str, NodeState, datetime]],
    now: datetime,
    policy: HeartbeatPolicy,
    grace_from: datetime | None,
) -> list[_Judged]:
    out = []
    for name, state, last in heard:
        counted = last if grace_from is None or last >= grace_from else grace_from
        out.append(_Judged(name, state, classify(counted, now, policy), counted, last))
    return out
