"""How one deployment's replicas come and go, as a pure function: failures, drains, rollouts.

- **Failed replicas** count toward the desired number (they hold their allocation, so a deployment
  never holds more than it asked for). After a backoff (5 s, doubling, at most 5 minutes) a failed
  replica is released and, in the same cycle, a replacement is placed in the room it left. The
  deployment's ``ReplicaFailure`` condition names the last error; the history lives in its status.
- **Nothing is stopped while it serves.** A Running replica that must go (scale-down, rollout,
  deletion, node drain) turns Draining: out of every gateway's routes (``routing.routable``), then
  released — and its engine stopped by its agent — once its agent reports no request in flight
  after every gateway refreshed its routes, or when ``drainSeconds`` have passed. A replica that
  is not Running serves nothing and is released at once.
- **A node that lost the build** (its agent registered again without the replica's engine variant:
  binary removed, replaced by another build) cannot run the replica: it is released and replaced
  elsewhere like one on a Lost node, not restarted in place for ever.
- **Rollouts surge.** Replicas placed for another revision (``TEMPLATE.WEIGHTS``: the deployment's
  model name and profiles, then the weights its Model names, ``Model.weights_digest``) are old:
  new ones are placed up to ``desired + maxSurge``, and old Running ones drain only while at least
  ``desired - maxUnavailable`` replicas stay Running — so each new replica is Ready before an old
  one drains. A Model's new source, digest, format or alternate is thus a rollout of every
  deployment serving it; its size or architecture is not.
- **Upgrades roll nothing.** A replica whose revision has no weights part (placed by a server that
  did not count the weights), or none at all (placed before rollouts), is current when its template
  part matches: it is kept and stamped (``stamp``) with the full revision, so the next change of
  its model rolls it like any other.

No I/O, no clock: ``now`` is passed in; without it nothing time-based (drain deadlines, failure
backoff) is decided.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Any

from fleetserve.conditions import Condition, ConditionReason, ConditionType
from fleetserve.drivers import RuntimeVariant, parse_driver
from fleetserve.engines.spec import EngineKind
from fleetserve.routing import ROUTE_REFRESH_SECONDS
from fleetserve.snapshot import ClusterSnapshot, ReplicaFacts, replica_ordinal
from fleetserve.spec.resources import (
    DEFAULT_DRAIN_SECONDS,
    Deployment,
    Replica,
    ReplicaState,
    revision_parts,
)
from fleetserve.validation import resolve_profile

# A Draining replica's in-flight count is trusted only when read this long after it started to
# drain: by then every gateway has refreshed its routes (twice the refresh period, for slack).
ROUTES_SETTLE = timedelta(seconds=2 * ROUTE_REFRESH_SECONDS)
FAILURE_BACKOFF_START = timedelta(seconds=5)
FAILURE_BACKOFF_MAX = timedelta(minutes=5)


def failure_backoff(failures: int) -> timedelta:
    """How long a deployment waits before replacing its ``failures``-th failed replica."""
    if failures <= 0:
        return timedelta(0)
    doubled: timedelta = FAILURE_BACKOFF_START * (1 << min(failures - 1, 16))
    return min(doubled, FAILURE_BACKOFF_MAX)


@dataclass(frozen=True)
class FailureHistory:
    """A deployment's replica failures, kept in its status between cycles."""

    count: int = 0  # failed replicas seen since the deployment last ran whole
    last_error: str = ""
    last_replica: str = ""
    seen: tuple[str, ...] = ()  # failed replicas already counted (names are never reused)
    retry_at: datetime | None = None  # when the failed replicas are replaced

    def to_dict(self) -> dict[str, Any]:
        """Plain data for the deployment's status."""
        return {
            "count": self.count,
            "lastError": self.last_error,
            "lastReplica": self.last_replica,
            "seen": list(self.seen),
            "retryAt": self.retry_at.isoformat() if self.retry_at else None,
        }

    @classmethod
    def from_status(cls, data: object) -> FailureHistory:
        """The history a status holds (an empty one for anything unreadable)."""
        if not isinstance(data, Mapping):
            return cls()
        try:
            retry = data.get("retryAt")
            return cls(
                count=int(data.get("count", 0)),
                last_error=str(data.get("lastError", "")),
                last_replica=str(data.get("lastReplica", "")),
                seen=tuple(str(s) for s in data.get("seen", ())),
                retry_at=datetime.fromisoformat(retry) if isinstance(retry, str) else None,
            )
        except (TypeError, ValueError):
            return cls()


