"""Serving-stack composition and the multi-accelerator gate on Kubernetes clusters."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from fleetserve.drivers import DRIVERS, Driver, pool_taint
from fleetserve.kube.cluster import render_cluster
from fleetserve.kube.stack import COMPONENTS, components_recorded, compose, drivers_of_component
from fleetserve.spec.cluster import Cluster
from fleetserve.spec.loader import Documents, load_files

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
AMD_COMPONENTS = {"amd-gpu-operator", "amd-device-metrics-exporter"}


def datacenter() -> Documents:
    return load_files(sorted((EXAMPLES / "datacenter").glob("**/*.yaml")))


def without_deployment(docs: Documents, name: str) -> Documents:
    """The same documents less deployment ``name`` (as if an operator deleted it)."""
    return dataclasses.replace(docs, deployments=[d for d in docs.deployments if d.name != name])


def cluster(*classes: str) -> Cluster:
    return Cluster(name="c", classes=classes)


def tolerated(objects: list[dict[str, Any]]) -> set[str]:
    """Every toleration key in every pod of ``objects``."""
    keys: set[str] = set()

    def walk(value: Any) -> None:
        if isinstance(value, dict):
            for t in value.get("tolerations", []) or []:
                keys.add(t["key"])
            for v in value.values():
                walk(v)
        elif isinstance(value, list):
            for v in value:
                walk(v)

    walk(objects)
    return keys


def test_every_component_of_the_driver_table_is_described() -> None:
    named = {c for spec in DRIVERS.values() for c in spec.stack_components}
    assert named == set(COMPONENTS)
    assert drivers_of_component("nfd") == (Driver.NVIDIA, Driver.AMD)
    assert drivers_of_component("dra-driver-cpu") == (Driver.CPU,)


def test_no_class_means_an_empty_stack_never_everything() -> None:
    plan = compose(cluster(), {})
    assert plan.claimed == () and plan.components == () and plan.provided == ()
    assert plan.condition.status


def test_the_claimed_drivers_select_the_components() -> None:
    classes = {c.name: c for c in datacenter().classes}
    full = compose(cluster("nvidia-h100-80gb", "amd-mi325x", "cpu"), classes)
    assert full.claimed == ("gpu.nvidia.com", "gpu.amd.com", "dra.cpu")
    assert set(full.components) == set(COMPONENTS)
    # The filter drops something: leave AMD out and its stack is absent.
    no_amd = compose(cluster("nvidia-h100-80gb", "nvidia-h100-pcie", "cpu"), classes)
    assert no_amd.claimed == ("gpu.nvidia.com", "dra.cpu")
    assert not AMD_COMPONENTS & set(no_amd.components)
    assert "nfd" in no_amd.components and "dra-driver-cpu" in no_amd.components
    cpu_only = compose(cluster("cpu"), classes)
    assert cpu_only.components == ("dra-driver-cpu",)


def test_a_cluster_of_nvidia_and_cpu_gets_no_amd_component_toleration_or_replica() -> None:
    docs = datacenter()
    full = render_cluster(docs, docs.clusters[0])
    amd_taint = pool_taint(Driver.AMD).key
    # With the AMD pool, the fallback profiles land there: the filter has something to drop.
    assert amd_taint in tolerated(full.objects)
    assert any(
        "mi325x" in json.dumps(o) for o in full.objects if o["kind"] in ("Deployment", "LeaderWorkerSet")
    )

    nv_cpu = docs.clusters[0].model_copy(update={"classes": ("nvidia-h100-80gb", "nvidia-h100-pcie", "cpu")})
    result = render_cluster(docs, nv_cpu)
    assert not AMD_COMPONENTS & set(result.stack.components)
    assert amd_taint not in tolerated(result.objects)
    assert tolerated(result.objects) == {pool_taint(Driver.NVIDIA).key, pool_taint(Driver.CPU).key}
    text = json.dumps(result.objects)
    assert "gpu.amd.com" not in text and "amd-gpu" not in text and "mi325x" not in text
    # The AMD profiles are not usable there: llama-405b's fourth replica has nowhere to go.
    by_dep = {d.deployment: d for d in result.decisions}
    assert len(by_dep["llama-405b"].unplaced) == 1
    assert "AMD" not in result.stack.condition.message


def test_a_class_edited_to_an_unsupported_driver_keeps_what_runs_and_sets_the_condition() -> None:
    docs = datacenter()
    before_cluster = docs.clusters[0].model_copy(update={"classes": ("nvidia-h100-80gb", "cpu")})
    before = render_cluster(docs, before_cluster)
    h100_replicas = {
        o["metadata"]["labels"]["fleetserve.io/replica"]
        for o in before.objects
        if o["kind"] in ("Deployment", "LeaderWorkerSet") and "nvidia-h100-80gb" in json.dumps(o)
    }
    assert h100_replicas
    # An operator mistypes the driver of the class the running replicas use.
    edited = Documents(
        classes=[
            c.model_copy(update={"driver": "gpu.nvdia.com"}) if c.name == "nvidia-h100-80gb" else c
            for c in docs.classes
        ],
        fabrics=docs.fabrics,
        nodes=docs.nodes,
        models=docs.models,
        deployments=docs.deployments,
        clusters=docs.clusters,
    )
    after = render_cluster(edited, before_cluster, existing=before.objects)
    cond = after.stack.condition
    assert (cond.type, cond.status, cond.reason) == ("StackReady", False, "UnsupportedDevices")
    assert "class nvidia-h100-80gb claims driver gpu.nvdia.com" in cond.message
    # Every object of every running replica is still there, exactly as it was.
    for obj in before.objects:
        if obj["metadata"].get("labels", {}).get("fleetserve.io/replica") in h100_replicas:
            assert obj in after.objects, obj["metadata"]["name"]
    assert set(after.kept_as_is) == h100_replicas
    assert all("gpu.nvdia.com" in why for why in after.kept_as_is.values())
    # The NVIDIA components the cluster had are kept although nothing selects them now.
    before_components = set(before.stack.components)
    assert before_components <= set(after.stack.components)
    assert {"nvidia-dra-driver-gpu", "nvidia-gpu-operator", "dcgm-exporter"} <= set(after.stack.kept)
    configmap = next(o for o in after.objects if o["kind"] == "ConfigMap")
    assert before_components <= set(components_recorded(configmap))
    assert json.loads(configmap["data"]["conditions"])[0]["reason"] == "UnsupportedDevices"
    # The gated deployment is not accepted, and nothing new is placed for it.
    llama405 = next(d for d in after.decisions if d.deployment == "llama-405b")
    assert llama405.accepted.reason == "UnsupportedDevices" and not llama405.placed


def test_a_replica_of_a_removed_deployment_keeps_its_objects() -> None:
    docs = datacenter()
    before = render_cluster(docs, docs.clusters[0])
    without = without_deployment(docs, "qwen-7b")
    after = render_cluster(without, docs.clusters[0], existing=before.objects)
    assert set(after.kept_as_is) == {"qwen-7b-0", "qwen-7b-1", "qwen-7b-2"}
    qwen = [
        o
        for o in before.objects
        if o["metadata"].get("labels", {}).get("fleetserve.io/deployment") == "qwen-7b"
    ]
    assert qwen and all(o in after.objects for o in qwen)


def test_an_unreadable_stack_record_means_no_recorded_component() -> None:
    assert components_recorded(None) == []
    assert components_recorded({"data": {"components": "not json"}}) == []
    assert components_recorded({"data": {"components": '["nfd", 3]'}}) == ["nfd"]


def test_two_clusters_never_read_each_others_stack_record() -> None:
    docs = datacenter()
    full = render_cluster(docs, docs.clusters[0])
    other = docs.clusters[0].model_copy(update={"name": "dc-west", "classes": ("cpu",)})
    # Same namespace, the first cluster's objects present: the second keeps none of its components.
    result = render_cluster(docs, other, existing=full.objects)
    assert result.stack.components == ("dra-driver-cpu",) and result.stack.kept == ()
    names = {o["metadata"]["name"] for o in result.objects if o["kind"] == "ConfigMap"}
    assert names == {"fleetserve-stack-dc-west"}
    # And none of the first cluster's replicas are taken for its own.
    assert not result.kept_as_is and all(r.startswith("qwen-7b-") for r in result.rendered)


def test_objects_kept_as_they_run_lose_only_what_the_server_added() -> None:
    docs = datacenter()
    before = render_cluster(docs, docs.clusters[0])
    from_server = []
    for obj in before.objects:
        served = json.loads(json.dumps(obj))
        served["metadata"].update(resourceVersion="42", uid="u", managedFields=[{"manager": "fleetserve"}])
        served["status"] = {"replicas": 1}
        from_server.append(served)
    without = without_deployment(docs, "qwen-7b")
    after = render_cluster(without, docs.clusters[0], existing=from_server)
    carried = [
        o
        for o in after.objects
        if o["metadata"].get("labels", {}).get("fleetserve.io/deployment") == "qwen-7b"
    ]
    originals = [
        o
        for o in before.objects
        if o["metadata"].get("labels", {}).get("fleetserve.io/deployment") == "qwen-7b"
    ]
    assert carried == originals
