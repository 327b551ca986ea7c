"""The reconciler loop over a real store (SQLite and PostgreSQL), with a clock the tests move.

Each test drives ``Reconciler.run_once`` by hand: allocation, node liveness, the multi-accelerator
gate, leader election, recorded decisions, and plans that went stale before their commit.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from builders import deployment as build_deployment
from builders import gpu_host_32c_256g, safetensors_8gb
from fleetserve.autoscale import Signals
from fleetserve.metrics.exposition import FleetMetrics
from fleetserve.modelfacts import ModelFacts
from fleetserve.placement.placer import RECORDED_UNPLACED
from fleetserve.protocol import ReplicaStatus
from fleetserve.reconcile.core import reconcile
from fleetserve.reconcile.health import HeartbeatPolicy
from fleetserve.routing import routable
from fleetserve.server.admin.apply import apply_batch
from fleetserve.server.reconciler.loop import LEASE, CyclePhase, CycleResult, Reconciler
from fleetserve.snapshot import ClusterSnapshot
from fleetserve.spec.policies import ReplicaRange
from fleetserve.spec.resources import Deployment, DeviceClass, Fabric, Node, NodeState, Replica, ReplicaState
from fleetserve.spec.status import DecisionRecord, DeploymentStatus
from fleetserve.store import SqlStore

T0 = datetime(2025, 6, 1, 12, 0, tzinfo=UTC)
POLICY = HeartbeatPolicy(not_ready_after=timedelta(seconds=40), lost_after=timedelta(seconds=300))
TTL = timedelta(seconds=15)

H100 = DeviceClass(name="h100", driver="gpu.nvidia.com", memory="80GiB")
MI300 = DeviceClass(name="mi300x", driver="gpu.amd.com", memory="192GiB")
MODEL = safetensors_8gb()


class FakeClock:
    """A clock that only moves when told to."""

    def __init__(self, start: datetime = T0) -> None:
        self._now = start

    def now(self) -> datetime:
        return self._now

    def advance(self, seconds: float) -> datetime:
        self._now += timedelta(seconds=seconds)
        return self._now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def reconciler(store: SqlStore, clock: FakeClock, holder: str = "server-1") -> Reconciler:
    return Reconciler(store, policy=POLICY, lease_ttl=TTL, clock=clock.now, holder=holder)


def gpu_node(name: str, count: int = 2, cls: DeviceClass = H100) -> Node:
    return gpu_host_32c_256g(name, cls.name, count)


def node_doc(name: str, count: int = 2, cls: DeviceClass = H100) -> dict[str, Any]:
    return {"kind": "Node", **gpu_node(name, count, cls).model_dump(mode="json", by_alias=True)}


def deployment(
    name: str = "chat",
    replicas: int = 1,
    cls: DeviceClass = H100,
    devices: int = 1,
    runtime: str | None = None,
) -> Deployment:
    profile: dict[str, Any] = {
        "name": "gpu",
        "engine": "vllm",
        "deviceClass": cls.name,
        "devicesPerNode": devices,
    }
    if runtime is not None:
        profile["runtime"] = runtime
    return build_deployment(name, replicas, profile, model=MODEL.name)


def setup(
    store: SqlStore,
    nodes: list[Node],
    deployments: list[Deployment],
    classes: tuple[DeviceClass, ...] = (H100,),
) -> None:
    for cls in classes:
        store.put_class(cls)
    for node in nodes:
        store.register(node)
    store.put_model(MODEL)
    for dep in deployments:
        store.put_deployment(dep)


def placement(store: SqlStore, deployment: str | None = None) -> dict[str, list[tuple[str, tuple[int, ...]]]]:
    """Replica name → its shards as (node, devices): where everything runs."""
    return {r.name: [(s.node, s.devices) for s in r.shards] for r in store.replicas(deployment)}


def shared_devices(store: SqlStore) -> list[tuple[str, int]]:
    """(node, device) pairs held by more than one replica: must always be empty."""
    seen: dict[tuple[str, int], int] = {}
    for replica in store.replicas():
        for shard in replica.shards:
            for device in shard.devices:
                seen[(shard.node, device)] = seen.get((shard.node, device), 0) + 1
    return sorted(k for k, n in seen.items() if n > 1)


def condition(store: SqlStore, deployment: str, kind: str) -> dict[str, Any]:
    status = store.get_deployment(deployment).status
    found: dict[str, Any] = next(c for c in status["conditions"] if c["type"] == kind)
    return found


def quiet(result: CycleResult) -> bool:
    """Whether a cycle led and changed nothing."""
    return result.leader and not (
        result.allocated or result.released or result.conflicts or result.transitions
    )


# --- allocation --------------------------------------------------------------------------------


def test_desired_replicas_are_allocated_and_a_second_cycle_changes_nothing(
    store: SqlStore, clock: FakeClock
) -> None:
    setup(store, [gpu_node("gpu-a"), gpu_node("gpu-b")], [deployment("chat", replicas=3)])
    loop = reconciler(store, clock)

    first = loop.run_once()

    assert first.leader and not first.conflicts
    assert sorted(first.allocated) == ["chat-0", "chat-1", "chat-2"]
    before = placement(store)
    assert sorted(before) == ["chat-0", "chat-1", "chat-2"]
    assert shared_devices(store) == []
    status = store.get_deployment("chat").status
    assert (status["desiredReplicas"], status["replicas"], status["unschedulable"]) == (
        3,
        ["chat-0", "chat-1", "chat-2"],
        0,
    )
    assert status["observedGeneration"] == 1

    clock.advance(5)
    second = loop.run_once()

    assert quiet(second), second
    assert placement(store) == before  # running replicas stay where they are


def test_the_datacenter_example_settles_in_one_cycle(
    store: SqlStore, clock: FakeClock, datacenter: list[dict[str, Any]]
) -> None:
    apply_batch(datacenter, store)
    loop = reconciler(store, clock)

    first = loop.run_once()

    assert first.leader and first.allocated and not first.conflicts
    before = placement(store)
    assert shared_devices(store) == []
    assert all(s[0] != "hgx-08" for shards in before.values() for s in shards)  # cordoned
    clock.advance(5)
    assert quiet(loop.run_once())
    assert placement(store) == before


# --- node liveness -----------------------------------------------------------------------------


def test_a_silent_node_goes_not_ready_then_lost_and_its_replicas_move_under_new_names(
    store: SqlStore, clock: FakeClock
) -> None:
    setup(store, [gpu_node("gpu-a")], [deployment("chat", replicas=1)])
    store.heartbeat("gpu-a", clock.now())  # an agent runs on gpu-a
    loop = reconciler(store, clock)
    assert loop.run_once().allocated == ["chat-0"]
    assert placement(store) == {"chat-0": [("gpu-a", (0,))]}
    # A second node, declared by apply: no agent has ever run on it.
    apply_batch([node_doc("gpu-b")], store)

    clock.advance(39)
    assert quiet(loop.run_once())

    clock.advance(1)  # 40 s of silence
    not_ready = loop.run_once()
    assert not_ready.transitions == [("gpu-a", "Ready", "NotReady")]
    assert not (not_ready.allocated or not_ready.released)
    assert store.get_node("gpu-a").state is NodeState.NOT_READY
    assert placement(store) == {"chat-0": [("gpu-a", (0,))]}  # a NotReady node keeps its replicas

    clock.advance(100)
    assert quiet(loop.run_once())

    clock.advance(160)  # 300 s of silence
    lost = loop.run_once()
    assert lost.transitions == [("gpu-a", "NotReady", "Lost")]
    assert lost.released == ["chat-0"]
    [moved] = lost.allocated
    assert moved != "chat-0"  # never the old identity: its agent may still run chat-0
    assert placement(store) == {moved: [("gpu-b", (0,))]}
    assert store.get_node("gpu-a").state is NodeState.LOST
    assert store.get_node("gpu-b").state is NodeState.READY  # no heartbeat ever: not judged
    assert store.get_deployment("chat").status["replicas"] == [moved]
    [decision] = store.list_decisions("chat", limit=1)
    assert decision.explanation["lost"] == ["chat-0"]

    clock.advance(5)
    assert quiet(loop.run_once())


def test_most_of_the_fleet_silent_past_the_lost_deadline_moves_nothing_and_lost_nodes_go_one_per_token(
    store: SqlStore, clock: FakeClock
) -> None:
    """Disruption mode in the loop (``reconcile/disruption.py``): four of five nodes silent for
    ten minutes are NotReady, none Lost, no replica released. Two come back at the registration
    they hold (Ready again, no new epoch): the mode ends, and the two still silent are judged Lost
    a Lost deadline later, one per token (0.1 node/s)."""
    nodes = [gpu_node(f"gpu-{i}") for i in range(5)]
    setup(store, nodes, [deployment("chat", replicas=3)])
    for n in nodes:
        store.heartbeat(n.name, clock.now(), epoch=1)
    loop = reconciler(store, clock)
    assert len(loop.run_once().allocated) == 3
    before = placement(store)
    hosting = sorted({node for shards in before.values() for node, _ in shards})
    spare = [n.name for n in nodes if n.name not in hosting]
    heard, silent = spare[0], sorted(set(n.name for n in nodes) - {spare[0]})
    assert len(silent) == 4 and set(hosting) <= set(silent)
    for _ in range(30):  # 600 s, heartbeats from one node only
        clock.advance(20)
        store.heartbeat(heard, clock.now(), epoch=1)
        cycle = loop.run_once()
        assert not (cycle.released or cycle.allocated), cycle
        assert all(new != "Lost" for _, _, new in cycle.transitions), cycle
    assert cycle.disruption is not None and (cycle.disruption.silent, cycle.disruption.fleet) == (4, 5)
    assert sorted(cycle.held) == silent
    assert placement(store) == before
    assert {store.get_node(n).state for n in silent} == {NodeState.NOT_READY}

    back, still = silent[:2], silent[2:]
    for name in (heard, *back):
        store.heartbeat(name, clock.now(), epoch=1)
    assert {store.get_node(n).state for n in back} == {NodeState.READY}
    ended = loop.run_once()
    assert ended.disruption is None and not ended.transitions
    # Judgement resumes counted from the mode's end: nothing Lost until a Lost deadline later.
    clock.advance(299)
    for name in (heard, *back):
        store.heartbeat(name, clock.now(), epoch=1)
    assert not loop.run_once().transitions
    losts: list[tuple[int, str]] = []
    for step in range(1, 5):  # then one per 10 s: 5 s cycles, a Lost at the first and the third
        clock.advance(5)
        for name in (heard, *back):
            store.heartbeat(name, clock.now(), epoch=1)
        losts += [(step, node) for node, _, new in loop.run_once().transitions if new == "Lost"]
    assert [step for step, _ in losts] == [1, 3], losts
    assert sorted(node for _, node in losts) == still
    assert {h.name: h.epoch for h in store.node_heartbeats()} == dict.fromkeys((n.name for n in nodes), 1)


def test_a_replica_name_moved_away_from_a_lost_node_is_never_handed_out_again(
    store: SqlStore, clock: FakeClock
) -> None:
    setup(store, [gpu_node("gpu-a"), gpu_node("gpu-b", count=4)], [])
    store.set_state("gpu-b", NodeState.NOT_READY)  # keep chat-0 on gpu-a
    store.put_deployment(deployment("chat", replicas=1))
    store.heartbeat("gpu-a", clock.now())
    loop = reconciler(store, clock)
    assert loop.run_once().allocated == ["chat-0"]
    store.register(gpu_node("gpu-b", count=4))  # gpu-b's agent comes back: Ready again

    clock.advance(300)
    lost = loop.run_once()
    assert lost.released == ["chat-0"]
    assert lost.allocated and "chat-0" not in lost.allocated

    # A later scale-up must not bring chat-0 back either: gpu-a's agent, cut off, may still be
    # serving under that name until it re-registers and is told to stop.
    store.put_deployment(deployment("chat", replicas=3))
    clock.advance(5)
    scaled = loop.run_once()
    assert len(scaled.allocated) == 2
    assert "chat-0" not in placement(store), sorted(placement(store))


def test_nodes_declared_by_apply_without_an_agent_keep_their_declared_state(
    store: SqlStore, clock: FakeClock
) -> None:
    store.put_class(H100)
    store.put_model(MODEL)
    apply_batch([node_doc("gpu-a"), node_doc("gpu-b")], store)
    store.put_deployment(deployment("chat", replicas=2))
    assert all(h.last_heartbeat is None for h in store.node_heartbeats())
    loop = reconciler(store, clock)
    loop.run_once()
    before = placement(store)

    clock.advance(3600)
    result = loop.run_once()

    assert quiet(result), result
    assert [(n.name, n.state) for n in store.nodes()] == [
        ("gpu-a", NodeState.READY),
        ("gpu-b", NodeState.READY),
    ]
    assert placement(store) == before


# --- the multi-accelerator gate ----------------------------------------------------------------


def test_a_class_edited_to_an_unsupported_driver_is_gated_without_stopping_what_runs(
    store: SqlStore, clock: FakeClock
) -> None:
    setup(
        store,
        [gpu_node("gpu-a", count=4), gpu_node("amd-a", count=4, cls=MI300)],
        [deployment("chat", replicas=1), deployment("batch", replicas=1, cls=MI300, runtime="rocm")],
        classes=(H100, MI300),
    )
    loop = reconciler(store, clock)
    assert sorted(loop.run_once().allocated) == ["batch-0", "chat-0"]
    chat_before = placement(store, "chat")

    # A mistyped driver on the class, and more replicas wanted of both deployments.
    store.put_class(H100.model_copy(update={"driver": "gpu.nvidai.com"}))
    store.put_deployment(deployment("chat", replicas=2))
    store.put_deployment(deployment("batch", replicas=2, cls=MI300, runtime="rocm"))
    clock.advance(5)
    gated = loop.run_once()

    accepted = condition(store, "chat", "Accepted")
    assert (accepted["status"], accepted["reason"]) == (False, "UnsupportedDevices")
    assert "gpu.nvidai.com" in accepted["message"]
    assert gated.released == []  # nothing stopped or deleted
    assert placement(store, "chat") == chat_before  # the running replica keeps its shards
    assert store.get_deployment("chat").status["replicas"] == list(chat_before)
    # The filter drops something: no new replica on the gated class...
    assert not [name for name in gated.allocated if name.startswith("chat-")]
    assert store.get_deployment("chat").status["unschedulable"] == 1
    # ...while a deployment on a supported class keeps being placed normally.
    assert [name for name in gated.allocated if name.startswith("batch-")] == ["batch-1"]
    assert condition(store, "batch", "Accepted")["status"] is True
    assert {s[0] for shards in placement(store, "batch").values() for s in shards} == {"amd-a"}

    clock.advance(5)
    again = loop.run_once()
    assert not again.released and placement(store, "chat") == chat_before

    # Fixing the typo lets the deployment grow again; what ran was never touched.
    store.put_class(H100)
    clock.advance(5)
    fixed = loop.run_once()
    assert condition(store, "chat", "Accepted")["status"] is True
    assert [name for name in fixed.allocated if name.startswith("chat-")] == ["chat-1"]
    assert {k: v for k, v in placement(store, "chat").items() if k in chat_before} == chat_before
    assert shared_devices(store) == []


# --- leader election ---------------------------------------------------------------------------


def test_only_the_lease_holder_acts_and_another_takes_over_when_it_stops_renewing(
    two_stores: tuple[SqlStore, SqlStore], clock: FakeClock
) -> None:
    store_a, store_b = two_stores
    setup(store_a, [gpu_node("gpu-a", count=4)], [deployment("chat", replicas=1)])
    a = reconciler(store_a, clock, holder="server-a")
    b = reconciler(store_b, clock, holder="server-b")

    assert a.run_once().allocated == ["chat-0"]
    follower = b.run_once()
    assert follower == CycleResult(leader=False)

    # Work for the follower to be tempted by: it must leave it alone.
    store_b.put_deployment(deployment("chat", replicas=2))
    clock.advance(5)
    assert b.run_once() == CycleResult(leader=False)
    assert sorted(placement(store_a)) == ["chat-0"]
    assert a.run_once().allocated == ["chat-1"]  # renewed at t=5, until t=20

    # At every tick, whatever the order, exactly one of them leads.
    for tick in range(6):
        clock.advance(3)
        first, second = (a, b) if tick % 2 else (b, a)
        assert [first.run_once().leader, second.run_once().leader].count(True) == 1
    assert store_a.leader(LEASE, clock.now()) == "server-a"

    # a stops renewing (its process hangs or dies): once its lease ran out, b takes over.
    clock.advance(TTL.total_seconds() - 1)
    assert not b.run_once().leader
    clock.advance(1)
    takeover = b.run_once()
    assert takeover.leader
    assert store_b.leader(LEASE, clock.now()) == "server-b"
    assert not a.run_once().leader

    # b acts as the leader now.
    store_a.put_deployment(deployment("chat", replicas=3))
    clock.advance(1)
    assert b.run_once().allocated == ["chat-2"]
    assert shared_devices(store_a) == []


def test_releasing_the_lease_lets_the_other_take_over_at_once(
    two_stores: tuple[SqlStore, SqlStore], clock: FakeClock
) -> None:
    store_a, store_b = two_stores
    setup(store_a, [gpu_node("gpu-a", count=4)], [deployment("chat", replicas=1)])
    a = reconciler(store_a, clock, holder="server-a")
    b = reconciler(store_b, clock, holder="server-b")
    assert a.run_once().leader
    assert not b.run_once().leader

    assert store_a.release_leadership(LEASE, a.holder)
    assert b.run_once().leader  # same instant: no waiting for the ttl
    assert not a.run_once().leader

    # run_forever gives the lease up when it stops, too.
    stop = threading.Event()
    stop.set()
    b.run_forever(stop, interval=0.0)
    assert store_a.leader(LEASE, clock.now()) is None
    assert a.run_once().leader


# --- recorded decisions ------------------------------------------------------------------------


def test_a_decision_is_recorded_when_replicas_are_placed_or_unschedulable(
    store: SqlStore, clock: FakeClock
) -> None:
    setup(
        store,
        [gpu_node("gpu-a"), gpu_node("gpu-b")],
        [deployment("chat", replicas=2), deployment("huge", replicas=1, devices=4)],  # no node has 4
    )
    loop = reconciler(store, clock)
    loop.run_once()

    [placed] = store.list_decisions("chat")
    assert placed.created_at == clock.now()
    assert sorted(p["replica"] for p in placed.explanation["placed"]) == ["chat-0", "chat-1"]
    [unschedulable] = store.list_decisions("huge")
    assert [u["replica"] for u in unschedulable.explanation["unplaced"]] == ["huge-0"]
    [report] = unschedulable.explanation["unplaced"][0]["reports"]
    # chat filled one node (bin packing); the other has 2 of the 4 devices needed.
    assert sorted((r["reason"], r["count"], r["have"]) for r in report["reasons"]) == [
        ("InsufficientFreeDevices", 1, 0),
        ("InsufficientFreeDevices", 1, 2),
    ]
    assert report["message"].startswith("profile gpu: 0/2 nodes fit")
    scheduled = condition(store, "huge", "Scheduled")
    assert (scheduled["status"], scheduled["reason"]) == (False, "Unschedulable")


def test_a_recorded_decision_explains_the_first_unplaced_replicas_and_counts_the_rest(
    store: SqlStore, clock: FakeClock
) -> None:
    setup(store, [gpu_node("gpu-a")], [deployment("huge", replicas=RECORDED_UNPLACED + 7, devices=4)])
    reconciler(store, clock).run_once()

    [record] = store.list_decisions("huge")
    unplaced = record.explanation["unplaced"]
    assert [u["replica"] for u in unplaced] == [f"huge-{i}" for i in range(RECORDED_UNPLACED)]
    assert all(u["reports"] for u in unplaced)
    assert record.explanation["unplacedTotal"] == RECORDED_UNPLACED + 7
    # The deployment's status still counts every one of them.
    [stored] = [d for d in store.list_deployments() if d.deployment.name == "huge"]
    assert stored.status["unschedulable"] == RECORDED_UNPLACED + 7


def test_steady_state_cycles_do_not_record_a_decision_every_cycle(store: SqlStore, clock: FakeClock) -> None:
    setup(
        store,
        [gpu_node("gpu-a"), gpu_node("gpu-b")],
        [deployment("chat", replicas=2), deployment("huge", replicas=1, devices=4)],
    )
    loop = reconciler(store, clock)
    loop.run_once()
    clock.advance(5)
    loop.run_once()
    recorded = {d: len(store.list_decisions(d)) for d in ("chat", "huge")}

    for _ in range(5):
        clock.advance(5)
        assert quiet(loop.run_once())

    assert {d: len(store.list_decisions(d)) for d in ("chat", "huge")} == recorded


def test_the_first_steady_state_cycle_does_not_bury_the_decision_that_placed_the_replicas(
    store: SqlStore, clock: FakeClock
) -> None:
    setup(
        store,
        [gpu_node("gpu-a"), gpu_node("gpu-b")],
        [deployment("chat", replicas=2), deployment("huge", replicas=1, devices=4)],
    )
    loop = reconciler(store, clock)
    loop.run_once()
    placed_at = clock.now()

    clock.advance(5)
    assert quiet(loop.run_once())  # everything desired runs: this cycle only keeps it

    # Neither deployment changed, so no new decision: `explain` (the latest decision) must still
    # say where chat's replicas were placed and why huge does not fit.
    assert [(d.created_at, d.deployment) for d in store.list_decisions()] == [
        (placed_at, "huge"),
        (placed_at, "chat"),
    ]
    latest = store.list_decisions("chat", limit=1)[0].explanation
    assert sorted(p["replica"] for p in latest["placed"]) == ["chat-0", "chat-1"]


def test_a_change_records_a_new_decision(store: SqlStore, clock: FakeClock) -> None:
    setup(store, [gpu_node("gpu-a"), gpu_node("gpu-b")], [deployment("chat", replicas=1)])
    loop = reconciler(store, clock)
    loop.run_once()
    count = len(store.list_decisions("chat"))

    store.put_deployment(deployment("chat", replicas=2))
    clock.advance(5)
    loop.run_once()

    decisions = store.list_decisions("chat")
    assert len(decisions) == count + 1
    assert [p["replica"] for p in decisions[0].explanation["placed"]] == ["chat-1"]
    assert decisions[0].created_at == clock.now()


# --- stale plans -------------------------------------------------------------------------------


def test_devices_taken_directly_through_the_store_are_never_allocated_twice(
    store: SqlStore, clock: FakeClock
) -> None:
    setup(
        store,
        [gpu_node("gpu-a"), gpu_node("gpu-b")],
        [deployment("batch", replicas=1, devices=2), deployment("chat", replicas=3)],
    )
    # Someone took gpu-a's two devices for batch before the reconciler ever ran.
    store.allocate(
        Replica.model_validate(
            {
                "name": "batch-0",
                "deployment": "batch",
                "profile": "gpu",
                "deviceClass": "h100",
                "shards": [{"node": "gpu-a", "devices": [0, 1]}],
            }
        )
    )
    result = reconciler(store, clock).run_once()

    assert result.conflicts == [] and result.released == []
    assert sorted(result.allocated) == ["chat-0", "chat-1"]  # the third does not fit
    assert shared_devices(store) == []
    assert placement(store, "batch") == {"batch-0": [("gpu-a", (0, 1))]}
    assert {s[0] for shards in placement(store, "chat").values() for s in shards} == {"gpu-b"}
    assert store.get_deployment("chat").status["unschedulable"] == 1


class RacingStore(SqlStore):
    """A store where, right after the reconciler's snapshot, another writer takes exactly the
    devices the reconciler's plan is about to allocate: its plan is stale before it commits."""

    def __init__(self, store: SqlStore) -> None:
        super().__init__(store.engine)
        self.stolen: Replica | None = None

    def snapshot(self, models: Mapping[str, ModelFacts] | None = None) -> ClusterSnapshot:
        snap = super().snapshot(models)
        if self.stolen is None:
            plan = reconcile([d.deployment for d in self.list_deployments()], snap)
            target = plan.allocate[0]
            self.stolen = target
            self.allocate(target.model_copy(update={"name": "intruder-0", "deployment": "intruder"}))
        return snap


