"""The change counter whole-fleet readers compare before reading (``changegate``, migration 0006),
on SQLite and PostgreSQL: every kind of write they depend on moves it, in the writer's own
transaction, and makes each reader (the observer's targets, the gateway's routes, the assignment
watch) read again; heartbeats and what agents report beside ports and restarts move nothing, and
the readers then skip their read. Two servers on one PostgreSQL database see each other's writes."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from datetime import UTC, datetime

import pytest
from sqlalchemy import Engine

from builders import cpu_8c_32g, safetensors_8gb
from builders import deployment as build_deployment
from fleetserve.changegate import ChangeGate
from fleetserve.gateway.endpoints import EndpointTable
from fleetserve.metrics.exposition import FleetMetrics
from fleetserve.protocol import AgentStatus, GpuSample, ReplicaStatus
from fleetserve.server.agents.assignwatch import AssignmentWatch
from fleetserve.server.observer import Observer
from fleetserve.spec.resources import (
    DeviceClass,
    Fabric,
    FabricType,
    NodeState,
    Replica,
    ReplicaState,
    Shard,
)
from fleetserve.spec.status import DecisionRecord, DeploymentStatus
from fleetserve.store import SqlStore, make_engine

NOW = datetime(2026, 1, 1, tzinfo=UTC)
CPU = {"name": "cpu", "engine": "llama.cpp", "cpu": {"cores": 1}}
H100 = DeviceClass.model_validate({"name": "h100", "driver": "gpu.nvidia.com", "memory": "80GiB"})


def cpu_replica(name: str, node: str) -> Replica:
    shard = Shard(node=node, cpu_cores=1, memory=1 << 30)
    return Replica(name=name, deployment="chat", profile="cpu", shards=(shard,), state=ReplicaState.PENDING)


def running(port: int | None = None, restarts: int = 0, in_flight: int | None = None) -> ReplicaStatus:
    return ReplicaStatus(port=port, restarts=restarts, inFlight=in_flight)


class Readers:
    """The three whole-fleet readers of one server, over one store."""

    def __init__(self, store: SqlStore) -> None:
        self.observer = Observer(store, FleetMetrics())
        self.routes = EndpointTable(store)
        self.watch = AssignmentWatch(store)
        # Counted read by read here: no rest after a read (the rest is tested on its own below).
        for reader in (self.observer, self.routes, self.watch):
            reader.gate = ChangeGate(pace=0.0)

    def look(self) -> tuple[int, int, int]:
        """Each reader's tick (without its loop); how many whole-fleet reads each has made."""
        self.observer.targets()
        fresh = self.routes.load_if_changed()
        if fresh is not None:
            self.routes.routes = fresh
        self.watch.inputs_if_changed()
        return self.observer.reads, self.routes.reads, self.watch.reads


@pytest.fixture
def fleet(store: SqlStore) -> SqlStore:
    store.put_model(safetensors_8gb("m"))
    store.put_deployment(build_deployment("chat", 2, CPU))
    for name in ("n1", "n2", "n3"):
        store.register(cpu_8c_32g(name, address=f"10.0.0.{name[-1]}"))
    store.allocate(cpu_replica("chat-0", "n1"))
    return store


def quiet(store: SqlStore) -> None:
    """What a steady fleet does all the time: heartbeats, reports that change nothing the readers
    read (in-flight counts, GPU samples), deployment statuses and decisions."""
    for name in ("n1", "n2", "n3"):
        store.heartbeat(name, NOW)
    status = AgentStatus(gpuMetrics=[GpuSample(name="fleetserve_gpu_utilization", labels={}, value=0.5)])
    chat0 = store.get_replica("chat-0")
    was = store.replica_status("chat-0")
    again = was.model_copy(update={"in_flight": (was.in_flight or 0) + 1})
    store.report("n1", store.epoch("n1"), NOW, {"chat-0": (chat0.state, again)}, agent_status=status)
    store.report("n2", store.epoch("n2"), NOW, {})
    store.set_deployment_status("chat", DeploymentStatus.model_validate({"ready": 1}))
    store.record_decision("chat", DecisionRecord.model_validate({"why": "nothing"}), NOW)


