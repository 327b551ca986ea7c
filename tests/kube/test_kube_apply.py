"""``fleetserve.kube.apply``: server-side apply and reading back, through the official client.

The requests go over HTTP to the fake API server of fake_apiserver.py (a LABELLED FAKE: no real
Kubernetes API server can run here), which records what the client sent.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
from fake_apiserver import APPLY_PATCH, FakeApiServer
from kubernetes import client

from fleetserve.kube.apply import Applied, KubeError, api_client, apply_objects, read_existing
from fleetserve.kube.stack import stack_configmap_name

NS = "fleetserve"
CLUSTER = "dc1"
STACK_CONFIGMAP = stack_configmap_name(CLUSTER)
SELECTOR = f"app.kubernetes.io/managed-by=fleetserve,fleetserve.io/cluster={CLUSTER}"


def labels(cluster: str = CLUSTER, **extra: str) -> dict[str, str]:
    return {"app.kubernetes.io/managed-by": "fleetserve", "fleetserve.io/cluster": cluster, **extra}


def meta(name: str, namespace: str | None = NS, cluster: str | None = CLUSTER) -> dict[str, Any]:
    out: dict[str, Any] = {"name": name}
    if namespace is not None:
        out["namespace"] = namespace
    if cluster is not None:
        out["labels"] = labels(cluster)
    return out


POD = {"containers": [{"name": "engine", "image": "ghcr.io/ggml-org/llama.cpp:server"}]}


def objects() -> list[dict[str, Any]]:
    """One object of every kind fleetserve applies, in the order a render writes them."""
    return [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": meta(NS, namespace=None)},
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta(STACK_CONFIGMAP), "data": {"stack": "[]"}},
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaimTemplate",
            "metadata": meta("qwen-0"),
            "spec": {
                "spec": {
                    "devices": {
                        "requests": [
                            {"name": "gpus", "exactly": {"deviceClassName": "gpu.nvidia.com", "count": 2}}
                        ]
                    }
                }
            },
        },
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": meta("qwen-0"),
            "spec": {
                "replicas": 1,
                "selector": {"matchLabels": {"fleetserve.io/replica": "qwen-0"}},
                "template": {"metadata": {"labels": {"fleetserve.io/replica": "qwen-0"}}, "spec": POD},
            },
        },
        {
            "apiVersion": "leaderworkerset.x-k8s.io/v1",
            "kind": "LeaderWorkerSet",
            "metadata": meta("llama-0"),
            "spec": {"replicas": 1, "leaderWorkerTemplate": {"size": 2, "workerTemplate": {"spec": POD}}},
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": meta("qwen-0"),
            "spec": {
                "selector": {"fleetserve.io/replica": "qwen-0"},
                "ports": [{"name": "http", "port": 8080}],
            },
        },
    ]


PATHS = [
    f"/api/v1/namespaces/{NS}",
    f"/api/v1/namespaces/{NS}/configmaps/{STACK_CONFIGMAP}",
    f"/apis/resource.k8s.io/v1/namespaces/{NS}/resourceclaimtemplates/qwen-0",
    f"/apis/apps/v1/namespaces/{NS}/deployments/qwen-0",
    f"/apis/leaderworkerset.x-k8s.io/v1/namespaces/{NS}/leaderworkersets/llama-0",
    f"/api/v1/namespaces/{NS}/services/qwen-0",
]


# --- apply -------------------------------------------------------------------------------------


def test_one_apply_patch_per_object(fake_api: FakeApiServer, kube_api: client.ApiClient) -> None:
    objs = objects()
    seen: list[Applied] = []
    done = apply_objects(kube_api, objs, on_applied=seen.append)
    assert done == seen
    assert [(a.kind, a.namespace, a.name, a.result) for a in done] == [
        ("Namespace", "", NS, "applied"),
        ("ConfigMap", NS, STACK_CONFIGMAP, "applied"),
        ("ResourceClaimTemplate", NS, "qwen-0", "applied"),
        ("Deployment", NS, "qwen-0", "applied"),
        ("LeaderWorkerSet", NS, "llama-0", "applied"),
        ("Service", NS, "qwen-0", "applied"),
    ]
    requests = fake_api.requests
    assert [r.method for r in requests] == ["PATCH"] * 6
    assert [r.path for r in requests] == PATHS
    for request, obj in zip(requests, objs, strict=True):
        assert request.content_type == APPLY_PATCH
        assert dict(request.query) == {"fieldManager": "fleetserve"}
        assert request.body == obj
    for obj in objs:
        stored = fake_api.stored(obj["apiVersion"], obj["kind"], obj["metadata"]["name"], NS)
        assert stored is not None
        assert {k: v for k, v in stored.items() if k != "metadata"} == {
            k: v for k, v in obj.items() if k != "metadata"
        }


def test_force_conflicts_sets_force(fake_api: FakeApiServer, kube_api: client.ApiClient) -> None:
    apply_objects(kube_api, objects()[:2], force_conflicts=True)
    assert [dict(r.query) for r in fake_api.requests] == [{"fieldManager": "fleetserve", "force": "true"}] * 2


def test_dry_run_stores_nothing(fake_api: FakeApiServer, kube_api: client.ApiClient) -> None:
    done = apply_objects(kube_api, objects(), dry_run=True)
    assert {a.result for a in done} == {"dry-run"}
    assert [r.path for r in fake_api.requests] == PATHS
    assert all(dict(r.query) == {"fieldManager": "fleetserve", "dryRun": "All"} for r in fake_api.requests)
    assert fake_api.objects == {}


def test_a_conflict_names_the_object_and_what_was_applied_before(
    fake_api: FakeApiServer, kube_api: client.ApiClient
) -> None:
    fake_api.conflicts.add("qwen-0")
    with pytest.raises(KubeError) as caught:
        apply_objects(kube_api, objects())
    message = str(caught.value)
    assert message.startswith("ResourceClaimTemplate fleetserve/qwen-0: HTTP 409 Conflict")
    assert "--force-conflicts takes them over" in message
    assert message.endswith("; 2 object(s) were applied before it")
    # Applied before the refusal stays applied; nothing after it was sent.
    assert len(fake_api.requests) == 3
    assert fake_api.stored("v1", "ConfigMap", STACK_CONFIGMAP, NS) is not None
    assert fake_api.stored("apps/v1", "Deployment", "qwen-0", NS) is None
    # --force-conflicts takes the fields over.
    assert len(apply_objects(kube_api, objects(), force_conflicts=True)) == 6


def test_an_absent_lws_crd_says_what_to_install(fake_api: FakeApiServer, kube_api: client.ApiClient) -> None:
    fake_api.lws_crd = False
    with pytest.raises(
        KubeError,
        match=r"^LeaderWorkerSet fleetserve/llama-0: HTTP 404 .*is the LeaderWorkerSet controller installed",
    ):
        apply_objects(kube_api, objects())


def test_an_unknown_kind_is_refused_before_anything_is_sent(
    fake_api: FakeApiServer, kube_api: client.ApiClient
) -> None:
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": meta("hf-token")}
    with pytest.raises(KubeError, match=r"^Secret hf-token: fleetserve does not apply v1 Secret objects$"):
        apply_objects(kube_api, [secret])
    wrong_version = {**objects()[3], "apiVersion": "apps/v1beta1"}
    with pytest.raises(KubeError, match=r"does not apply apps/v1beta1 Deployment objects"):
        apply_objects(kube_api, [wrong_version])
    assert fake_api.requests == []


# --- read back ---------------------------------------------------------------------------------


def seed(fake_api: FakeApiServer, *, stack: bool = True, lws: bool = True) -> list[dict[str, Any]]:
    """The cluster's objects: ours (returned), another cluster's, unlabelled ones, another namespace's."""
    ours = [o for o in objects() if o["kind"] not in ("Namespace", "ConfigMap", "LeaderWorkerSet")]
    if stack:
        ours.insert(0, objects()[1])
    if lws:
        ours.append(objects()[4])
    for obj in ours:
        fake_api.add(obj)
    for obj in objects()[2:]:
        theirs = copy.deepcopy(obj)
        theirs["metadata"] = meta(obj["metadata"]["name"] + "-x", cluster="dc2")
        fake_api.add(theirs)
        unlabelled = copy.deepcopy(obj)
        unlabelled["metadata"] = meta(obj["metadata"]["name"] + "-y", cluster=None)
        fake_api.add(unlabelled)
        elsewhere = copy.deepcopy(obj)
        elsewhere["metadata"] = meta(obj["metadata"]["name"] + "-z", namespace="other")
        fake_api.add(elsewhere)
    return ours


