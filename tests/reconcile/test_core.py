"""One reconcile cycle: keep what runs, replace what was lost, stop surplus and orphans, gate without harm."""

from __future__ import annotations

from types import MappingProxyType

from fleetserve.modelfacts import ModelFacts
from fleetserve.reconcile.core import reconcile
from fleetserve.snapshot import ClusterSnapshot
from fleetserve.spec.resources import Deployment, DeviceClass, Node, Replica, Shard

GiB = 1 << 30
FACTS = MappingProxyType({"m": ModelFacts("m", 2 * GiB, 0, 4096)})


def node(name: str, state: str = "Ready", count: int = 2) -> Node:
    return Node.model_validate(
        {
            "name": name,
            "state": state,
            "cpu": {"cores": 8, "memory": "64GiB"},
            "gpus": [{"class": "h100", "count": count}],
        }
    )


def snapshot(nodes: list[Node], replicas: list[Replica], driver: str = "gpu.nvidia.com") -> ClusterSnapshot:
    classes = {"h100": DeviceClass(name="h100", driver=driver, memory=80 * GiB)}
    return ClusterSnapshot(
        classes=MappingProxyType(classes), nodes=tuple(nodes), replicas=tuple(replicas), models=FACTS
    )


def replica(name: str, dep: str, node_name: str, device: int) -> Replica:
    return Replica(
        name=name,
        deployment=dep,
        profile="p",
        device_class="h100",
        shards=(Shard(node=node_name, devices=(device,)),),
    )


def deployment(replicas: int = 1, name: str = "d") -> Deployment:
    return Deployment.model_validate(
        {
            "name": name,
            "model": "m",
            "replicas": replicas,
            "profiles": [{"name": "p", "engine": "vllm", "deviceClass": "h100"}],
        }
    )


def test_a_settled_deployment_changes_nothing():
    plan = reconcile([deployment(1)], snapshot([node("a")], [replica("d-0", "d", "a", 0)]))
    assert not plan.changes
    assert plan.decisions[0].kept == ("d-0",)


def test_a_replica_on_a_lost_node_is_released_and_replaced_under_a_new_name():
    plan = reconcile([deployment(1)], snapshot([node("a", "Lost"), node("b")], [replica("d-0", "d", "a", 0)]))
    assert plan.release == ("d-0",)
    assert [(r.name, r.shards[0].node) for r in plan.allocate] == [("d-1", "b")]


def test_a_not_ready_node_keeps_its_replicas_until_it_is_lost():
    plan = reconcile(
        [deployment(1)], snapshot([node("a", "NotReady"), node("b")], [replica("d-0", "d", "a", 0)])
    )
    assert not plan.changes


def test_scale_down_stops_the_newest_and_frees_room_for_others_in_the_same_cycle():
    nodes = [node("a", count=2)]
    running = [replica("d-0", "d", "a", 0), replica("d-1", "d", "a", 1)]
    plan = reconcile([deployment(1), deployment(1, "e")], snapshot(nodes, running))
    assert plan.release == ("d-1",)
    assert [(r.name, r.shards[0].devices) for r in plan.allocate] == [("e-0", (1,))]


def test_replicas_of_a_deleted_deployment_are_stopped():
    plan = reconcile([], snapshot([node("a")], [replica("old-0", "old", "a", 0)]))
    assert plan.release == ("old-0",)


def test_a_class_edited_to_an_unsupported_driver_keeps_its_running_replicas():
    running = [replica("d-0", "d", "a", 0)]
    plan = reconcile([deployment(2)], snapshot([node("a")], running, driver="gpu.nvidai.com"))
    [decision] = plan.decisions
    assert (decision.accepted.status, decision.accepted.reason) == (False, "UnsupportedDevices")
    assert "gpu.nvidai.com" in decision.accepted.message
    assert decision.kept == ("d-0",)
    assert plan.release == () and plan.allocate == ()


def test_new_replicas_are_named_from_the_deployments_next_ordinal_never_reusing_one():
    snap = snapshot([node("a")], [])
    snap = ClusterSnapshot(
        classes=snap.classes,
        nodes=snap.nodes,
        replicas=(),
        models=FACTS,
        next_ordinals=MappingProxyType({"d": 7}),
    )
    plan = reconcile([deployment(2)], snap)
    assert [r.name for r in plan.allocate] == ["d-7", "d-8"]
