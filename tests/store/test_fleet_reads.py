"""The store's whole-fleet reads and writes at scale, on SQLite and PostgreSQL: batched allocation
(``allocate_all``), parsed documents kept between reads (``doccache``) never hiding a change, and
the narrow reads assignments are built from."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from builders import cpu_8c_32g, gpu_host_32c_256g, safetensors_8gb
from builders import deployment as build_deployment
from fleetserve.errors import AllocationConflict
from fleetserve.protocol import ReplicaStatus
from fleetserve.spec.resources import DeviceClass, Replica, ReplicaState, Shard
from fleetserve.store import SqlStore
from fleetserve.store import allocation as sql_allocation

NOW = datetime(2026, 1, 1, tzinfo=UTC)
H100 = DeviceClass.model_validate({"name": "h100", "driver": "gpu.nvidia.com", "memory": "80GiB"})


def gpu_replica(name: str, node: str, *devices: int) -> Replica:
    shard = Shard(node=node, devices=devices, cpu_cores=1, memory=1 << 30)
    return Replica(
        name=name,
        deployment="chat",
        profile="gpu",
        device_class="h100",
        shards=(shard,),
        state=ReplicaState.PENDING,
    )


@pytest.fixture
def fleet(store: SqlStore) -> SqlStore:
    store.put_class(H100)
    for name in ("g1", "g2"):
        store.register(gpu_host_32c_256g(name, "h100", 2, address=f"10.0.0.{name[-1]}"))
    return store


def test_a_batch_takes_each_replica_against_what_the_ones_before_it_took(fleet: SqlStore) -> None:
    fleet.allocate(gpu_replica("chat-9", "g2", 1))
    batch = [
        gpu_replica("chat-0", "g1", 0),
        gpu_replica("chat-1", "g1", 0),  # the device chat-0 just took
        gpu_replica("chat-2", "g1", 1),
        gpu_replica("chat-9", "g2", 0),  # the name is allocated already
        gpu_replica("chat-3", "g2", 0),
    ]

    outcomes = fleet.allocate_all(batch)

    assert [type(o).__name__ if o else None for o in outcomes] == [
        None,
        "AllocationConflict",
        None,
        "AllocationConflict",
        None,
    ]
    assert all(isinstance(o, AllocationConflict) for o in outcomes if o is not None)
    assert [r.name for r in fleet.replicas()] == ["chat-0", "chat-2", "chat-3", "chat-9"]
    assert fleet.snapshot().next_ordinals["chat"] == 10
    assert fleet.placement_epochs("chat-3") == {"g2": 1}
    assert fleet.allocate_all([]) == []


def test_batches_smaller_than_the_plan_give_the_outcomes_one_by_one_would(
    fleet: SqlStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sql_allocation, "ALLOCATE_BATCH", 2)
    batch = [gpu_replica(f"chat-{i}", f"g{1 + i % 2}", i // 2 % 2) for i in range(6)]

    outcomes = fleet.allocate_all(batch)

    # Four devices in all: the first four replicas fit, the last two find theirs taken.
    assert [o is None for o in outcomes] == [True, True, True, True, False, False]
    assert len(fleet.replicas()) == 4


def test_kept_documents_never_hide_a_change(fleet: SqlStore) -> None:
    fleet.allocate(gpu_replica("chat-0", "g1", 0))
    first = fleet.snapshot()
    assert fleet.replica_endpoints()[0].status.port is None

    fleet.set_replica_state("chat-0", ReplicaState.RUNNING)
    fleet.report("g1", 1, NOW, {"chat-0": (ReplicaState.RUNNING, ReplicaStatus(port=8001))}, ["m"])
    fleet.cordon("g2", "repair")
    second = fleet.snapshot()

    assert first.replicas[0].state is ReplicaState.PENDING
    assert second.replicas[0].state is ReplicaState.RUNNING
    assert {n.name: n.model_cache for n in second.nodes}["g1"] == ("m",)
    assert {n.name: n.cordon is not None for n in second.nodes} == {"g1": False, "g2": True}
    endpoint = fleet.replica_endpoints()[0]
    assert (endpoint.address, endpoint.status.port, endpoint.replica.state) == (
        "10.0.0.1",
        8001,
        ReplicaState.RUNNING,
    )

    # Released and allocated again under the same name elsewhere: a new document, not the kept one.
    fleet.release("chat-0")
    assert fleet.snapshot().replicas == () and fleet.replica_endpoints() == []
    fleet.uncordon("g2")
    fleet.allocate(gpu_replica("chat-0", "g2", 1))
    assert [s.node for s in fleet.snapshot().replicas[0].shards] == ["g2"]
    assert fleet.replica_endpoints()[0].address == "10.0.0.2"


def test_assignment_inputs_name_every_shard_epoch_deployment_and_shared_document(fleet: SqlStore) -> None:
    fleet.put_model(safetensors_8gb("m"))
    fleet.put_deployment(build_deployment("chat", 2, model="m"))
    fleet.register(cpu_8c_32g("c1"))
    fleet.allocate(gpu_replica("chat-0", "g1", 0))
    fleet.register(gpu_host_32c_256g("g1", "h100", 2, address="10.0.0.1"))  # epoch 2

    got = fleet.assignment_inputs()

    assert got.shards == (("chat-0", "g1", "chat"),)
    assert got.epochs == {"g1": 2, "g2": 1, "c1": 1}
    assert set(got.deployments) == {"chat"} and '"replicas":2' in got.deployments["chat"]
    assert '"h100"' in got.shared and '"hf://org/m"' in got.shared


def test_assignments_read_only_the_classes_and_the_nodes_they_name(fleet: SqlStore) -> None:
    assert list(fleet.device_classes()) == ["h100"]
    assert fleet.node_addresses(["g2", "g2", "gone"]) == {"g2": "10.0.0.2"}
    assert fleet.node_addresses([]) == {}