def test_read_existing_returns_the_clusters_objects(
    fake_api: FakeApiServer, kube_api: client.ApiClient
) -> None:
    ours = seed(fake_api)
    got = read_existing(kube_api, CLUSTER, NS)
    assert sorted((o["apiVersion"], o["kind"], o["metadata"]["name"]) for o in got) == sorted(
        (o["apiVersion"], o["kind"], o["metadata"]["name"]) for o in ours
    )
    for obj in got:
        assert obj["metadata"]["namespace"] == NS
        assert obj["metadata"]["labels"] == labels()
        assert obj["metadata"]["resourceVersion"]
    stack = next(o for o in got if o["kind"] == "ConfigMap")
    assert stack["data"] == {"stack": "[]"}
    deployment = next(o for o in got if o["kind"] == "Deployment")
    assert deployment["spec"]["template"]["spec"] == POD  # camelCase plain data, as written
    lists = [r for r in fake_api.requests if not r.path.endswith(STACK_CONFIGMAP)]
    assert lists and all(r.method == "GET" and r.query.get("labelSelector") == SELECTOR for r in lists)


def test_read_existing_without_stack_record_or_lws_crd(
    fake_api: FakeApiServer, kube_api: client.ApiClient
) -> None:
    ours = seed(fake_api, stack=False, lws=False)
    fake_api.lws_crd = False
    got = read_existing(kube_api, CLUSTER, NS)
    assert (
        sorted(o["kind"] for o in got)
        == sorted(o["kind"] for o in ours)
        == [
            "Deployment",
            "ResourceClaimTemplate",
            "Service",
        ]
    )
    assert any(r.path.endswith("/leaderworkersets") for r in fake_api.requests)


def test_read_existing_refusals_raise_kube_error(fake_api: FakeApiServer, tmp_path: Path) -> None:
    api = api_client(kubeconfig=fake_api.write_kubeconfig(tmp_path / "kubeconfig", token="wrong"))
    try:
        with pytest.raises(
            KubeError, match=r"^reading cluster dc1's objects in namespace fleetserve: HTTP 401"
        ):
            read_existing(api, CLUSTER, NS)
    finally:
        api.close()


# --- configuration -----------------------------------------------------------------------------


def test_a_missing_kubeconfig_raises_kube_error(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere" / "kubeconfig"
    with pytest.raises(KubeError, match=rf"^cannot load the Kubernetes configuration from {missing}: "):
        api_client(kubeconfig=missing)


def test_the_kubeconfig_reaches_the_server(fake_api: FakeApiServer, kube_api: client.ApiClient) -> None:
    assert kube_api.configuration.host == fake_api.url
    apply_objects(kube_api, objects()[:1])
    assert fake_api.stored("v1", "Namespace", NS) is not None