class RolloutCause(StrEnum):
    """What changed between the old replicas' revision and the current one."""

    NONE = ""  # no replica of another revision
    DEPLOYMENT = "deployment"  # the deployment's model name or profiles
    MODEL = "model"  # the weights its Model names (source, sha256, format, alternates)
    BOTH = "deployment and model"


def same_revision(stored: str | None, current: str) -> bool:
    """Whether a replica placed for revision ``stored`` runs ``current``: the same template part,
    and the same weights part where both have one (a revision without, placed before the weights
    counted or while they were unknown, is taken as current rather than rolled)."""
    if stored is None:
        return True
    template, weights = revision_parts(stored)
    now_template, now_weights = revision_parts(current)
    return template == now_template and (not weights or not now_weights or weights == now_weights)


def rollout_cause(old: Sequence[str | None], current: str) -> RolloutCause:
    """Why replicas of revisions ``old`` are replaced by ``current``."""
    now_template, now_weights = revision_parts(current)
    template = weights = False
    for revision in old:
        t, w = revision_parts(revision or "")
        template = template or t != now_template
        weights = weights or bool(w and now_weights and w != now_weights)
    if template and weights:
        return RolloutCause.BOTH
    if weights:
        return RolloutCause.MODEL
    return RolloutCause.DEPLOYMENT if template else RolloutCause.NONE


@dataclass(frozen=True)
class RolloutProgress:
    """Where a deployment's replicas stand against its current template revision."""

    revision: str
    desired: int
    updated: int  # replicas at the current revision (not draining)
    ready: int  # of those, Running
    old: int  # replicas at another revision, not yet draining
    draining: int
    cause: RolloutCause = RolloutCause.NONE  # what changed, while replicas of another revision live

    @property
    def complete(self) -> bool:
        return self.old == 0 and self.updated == self.desired and self.ready == self.desired

    def to_dict(self) -> dict[str, Any]:
        return {
            "revision": self.revision,
            "desired": self.desired,
            "updated": self.updated,
            "ready": self.ready,
            "old": self.old,
            "draining": self.draining,
            "complete": self.complete,
            "cause": self.cause.value,
        }


@dataclass(frozen=True)
class Lifecycle:
    """What one cycle decided for one deployment's existing replicas, and how many to add."""

    kept: tuple[str, ...]  # counted toward the desired number, left as they are
    place: int  # new replicas to place at the current revision
    drain: tuple[str, ...] = ()  # Running replicas to take out of the routes now
    release: tuple[str, ...] = ()  # replicas to release now
    lost: tuple[str, ...] = ()  # on Lost nodes (released)
    surplus: tuple[str, ...] = ()  # beyond the desired count (drained or released)
    failures: FailureHistory = field(default_factory=FailureHistory)
    progress: RolloutProgress | None = None
    conditions: tuple[Condition, ...] = ()
    # Kept replicas whose stored revision predates the weights part: to be stamped with the
    # current revision (``progress.revision``), so that a later model change rolls them.
    stamp: tuple[str, ...] = ()


def drained(facts: ReplicaFacts, drain_seconds: float, now: datetime | None) -> bool:
    """Whether a Draining replica may be released: its agent reported nothing in flight after every
    gateway refreshed its routes, or its drain deadline passed."""
    since = facts.draining_since
    if since is None:
        return True  # draining with no start recorded: nothing to wait for
    if now is None:
        return False
    if now >= since + timedelta(seconds=drain_seconds):
        return True
    return (
        facts.in_flight == 0 and facts.reported_at is not None and facts.reported_at >= since + ROUTES_SETTLE
    )


def _order(replica: Replica) -> tuple[int, str]:
    ordinal = replica_ordinal(replica.deployment, replica.name)
    return (ordinal if ordinal is not None else -1, replica.name)