def test_a_plan_gone_stale_before_its_commit_is_refused_not_double_allocated(
    store: SqlStore, clock: FakeClock
) -> None:
    setup(store, [gpu_node("gpu-a"), gpu_node("gpu-b")], [deployment("chat", replicas=2)])
    racing = RacingStore(store)
    loop = reconciler(racing, clock)

    result = loop.run_once()

    assert racing.stolen is not None
    assert result.leader
    assert result.conflicts == [racing.stolen.name]  # counted, not raised
    assert racing.stolen.name not in result.allocated
    assert len(result.allocated) == 1
    assert shared_devices(store) == []
    assert racing.stolen.name not in store.get_deployment("chat").status["replicas"]
    intruder = store.get_replica("intruder-0")
    assert intruder.shards == racing.stolen.shards

    # The next cycle decides again from the real state: the intruder belongs to no deployment
    # and is stopped, and chat gets its second replica.
    clock.advance(5)
    again = loop.run_once()
    assert again.conflicts == []
    assert again.released == ["intruder-0"]
    assert len(again.allocated) == 1
    assert len(store.replicas("chat")) == 2
    assert shared_devices(store) == []
    clock.advance(5)
    assert quiet(loop.run_once())


# --- lifecycle: failures and drains through the SQL store ------------------------------------------


