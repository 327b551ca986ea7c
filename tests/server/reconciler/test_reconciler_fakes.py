"""The reconciler over in-memory fakes of its narrow store views: no database at all.

The SQL store's own behaviour is covered in tests/server/test_reconciler.py; here the point is
that ``Reconciler`` needs nothing but ``ReconcilerStore``.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime, timedelta

from builders import deployment, gpu_host_32c_256g, safetensors_8gb
from fleetserve.inventory.memory import InMemoryInventory
from fleetserve.reconcile.health import HeartbeatPolicy, Transition
from fleetserve.server.reconciler.loop import Reconciler
from fleetserve.spec.adapter import Adapter
from fleetserve.spec.resources import DeviceClass, Model, NodeState, ReplicaState
from fleetserve.spec.status import DecisionRecord, DeploymentStatus
from fleetserve.store.deployments import StoredDeployment
from fleetserve.store.protocols import ReconcilerStore
from fleetserve.store.reports import NodeHeartbeat

T0 = datetime(2025, 6, 1, 12, 0, tzinfo=UTC)
H100 = DeviceClass(name="h100", driver="gpu.nvidia.com", memory="80GiB")
MODEL = safetensors_8gb()


class FakeStore(InMemoryInventory):
    """The reconciler's store in memory: the reference inventory plus deployments, beats, a lease."""

    def __init__(self) -> None:
        super().__init__()
        self.deployments: dict[str, StoredDeployment] = {}
        self.models: list[Model] = []
        self.statuses: dict[str, DeploymentStatus] = {}
        self.decisions: list[tuple[str, DecisionRecord]] = []
        self.heard: dict[str, datetime] = {}
        self.lease_holder: str | None = None
        self.changes = 0

    def list_deployments(self) -> list[StoredDeployment]:
        return [self.deployments[n] for n in sorted(self.deployments)]

    def list_models(self) -> list[Model]:
        return list(self.models)

    def list_adapters(self) -> list[Adapter]:
        return []

    def set_deployment_status(self, name: str, status: DeploymentStatus) -> None:
        self.statuses[name] = status

    def record_decision(self, deployment: str, explanation: DecisionRecord, now: datetime) -> int:
        self.decisions.append((deployment, explanation))
        return len(self.decisions)

    def fleet_changes(self) -> int:
        # The fake keeps no change counter: every read is a change, so no cycle is ever quiet.
        self.changes += 1
        return self.changes

    def node_heartbeats(self) -> list[NodeHeartbeat]:
        return [
            NodeHeartbeat(n.name, n.state, self.epoch(n.name), self.heard.get(n.name)) for n in self.nodes()
        ]

    def mark_silent(self, changes: Sequence[Transition]) -> list[str]:
        moved = []
        for change in changes:  # the fake has no concurrent writer: the state is all it checks
            if self.get_node(change.node).state is change.old:
                self.set_state(change.node, change.new)
                moved.append(change.node)
        return sorted(moved)

    def start_draining(self, names: Sequence[str], now: datetime) -> list[str]:
        out = []
        for replica in self.replicas():
            if replica.name in names and replica.state is not ReplicaState.DRAINING:
                self.release(replica.name)
                self.allocate(replica.model_copy(update={"state": ReplicaState.DRAINING}))
                out.append(replica.name)
        return out

    def stamp_revision(self, names: Sequence[str], revision: str) -> list[str]:
        out = []
        for replica in self.replicas():
            if replica.name in names:
                self.release(replica.name)
                self.allocate(replica.model_copy(update={"revision": revision}))
                out.append(replica.name)
        return out

    def try_acquire_leadership(self, name: str, holder: str, now: datetime, ttl: timedelta) -> bool:
        if self.lease_holder in (None, holder):
            self.lease_holder = holder
            return True
        return False

    def release_leadership(self, name: str, holder: str) -> bool:
        held = self.lease_holder == holder
        self.lease_holder = None if held else self.lease_holder
        return held


def fleet() -> FakeStore:
    store = FakeStore()
    store.put_class(H100)
    store.register(gpu_host_32c_256g("g1", "h100", count=2))
    store.heard["g1"] = T0
    store.models.append(MODEL)
    dep = deployment("chat", 2, {"name": "p", "engine": "vllm", "deviceClass": "h100"}, model="m")
    store.deployments["chat"] = StoredDeployment(dep, 1, DeploymentStatus())
    return store


def test_the_leader_places_every_replica_through_the_narrow_views():
    store = fleet()
    view: ReconcilerStore = store
    result = Reconciler(view, clock=lambda: T0, holder="me").run_once()
    assert result.leader
    assert sorted(result.allocated) == ["chat-0", "chat-1"]
    assert sorted(r.name for r in store.replicas()) == ["chat-0", "chat-1"]
    assert {s.devices for r in store.replicas() for s in r.shards} == {(0,), (1,)}
    assert "chat" in store.statuses


def test_a_follower_only_bids_for_the_lease():
    store = fleet()
    store.lease_holder = "someone-else"
    result = Reconciler(store, clock=lambda: T0, holder="me").run_once()
    assert not result.leader
    assert store.replicas() == []


def test_a_silent_node_goes_not_ready_and_nothing_is_placed_on_it():
    store = fleet()
    policy = HeartbeatPolicy(not_ready_after=timedelta(seconds=40), lost_after=timedelta(seconds=300))
    result = Reconciler(
        store, policy=policy, clock=lambda: T0 + timedelta(seconds=60), holder="me"
    ).run_once()
    assert result.transitions == [("g1", "Ready", "NotReady")]
    assert store.get_node("g1").state is NodeState.NOT_READY
    assert result.allocated == []
