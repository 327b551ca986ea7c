"""The reconciler loop: the edge around the pure ``reconcile`` core.

Each cycle, on the one server that holds the leader lease: judge node liveness from heartbeats,
take one snapshot, decide (pure), then commit — releases first, then the new replicas, a batch to a
transaction. The store re-checks every allocation against the current state, so a plan built on
stale state is rejected, never half-applied; the next cycle decides again.

A quiet fleet is not read again every cycle. After a cycle that changed nothing (no node's
liveness, no replica placed, drained or released, no status but the autoscaler's log) and left no
step waiting on the clock (no replica draining or failed), the next cycles only judge liveness and
compare the store's change counter (``changegate``: bumped by the database with every write to
nodes, replicas, deployments, models, classes and fabrics). While it has not moved, the snapshot
that cycle read is still the fleet, and planning it again would decide the same: such a cycle is
*quiet* and reads nothing more (``fleetserve_reconcile_quiet_total``). Autoscaled deployments are
still judged every cycle, on the replicas that cycle read; a new count ends the quiet. At least
every ``changegate.FULL_READ_SECONDS`` a cycle reads and plans in full anyway. At 5,000 nodes a
full cycle is most of a second of CPU in the server process, which its agents' requests waited on.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from fleetserve.autoscale import AutoscaleState, DecisionLog, decide_for, render_decision
from fleetserve.changegate import FULL_READ_SECONDS
from fleetserve.errors import AllocationConflict, ConfigError, FleetserveError, UnknownReplica
from fleetserve.gguf_facts import adapter_facts, model_facts
from fleetserve.metrics.exposition import FleetMetrics
from fleetserve.modelfacts import ModelFacts
from fleetserve.reconcile.core import Planner
from fleetserve.reconcile.disruption import Disruption, Liveness, judge
from fleetserve.reconcile.health import HeartbeatPolicy
from fleetserve.reconcile.lifecycle import FailureHistory
from fleetserve.server.reconciler.signals import SignalSource
from fleetserve.snapshot import ClusterSnapshot
from fleetserve.spec.adapter import Adapter
from fleetserve.spec.resources import Deployment, Model, Replica, ReplicaState
from fleetserve.spec.status import (
    AutoscalerEntry,
    DecisionRecord,
    DeploymentStatus,
    FailureStatus,
    RolloutStatus,
    StatusCondition,
)
from fleetserve.store.protocols import ReconcilerStore

log = logging.getLogger("fleetserve.reconciler")

LEASE = "reconciler"


def holder_name() -> str:
    """Who holds the lease, as operators read it: ``host:pid:random``, the pid of this process (a
    reconciler process is given its server's)."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def utcnow() -> datetime:
    """The wall clock, in UTC; the one place the reconciler reads it."""
    return datetime.now(UTC)


class CyclePhase(StrEnum):
    """The parts of a cycle timed apart (``fleetserve_reconcile_phase_seconds``)."""

    SNAPSHOT = "snapshot"  # liveness from heartbeats, deployments, models and the snapshot: reads
    PLAN = "plan"  # the pure decision: lifecycles and placement
    COMMIT = "commit"  # drains, releases, allocations, statuses and decisions: writes


@dataclass
class CycleResult:
    """What one cycle did, for logs, metrics and tests."""

    leader: bool
    transitions: list[tuple[str, str, str]] = field(default_factory=list)
    allocated: list[str] = field(default_factory=list)
    released: list[str] = field(default_factory=list)
    draining: list[str] = field(default_factory=list)
    conflicts: list[str] = field(default_factory=list)
    seconds: float = 0.0
    # Seconds per phase (a follower's cycle has none, nor a quiet one).
    phases: dict[CyclePhase, float] = field(default_factory=dict)
    # Nothing had changed since a cycle that changed nothing: the fleet was not read again.
    quiet: bool = False
    # The autoscaler's desired count of every deployment a full cycle planned (None: not planned).
    desired: dict[str, int] | None = None
    # Disruption mode, as this cycle judged it (None: off), and the nodes past the Lost deadline
    # not judged Lost (the mode, or the re-placement rate).
    disruption: Disruption | None = None
    held: tuple[str, ...] = ()
    # Seconds the loop had not run before this cycle, when that was a stall of its own.
    stalled: float | None = None

    def figures(self) -> CycleFigures:
        """What this cycle tells ``/metrics``."""
        return CycleFigures(
            leader=self.leader,
            seconds=self.seconds,
            quiet=self.quiet,
            phases=self.phases,
            desired=self.desired,
            disruption=self.disruption,
        )


class CycleFigures(BaseModel):
    """What a cycle tells ``/metrics``: a typed value, so that a reconciler in a process of its own
    (``server/reconciler/process.py``) hands it to the process that serves ``/metrics``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    leader: bool
    seconds: float = Field(ge=0)
    quiet: bool = False
    phases: dict[CyclePhase, Annotated[float, Field(ge=0)]] = Field(default_factory=dict)
    desired: dict[str, int] | None = None
    disruption: Disruption | None = None

    def record(self, metrics: FleetMetrics) -> None:
        """Set disruption mode; count a quiet cycle; time a full one, its phases (placement is the
        plan), and set the autoscaler's desired counts. A follower's cycle did nothing to tell."""
        if not self.leader:
            return
        metrics.set_disruption(self.disruption)
        if self.quiet:
            metrics.count_quiet_cycle()
            return
        plan = self.phases.get(CyclePhase.PLAN)
        if plan is not None:
            metrics.observe_placement(plan)
        metrics.observe_reconcile(self.seconds)
        for phase, seconds in self.phases.items():
            metrics.observe_reconcile_phase(phase.value, seconds)
        if self.desired is not None:
            metrics.set_desired_replicas(self.desired)


@dataclass
class _Quiet:
    """What a cycle that changed nothing leaves for the next ones: the change counter it read
    before reading the fleet, when, and what it read and decided (for the autoscaler's judgement
    and its log in the statuses)."""

    counter: int
    at: datetime
    deployments: tuple[Deployment, ...]
    replicas: tuple[Replica, ...]
    desired: dict[str, int]
    statuses: dict[str, DeploymentStatus]


class Reconciler:
    """Drives desired state to actual state; only the lease holder acts."""

    def __init__(
        self,
        store: ReconcilerStore,
        policy: HeartbeatPolicy | None = None,
        lease_ttl: timedelta = timedelta(seconds=15),
        clock: Callable[[], datetime] = utcnow,
        holder: str | None = None,
        signals: SignalSource | None = None,
        metrics: FleetMetrics | None = None,
        quiet_cycles: bool = True,
        ticker: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        # The loop's own clock, to find its own stalls (a gap between cycles); the pause between
        # cycles is ``run_forever``'s (0: cycles run by hand).
        self.ticker = ticker
        self.interval = 0.0
        self._liveness = Liveness()
        # False: every cycle reads and plans in full (bench/reconcile.py times such cycles).
        self.quiet_cycles = quiet_cycles
        self.signals = signals
        self.metrics = metrics
        self.scale_log = DecisionLog()
        self._scale_state: dict[str, AutoscaleState] = {}
        self.policy = policy or HeartbeatPolicy()
        self.lease_ttl = lease_ttl
        self.clock = clock
        self.holder = holder or holder_name()
        self._facts: dict[str, tuple[Model, ModelFacts]] = {}
        self._adapters: dict[str, tuple[Adapter, ModelFacts]] = {}
        self._last_recorded: dict[str, Any] = {}
        # The free capacity, kept between cycles and patched from each snapshot.
        self._planner = Planner()
        self._quiet: _Quiet | None = None
        # Autoscaler decisions a quiet check made, for the full cycle it started to use (not
        # decide twice): per deployment, the stored deployment and its scaled copy.
        self._scaled: dict[str, tuple[Deployment, Deployment]] = {}

    def _model_facts(self, models: list[Model]) -> dict[str, ModelFacts]:
        out = {}
        for model in models:
            cached = self._facts.get(model.name)
            if cached is None or cached[0] != model:
                try:
                    cached = (model, model_facts(model))
                except ConfigError as err:
                    log.warning("model %s: %s", model.name, err)
                    continue
                self._facts[model.name] = cached
            out[model.name] = cached[1]
        return out

    def _adapter_facts(self, adapters: list[Adapter]) -> dict[str, ModelFacts]:
        """Each adapter's bytes, as facts under its name (which no model has: apply refuses it)."""
        out = {}
        for adapter in adapters:
            cached = self._adapters.get(adapter.name)
            if cached is None or cached[0] != adapter:
                try:
                    cached = (adapter, adapter_facts(adapter))
                except ConfigError as err:
                    log.warning("adapter %s: %s", adapter.name, err)
                    continue
                self._adapters[adapter.name] = cached
            out[adapter.name] = cached[1]
        return out

    def run_once(self) -> CycleResult:
        """One cycle; a follower only renews its bid for the lease."""
        started = time.perf_counter()
        tick = self.ticker()
        now = self.clock()
        if not self.store.try_acquire_leadership(LEASE, self.holder, now, self.lease_ttl):
            self._quiet = None  # another server may change the fleet in ways no counter shows
            self._liveness = Liveness(tick=tick)  # a leader to be judges afresh, from its first cycle
            return CycleResult(leader=False)
        result = CycleResult(leader=True)
        # Taken before anything is read: a write that commits meanwhile moves it past this value.
        counter = self.store.fleet_changes()
        self._judge_liveness(now, tick, result)
        if self.quiet_cycles and not result.transitions and self._still_quiet(counter, now):
            result.quiet = True
            result.seconds = time.perf_counter() - started
            self._record(result)
            return result
        self._quiet = None
        stored = self.store.list_deployments()
        snapshot = self.store.snapshot(
            {**self._model_facts(self.store.list_models()), **self._adapter_facts(self.store.list_adapters())}
        )
        deployments = [self._scale(d.deployment, snapshot.replicas) for d in stored]
        self._scaled.clear()
        failures = {d.deployment.name: FailureHistory.from_status(d.status.failures.stored()) for d in stored}
        placing = time.perf_counter()
        result.phases[CyclePhase.SNAPSHOT] = placing - started
        plan = self._planner.plan(deployments, snapshot, now, failures)
        committing = time.perf_counter()
        result.phases[CyclePhase.PLAN] = committing - placing
        if plan.drain:
            result.draining = self.store.start_draining(plan.drain, now)
            for name in result.draining:
                log.info("replica %s: draining (out of the routes until its requests are done)", name)
        for name in plan.release:
            try:
                self.store.release(name)
                result.released.append(name)
            except UnknownReplica:
                pass  # released by someone else meanwhile: the goal is reached
        self._allocate(plan.allocate, result)
        for revision, names in plan.stamps.items():
            for name in self.store.stamp_revision(names, revision):
                log.info("replica %s: stamped with revision %s (weights uncounted)", name, revision)
        allocated = set(result.allocated)
        generations = {d.deployment.name: d.generation for d in stored}
        previous = {d.deployment.name: d.previous for d in stored}
        stored_status = {d.deployment.name: d.status for d in stored}
        statuses: dict[str, DeploymentStatus] = {}
        moved = False
        for decision in plan.decisions:
            conditions = decision.conditions_data()
            life = plan.lifecycles.get(decision.deployment)
            before = previous.get(decision.deployment)
            status = DeploymentStatus(
                failures=FailureStatus.model_validate(life.failures.to_dict() if life is not None else {}),
                rollout=RolloutStatus.model_validate(
                    life.progress.to_dict() if life is not None and life.progress else {}
                ),
                previous_revision=snapshot.revision_of(before) if before is not None else None,
                autoscaler=self._autoscaler_log(decision.deployment),
                observed_generation=generations.get(decision.deployment),
                conditions=[StatusCondition.model_validate(c) for c in conditions],
                desired_replicas=decision.desired,
                replicas=sorted(
                    [
                        *decision.kept,
                        *(p.replica.name for p in decision.placed if p.replica.name in allocated),
                    ]
                ),
                unschedulable=len(decision.unplaced),
            )
            statuses[decision.deployment] = status
            # A steady cycle computes the status it read (thousands of replica names at a large
            # fleet): writing it again would only churn the database.
            read = stored_status.get(decision.deployment)
            if read is None or status.stored() != read.stored():
                # The autoscaler's log moves every cycle (repeats, last_at); anything else is news.
                moved = moved or not _same_but_autoscaler(status, read)
                try:
                    self.store.set_deployment_status(decision.deployment, status)
                except FleetserveError:
                    continue  # deleted meanwhile
            # Keep a decision when it did something or says something new; a cycle that only
            # kept what runs would bury the decision that placed it. What is compared is the
            # decision's compact ``outcome``, not its whole record: at a large fleet, one dict per
            # unplaced replica made and kept every cycle.
            interesting = decision.outcome()
            acted = bool(decision.placed or decision.unplaced or decision.lost or decision.surplus)
            last = self._last_recorded.get(decision.deployment)
            new_conditions = last is None or last["conditions"] != conditions
            if new_conditions or (acted and last != interesting):
                record = DecisionRecord.model_validate(decision.to_record())
                self.store.record_decision(decision.deployment, record, now)
                self._last_recorded[decision.deployment] = interesting
                moved = True
        if not (moved or result.transitions or result.conflicts or plan.changes) and _settled(snapshot):
            self._quiet = _Quiet(
                counter=counter,
                at=now,
                deployments=tuple(d.deployment for d in stored),
                replicas=snapshot.replicas,
                desired={d.name: d.desired_replicas for d in deployments},
                statuses=statuses,
            )
        ended = time.perf_counter()
        result.phases[CyclePhase.COMMIT] = ended - committing
        result.seconds = ended - started
        result.desired = {d.name: d.desired_replicas for d in deployments}
        self._record(result)
        return result

    def _judge_liveness(self, now: datetime, tick: float, result: CycleResult) -> None:
        """Judge every node's heartbeats (``reconcile/disruption.py``) and store the states that move."""
        beats = [(h.name, h.state, h.last_heartbeat) for h in self.store.node_heartbeats()]
        before = self._liveness
        judged = judge(beats, now, tick, self.policy, before, self.interval)
        self._liveness = judged.liveness
        if judged.stalled is not None:
            log.warning(
                "the reconcile loop did not run for %.1f s (the server stopped or starved): every "
                "node's heartbeat deadline counts from now",
                judged.stalled,
            )
        mode = judged.disruption
        if mode is not None and before.disrupted_since is None:
            log.warning("disruption mode: %s (nodes are marked NotReady, none judged Lost)", mode.message())
        elif mode is None and before.disrupted_since is not None:
            log.warning("disruption mode ended: heartbeats resumed; deadlines count from now")
        moved = set(self.store.mark_silent(judged.transitions))
        skipped = []
        for change in judged.transitions:
            if change.node not in moved:
                skipped.append(change.node)
                continue
            result.transitions.append((change.node, change.old.value, change.new.value))
            log.info("node %s: %s -> %s", change.node, change.old.value, change.new.value)
        if skipped:
            log.info(
                "%d node(s) not marked this cycle: heard since they were judged, their state moved, "
                "or their rows are being written (a heartbeat in flight); judged again next cycle: %s",
                len(skipped),
                ", ".join(skipped[:10]) + (" …" if len(skipped) > 10 else ""),
            )
        result.disruption, result.held, result.stalled = mode, judged.held, judged.stalled

    def _autoscaler_log(self, deployment: str) -> list[AutoscalerEntry]:
        """The autoscaler's log of a deployment, as its status keeps it."""
        return [AutoscalerEntry.model_validate(e) for e in self.scale_log.entries(deployment)]

    def _record(self, result: CycleResult) -> None:
        if self.metrics is not None:
            result.figures().record(self.metrics)

    def _allocate(self, replicas: tuple[Replica, ...], result: CycleResult) -> None:
        """Commit the plan's new replicas, in batches; each refused one is recorded as a conflict."""
        outcomes: list[FleetserveError | None]
        try:
            outcomes = list(self.store.allocate_all(replicas))
        except FleetserveError as exc:
            log.warning("allocating %d replicas at once failed (%s); one by one instead", len(replicas), exc)
            outcomes = [self._allocate_one(replica) for replica in replicas]
        for replica, outcome in zip(replicas, outcomes, strict=True):
            if outcome is None:
                result.allocated.append(replica.name)
                continue
            result.conflicts.append(replica.name)
            if isinstance(outcome, AllocationConflict):
                log.info("plan for %s went stale (%s); the next cycle decides again", replica.name, outcome)
            else:
                log.error("could not store replica %s: %s", replica.name, outcome)

    def _allocate_one(self, replica: Replica) -> FleetserveError | None:
        # One replica the store refuses must not keep every other one from being placed.
        try:
            self.store.allocate(replica)
        except FleetserveError as exc:
            return exc
        return None

    def _still_quiet(self, counter: int, now: datetime) -> bool:
        """Whether this cycle may skip reading and planning: nothing changed since a cycle that
        changed nothing, not for too long, and no autoscaled deployment wants a new count. Writes
        each autoscaled deployment's status again when only its autoscaler log moved."""
        quiet = self._quiet
        if quiet is None or counter != quiet.counter:
            return False
        if now - quiet.at >= timedelta(seconds=FULL_READ_SECONDS):
            return False
        # Decisions made here are the full cycle's if one follows (see ``_scale``).
        scaled: dict[str, tuple[Deployment, Deployment]] = {}
        self._scaled = scaled
        for dep in quiet.deployments:
            if isinstance(dep.replicas, int) or self.signals is None:
                continue
            after = self._autoscale(dep, quiet.replicas)
            scaled[dep.name] = (dep, after)
            if after.desired_replicas != quiet.desired.get(dep.name):
                return False
        for name in scaled:
            status = quiet.statuses.get(name)
            if status is None:
                continue
            logged = status.model_copy(update={"autoscaler": self._autoscaler_log(name)})
            if logged.stored() != status.stored():
                try:
                    self.store.set_deployment_status(name, logged)
                except FleetserveError:
                    return False  # deleted meanwhile: a change the next full cycle reads
                quiet.statuses[name] = logged
        self._scaled = {}
        return True

    def _scale(self, dep: Deployment, replicas: tuple[Replica, ...]) -> Deployment:
        """The deployment as the autoscaler wants it: decided just before by the quiet check that
        started this cycle, if that was this very deployment, else now."""
        decided = self._scaled.get(dep.name)
        if decided is not None and decided[0] == dep:
            return decided[1]
        return self._autoscale(dep, replicas)

    def _autoscale(self, dep: Deployment, replicas: tuple[Replica, ...]) -> Deployment:
        """The deployment with the autoscaler's replica count, for a {min, max} range; as is otherwise."""
        if isinstance(dep.replicas, int) or self.signals is None:
            return dep
        now = time.monotonic()
        mine = [r for r in replicas if r.deployment == dep.name]
        decision = decide_for(dep, self.signals(dep, mine, now), self._scale_state.get(dep.name), now)
        if decision is None:
            return dep
        self._scale_state[dep.name] = decision.state
        self.scale_log.record(decision)
        if decision.changed:
            log.info("autoscaler: %s", render_decision(decision))
        return dep.model_copy(update={"replicas": decision.desired})

    def run_forever(
        self, stop: threading.Event, interval: float, on_cycle: Callable[[CycleResult], None] | None = None
    ) -> None:
        """Cycle every ``interval`` seconds until ``stop`` is set; a failing cycle is logged, not
        fatal. ``on_cycle`` is given each cycle that ended (a reconciler process sends its figures)."""
        self.interval = interval
        while not stop.is_set():
            try:
                result = self.run_once()
                if on_cycle is not None:
                    on_cycle(result)
                if result.allocated or result.released or result.draining or result.transitions:
                    log.info(
                        "cycle: allocated %s, draining %s, released %s, %d conflicts, %.1f ms",
                        result.allocated,
                        result.draining,
                        result.released,
                        len(result.conflicts),
                        result.seconds * 1000,
                    )
            except FleetserveError as exc:
                log.error("reconcile cycle failed: %s", exc)
            except Exception:
                # The loop is the supervisor of every cycle: log the fault with its traceback and
                # try again next cycle rather than leave the control plane without a reconciler.
                log.exception("reconcile cycle crashed")
            stop.wait(interval)
        try:
            self.store.release_leadership(LEASE, self.holder)
        except FleetserveError as exc:
            log.warning("could not hand the reconciler lease over: %s", exc)


def _same_but_autoscaler(status: DeploymentStatus, other: DeploymentStatus | None) -> bool:
    """Whether two statuses differ at most in the autoscaler's log."""
    if other is None:
        return False
    return {k: v for k, v in status.stored().items() if k != "autoscaler"} == {
        k: v for k, v in other.stored().items() if k != "autoscaler"
    }


def _settled(snapshot: ClusterSnapshot) -> bool:
    """Whether no replica waits on the clock: a drain ends at its deadline, a failed replica is
    replaced when its backoff ends, with nothing else changing meanwhile."""
    waiting = (ReplicaState.DRAINING, ReplicaState.FAILED)
    return not any(r.state in waiting for r in snapshot.replicas)