def report(store: SqlStore, node: str, now: datetime, **replicas: tuple[ReplicaState, ReplicaStatus]) -> None:
    """What the node's agent would report: replica states and statuses."""
    store.report(node, store.epoch(node), now, {name.replace("_", "-"): v for name, v in replicas.items()})


def held_devices(store: SqlStore) -> int:
    return sum(len(s.devices) for r in store.replicas() for s in r.shards)


def test_a_replica_failing_again_and_again_never_holds_more_than_its_one_allocation(
    store: SqlStore, clock: FakeClock
) -> None:
    setup(store, [gpu_node("gpu-a")], [deployment("chat", replicas=1)])
    loop = reconciler(store, clock)
    names = set()
    for _ in range(8):
        loop.run_once()
        [replica] = store.replicas("chat")
        names.add(replica.name)
        failed = ReplicaStatus(message="model source answered 404 Not Found")
        store.report(
            "gpu-a", store.epoch("gpu-a"), clock.now(), {replica.name: (ReplicaState.FAILED, failed)}
        )
        for _ in range(3):  # cycles within the backoff change nothing
            clock.advance(1)
            store.heartbeat("gpu-a", clock.now())
            loop.run_once()
            assert [r.name for r in store.replicas("chat")] == [replica.name]
            assert held_devices(store) == 1, "capacity never leaks"
        retry_at = store.get_deployment("chat").status["failures"]["retryAt"]
        clock.advance((datetime.fromisoformat(retry_at) - clock.now()).total_seconds())
        store.heartbeat("gpu-a", clock.now())
    assert len(names) == 8, "each failed replica was replaced by a new identity"
    failure = condition(store, "chat", "ReplicaFailure")
    assert failure["status"] is True and "404 Not Found" in failure["message"]
    assert store.get_deployment("chat").status["failures"]["count"] == 8
    print(f"8 failures: {len(store.replicas())} replica held, {held_devices(store)} device(s) allocated")


