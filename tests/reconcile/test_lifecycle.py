"""A deployment's replicas coming and going (reconcile.lifecycle through reconcile.core): failed
replicas replaced in place with backoff, drains that wait for in-flight requests, rollouts with surge.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from types import MappingProxyType
from typing import Any

import pytest
from pydantic import ValidationError

from builders import cpu_8c_32g, deployment, gpu_host_8c_64g
from fleetserve.conditions import ConditionReason, ConditionType
from fleetserve.gguf_facts import model_facts
from fleetserve.modelfacts import ModelFacts
from fleetserve.reconcile.core import ReconcilePlan, reconcile
from fleetserve.reconcile.lifecycle import (
    FAILURE_BACKOFF_MAX,
    ROUTES_SETTLE,
    FailureHistory,
    RolloutCause,
    drained,
    failure_backoff,
)
from fleetserve.snapshot import ClusterSnapshot, ReplicaFacts
from fleetserve.spec.resources import Deployment, DeviceClass, Model, Node, Replica, ReplicaState

GiB = 1 << 30
FACTS = MappingProxyType({"m": ModelFacts("m", 2 * GiB, 0, 4096), "m2": ModelFacts("m2", 2 * GiB, 0, 4096)})
CLASSES = MappingProxyType({"h100": DeviceClass(name="h100", driver="gpu.nvidia.com", memory=80 * GiB)})
T0 = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
CPU = {"name": "cpu", "engine": "llama.cpp", "cpu": {"cores": 2}}


@dataclass
class Cluster:
    """A cluster that follows its plans the way the store and agents would, without either."""

    nodes: list[Node]
    replicas: dict[str, Replica] = field(default_factory=dict)
    facts: dict[str, ReplicaFacts] = field(default_factory=dict)
    failures: dict[str, FailureHistory] = field(default_factory=dict)
    next_ordinal: dict[str, int] = field(default_factory=dict)
    now: datetime = T0
    models: Mapping[str, ModelFacts] = field(default_factory=lambda: FACTS)

    def snapshot(self) -> ClusterSnapshot:
        return ClusterSnapshot(
            classes=CLASSES,
            nodes=tuple(self.nodes),
            replicas=tuple(self.replicas[n] for n in sorted(self.replicas)),
            models=self.models,
            next_ordinals=MappingProxyType(dict(self.next_ordinal)),
            replica_facts=MappingProxyType(dict(self.facts)),
        )

    def cycle(self, deps: list[Deployment]) -> ReconcilePlan:
        plan = reconcile(deps, self.snapshot(), self.now, self.failures)
        for name in plan.drain:
            self.replicas[name] = self.replicas[name].model_copy(update={"state": ReplicaState.DRAINING})
            self.facts[name] = ReplicaFacts(draining_since=self.now)
        for name in plan.release:
            del self.replicas[name]
            self.facts.pop(name, None)
        for replica in plan.allocate:
            self.replicas[replica.name] = replica
            ordinal = int(replica.name.rsplit("-", 1)[1])
            self.next_ordinal[replica.deployment] = max(
                self.next_ordinal.get(replica.deployment, 0), ordinal + 1
            )
        for revision, names in plan.stamps.items():
            for name in names:
                self.replicas[name] = self.replicas[name].model_copy(update={"revision": revision})
        self.failures = {name: life.failures for name, life in plan.lifecycles.items()}
        return plan

    def set_state(self, name: str, state: ReplicaState, message: str = "") -> None:
        self.replicas[name] = self.replicas[name].model_copy(update={"state": state})
        if message:
            self.facts[name] = ReplicaFacts(message=message)

    def report_idle(self) -> None:
        """Every draining replica's agent reports nothing in flight, now."""
        for name, replica in self.replicas.items():
            if replica.state is ReplicaState.DRAINING:
                self.facts[name] = ReplicaFacts(
                    in_flight=0, reported_at=self.now, draining_since=self.facts[name].draining_since
                )

    def tick(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)

    def held_cores(self) -> int:
        return sum(s.cpu_cores for r in self.replicas.values() for s in r.shards)

    def states(self, dep: str) -> dict[str, ReplicaState]:
        return {n: r.state for n, r in sorted(self.replicas.items()) if r.deployment == dep}


def condition(plan: ReconcilePlan, kind: ConditionType) -> Any:
    return next(c for c in plan.decisions[0].conditions if c.type is kind)


# --- failed replicas ---------------------------------------------------------------------------


