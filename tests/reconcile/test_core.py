"""One reconcile cycle: keep what runs, replace what was lost, stop surplus and orphans, gate without harm."""

from __future__ import annotations

from types import MappingProxyType

from builders import deployment, gpu_host_8c_64g
from fleetserve.modelfacts import ModelFacts
from fleetserve.reconcile.core import reconcile
from fleetserve.snapshot import ClusterSnapshot
from fleetserve.spec.resources import DeviceClass, Node, Replica, Shard

GiB = 1 << 30
FACTS = MappingProxyType({"m": ModelFacts("m", 2 * GiB, 0, 4096)})


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


def test_a_not_ready_node_keeps_its_replicas_until_it_is_lost():
    plan = reconcile(
        [deployment("d", 1)],
        snapshot(
            [gpu_host_8c_64g("a", "h100", state="NotReady"), gpu_host_8c_64g("b", "h100")],
            [replica("d-0", "d", "a", 0)],
        ),
    )
    assert not plan.changes


def test_scale_down_stops_the_newest_and_frees_room_for_others_in_the_same_cycle():
    nodes = [gpu_host_8c_64g("a", "h100", 2)]
    running = [replica("d-0", "d", "a", 0), replica("d-1", "d", "a", 1)]
    plan = reconcile([deployment("d", 1), deployment("e", 1)], snapshot(nodes, running))
    assert plan.release == ("d-1",)
    assert [(r.name, r.shards[0].devices) for r in plan.allocate] == [("e-0", (1,))]


def test_replicas_of_a_deleted_deployment_are_stopped():
    plan = reconcile([], snapshot([gpu_host_8c_64g("a", "h100")], [replica("old-0", "old", "a", 0)]))
    assert plan.release == ("old-0",)


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