def test_a_scaled_down_replica_drains_until_its_agent_reports_no_request_then_is_released(
    store: SqlStore, clock: FakeClock
) -> None:
    setup(
        store, [gpu_host_32c_256g("gpu-a", "h100", 2, address="10.0.0.1")], [deployment("chat", replicas=2)]
    )
    loop = reconciler(store, clock)
    loop.run_once()
    serving = ReplicaStatus(port=8000, inFlight=1, inFlightAge=0)
    report(
        store,
        "gpu-a",
        clock.now(),
        chat_0=(ReplicaState.RUNNING, serving),
        chat_1=(ReplicaState.RUNNING, serving),
    )
    store.put_deployment(deployment("chat", replicas=1))

    assert loop.run_once().draining == ["chat-1"]
    assert store.get_replica("chat-1").state is ReplicaState.DRAINING
    assert [e.replica.name for e in routable(store.replica_endpoints())] == ["chat-0"], "out of the routes"

    clock.advance(1)
    report(
        store, "gpu-a", clock.now(), chat_1=(ReplicaState.RUNNING, ReplicaStatus(inFlight=0, inFlightAge=0))
    )
    assert loop.run_once().released == [], "read before every gateway refreshed its routes"
    clock.advance(2)
    report(
        store, "gpu-a", clock.now(), chat_1=(ReplicaState.RUNNING, ReplicaStatus(inFlight=1, inFlightAge=0))
    )
    assert loop.run_once().released == [], "a request is still in flight"
    clock.advance(1)
    report(
        store, "gpu-a", clock.now(), chat_1=(ReplicaState.RUNNING, ReplicaStatus(inFlight=0, inFlightAge=0))
    )
    assert loop.run_once().released == ["chat-1"]
    assert [r.name for r in store.replicas()] == ["chat-0"]