def test_heartbeats_move_nothing_and_every_change_makes_every_reader_read_again(fleet: SqlStore) -> None:
    readers = Readers(fleet)
    assert readers.look() == (1, 1, 1)
    assert readers.look() == (1, 1, 1), "nothing changed: no reader reads again"

    def report(port: int | None, restarts: int = 0) -> None:
        fleet.report(
            "n1", fleet.epoch("n1"), NOW, {"chat-0": (ReplicaState.RUNNING, running(port, restarts))}
        )

    changes: list[tuple[str, Callable[[], object]]] = [
        ("replica state", lambda: fleet.set_replica_state("chat-0", ReplicaState.RUNNING)),
        ("endpoint reported", lambda: report(8001)),
        ("restarts reported", lambda: report(8001, restarts=1)),
        ("replica allocated", lambda: fleet.allocate(cpu_replica("chat-1", "n2"))),
        ("replica released", lambda: fleet.release("chat-1")),
        ("replicas allocated in a batch", lambda: fleet.allocate_all([cpu_replica("chat-2", "n2")])),
        ("replica draining", lambda: fleet.start_draining(["chat-2"], NOW)),
        ("node cordoned", lambda: fleet.cordon("n3", "maintenance")),
        ("node uncordoned", lambda: fleet.uncordon("n3")),
        ("node state", lambda: fleet.set_state("n3", NodeState.NOT_READY)),
        ("node registered again", lambda: fleet.register(cpu_8c_32g("n3", address="10.0.0.3"))),
        ("node drained", lambda: fleet.drain("n2", "kernel update", now=NOW)),
        ("node registered", lambda: fleet.register(cpu_8c_32g("n4", address="10.0.0.4"))),
        ("node deleted", lambda: fleet.delete_node("n4")),
        ("deployment changed", lambda: fleet.put_deployment(build_deployment("chat", 3, CPU))),
        ("model stored", lambda: fleet.put_model(safetensors_8gb("other"))),
        ("device class stored", lambda: fleet.put_class(H100)),
    ]
    for i, (what, change) in enumerate(changes, start=2):
        quiet(fleet)
        assert readers.look() == (i - 1, i - 1, i - 1), f"only quiet writes before {what}"
        before = fleet.fleet_changes()
        change()
        assert fleet.fleet_changes() > before, what
        assert readers.look() == (i, i, i), f"every reader reads again after: {what}"
    # And what they read is the fleet as it is: chat-0 is routed, at the port its agent reported.
    (target,) = readers.observer.targets()
    assert (target.key, target.url) == ("chat-0", "http://10.0.0.1:8001/metrics")
    assert [e.replica for e in readers.routes.routes["chat"].endpoints] == ["chat-0"]


def test_a_fabric_stored_changed_or_deleted_moves_the_counter(fleet: SqlStore) -> None:
    """Placement reads fabrics (migration 0007): the reconciler's quiet cycles must see them."""
    for change in (
        lambda: fleet.put_fabric(Fabric(name="ib0")),
        lambda: fleet.put_fabric(Fabric(name="ib0", type=FabricType.ROCE)),
        lambda: fleet.delete_fabric("ib0"),
    ):
        before = fleet.fleet_changes()
        change()
        assert fleet.fleet_changes() > before


def test_a_write_that_fails_moves_nothing(fleet: SqlStore) -> None:
    before = fleet.fleet_changes()
    with pytest.raises(Exception, match="already allocated"):
        fleet.allocate(cpu_replica("chat-0", "n2"))
    with pytest.raises(Exception, match="no replica"):
        fleet.set_replica_state("nope-0", ReplicaState.RUNNING)
    assert fleet.fleet_changes() == before


def test_a_reader_reads_in_full_when_its_last_read_is_old_even_if_nothing_moved() -> None:
    now = [0.0]
    gate = ChangeGate(full_every=30.0, clock=lambda: now[0])
    assert gate.due(7)
    gate.read(7)
    now[0] = 29.9
    assert not gate.due(7)
    assert gate.due(8)
    now[0] = 30.0
    assert gate.due(7)


def test_a_reader_rests_after_a_long_read_for_three_times_as_long() -> None:
    now = [0.0]
    gate = ChangeGate(full_every=30.0, clock=lambda: now[0])
    assert gate.due(1)
    now[0] = 0.5  # a read of 0.5 s, begun at 0
    gate.read(1, began=0.0)
    now[0] = 1.99
    assert not gate.due(2)  # moved, but resting: 1.5 s after a 0.5 s read
    now[0] = 2.0
    assert gate.due(2)
    gate.read(2, began=now[0])  # a read that took no time: no rest
    assert gate.due(3) and not gate.due(2)


@pytest.fixture
def second_server(postgres_store: SqlStore, postgres_url: str, postgres_schema: str) -> Iterator[Engine]:
    """A second server's own engine on the same database (and schema) as ``postgres_store``."""
    engine = make_engine(postgres_url, connect_args={"options": f"-csearch_path={postgres_schema}"})
    yield engine
    engine.dispose()


def test_a_write_on_one_server_makes_the_other_servers_readers_read_again(
    postgres_store: SqlStore, second_server: Engine
) -> None:
    a, b = postgres_store, SqlStore(second_server)
    a.put_model(safetensors_8gb("m"))
    a.put_deployment(build_deployment("chat", 2, CPU))
    a.register(cpu_8c_32g("n1", address="10.0.0.1"))
    on_b = Readers(b)
    assert on_b.look() == (1, 1, 1)
    assert on_b.routes.routes["chat"].endpoints == ()

    a.heartbeat("n1", NOW, a.epoch("n1"))
    assert on_b.look() == (1, 1, 1)
    a.allocate(cpu_replica("chat-0", "n1"))
    assert on_b.look() == (2, 2, 2)
    a.report("n1", a.epoch("n1"), NOW, {"chat-0": (ReplicaState.RUNNING, running(8001))})
    assert on_b.look() == (3, 3, 3)
    assert [e.replica for e in on_b.routes.routes["chat"].endpoints] == ["chat-0"]
    # And the other way round: B's write reaches A's readers.
    on_a = Readers(a)
    assert on_a.look() == (1, 1, 1)
    b.cordon("n1", "maintenance")
    assert on_a.look() == (2, 2, 2)
