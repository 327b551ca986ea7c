"""One reconcile cycle: keep what runs, replace what was lost, stop surplus and orphans, gate without harm."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from types import MappingProxyType

import pytest

from builders import deployment, gpu_host_8c_64g
from fleetserve.drivers import RuntimeVariant
from fleetserve.engines.spec import EngineKind
from fleetserve.modelfacts import ModelFacts
from fleetserve.reconcile.core import reconcile
from fleetserve.snapshot import ClusterSnapshot, ReplicaFacts
from fleetserve.spec.nodeparts import EngineFingerprint
from fleetserve.spec.resources import DeviceClass, Node, Replica, ReplicaState, Shard

GiB = 1 << 30
FACTS = MappingProxyType({"m": ModelFacts("m", 2 * GiB, 0, 4096)})
T0 = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)


def snapshot(nodes: list[Node], replicas: list[Replica], driver: str = "gpu.nvidia.com") -> ClusterSnapshot:
    classes = {"h100": DeviceClass(name="h100", driver=driver, memory=80 * GiB)}
    return ClusterSnapshot(
        classes=MappingProxyType(classes), nodes=tuple(nodes), replicas=tuple(replicas), models=FACTS
    )


def with_facts(snap: ClusterSnapshot, facts: dict[str, ReplicaFacts]) -> ClusterSnapshot:
    return ClusterSnapshot(
        classes=snap.classes,
        nodes=snap.nodes,
        replicas=snap.replicas,
        models=snap.models,
        replica_facts=MappingProxyType(facts),
    )


def replica(name: str, dep: str, node_name: str, device: int) -> Replica:
    return Replica(
        name=name,
        deployment=dep,
        profile="p",
        device_class="h100",
        shards=(Shard(node=node_name, devices=(device,)),),
    )


def test_a_settled_deployment_changes_nothing():
    plan = reconcile(
        [deployment("d", 1)], snapshot([gpu_host_8c_64g("a", "h100")], [replica("d-0", "d", "a", 0)])
    )
    assert not plan.changes
    assert plan.decisions[0].kept == ("d-0",)


def test_a_replica_on_a_lost_node_is_released_and_replaced_under_a_new_name():
    plan = reconcile(
        [deployment("d", 1)],
        snapshot(
            [gpu_host_8c_64g("a", "h100", state="Lost"), gpu_host_8c_64g("b", "h100")],
            [replica("d-0", "d", "a", 0)],
        ),
    )
    assert plan.release == ("d-0",)
    assert [(r.name, r.shards[0].node) for r in plan.allocate] == [("d-1", "b")]


def fingerprints(*variants: str) -> tuple[EngineFingerprint, ...]:
    """An agent's report of one vLLM build running ``variants`` on its node."""
    return (
        EngineFingerprint(
            engine=EngineKind.VLLM, version="0.32.0", variants=tuple(map(RuntimeVariant, variants))
        ),
    )


@pytest.mark.parametrize(
    ("engines", "replaced"),
    [
        pytest.param((), True, id="a-node-whose-agent-now-finds-no-engine"),
        pytest.param(fingerprints("cpu"), True, id="a-node-upgraded-to-another-build-of-the-engine"),
        pytest.param(fingerprints("cuda"), False, id="a-node-that-still-has-the-build"),
        pytest.param(None, False, id="a-node-that-never-reported-engines"),
    ],
)
def test_a_replica_on_a_node_that_lost_its_engine_build_is_released_and_replaced_elsewhere(engines, replaced):
    plan = reconcile(
        [deployment("d", 1)],
        snapshot(
            [
                gpu_host_8c_64g("a", "h100", engines=engines),
                gpu_host_8c_64g("b", "h100", engines=fingerprints("cuda")),
            ],
            [replica("d-0", "d", "a", 0)],
        ),
    )
    if replaced:
        assert plan.release == ("d-0",)
        assert [(r.name, r.shards[0].node) for r in plan.allocate] == [("d-1", "b")]
    else:
        assert not plan.changes


def test_a_not_ready_node_keeps_its_replicas_until_it_is_lost():
    plan = reconcile(
        [deployment("d", 1)],
        snapshot(
            [gpu_host_8c_64g("a", "h100", state="NotReady"), gpu_host_8c_64g("b", "h100")],
            [replica("d-0", "d", "a", 0)],
        ),
    )
    assert not plan.changes


def test_scale_down_drains_the_newest_and_its_room_serves_others_once_it_is_released():
    nodes = [gpu_host_8c_64g("a", "h100", 2)]
    running = [replica("d-0", "d", "a", 0), replica("d-1", "d", "a", 1)]
    plan = reconcile([deployment("d", 1), deployment("e", 1)], snapshot(nodes, running), now=T0)
    # d-1 serves: it drains first (out of the routes); its device is still taken this cycle.
    assert plan.drain == ("d-1",) and plan.release == ()
    assert plan.allocate == ()

    drained = [running[0], running[1].model_copy(update={"state": ReplicaState.DRAINING})]
    quiet = ReplicaFacts(in_flight=0, reported_at=T0 + timedelta(seconds=3), draining_since=T0)
    later = with_facts(snapshot(nodes, drained), {"d-1": quiet})
    plan = reconcile([deployment("d", 1), deployment("e", 1)], later, now=T0 + timedelta(seconds=3))
    assert plan.release == ("d-1",)
    assert [(r.name, r.shards[0].devices) for r in plan.allocate] == [("e-0", (1,))]


def test_a_replica_that_serves_nothing_is_released_at_once_when_scaled_down():
    nodes = [gpu_host_8c_64g("a", "h100", 2)]
    starting = [
        replica("d-0", "d", "a", 0),
        replica("d-1", "d", "a", 1).model_copy(update={"state": ReplicaState.STARTING}),
    ]
    plan = reconcile([deployment("d", 1)], snapshot(nodes, starting), now=T0)
    assert plan.release == ("d-1",) and plan.drain == ()


def test_a_class_edited_to_an_unsupported_driver_keeps_its_running_replicas():
    running = [replica("d-0", "d", "a", 0)]
    plan = reconcile(
        [deployment("d", 2)], snapshot([gpu_host_8c_64g("a", "h100")], running, driver="gpu.nvidai.com")
    )
    [decision] = plan.decisions
    assert (decision.accepted.status, decision.accepted.reason) == (False, "UnsupportedDevices")
    assert "gpu.nvidai.com" in decision.accepted.message
    assert decision.kept == ("d-0",)
    assert plan.release == () and plan.allocate == ()


def test_new_replicas_are_named_from_the_deployments_next_ordinal_never_reusing_one():
    snap = snapshot([gpu_host_8c_64g("a", "h100")], [])
    snap = ClusterSnapshot(
        classes=snap.classes,
        nodes=snap.nodes,
        replicas=(),
        models=FACTS,
        next_ordinals=MappingProxyType({"d": 7}),
    )
    plan = reconcile([deployment("d", 2)], snap)
    assert [r.name for r in plan.allocate] == ["d-7", "d-8"]