# --- timing --------------------------------------------------------------------------------------


def test_a_cycle_times_its_snapshot_plan_and_commit_phases_on_metrics(
    store: SqlStore, clock: FakeClock
) -> None:
    setup(store, [gpu_node("gpu-a")], [deployment("chat", replicas=2)])
    metrics = FleetMetrics()
    leader = Reconciler(store, policy=POLICY, lease_ttl=TTL, clock=clock.now, holder="one", metrics=metrics)
    follower = Reconciler(store, policy=POLICY, lease_ttl=TTL, clock=clock.now, holder="two", metrics=metrics)

    led = leader.run_once()
    followed = follower.run_once()

    assert sorted(led.allocated) == ["chat-0", "chat-1"]
    assert list(led.phases) == [CyclePhase.SNAPSHOT, CyclePhase.PLAN, CyclePhase.COMMIT]
    assert sum(led.phases.values()) == pytest.approx(led.seconds)
    assert not followed.leader and followed.phases == {}
    text = metrics.render()[0].decode()
    for phase in CyclePhase:
        assert f'fleetserve_reconcile_phase_seconds_count{{phase="{phase.value}"}} 1.0' in text


class CountingStatusStore(SqlStore):
    """The real store, counting status writes."""

    writes = 0

    def set_deployment_status(self, name: str, status: DeploymentStatus) -> None:
        self.writes += 1
        super().set_deployment_status(name, status)


