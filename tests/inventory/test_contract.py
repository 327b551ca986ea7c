"""The Inventory rules, one suite for every implementation: in memory, SQLite, PostgreSQL."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import pytest

from builders import cpu_8c_32g, gpu_host_16c_64g
from fleetserve.errors import AllocationConflict, ConfigError, UnknownNode, UnknownReplica
from fleetserve.inventory.base import Inventory
from fleetserve.inventory.memory import InMemoryInventory
from fleetserve.modelfacts import ModelFacts
from fleetserve.spec.nodeparts import Cordon
from fleetserve.spec.resources import DeviceClass, Fabric, Node, NodeState, Replica

GPU = DeviceClass(name="gpu-a", driver="gpu.nvidia.com", memory="80Gi")
IB = Fabric(name="ib-0")


@pytest.fixture(params=["memory", "sqlite", "postgres"])
def inventory(request: pytest.FixtureRequest) -> Inventory:
    if request.param == "memory":
        inv: Inventory = InMemoryInventory()
    else:
        inv = request.getfixturevalue(f"{request.param}_store")
    inv.put_class(GPU)
    inv.put_fabric(IB)
    return inv


# This suite's GPU machine: 16 cores, 64 GiB, 4 GPUs of class GPU (2 ECC errors where faulted),
# one HCA on IB.
gpu_node = partial(
    gpu_host_16c_64g,
    cls=GPU.name,
    uuid="{node}-gpu-{i}",
    ecc_errors=2,
    hcas=[{"name": "mlx5_0", "fabric": IB.name}],
)


def replica(name: str, *shards: tuple[str, tuple[int, ...]] | dict[str, Any]) -> Replica:
    """A replica from shards given as (node, devices) or as a Shard document."""
    docs = [{"node": s[0], "devices": list(s[1])} if isinstance(s, tuple) else s for s in shards]
    return Replica.model_validate({"name": name, "deployment": "d", "profile": "p", "shards": docs})


def names(replicas: list[Replica] | tuple[Replica, ...]) -> list[str]:
    return [r.name for r in replicas]


# --- allocation ------------------------------------------------------------------------------


@dataclass(frozen=True)
class AllocCase:
    id: str
    nodes: tuple[Node, ...]
    before: tuple[Replica, ...]
    replica: Replica
    fits: bool
    # Must be allocatable after a refused attempt: proves the attempt took nothing.
    probe: Replica | None = None


TWO = (gpu_node("n1"), gpu_node("n2"))
CPU = (cpu_8c_32g("c1"),)

ALLOCATION_CASES = [
    AllocCase("free devices", TWO, (), replica("r", ("n1", (0, 1))), fits=True),
    AllocCase(
        "uncorrected ECC fault",
        (gpu_node("n1", ecc=(1,)),),
        (),
        replica("r", ("n1", (0, 1))),
        fits=False,
        probe=replica("p", ("n1", (0, 2, 3))),
    ),
    AllocCase(
        "foreign process",
        (gpu_node("n1", foreign=(2,)),),
        (),
        replica("r", ("n1", (2, 3))),
        fits=False,
        probe=replica("p", ("n1", (3,))),
    ),
    AllocCase(
        "device already allocated",
        TWO,
        (replica("a", ("n1", (0,))),),
        replica("r", ("n1", (1, 0))),
        fits=False,
        probe=replica("p", ("n1", (1,))),
    ),
    AllocCase(
        "device index the node lacks",
        TWO,
        (),
        replica("r", ("n1", (3, 4))),
        fits=False,
        probe=replica("p", ("n1", (3,))),
    ),
    AllocCase("unknown node", TWO, (), replica("r", ("nx", (0,))), fits=False),
    AllocCase(
        "one device twice in one replica",
        TWO,
        (),
        replica("r", ("n1", (0,)), ("n1", (0,))),
        fits=False,
        probe=replica("p", ("n1", (0,))),
    ),
    AllocCase(
        "replica name already allocated",
        TWO,
        (replica("a", ("n1", (0,))),),
        replica("a", ("n2", (0,))),
        fits=False,
        probe=replica("p", ("n2", (0,))),
    ),
    AllocCase(
        "multi-node: second shard conflicts, first shard untouched",
        TWO,
        (replica("a", ("n2", (0,))),),
        replica("r", ("n1", (0, 1)), ("n2", (0, 1))),
        fits=False,
        probe=replica("p", ("n1", (0, 1)), ("n2", (1,))),
    ),
    AllocCase(
        "multi-node: second node unknown",
        TWO,
        (),
        replica("r", ("n1", (0, 1)), ("nx", (0,))),
        fits=False,
        probe=replica("p", ("n1", (0, 1))),
    ),
    AllocCase(
        "multi-node fits", TWO, (), replica("r", ("n1", (0, 1, 2, 3)), ("n2", (0, 1, 2, 3))), fits=True
    ),
    AllocCase(
        "CPU cores exhausted",
        CPU,
        (replica("a", {"node": "c1", "cpuCores": 6}),),
        replica("r", {"node": "c1", "cpuCores": 4}),
        fits=False,
        probe=replica("p", {"node": "c1", "cpuCores": 2}),
    ),
    AllocCase(
        "CPU memory exhausted",
        CPU,
        (replica("a", {"node": "c1", "cpuCores": 1, "memory": 24 * 2**30}),),
        replica("r", {"node": "c1", "cpuCores": 1, "memory": 16 * 2**30}),
        fits=False,
        probe=replica("p", {"node": "c1", "cpuCores": 1, "memory": 8 * 2**30}),
    ),
    AllocCase(
        "CPU fits exactly",
        CPU,
        (replica("a", {"node": "c1", "cpuCores": 6, "memory": 24 * 2**30}),),
        replica("r", {"node": "c1", "cpuCores": 2, "memory": 8 * 2**30}),
        fits=True,
    ),
    AllocCase(
        "GPU shard fits but its node lacks cores",
        (gpu_node("n1"),),
        (replica("a", {"node": "n1", "devices": [0], "cpuCores": 12}),),
        replica("r", {"node": "n1", "devices": [1], "cpuCores": 8}),
        fits=False,
        probe=replica("p", {"node": "n1", "devices": [1], "cpuCores": 4}),
    ),
]


@pytest.mark.parametrize("case", ALLOCATION_CASES, ids=lambda c: c.id)
def test_allocation_is_whole_or_nothing(inventory: Inventory, case: AllocCase) -> None:
    for node in case.nodes:
        inventory.register(node)
    for existing in case.before:
        inventory.allocate(existing)

    if case.fits:
        inventory.allocate(case.replica)
        expected = [*case.before, case.replica]
    else:
        with pytest.raises(AllocationConflict):
            inventory.allocate(case.replica)
        expected = list(case.before)

    stored = {r.name: r for r in inventory.replicas()}
    assert sorted(stored) == sorted(r.name for r in expected)
    for r in expected:
        assert stored[r.name] == r
    if case.probe is not None:
        inventory.allocate(case.probe)


def test_release_frees_every_shard(inventory: Inventory) -> None:
    for node in (*TWO, *CPU):
        inventory.register(node)
    whole = replica(
        "r",
        {"node": "n1", "devices": [0, 1, 2, 3], "cpuCores": 16},
        {"node": "n2", "devices": [0, 1, 2, 3], "hcas": ["mlx5_0"], "memory": 64 * 2**30},
        {"node": "c1", "cpuCores": 8, "memory": 32 * 2**30},
    )
    inventory.allocate(whole)
    with pytest.raises(AllocationConflict):
        inventory.allocate(replica("other", {"node": "c1", "cpuCores": 1}))

    assert inventory.release("r") == whole

    assert inventory.replicas() == []
    assert inventory.snapshot().replicas == ()
    # Exactly the same resources, every shard of them, can be taken again.
    inventory.allocate(whole.model_copy(update={"name": "again"}))


def test_release_unknown_replica(inventory: Inventory) -> None:
    inventory.register(gpu_node("n1"))
    with pytest.raises(UnknownReplica):
        inventory.release("nope")
    inventory.allocate(replica("r", ("n1", (0,))))
    inventory.release("r")
    with pytest.raises(UnknownReplica):
        inventory.release("r")


@pytest.mark.parametrize(
    "fault",
    [{"ecc": (0,)}, {"foreign": (0,)}, {"count": 1}],
    ids=["ECC fault", "foreign process", "device gone"],
)
def test_a_device_failing_under_a_replica_keeps_its_siblings_taken(
    inventory: Inventory, fault: dict[str, Any]
) -> None:
    inventory.register(gpu_node("n1"))
    inventory.allocate(replica("a", {"node": "n1", "devices": [0, 1], "cpuCores": 10}))
    inventory.register(gpu_node("n1", **fault))

    with pytest.raises(AllocationConflict):
        inventory.allocate(replica("b", ("n1", (1,))))
    with pytest.raises(AllocationConflict):
        inventory.allocate(replica("c", {"node": "n1", "cpuCores": 8}))
    assert names(inventory.replicas()) == ["a"]


@pytest.mark.parametrize("how", ["cordon", "not ready"])
def test_nothing_new_lands_on_a_cordoned_or_not_ready_node(inventory: Inventory, how: str) -> None:
    inventory.register(gpu_node("n1"))
    if how == "cordon":
        inventory.cordon("n1", "bad fan")
    else:
        inventory.set_state("n1", NodeState.NOT_READY)
    with pytest.raises(AllocationConflict, match="cordoned or not Ready"):
        inventory.allocate(replica("a", ("n1", (0,))))
    assert inventory.replicas() == []


def test_a_cordon_needs_a_reason(inventory: Inventory) -> None:
    inventory.register(gpu_node("n1"))
    with pytest.raises(ConfigError, match="give a reason"):
        inventory.cordon("n1", "")
    assert inventory.get_node("n1").cordon is None


# --- registration and the cordon -------------------------------------------------------------


def test_registration_is_idempotent_and_bumps_the_epoch(inventory: Inventory) -> None:
    node = gpu_node("n1")
    outcomes = [inventory.register(node) for _ in range(3)]

    assert [(o.epoch, o.created) for o in outcomes] == [(1, True), (2, False), (3, False)]
    assert [o.node for o in outcomes] == [node] * 3
    assert inventory.nodes() == [node]
    assert inventory.register(gpu_node("n2")).epoch == 1  # epochs are per node


OPERATOR = Cordon(reason="PSU fault, ticket 4711", by="alice")
AGENT = Cordon(reason="agent claims a cordon", by="agent")


@pytest.mark.parametrize(
    ("operator", "in_document", "expected"),
    [
        (OPERATOR, None, OPERATOR),
        (OPERATOR, AGENT, OPERATOR),
        (None, AGENT, None),
        (None, None, None),
    ],
    ids=["cordon kept", "document cannot replace it", "document cannot add one", "no cordon"],
)
def test_reregistration_updates_hardware_but_never_the_cordon(
    inventory: Inventory, operator: Cordon | None, in_document: Cordon | None, expected: Cordon | None
) -> None:
    inventory.register(gpu_node("n1", count=4))
    if operator is not None:
        inventory.cordon("n1", operator.reason, by=operator.by)

    again = gpu_node("n1", count=8, ecc=(5,), cordon=in_document, labels={"rack": "b7"})
    registration = inventory.register(again)

    stored = inventory.get_node("n1")
    assert registration.node == stored
    assert stored.cordon == expected
    assert len(stored.devices) == 8
    assert not stored.devices[5].health.healthy
    assert stored.labels == {"rack": "b7"}


def test_a_new_node_keeps_the_cordon_of_its_document(inventory: Inventory) -> None:
    inventory.register(gpu_node("n1", cordon=OPERATOR))
    assert inventory.get_node("n1").cordon == OPERATOR


@pytest.mark.parametrize("state", [NodeState.NOT_READY, NodeState.LOST])
def test_reregistration_makes_the_node_ready(inventory: Inventory, state: NodeState) -> None:
    inventory.register(gpu_node("n1", state=state))
    assert inventory.get_node("n1").state is NodeState.READY
    assert inventory.set_state("n1", state).state is state
    assert inventory.get_node("n1").state is state
    assert inventory.register(gpu_node("n1")).node.state is NodeState.READY


def test_cordon_and_uncordon(inventory: Inventory) -> None:
    inventory.register(gpu_node("n1"))
    assert inventory.cordon("n1", "disk full").cordon == Cordon(reason="disk full", by="operator")
    assert inventory.get_node("n1").cordon == Cordon(reason="disk full")
    assert inventory.uncordon("n1").cordon is None
    assert inventory.get_node("n1").cordon is None


NODE_OPERATIONS: list[tuple[str, Callable[[Inventory], object]]] = [
    ("get_node", lambda inv: inv.get_node("nope")),
    ("cordon", lambda inv: inv.cordon("nope", "why")),
    ("uncordon", lambda inv: inv.uncordon("nope")),
    ("set_state", lambda inv: inv.set_state("nope", NodeState.LOST)),
]


@pytest.mark.parametrize("operation", [op for _, op in NODE_OPERATIONS], ids=[n for n, _ in NODE_OPERATIONS])
def test_unknown_node(inventory: Inventory, operation: Callable[[Inventory], object]) -> None:
    inventory.register(gpu_node("n1"))
    with pytest.raises(UnknownNode, match="nope"):
        operation(inventory)


# --- snapshot --------------------------------------------------------------------------------


def test_snapshot_reflects_everything(inventory: Inventory) -> None:
    cpu_class = DeviceClass(name="cpu", driver="dra.cpu", memory=0)
    inventory.put_class(cpu_class)
    inventory.put_class(GPU.model_copy(update={"memory": 94 * 2**30}))  # replaced, not added
    inventory.put_fabric(Fabric(name="roce-1", type="roce"))
    for node in (gpu_node("n2"), gpu_node("n1", ecc=(3,)), cpu_8c_32g("c1")):
        inventory.register(node)
    placed = [
        replica("r2", {"node": "c1", "cpuCores": 4, "memory": 2**30}),
        replica("r1", ("n1", (0, 1)), ("n2", (2,))).model_copy(update={"fabric": IB.name}),
    ]
    for r in placed:
        inventory.allocate(r)
    # A cordon or a lost heartbeat after placement leaves the replicas where they are.
    inventory.cordon("n2", "maintenance")
    inventory.set_state("c1", NodeState.NOT_READY)
    facts = {"m": ModelFacts(name="m", weight_bytes=10, kv_bytes_per_token=2, context_length=16)}

    before = inventory.snapshot()
    snap = inventory.snapshot(facts)

    assert dict(snap.classes) == {"cpu": cpu_class, GPU.name: GPU.model_copy(update={"memory": 94 * 2**30})}
    assert dict(snap.fabrics) == {IB.name: IB, "roce-1": Fabric(name="roce-1", type="roce")}
    assert snap.nodes == tuple(inventory.nodes())
    assert [n.name for n in snap.nodes] == ["c1", "n1", "n2"]
    assert snap.nodes[2].cordon == Cordon(reason="maintenance")
    assert snap.nodes[0].state is NodeState.NOT_READY
    assert not snap.nodes[1].devices[3].health.healthy
    assert snap.replicas == tuple(sorted(placed, key=lambda r: r.name))
    assert dict(snap.models) == facts
    assert dict(before.models) == {}

    # A snapshot is frozen: later changes show only in later snapshots.
    inventory.release("r1")
    inventory.uncordon("n2")
    assert names(before.replicas) == ["r1", "r2"]
    assert before.nodes[2].cordon is not None
    assert names(inventory.snapshot().replicas) == ["r2"]


def test_a_released_replica_name_is_never_handed_out_again(inventory: Inventory) -> None:
    inventory.register(gpu_node("n1"))
    inventory.allocate(replica("d-3", ("n1", (0,))).model_copy(update={"deployment": "d"}))
    inventory.release("d-3")
    assert inventory.snapshot().next_ordinals.get("d") == 4