def test_a_failed_replica_counts_toward_desired_and_is_replaced_in_its_own_room_after_a_backoff():
    cluster = Cluster([cpu_8c_32g("c1")])
    dep = deployment("d", 1, CPU)
    [first] = cluster.cycle([dep]).allocate
    cluster.set_state(first.name, ReplicaState.FAILED, "source answered 404 Not Found")

    plan = cluster.cycle([dep])
    assert plan.allocate == () and plan.release == (), "a failed replica holds its place until replaced"
    failure = condition(plan, ConditionType.REPLICA_FAILURE)
    assert (failure.status, failure.reason) == (True, ConditionReason.REPLICA_FAILED)
    assert "404 Not Found" in failure.message and first.name in failure.message
    assert cluster.failures["d"].retry_at == T0 + failure_backoff(1)

    cluster.tick(failure_backoff(1).total_seconds())
    plan = cluster.cycle([dep])
    assert plan.release == (first.name,)
    [second] = plan.allocate
    assert second.name != first.name, "a replacement is a new identity"
    assert second.shards == first.shards, "released first, so the replacement takes the same allocation"


def test_a_replica_that_fails_forever_never_holds_more_than_the_desired_allocations():
    cluster = Cluster([cpu_8c_32g("c1")])
    dep = deployment("d", 1, CPU)
    waits = []
    for _ in range(12):
        cluster.cycle([dep])
        for name, state in cluster.states("d").items():
            if state is ReplicaState.PENDING:
                cluster.set_state(name, ReplicaState.FAILED, "source answered 404 Not Found")
        plan = cluster.cycle([dep])
        assert len(cluster.replicas) == 1 and cluster.held_cores() == 2, "capacity never leaks"
        retry_at = cluster.failures["d"].retry_at
        assert retry_at is not None
        waits.append(retry_at - cluster.now)
        cluster.now = retry_at
    assert cluster.failures["d"].count == 12
    assert waits[:3] == [failure_backoff(1), failure_backoff(2), failure_backoff(3)]
    assert waits[1] == 2 * waits[0], "the backoff doubles"
    assert max(waits) == FAILURE_BACKOFF_MAX, "and is capped"
    assert "12 failures in a row" in condition(plan, ConditionType.REPLICA_FAILURE).message


def test_the_failure_count_starts_afresh_once_the_deployment_runs_whole():
    cluster = Cluster([cpu_8c_32g("c1")])
    dep = deployment("d", 1, CPU)
    [first] = cluster.cycle([dep]).allocate
    cluster.set_state(first.name, ReplicaState.FAILED, "boom")
    cluster.cycle([dep])
    cluster.tick(60)
    [second] = cluster.cycle([dep]).allocate
    cluster.set_state(second.name, ReplicaState.RUNNING)
    plan = cluster.cycle([dep])
    assert cluster.failures["d"].count == 0
    assert condition(plan, ConditionType.REPLICA_FAILURE).status is False


# --- drains --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("case", "facts", "after", "released"),
    [
        ("in flight reported after the routes settled, none left", dict(in_flight=0, settled=True), 3, True),
        (
            "nothing in flight, but read before every gateway refreshed",
            dict(in_flight=0, settled=False),
            3,
            False,
        ),
        ("requests still in flight", dict(in_flight=2, settled=True), 3, False),
        ("requests still in flight at the deadline", dict(in_flight=2, settled=True), 30, True),
        ("the engine's metrics could not be read", dict(in_flight=None, settled=True), 29, False),
        (
            "the engine's metrics could not be read, deadline passed",
            dict(in_flight=None, settled=True),
            30,
            True,
        ),
    ],
)
def test_a_draining_replica_is_released_when(case: str, facts: dict[str, Any], after: float, released: bool):
    reported = T0 + (ROUTES_SETTLE if facts["settled"] else ROUTES_SETTLE / 2)
    state = ReplicaFacts(in_flight=facts["in_flight"], reported_at=reported, draining_since=T0)
    assert drained(state, 30.0, T0 + timedelta(seconds=after)) is released, case


def test_drain_seconds_is_the_deployments_deadline():
    cluster = Cluster([cpu_8c_32g("c1")])
    dep = deployment("d", 1, CPU, drainSeconds=5)
    [r] = cluster.cycle([dep]).allocate
    cluster.set_state(r.name, ReplicaState.RUNNING)
    smaller = deployment("d", 0, CPU, drainSeconds=5)
    assert cluster.cycle([smaller]).drain == (r.name,)
    cluster.tick(4.9)
    assert cluster.cycle([smaller]).release == ()
    cluster.tick(0.1)
    assert cluster.cycle([smaller]).release == (r.name,)