def test_a_steady_cycle_does_not_write_back_the_status_it_read(store: SqlStore, clock: FakeClock) -> None:
    counting = CountingStatusStore(store.engine)
    setup(counting, [gpu_node("gpu-a")], [deployment("chat", replicas=3)])  # 2 fit, 1 unschedulable
    loop = reconciler(counting, clock)

    loop.run_once()
    clock.advance(5)
    loop.run_once()  # the rollout's progress counts the replicas placed by the first
    settled = counting.writes
    for _ in range(3):
        clock.advance(5)
        loop.run_once()
    assert counting.writes == settled
    assert counting.get_deployment("chat").status["replicas"] == ["chat-0", "chat-1"]

    counting.put_deployment(deployment("chat", replicas=1))  # a change: a new status
    clock.advance(5)
    loop.run_once()
    assert counting.writes > settled
    assert counting.get_deployment("chat").status["desiredReplicas"] == 1


def test_time_based_steps_still_fire_when_nothing_else_changes(store: SqlStore, clock: FakeClock) -> None:
    """The reconciler keeps its free capacity between cycles (``Planner``); cycles where only
    the clock moves must still end a drain at its deadline and carry a rollout through."""
    setup(store, [gpu_host_32c_256g("gpu-a", "h100", 2, address="10.0.0.1")], [deployment("chat")])
    loop = reconciler(store, clock)
    assert loop.run_once().allocated == ["chat-0"]
    serving = ReplicaStatus(port=8000, inFlight=2, inFlightAge=0)
    report(store, "gpu-a", clock.now(), chat_0=(ReplicaState.RUNNING, serving))
    changed = build_deployment(
        "chat", 1, {"name": "gpu-v2", "engine": "vllm", "deviceClass": "h100"}, model=MODEL.name
    )
    store.put_deployment(changed)

    clock.advance(1)
    assert loop.run_once().allocated == ["chat-1"], "the rollout surges a new replica first"
    report(store, "gpu-a", clock.now(), chat_1=(ReplicaState.RUNNING, serving))
    clock.advance(1)
    assert loop.run_once().draining == ["chat-0"], "the old one drains once the new one runs"
    # Its agent keeps reporting a request in flight: only the deadline (drainSeconds) ends it.
    for _ in range(5):
        clock.advance(5)
        report(store, "gpu-a", clock.now(), chat_0=(ReplicaState.DRAINING, serving))
        assert quiet(loop.run_once())
    clock.advance(10)
    store.heartbeat("gpu-a", clock.now())
    assert loop.run_once().released == ["chat-0"]
    assert store.get_deployment("chat").status["rollout"]["complete"] is True
    assert shared_devices(store) == [] and held_devices(store) == 1


