"""The autoscaler's pure core: (policy, signals, previous state, now) → a decision with its reason.

Rules, in the order ``decide`` applies them:

- **From zero.** A deployment at zero replicas goes up as soon as the gateway holds a request:
  to one replica, or to as many as the held load needs when a burst arrives at once.
- **No fresh metrics.** When Ready replicas report nothing, the count holds: missing data never
  scales down. When only some report, the load is what they report (a replica that has not
  reported yet counts as idle), which may scale up but never down.
- **Idle.** With ``replicas.min == 0``, no load and no request for ``scale_to_zero_after_seconds``,
  the deployment goes to zero.
- **Up, fast.** The load needs ``ceil(load / target)`` replicas (``load`` is the sum of the
  policy's metric over the replicas plus the requests held at the gateway). When that exceeds the
  current count the count goes there at once (after ``scale_up_stabilization_seconds``, 0 by
  default).
- **Down, slowly.** Scaling down waits until the load has needed fewer replicas continuously for
  ``scale_down_cooldown_seconds``, then goes straight to the largest count the load needed at any
  time during that window (Kubernetes' HPA takes the same "highest recommendation in the window"):
  no step-by-step crawl after a long quiet period, yet a brief dip inside the window cannot shrink
  the deployment below what its busiest moment needed. The load rule never goes below one
  replica; only the idle rule reaches zero.
- **Bounds.** The result is always clamped to ``[min, max]``; a clamp that bites is the reason.

Because a scale-up resets the cooldown and a scale-down restarts it, a scale-down always comes at
least one cooldown after the previous change: flapping load cannot make the count oscillate faster.

No I/O, no clock: ``now`` is passed in. Decisions are data; ``render_decision`` alone turns one
into a sentence.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any

from fleetserve.spec.policies import AutoscalePolicy, LoadMetric, ReplicaRange
from fleetserve.spec.resources import Deployment, Replica, ReplicaState

# ``ceil(load / target)`` is capped here before rounding so absurd loads stay integers; the clamp
# to ``replicas.max`` follows anyway.
_WANTED_CAP = 1e9


class ScaleReason(StrEnum):
    """Why the autoscaler chose its count this cycle."""

    BELOW_MIN = "BelowMin"
    ABOVE_MAX = "AboveMax"
    LOAD_ABOVE_TARGET = "LoadAboveTarget"
    LOAD_BELOW_TARGET_AFTER_COOLDOWN = "LoadBelowTargetAfterCooldown"
    IDLE = "Idle"  # → scale to zero
    HELD_REQUEST = "HeldRequest"  # → scale from zero
    STEADY = "Steady"
    NO_FRESH_METRICS = "NoFreshMetrics"


class Timer(StrEnum):
    """Which timed rule a decision's ``waited`` / ``wait`` seconds belong to."""

    UP_STABILIZATION = "UpStabilization"
    DOWN_COOLDOWN = "DownCooldown"
    IDLE = "Idle"


def load_of(metric: LoadMetric, running: float, waiting: float) -> float:
    """One replica's load as the policy counts it; callers build ``Signals`` values with this."""
    if metric == "in_flight":
        return running
    if metric == "waiting":
        return waiting
    return running + waiting


@dataclass(frozen=True)
class Signals:
    """What the autoscaler sees of one deployment this cycle.

    ``outstanding_per_replica`` holds one fresh value of the policy's metric per reporting replica
    (stale scrapes left out); ``gateway_waiting`` counts requests the gateway holds for the
    deployment (queued, or held while it is scaled to zero); ``last_request_at`` is when the gateway
    last received a request for it, if ever.
    """

    deployment: str
    replicas_ready: int
    replicas_total: int
    outstanding_per_replica: tuple[float, ...] = ()
    gateway_waiting: int = 0
    last_request_at: float | None = None


@dataclass(frozen=True)
class SignalsQuery:
    """What the reconciler asks of the process that sees the traffic, to build one deployment's
    ``Signals``: the policy's metric, the names of its Running replicas, how many it has in all, and
    ``now`` (monotonic seconds: one clock for every process of the machine)."""

    deployment: str
    metric: LoadMetric
    ready: tuple[str, ...]
    total: int
    now: float

    @classmethod
    def of(cls, dep: Deployment, replicas: list[Replica], now: float) -> SignalsQuery:
        """What the autoscaler asks about ``dep``, given its replicas."""
        policy = dep.autoscale or AutoscalePolicy()
        ready = tuple(r.name for r in replicas if r.state is ReplicaState.RUNNING)
        return cls(dep.name, policy.metric, ready, len(replicas), now)