def test_a_draining_replica_is_not_counted_so_its_replacement_is_placed_at_once():
    cluster = Cluster([cpu_8c_32g("c1"), cpu_8c_32g("c2")])
    dep = deployment("d", 1, CPU)
    [r] = cluster.cycle([dep]).allocate
    cluster.set_state(r.name, ReplicaState.RUNNING)
    cluster.replicas[r.name] = r.model_copy(update={"state": ReplicaState.DRAINING})  # a node drain
    cluster.facts[r.name] = ReplicaFacts(draining_since=cluster.now)
    plan = cluster.cycle([dep])
    assert len(plan.allocate) == 1 and plan.release == ()


# --- rollouts ------------------------------------------------------------------------------------


def roll(cluster: Cluster, dep: Deployment, cycles: int = 30) -> list[dict[str, ReplicaState]]:
    """Drive a rollout: each cycle, new replicas start Running and draining ones go idle."""
    seen = []
    for _ in range(cycles):
        cluster.cycle([dep])
        seen.append(cluster.states(dep.name))
        for name, state in cluster.states(dep.name).items():
            if state is ReplicaState.PENDING:
                cluster.set_state(name, ReplicaState.RUNNING)
        cluster.tick(ROUTES_SETTLE.total_seconds())
        cluster.report_idle()
    return seen


@pytest.mark.parametrize(
    ("surge", "unavailable"),
    [(1, 0), (2, 0), (0, 1), (1, 1)],
)
def test_a_rollout_replaces_every_replica_within_its_surge_and_unavailability(surge: int, unavailable: int):
    cluster = Cluster([cpu_8c_32g("c1"), cpu_8c_32g("c2"), cpu_8c_32g("c3")])
    rollout = {"maxSurge": surge, "maxUnavailable": unavailable}
    old = deployment("d", 3, CPU, rollout=rollout)
    roll(cluster, old, 3)
    old_names = set(cluster.replicas)
    assert len(old_names) == 3

    new = deployment("d", 3, CPU, model="m2", rollout=rollout)
    assert new.template_revision() != old.template_revision()
    for states in roll(cluster, new):
        serving = [n for n, s in states.items() if s is ReplicaState.RUNNING]
        counted = [n for n, s in states.items() if s is not ReplicaState.DRAINING]
        assert len(serving) >= 3 - unavailable, states
        assert len(counted) <= 3 + surge, states
    assert not old_names & set(cluster.replicas), "every old replica is gone"
    assert all(r.revision == new.template_revision() for r in cluster.replicas.values())
    assert all(s is ReplicaState.RUNNING for s in cluster.states("d").values())


def test_with_no_unavailability_a_new_replica_is_ready_before_an_old_one_drains():
    cluster = Cluster([cpu_8c_32g("c1"), cpu_8c_32g("c2")])
    old = deployment("d", 1, CPU)
    roll(cluster, old, 2)
    [old_name] = cluster.replicas
    new = deployment("d", 1, CPU, model="m2")
    plan = cluster.cycle([new])
    assert len(plan.allocate) == 1 and plan.drain == ()
    assert condition(plan, ConditionType.PROGRESSING).reason is ConditionReason.ROLLING_OUT
    cluster.cycle([new])
    assert cluster.states("d")[old_name] is ReplicaState.RUNNING, "the new one is not Ready yet"
    cluster.set_state(plan.allocate[0].name, ReplicaState.RUNNING)
    assert cluster.cycle([new]).drain == (old_name,)


def test_changing_the_replica_count_or_policies_is_no_rollout():
    base = deployment("d", 1, CPU)
    assert deployment("d", 3, CPU, drainSeconds=5).template_revision() == base.template_revision()
    args = dict(CPU, engineArgs=["--temp", "0.5"])
    assert deployment("d", 1, args).template_revision() != base.template_revision()


def test_a_rollout_that_could_never_move_is_refused():
    with pytest.raises(ValidationError, match="cannot both be 0"):
        deployment("d", 1, CPU, rollout={"maxSurge": 0, "maxUnavailable": 0})


def test_failure_history_survives_its_status_round_trip():
    history = FailureHistory(3, "boom", "d-7", ("d-7",), T0)
    assert FailureHistory.from_status(history.to_dict()) == history
    assert FailureHistory.from_status({"count": "x"}) == FailureHistory()
    assert FailureHistory.from_status(None) == FailureHistory()