# --- quiet cycles -------------------------------------------------------------------------------


class CountingReadsStore(SqlStore):
    """The real store, counting the reconciler's whole-fleet reads."""

    snapshots = 0

    def snapshot(self, models: Mapping[str, ModelFacts] | None = None) -> ClusterSnapshot:
        self.snapshots += 1
        return super().snapshot(models)


def settle(loop: Reconciler) -> int:
    """Cycle until one is quiet; how many read and planned in full before it (at most three: one
    that acts, one that records what it did in the status, one that changes nothing)."""
    for full in range(4):
        if loop.run_once().quiet:
            return full
    raise AssertionError("no quiet cycle after three full ones")


def test_a_quiet_fleet_is_not_read_again_until_something_changes(store: SqlStore, clock: FakeClock) -> None:
    counting = CountingReadsStore(store.engine)
    setup(counting, [gpu_node("gpu-a")], [deployment("chat", replicas=3)])  # 2 fit, 1 unschedulable
    metrics = FleetMetrics()
    loop = Reconciler(counting, policy=POLICY, lease_ttl=TTL, clock=clock.now, holder="one", metrics=metrics)
    assert sorted(loop.run_once().allocated) == ["chat-0", "chat-1"]
    full = settle(loop)
    assert 1 <= full <= 2, "the allocations moved the counter: the next cycle reads and plans again"
    assert counting.snapshots == 1 + full

    for _ in range(4):  # heartbeats, statuses and decisions move nothing a plan reads
        clock.advance(5)
        counting.heartbeat("gpu-a", clock.now())
        counting.record_decision("chat", DecisionRecord.model_validate({"why": "a test"}), clock.now())
        cycle = loop.run_once()
        assert cycle.quiet and cycle.leader and cycle.phases == {}
    assert counting.snapshots == 1 + full
    text = metrics.render()[0].decode()
    assert "fleetserve_reconcile_quiet_total 5.0" in text
    assert f"fleetserve_reconcile_seconds_count {1 + full}.0" in text

    counting.register(gpu_node("gpu-b"))  # room for the unschedulable third
    clock.advance(1)
    counting.heartbeat("gpu-a", clock.now())
    moved = loop.run_once()
    assert not moved.quiet and moved.allocated == ["chat-2"]
    assert counting.snapshots == 2 + full