@dataclass(frozen=True)
class AutoscaleState:
    """What the autoscaler remembers of one deployment between cycles."""

    desired: int
    last_scale_up_at: float | None = None
    last_scale_down_at: float | None = None
    # Since when the load has continuously needed fewer replicas than ``desired``, and the most it
    # needed in that time (the count a scale-down goes to).
    below_target_since: float | None = None
    below_target_peak: int = 0
    # Since when the load has continuously needed more (for the scale-up stabilization).
    above_target_since: float | None = None
    # When the autoscaler first saw the deployment: idle time counts from here until a request.
    observed_since: float | None = None


@dataclass(frozen=True)
class Decision:
    """One cycle's answer for one deployment: the count, why, and the numbers behind it."""

    deployment: str
    at: float
    previous: int
    desired: int
    reason: ScaleReason
    state: AutoscaleState
    # The load (policy metric plus gateway-held requests) and the replicas it needs at the target.
    load: float
    wanted: int
    target: float
    ready: int
    reported: int
    bounds: tuple[int, int]
    # A timed rule that is still waiting or just fired: which, seconds waited, seconds required.
    timer: Timer | None = None
    waited: float | None = None
    wait: float | None = None

    @property
    def changed(self) -> bool:
        return self.desired != self.previous

    @property
    def detail(self) -> str:
        return render_decision(self)

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready view for logs and ``fleetserve describe``."""
        return {
            "deployment": self.deployment,
            "at": self.at,
            "previous": self.previous,
            "desired": self.desired,
            "changed": self.changed,
            "reason": self.reason.value,
            "load": self.load,
            "wanted": self.wanted,
            "ready": self.ready,
            "reported": self.reported,
            "bounds": list(self.bounds),
            "timer": None if self.timer is None else self.timer.value,
            "waited": self.waited,
            "detail": self.detail,
        }


def _seconds(value: float) -> str:
    return f"{value:.0f}s" if value >= 1 or value == 0 else f"{value:.1f}s"


def _replicas(n: int) -> str:
    return f"{n} replica" if n == 1 else f"{n} replicas"


def _load_clause(d: Decision) -> str:
    return f"load {d.load:g} at target {d.target:g} per replica needs {_replicas(d.wanted)}"


def render_decision(d: Decision) -> str:
    """The one sentence that explains a decision; tests compare reasons and numbers, not this."""
    move = f"{d.previous} → {d.desired}" if d.changed else f"stays at {d.desired}"
    low, high = d.bounds
    match d.reason:
        case ScaleReason.BELOW_MIN:
            why = f"raised to replicas.min {low} ({_load_clause(d)})"
        case ScaleReason.ABOVE_MAX:
            why = f"capped at replicas.max {high} ({_load_clause(d)})"
        case ScaleReason.LOAD_ABOVE_TARGET:
            why = _load_clause(d)
        case ScaleReason.LOAD_BELOW_TARGET_AFTER_COOLDOWN:
            why = (
                f"the load needed at most {_replicas(d.desired)} for {_seconds(d.waited or 0)} "
                f"(cooldown {_seconds(d.wait or 0)}); now {_load_clause(d)}"
            )
        case ScaleReason.IDLE:
            why = f"no request for {_seconds(d.waited or 0)} (scale to zero after {_seconds(d.wait or 0)})"
        case ScaleReason.HELD_REQUEST:
            why = f"the gateway holds requests ({_load_clause(d)})"
        case ScaleReason.NO_FRESH_METRICS:
            why = (
                f"only {d.reported} of {d.ready} Ready replicas reported fresh metrics; "
                "never scaling down on missing data"
            )
        case ScaleReason.STEADY:
            waited, wait = _seconds(d.waited or 0), _seconds(d.wait or 0)
            if d.previous == 0:
                why = "scaled to zero and no request is held"
            elif d.timer is Timer.UP_STABILIZATION:
                why = f"{_load_clause(d)}, above target for {waited} of the {wait} scale-up stabilization"
            elif d.timer is Timer.DOWN_COOLDOWN:
                why = f"{_load_clause(d)}, below for {waited} of the {wait} cooldown"
            elif d.timer is Timer.IDLE:
                why = f"no request for {waited} of the {wait} before scaling to zero"
            else:
                why = _load_clause(d)
    return f"{d.deployment}: {move}: {why}"


def _wanted(load: float, target: float) -> int:
    """Replicas that serve ``load`` at ``target`` each; rounding noise (8.000000001/4) is ignored."""
    ratio = min(load / target, _WANTED_CAP)
    return math.ceil(round(ratio, 9))


def _clamp(value: int, bounds: ReplicaRange) -> int:
    return max(bounds.min, min(bounds.max, value))


def _fresh(values: tuple[float, ...]) -> tuple[float, ...]:
    """Values that are real loads; NaN, infinities and negatives count as not reported."""
    return tuple(v for v in values if math.isfinite(v) and v >= 0)


@dataclass(frozen=True)
class _Proposal:
    """The rules' answer before clamping: the count, the reason, the timers' progress, the state."""

    desired: int
    reason: ScaleReason
    state: AutoscaleState
    timer: Timer | None = None
    waited: float | None = None
    wait: float | None = None


def _quiet(state: AutoscaleState) -> AutoscaleState:
    """The state with both load timers stopped."""
    return replace(state, below_target_since=None, below_target_peak=0, above_target_since=None)


def decide(
    deployment_name: str,
    bounds: ReplicaRange,
    policy: AutoscalePolicy,
    signals: Signals,
    state: AutoscaleState | None,
    now: float,
) -> Decision:
    """Decide the replica count for one deployment this cycle.

    ``bounds`` is the deployment's ``replicas: {min, max}``; ``state`` is the previous decision's
    state (None on the first cycle, when the current count is ``signals.replicas_total``).
    """
    if signals.deployment != deployment_name:
        raise ValueError(f"signals are for {signals.deployment!r}, not {deployment_name!r}")
    if state is None:
        state = AutoscaleState(desired=signals.replicas_total, observed_since=now)
    elif state.observed_since is None:
        state = replace(state, observed_since=now)
    current = state.desired
    values = _fresh(signals.outstanding_per_replica)
    ready = max(signals.replicas_ready, 0)
    reported = len(values)
    # The reporting replicas stand for every Ready one; requests held at the gateway are load too.
    # A Ready replica that has not reported yet counts as idle: right after a scale-up the
    # gateway still sends everything to the old ones, and counting the newcomer at their load
    # would double it and scale again (Kubernetes' HPA counts such pods as 0 when scaling up).
    on_replicas = sum(values)
    load = on_replicas + max(signals.gateway_waiting, 0)
    wanted = _wanted(load, policy.target)

    proposal = _propose(current, bounds, policy, signals, state, now, load, wanted, ready, reported)
    desired = _clamp(proposal.desired, bounds)
    reason = proposal.reason
    if desired > proposal.desired:
        reason = ScaleReason.BELOW_MIN
    elif desired < proposal.desired:
        reason = ScaleReason.ABOVE_MAX
    new_state = replace(proposal.state, desired=desired)
    if desired > current:
        new_state = replace(_quiet(new_state), last_scale_up_at=now)
    elif desired < current:
        new_state = replace(_quiet(new_state), last_scale_down_at=now)
    return Decision(
        deployment=deployment_name,
        at=now,
        previous=current,
        desired=desired,
        reason=reason,
        state=new_state,
        load=load,
        wanted=wanted,
        target=policy.target,
        ready=ready,
        reported=reported,
        timer=proposal.timer,
        waited=proposal.waited,
        wait=proposal.wait,
        bounds=(bounds.min, bounds.max),
    )


def _propose(
    current: int,
    bounds: ReplicaRange,
    policy: AutoscalePolicy,
    signals: Signals,
    state: AutoscaleState,
    now: float,
    load: float,
    wanted: int,
    ready: int,
    reported: int,
) -> _Proposal:
    if current <= 0:
        if load > 0:
            return _Proposal(max(1, wanted), ScaleReason.HELD_REQUEST, _quiet(state))
        return _Proposal(0, ScaleReason.STEADY, _quiet(state))
    if ready > 0 and reported == 0:
        return _Proposal(current, ScaleReason.NO_FRESH_METRICS, _quiet(state))
    complete = reported >= ready

    idle = _idle(current, bounds, policy, signals, state, now, load, complete)
    if idle is not None and idle.desired == 0:
        return idle

    needed = max(1, wanted)  # the load rule keeps one replica; only the idle rule reaches zero
    if needed > current:
        since = state.above_target_since if state.above_target_since is not None else now
        held = now - since
        timers = replace(state, below_target_since=None, below_target_peak=0, above_target_since=since)
        if held >= policy.scale_up_stabilization_seconds:
            return _Proposal(needed, ScaleReason.LOAD_ABOVE_TARGET, timers)
        return _Proposal(
            current,
            ScaleReason.STEADY,
            timers,
            Timer.UP_STABILIZATION,
            held,
            policy.scale_up_stabilization_seconds,
        )
    if needed == current:
        # At one replica with min 0 the idle timer is the one that matters.
        return (
            idle
            if idle is not None and current == 1
            else _Proposal(current, ScaleReason.STEADY, _quiet(state))
        )
    if not complete:
        return _Proposal(current, ScaleReason.NO_FRESH_METRICS, _quiet(state))
    # Below target: the window starts (or continues) and remembers the most the load needed.
    if state.below_target_since is None:
        since, peak = now, needed
    else:
        since, peak = state.below_target_since, max(state.below_target_peak, needed)
    timers = replace(state, below_target_since=since, below_target_peak=peak, above_target_since=None)
    cooldown = policy.scale_down_cooldown_seconds
    reason = ScaleReason.LOAD_BELOW_TARGET_AFTER_COOLDOWN if now - since >= cooldown else ScaleReason.STEADY
    count = peak if reason is ScaleReason.LOAD_BELOW_TARGET_AFTER_COOLDOWN else current
    return _Proposal(count, reason, timers, Timer.DOWN_COOLDOWN, now - since, cooldown)


def _idle(
    current: int,
    bounds: ReplicaRange,
    policy: AutoscalePolicy,
    signals: Signals,
    state: AutoscaleState,
    now: float,
    load: float,
    complete: bool,
) -> _Proposal | None:
    """Scale to zero when min is 0, nothing is outstanding and no request came for long enough.

    None when the rule does not apply; a Steady proposal with the idle timer when it applies but
    has not run out (or a change was too recent).
    """
    if bounds.min != 0 or load > 0 or not complete:
        return None
    last = signals.last_request_at
    if last is None:
        last = state.observed_since if state.observed_since is not None else now
    idle_for = now - last
    # Like any scale-down, not sooner than a cooldown after the previous change.
    changes = [t for t in (state.last_scale_up_at, state.last_scale_down_at) if t is not None]
    settled = not changes or now - max(changes) >= policy.scale_down_cooldown_seconds
    after = policy.scale_to_zero_after_seconds
    if idle_for < after:
        return _Proposal(current, ScaleReason.STEADY, _quiet(state), Timer.IDLE, idle_for, after)
    if not settled:
        since_change = now - max(changes)
        cooldown = policy.scale_down_cooldown_seconds
        return _Proposal(
            current, ScaleReason.STEADY, _quiet(state), Timer.DOWN_COOLDOWN, since_change, cooldown
        )
    return _Proposal(0, ScaleReason.IDLE, _quiet(state), Timer.IDLE, idle_for, after)


def decide_for(
    deployment: Deployment, signals: Signals, state: AutoscaleState | None, now: float
) -> Decision | None:
    """``decide`` for a deployment document; None for a fixed replica count (nothing to scale)."""
    if isinstance(deployment.replicas, int):
        return None
    policy = deployment.autoscale if deployment.autoscale is not None else AutoscalePolicy()
    return decide(deployment.name, deployment.replicas, policy, signals, state, now)


class DecisionLog:
    """The last decisions per deployment, bounded, as dicts for ``fleetserve describe``.

    A decision identical to the previous entry (same reason, count and move) updates that entry
    (``repeats``, ``last_at``, ``detail``) instead of pushing older history out.
    """

    def __init__(self, capacity: int = 20) -> None:
        if capacity < 1:
            raise ValueError("a decision log keeps at least one entry")
        self._capacity = capacity
        self._entries: dict[str, deque[dict[str, Any]]] = {}

    def record(self, decision: Decision) -> None:
        entries = self._entries.setdefault(decision.deployment, deque(maxlen=self._capacity))
        entry = decision.as_dict()
        if entries and not decision.changed:
            last = entries[-1]
            same = last["reason"] == entry["reason"] and last["desired"] == entry["desired"]
            if same and not last["changed"]:
                last.update(
                    repeats=last["repeats"] + 1,
                    last_at=decision.at,
                    detail=entry["detail"],
                    load=entry["load"],
                    wanted=entry["wanted"],
                )
                return
        entry.update(repeats=1, last_at=decision.at)
        entries.append(entry)

    def entries(self, deployment: str) -> tuple[dict[str, Any], ...]:
        """Oldest first; copies, so callers cannot edit the log."""
        return tuple(dict(e) for e in self._entries.get(deployment, ()))

    def forget(self, deployment: str) -> None:
        self._entries.pop(deployment, None)

    def snapshot(self) -> Mapping[str, tuple[dict[str, Any], ...]]:
        return {name: self.entries(name) for name in sorted(self._entries)}