def test_a_gpu_rollout_surges_on_free_devices():
    cluster = Cluster([gpu_host_8c_64g("a", "h100", 2)])
    old = deployment("d", 1)
    roll(cluster, old, 2)
    new = deployment("d", 1, model="m2")
    plan = cluster.cycle([new])
    assert [r.shards[0].devices for r in plan.allocate] == [(1,)]


# --- a model's change ----------------------------------------------------------------------------

MODEL = Model(name="m", source="/models/m.gguf", size=2 * GiB, sha256="a" * 64)


def serving(model: Model) -> Mapping[str, ModelFacts]:
    """The snapshot's model facts with ``model`` as the edge reads it (its weights digest too)."""
    return MappingProxyType({**FACTS, model.name: model_facts(model)})


@pytest.mark.parametrize(
    ("change", "rolls"),
    [({"sha256": "b" * 64}, True), ({"source": "/models/m-v2.gguf"}, True), ({"size": 3 * GiB}, False)],
    ids=["a new sha256", "a new source", "a new size"],
)
def test_a_models_new_weights_roll_its_replicas_within_the_surge_and_its_other_facts_roll_nothing(
    change: dict[str, Any], rolls: bool
):
    cluster = Cluster([cpu_8c_32g("c1"), cpu_8c_32g("c2"), cpu_8c_32g("c3")], models=serving(MODEL))
    dep = deployment("d", 2, CPU, rollout={"maxSurge": 1, "maxUnavailable": 0})
    roll(cluster, dep, 3)
    old_names = set(cluster.replicas)
    assert len(old_names) == 2

    cluster.models = serving(MODEL.model_copy(update=change))
    first = cluster.cycle([dep])
    if not rolls:
        assert (first.allocate, first.drain, first.release) == ((), (), ())
        assert condition(first, ConditionType.PROGRESSING).reason is ConditionReason.COMPLETE
        return
    assert len(first.allocate) == 1 and first.drain == (), "one surge replica, nothing drained yet"
    progress = first.lifecycles["d"].progress
    assert progress is not None and progress.cause is RolloutCause.MODEL
    assert "the weights of model m changed" in condition(first, ConditionType.PROGRESSING).message
    for states in roll(cluster, dep):
        assert sum(s is ReplicaState.RUNNING for s in states.values()) >= 2, states
        assert sum(s is not ReplicaState.DRAINING for s in states.values()) <= 3, states
    assert not old_names & set(cluster.replicas), "every old replica is gone"
    revision = cluster.snapshot().revision_of(dep)
    assert all(r.revision == revision for r in cluster.replicas.values())


def test_replicas_placed_before_the_weights_counted_are_kept_and_stamped_then_rolled_by_a_model_change():
    """An upgraded server rolls nothing: the replicas an older server placed (revision without the
    weights part) are current, stamped with the full revision; the model's next change rolls them."""
    cluster = Cluster([cpu_8c_32g("c1"), cpu_8c_32g("c2"), cpu_8c_32g("c3")])
    dep = deployment("d", 2, CPU)
    roll(cluster, dep, 3)
    legacy = dict(cluster.replicas)
    assert all(r.revision == dep.template_revision() for r in legacy.values())

    cluster.models = serving(MODEL)  # the upgraded server's snapshot knows the weights
    plan = cluster.cycle([dep])
    revision = cluster.snapshot().revision_of(dep)
    assert (plan.allocate, plan.drain, plan.release) == ((), (), ())
    assert plan.stamps == {revision: tuple(sorted(legacy))}
    assert condition(plan, ConditionType.PROGRESSING).reason is ConditionReason.COMPLETE
    assert all(r.revision == revision for r in cluster.replicas.values())
    assert cluster.cycle([dep]).stamps == {}, "stamped once"

    cluster.models = serving(MODEL.model_copy(update={"sha256": "c" * 64}))
    assert len(cluster.cycle([dep]).allocate) == 1, "the stamped replicas are old now"


def test_a_deployment_change_and_a_model_change_together_say_both():
    cluster = Cluster([cpu_8c_32g("c1"), cpu_8c_32g("c2")], models=serving(MODEL))
    roll(cluster, deployment("d", 1, CPU), 2)
    cluster.models = serving(MODEL.model_copy(update={"sha256": "d" * 64}))
    plan = cluster.cycle([deployment("d", 1, dict(CPU, engineArgs=["--temp", "0.5"]))])
    progress = plan.lifecycles["d"].progress
    assert progress is not None and progress.cause is RolloutCause.BOTH