def test_a_quiet_fleet_is_still_read_in_full_every_half_minute(store: SqlStore, clock: FakeClock) -> None:
    counting = CountingReadsStore(store.engine)
    setup(counting, [gpu_node("gpu-a")], [deployment("chat", replicas=1)])
    loop = reconciler(counting, clock)
    settle(loop)
    clock.advance(29)
    counting.heartbeat("gpu-a", clock.now())
    assert loop.run_once().quiet
    clock.advance(1)
    assert not loop.run_once().quiet, "30 s after the last full read, a cycle reads in full again"
    assert loop.run_once().quiet


def test_a_node_falling_silent_ends_the_quiet(store: SqlStore, clock: FakeClock) -> None:
    """Liveness is judged every cycle, quiet or not: a node that stops heartbeating goes NotReady
    on time (here after 15 s, well inside the half minute between full reads), and that cycle
    reads and plans the fleet."""
    setup(store, [gpu_node("gpu-a", count=1), gpu_node("gpu-b", count=1)], [deployment("chat")])
    policy = HeartbeatPolicy(not_ready_after=timedelta(seconds=15), lost_after=timedelta(seconds=300))
    loop = Reconciler(store, policy=policy, lease_ttl=TTL, clock=clock.now, holder="one")
    for name in ("gpu-a", "gpu-b"):
        store.heartbeat(name, clock.now())
    (first,) = loop.run_once().allocated
    ((silent, _),) = placement(store)[first]
    other = "gpu-b" if silent == "gpu-a" else "gpu-a"
    settle(loop)
    for _ in range(2):
        clock.advance(5)
        store.heartbeat(other, clock.now())  # only the other node keeps beating
        assert loop.run_once().quiet
    clock.advance(6)  # 16 s of silence from the replica's node
    cycle = loop.run_once()
    assert not cycle.quiet
    assert cycle.transitions == [(silent, "Ready", "NotReady")]
    assert list(cycle.phases) == list(CyclePhase), "and the fleet is read and planned in that cycle"


def test_a_fabric_stored_ends_the_quiet(store: SqlStore, clock: FakeClock) -> None:
    setup(store, [gpu_node("gpu-a")], [deployment("chat")])
    loop = reconciler(store, clock)
    settle(loop)
    store.put_fabric(Fabric(name="ib0"))
    assert not loop.run_once().quiet


@pytest.mark.parametrize("waiting", ["failed", "draining"])
def test_a_drain_or_a_failure_waiting_on_the_clock_keeps_every_cycle_full(
    store: SqlStore, clock: FakeClock, waiting: str
) -> None:
    """A failed replica is replaced when its backoff ends, a drain ends at its deadline: with
    nothing else changing meanwhile, only a full cycle sees the time come."""
    setup(store, [gpu_node("gpu-a")], [deployment("chat", replicas=1)])
    loop = reconciler(store, clock)
    loop.run_once()
    settle(loop)
    if waiting == "failed":
        store.set_replica_state("chat-0", ReplicaState.FAILED)
    else:
        store.set_replica_state("chat-0", ReplicaState.RUNNING)
        store.start_draining(["chat-0"], clock.now())
    for _ in range(4):
        clock.advance(1)
        store.heartbeat("gpu-a", clock.now())
        assert not loop.run_once().quiet


def test_an_autoscaled_deployment_is_judged_in_quiet_cycles_and_a_new_count_ends_the_quiet(
    store: SqlStore, clock: FakeClock
) -> None:
    waiting = {"n": 0}

    def signals(dep: Deployment, replicas: list[Replica], now: float) -> Signals:
        # None ready: the gateway's held requests are all the load there is.
        return Signals(dep.name, 0, len(replicas), gateway_waiting=waiting["n"])

    scaled = build_deployment(
        "chat",
        1,
        {"name": "gpu", "engine": "vllm", "deviceClass": H100.name, "devicesPerNode": 1},
        model=MODEL.name,
    ).model_copy(update={"replicas": ReplicaRange(min=1, max=2)})
    setup(store, [gpu_node("gpu-a")], [scaled])
    loop = Reconciler(store, policy=POLICY, lease_ttl=TTL, clock=clock.now, holder="one", signals=signals)
    assert loop.run_once().allocated == ["chat-0"]
    settle(loop)
    repeats = store.get_deployment("chat").status["autoscaler"][-1]["repeats"]
    for _ in range(3):
        clock.advance(1)
        assert loop.run_once().quiet
    log = store.get_deployment("chat").status["autoscaler"]
    assert log[-1]["repeats"] == repeats + 3, "each quiet cycle's decision is in the status's log"

    waiting["n"] = 20  # requests pile up at the gateway: the autoscaler wants a second replica
    clock.advance(1)
    cycle = loop.run_once()
    assert not cycle.quiet and cycle.allocated == ["chat-1"]
    ups = [e for e in store.get_deployment("chat").status["autoscaler"] if e["changed"]]
    assert [(e["previous"], e["desired"]) for e in ups][-1:] == [(1, 2)], "decided once, not twice"