def _serving(replica: Replica) -> bool:
    return replica.state is ReplicaState.RUNNING


def retire(replicas: Sequence[Replica]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Replicas to stop, split: (to drain: Running, to release now: serving nothing)."""
    drain = tuple(r.name for r in replicas if _serving(r))
    release = tuple(r.name for r in replicas if not _serving(r))
    return drain, release


def _failures(
    failed: Sequence[Replica],
    snapshot: ClusterSnapshot,
    history: FailureHistory,
    now: datetime | None,
    whole: bool,
) -> tuple[FailureHistory, tuple[str, ...]]:
    """The failure history after this cycle, and the failed replicas to replace now."""
    names = {r.name for r in failed}
    new = sorted((r for r in failed if r.name not in history.seen), key=_order)
    count, error, last, retry_at = history.count, history.last_error, history.last_replica, history.retry_at
    for replica in new:
        count += 1
        error = snapshot.facts_of(replica.name).message or "the replica failed"
        last = replica.name
    if new:
        retry_at = now + failure_backoff(count) if now is not None else None
    if not failed and whole:
        count, retry_at = 0, None  # ran whole again: the next failure starts the backoff afresh
    replace: tuple[str, ...] = ()
    if failed and now is not None and retry_at is not None and now >= retry_at:
        replace = tuple(sorted(names))
    seen = tuple(sorted(names - set(replace)))
    return FailureHistory(count, error, last, seen, retry_at if failed else None), replace


def _failure_condition(history: FailureHistory, failed: int) -> Condition:
    if history.count == 0:
        return Condition(ConditionType.REPLICA_FAILURE, False, ConditionReason.NO_FAILURE)
    when = f"; replaced at {history.retry_at.isoformat()}" if history.retry_at and failed else ""
    return Condition(
        ConditionType.REPLICA_FAILURE,
        True,
        ConditionReason.REPLICA_FAILED,
        f"replica {history.last_replica} failed: {history.last_error} "
        f"({history.count} failure{'s' if history.count != 1 else ''} in a row{when})",
    )


def _progress_condition(progress: RolloutProgress, replacing: bool, model: str) -> Condition:
    # Counts stay out of the message (they are in status.rollout): a condition that changes every
    # cycle would record a decision every cycle.
    if not replacing:
        return Condition(
            ConditionType.PROGRESSING,
            True,
            ConditionReason.COMPLETE,
            f"no replica of another revision: every replica is placed for revision {progress.revision}",
        )
    because = {
        RolloutCause.MODEL: f": the weights of model {model} changed",
        RolloutCause.DEPLOYMENT: ": the deployment's model or profiles changed",
        RolloutCause.BOTH: f": the deployment's profiles and the weights of model {model} changed",
    }.get(progress.cause, "")
    return Condition(
        ConditionType.PROGRESSING,
        True,
        ConditionReason.ROLLING_OUT,
        f"replacing the replicas of other revisions with revision {progress.revision}{because}",
    )


Build = tuple[EngineKind, RuntimeVariant] | None


def unrunnable(
    dep: Deployment, replica: Replica, snapshot: ClusterSnapshot, builds: dict[str, Build] | None = None
) -> bool:
    """Whether a node under ``replica`` no longer runs its profile's engine build (a profile or
    class no longer known says nothing: the rollout or the gate decides those). ``builds`` keeps
    each profile's build once resolved, for a caller judging many replicas of ``dep``: at 25,000
    replicas, resolving every replica's profile again was a third of a cycle's planning."""
    memo = builds if builds is not None else {}
    if replica.profile not in memo:
        memo[replica.profile] = _build(dep, replica.profile, snapshot)
    build = memo[replica.profile]
    return build is not None and snapshot.without_build(replica, *build)


def _build(dep: Deployment, name: str, snapshot: ClusterSnapshot) -> Build:
    """The engine build profile ``name`` of ``dep`` needs (None: no such profile, or its class is
    no longer known or names no driver)."""
    profile = next((p for p in dep.profiles if p.name == name), None)
    if profile is None:
        return None
    if profile.device_class is not None:
        cls = snapshot.classes.get(profile.device_class)
        if cls is None or parse_driver(cls.driver) is None:
            return None
    resolved = resolve_profile(profile, snapshot.classes)
    return resolved.engine, resolved.variant


def plan_lifecycle(
    dep: Deployment,
    snapshot: ClusterSnapshot,
    history: FailureHistory | None = None,
    now: datetime | None = None,
) -> Lifecycle:
    """Decide what happens to one deployment's replicas this cycle (see the module docstring)."""
    history = history or FailureHistory()
    mine = sorted(snapshot.replicas_of(dep.name), key=_order)
    builds: dict[str, Build] = {}
    lost = tuple(r.name for r in mine if snapshot.on_lost_node(r) or unrunnable(dep, r, snapshot, builds))
    release: list[str] = list(lost)
    draining = [r for r in mine if r.name not in lost and r.state is ReplicaState.DRAINING]
    release += [r.name for r in draining if drained(snapshot.facts_of(r.name), dep.drain_seconds, now)]
    live = [r for r in mine if r.name not in lost and r.state is not ReplicaState.DRAINING]

    desired = dep.desired_replicas
    revision = snapshot.revision_of(dep)
    failed = [r for r in live if r.state is ReplicaState.FAILED]
    whole = len(live) == desired and all(_serving(r) for r in live)
    failures, replace = _failures(failed, snapshot, history, now, whole)
    release += replace
    live = [r for r in live if r.name not in replace]

    current: list[Replica] = []
    old: list[Replica] = []
    for r in live:
        (current if same_revision(r.revision, revision) else old).append(r)
    stamp = tuple(r.name for r in current if r.revision != revision) if revision_parts(revision)[1] else ()
    drain: list[str] = []
    surplus: list[str] = []
    # Scale-down: beyond the desired count, what serves nothing goes first, then the newest.
    if len(current) > desired:
        by_worth = sorted(current, key=lambda r: (_serving(r), -_order(r)[0]), reverse=True)
        extra = by_worth[desired:]
        surplus = [r.name for r in extra]
        d, rel = retire(extra)
        drain += d
        release += rel
        current = by_worth[:desired]
    # Rollout: old replicas that serve nothing go at once; Running ones drain only while enough run.
    old_idle = [r for r in old if not _serving(r)]
    release += [r.name for r in old_idle]
    old_ready = [r for r in old if _serving(r)]
    available = sum(_serving(r) for r in current) + len(old_ready)
    may_drain = max(0, available - max(0, desired - dep.rollout.max_unavailable))
    going = old_ready[:may_drain]
    drain += [r.name for r in going]
    old_left = old_ready[may_drain:]
    place = max(
        0, min(desired - len(current), desired + dep.rollout.max_surge - len(current) - len(old_left))
    )
    progress = RolloutProgress(
        revision=revision,
        desired=desired,
        updated=len(current),
        ready=sum(_serving(r) for r in current),
        old=len(old_left),
        draining=len(draining) - sum(r.name in release for r in draining) + len(drain),
        cause=rollout_cause([r.revision for r in old], revision),
    )
    return Lifecycle(
        kept=tuple(r.name for r in (*current, *old_left)),
        place=place,
        drain=tuple(drain),
        release=tuple(dict.fromkeys(release)),
        lost=lost,
        surplus=tuple(surplus),
        failures=failures,
        progress=progress,
        conditions=(
            _failure_condition(failures, len(failed)),
            _progress_condition(progress, bool(old), dep.model),
        ),
        stamp=stamp,
    )


def plan_orphans(
    snapshot: ClusterSnapshot, wanted: frozenset[str], now: datetime | None
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Replicas of deployments that no longer exist: (to drain, to release now)."""
    gone = [r for r in snapshot.replicas if r.deployment not in wanted]
    waiting = [r for r in gone if r.state is ReplicaState.DRAINING]
    done = [r.name for r in waiting if drained(snapshot.facts_of(r.name), DEFAULT_DRAIN_SECONDS, now)]
    drain, release = retire([r for r in gone if r.state is not ReplicaState.DRAINING])
    return drain, (*release, *done)
