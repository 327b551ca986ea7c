"""``fleetserve kube render``: per-replica objects, checked against the official Kubernetes schema."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest

from fleetserve.drivers import DRIVERS, Driver, pool_label, pool_taint
from fleetserve.errors import ConfigError
from fleetserve.kube.cluster import render_cluster
from fleetserve.kube.objects import object_name, running_replicas
from fleetserve.spec.cluster import Cluster, DeviceApi
from fleetserve.spec.loader import Documents, load_files, load_text

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
K8S_VERSION = "1.37.0"

# The LeaderWorkerSet is a CRD (leaderworkerset.x-k8s.io/v1): the official schemas do not have it.
# Its pod templates are checked as the official PodTemplate; the fields around them against the
# LWS API's own rules for the fields fleetserve writes (kubernetes-sigs/lws, api/leaderworkerset/v1).
LWS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "leaderworkerset.x-k8s.io/v1"},
        "kind": {"const": "LeaderWorkerSet"},
        "metadata": {"type": "object", "required": ["name", "namespace"]},
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["leaderWorkerTemplate"],
            "properties": {
                "replicas": {"type": "integer", "minimum": 0},
                "startupPolicy": {"enum": ["LeaderCreated", "LeaderReady"]},
                "leaderWorkerTemplate": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["size", "workerTemplate"],
                    "properties": {
                        "size": {"type": "integer", "minimum": 1},
                        "restartPolicy": {"enum": ["RecreateGroupOnPodRestart", "None", "Default"]},
                        "leaderTemplate": {"type": "object"},
                        "workerTemplate": {"type": "object"},
                    },
                },
            },
        },
    },
}


def validate(obj: dict[str, Any]) -> None:
    """Raise unless ``obj`` is valid: the official schema (strict: no unknown field), or LWS's."""
    if obj["kind"] == "LeaderWorkerSet":
        jsonschema.validate(obj, LWS_SCHEMA)
        lwt = obj["spec"]["leaderWorkerTemplate"]
        for key in ("leaderTemplate", "workerTemplate"):
            wrapped = {
                "apiVersion": "v1",
                "kind": "PodTemplate",
                "metadata": {"name": "t"},
                "template": lwt[key],
            }
            kubernetes_validate.validate(wrapped, K8S_VERSION, strict=True)
        return
    kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def example(name: str) -> Documents:
    return load_files(sorted((EXAMPLES / name).glob("**/*.yaml")))


def render(docs: Documents, cluster: Cluster | None = None, existing: list[dict[str, Any]] | None = None):  # type: ignore[no-untyped-def]
    return render_cluster(docs, cluster or docs.clusters[0], existing or [])


def pods(obj: dict[str, Any]) -> list[dict[str, Any]]:
    """The pod specs of a workload object."""
    if obj["kind"] == "Deployment":
        return [obj["spec"]["template"]["spec"]]
    if obj["kind"] == "LeaderWorkerSet":
        lwt = obj["spec"]["leaderWorkerTemplate"]
        return [lwt["leaderTemplate"]["spec"], lwt["workerTemplate"]["spec"]]
    return []


def workloads(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] in ("Deployment", "LeaderWorkerSet")]


@pytest.mark.parametrize("name", ["datacenter", "homelab"])
@pytest.mark.parametrize("api", [DeviceApi.DRA, DeviceApi.PLUGIN])
def test_every_object_is_valid_against_the_official_schema(name: str, api: DeviceApi) -> None:
    docs = example(name)
    cluster = docs.clusters[0].model_copy(update={"device_api": api})
    result = render(docs, cluster)
    assert workloads(result.objects)
    for obj in result.objects:
        validate(obj)


def test_the_schema_check_can_fail() -> None:
    result = render(example("datacenter"))
    dep = next(o for o in result.objects if o["kind"] == "Deployment")
    bad = copy.deepcopy(dep)
    bad["spec"]["template"]["spec"]["containers"][0]["gpus"] = 8  # no such field
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(bad)
    bad = copy.deepcopy(dep)
    bad["spec"]["replicas"] = "one"
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(bad)
    lws = next(o for o in result.objects if o["kind"] == "LeaderWorkerSet")
    bad = copy.deepcopy(lws)
    bad["spec"]["leaderWorkerTemplate"]["size"] = 0
    with pytest.raises(jsonschema.ValidationError):
        validate(bad)


# --- per driver: claim, label, taint, toleration ------------------------------------------------

ONE_OF_EACH = """
kind: DeviceClass
name: h100
driver: gpu.nvidia.com
memory: 80GiB
match: {productName: "NVIDIA H100 80GB HBM3"}
---
kind: DeviceClass
name: mi300x
driver: gpu.amd.com
memory: 192GiB
match: {productName: "AMD_Instinct_MI300X_OAM"}
---
kind: Node
name: nv
cpu: {cores: 64, memory: 512GiB}
gpus: [{class: h100, count: 8}]
---
kind: Node
name: amd
cpu: {cores: 64, memory: 512GiB}
gpus: [{class: mi300x, count: 8}]
---
kind: Node
name: cpu
cpu: {cores: 64, memory: 512GiB}
---
kind: Model
name: m
source: hf://org/repo/m.gguf
format: gguf
size: 1GB
architecture: {layers: 2, kvHeads: 2, headDim: 64, contextLength: 4096}
---
kind: Model
name: big
source: hf://org/big
format: safetensors
size: 100GB
architecture: {layers: 2, kvHeads: 2, headDim: 64, contextLength: 4096}
---
kind: Deployment
name: on-nvidia
model: big
profiles: [{name: p, engine: vllm, deviceClass: h100, devicesPerNode: 2}]
---
kind: Deployment
name: on-nvidia-llama
model: m
profiles: [{name: p, engine: llama.cpp, deviceClass: h100}]
---
kind: Deployment
name: on-amd
model: m
profiles: [{name: p, engine: llama.cpp, deviceClass: mi300x}]
---
kind: Deployment
name: on-amd-rocm
model: m
profiles: [{name: p, engine: llama.cpp, runtime: rocm, deviceClass: mi300x}]
---
kind: Deployment
name: on-cpu
model: m
profiles: [{name: p, engine: llama.cpp, cpu: {cores: 8, memory: 16GiB}}]
---
kind: Cluster
name: all
classes: [h100, mi300x, cpu]
"""

CASES = [
    # deployment, driver, devices per pod, device-plugin resource, image suffix
    ("on-nvidia", Driver.NVIDIA, 2, "nvidia.com/gpu", "vllm-openai:v0.23.0"),
    ("on-nvidia-llama", Driver.NVIDIA, 1, "nvidia.com/gpu", "server-cuda-b11434"),
    ("on-amd", Driver.AMD, 1, "squat.ai/dri", "server-vulkan-b11434"),
    ("on-amd-rocm", Driver.AMD, 1, "amd.com/gpu", "server-rocm-b11434"),
    ("on-cpu", Driver.CPU, 1, None, "server-b11434"),
]


def _objects_of(objects: list[dict[str, Any]], deployment: str) -> dict[str, dict[str, Any]]:
    return {
        o["kind"]: o
        for o in objects
        if o["metadata"].get("labels", {}).get("fleetserve.io/deployment") == deployment
    }


@pytest.mark.parametrize(("deployment", "driver", "count", "plugin", "image"), CASES)
def test_each_driver_gets_its_claim_pool_and_only_its_toleration(
    deployment: str, driver: Driver, count: int, plugin: str | None, image: str
) -> None:
    docs = load_text(ONE_OF_EACH)
    objs = _objects_of(render(docs).objects, deployment)
    claim = objs["ResourceClaimTemplate"]["spec"]["spec"]["devices"]["requests"][0]["exactly"]
    assert claim["deviceClassName"] == driver.value
    assert claim["count"] == (1 if driver is Driver.CPU else count)
    pod = pods(objs["Deployment"])[0]
    key, value = pool_label(driver)
    assert pod["nodeSelector"] == {key: value}
    taint = pool_taint(driver)
    assert pod["tolerations"] == [
        {"key": taint.key, "operator": "Equal", "value": taint.value, "effect": taint.effect}
    ]
    assert pod["resourceClaims"] == [
        {"name": "devices", "resourceClaimTemplateName": object_name(f"{deployment}-0")}
    ]
    container = pod["containers"][0]
    assert container["resources"]["claims"] == [{"name": "devices"}]
    assert container["image"].endswith(image)
    # The claim decides which devices the container sees: no host indices leak into the pod.
    env = {e["name"] for e in container["env"]}
    assert not env & {v for spec in DRIVERS.values() for vs in spec.visible_devices_env.values() for v in vs}
    if driver is not Driver.CPU and "llama" in container["image"]:
        assert "--n-gpu-layers" in container["command"] and "999" in container["command"]
    # The Service routes to this replica's pod on the engine's port.
    svc = objs["Service"]
    assert svc["spec"]["selector"] == {"fleetserve.io/replica": f"{deployment}-0"}
    assert svc["spec"]["ports"][0]["targetPort"] == "http"
    # The plugin rendering of the same replica asks for the driver table's resource instead.
    cluster = docs.clusters[0].model_copy(update={"device_api": DeviceApi.PLUGIN})
    pobjs = _objects_of(render(docs, cluster).objects, deployment)
    assert "ResourceClaimTemplate" not in pobjs
    ppod = pods(pobjs["Deployment"])[0]
    assert "resourceClaims" not in ppod
    limits = ppod["containers"][0]["resources"].get("limits", {})
    if plugin is None:
        assert set(limits) == {"cpu", "memory"}
    else:
        assert limits == {plugin: str(count)}


def test_a_class_selects_its_devices_by_product_name() -> None:
    objs = _objects_of(render(load_text(ONE_OF_EACH)).objects, "on-nvidia")
    (selector,) = objs["ResourceClaimTemplate"]["spec"]["spec"]["devices"]["requests"][0]["exactly"][
        "selectors"
    ]
    assert selector["cel"]["expression"] == (
        'device.attributes["gpu.nvidia.com"].productName.matches("^(?:NVIDIA H100 80GB HBM3)$")'
    )


def test_cpu_pods_are_guaranteed_qos_with_requests_equal_limits_equal_claim() -> None:
    for docs in (example("datacenter"), example("homelab"), load_text(ONE_OF_EACH)):
        result = render(docs)
        cpu_workloads = [
            w for w in workloads(result.objects) if pods(w)[0]["tolerations"][0]["key"].endswith("dra.cpu")
        ]
        assert cpu_workloads
        claims = {
            o["metadata"]["name"]: o["spec"]["spec"]["devices"]["requests"][0]["exactly"]
            for o in result.objects
            if o["kind"] == "ResourceClaimTemplate"
        }
        for w in cpu_workloads:
            for pod in pods(w):
                for c in pod["containers"] + pod.get("initContainers", []):
                    res = c["resources"]
                    # Guaranteed: every container has cpu and memory requests equal to limits.
                    assert set(res["requests"]) == {"cpu", "memory"}, w["metadata"]["name"]
                    assert res["requests"] == res["limits"]
                claim = claims[pod["resourceClaims"][0]["resourceClaimTemplateName"]]
                assert (
                    claim["capacity"]["requests"]["dra.cpu/cpu"]
                    == pod["containers"][0]["resources"]["requests"]["cpu"]
                )
                # llama-server runs as many threads as the claim has CPUs.
                command = pod["containers"][0]["command"]
                assert command[command.index("--threads") + 1] == claim["capacity"]["requests"]["dra.cpu/cpu"]


def test_multi_node_vllm_is_a_leader_worker_set_on_one_fabric() -> None:
    result = render(example("datacenter"))
    lws = [o for o in result.objects if o["kind"] == "LeaderWorkerSet"]
    assert lws
    for obj in lws:
        leader, worker = pods(obj)
        assert obj["spec"]["leaderWorkerTemplate"]["size"] == 2
        assert leader["nodeSelector"]["fabric.fleetserve.io/ib-east"] == "attached"
        assert worker["nodeSelector"] == leader["nodeSelector"]
        script = leader["containers"][0]["command"][2]
        assert script.startswith(
            "ray start --head --port=6379 && exec vllm serve meta-llama/Llama-3.1-405B-Instruct"
        )
        assert "--pipeline-parallel-size 2" in script
        assert worker["containers"][0]["command"] == [
            "ray",
            "start",
            "--block",
            "--address=$(LWS_LEADER_ADDRESS):6379",
        ]
        assert "readinessProbe" not in worker["containers"][0]
        # The Service reaches the leader only: it runs the API server.
        svc = next(
            o
            for o in result.objects
            if o["kind"] == "Service" and o["metadata"]["name"] == obj["metadata"]["name"]
        )
        assert svc["spec"]["selector"]["leaderworkerset.sigs.k8s.io/worker-index"] == "0"


def test_probes_watch_the_engine_health_endpoint() -> None:
    for obj in workloads(render(example("homelab")).objects):
        c = pods(obj)[0]["containers"][0]
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}


def test_model_storage_is_per_node_or_per_replica_never_one_shared_volume() -> None:
    dc = render(example("datacenter"))
    home = render(example("homelab"))
    assert not [o for o in dc.objects + home.objects if o["kind"] == "PersistentVolumeClaim"]
    for obj in workloads(dc.objects):
        for pod in pods(obj):
            (models,) = [v for v in pod["volumes"] if v["name"] == "models"]
            assert models["hostPath"] == {"path": "/var/lib/fleetserve/models", "type": "DirectoryOrCreate"}
    for obj in workloads(home.objects):
        for pod in pods(obj):
            (models,) = [v for v in pod["volumes"] if v["name"] == "models"]
            assert "persistentVolumeClaim" not in models
            spec = models["ephemeral"]["volumeClaimTemplate"]["spec"]
            assert spec["accessModes"] == ["ReadWriteOnce"]
    # 18.6 GB of weights → a 21 GiB volume (20% room for the engine's download leftovers).
    qwen = next(o for o in workloads(home.objects) if o["metadata"]["name"] == "qwen3-0")
    (models,) = [v for v in pods(qwen)[0]["volumes"] if v["name"] == "models"]
    assert models["ephemeral"]["volumeClaimTemplate"]["spec"]["resources"]["requests"] == {"storage": "21Gi"}


def test_images_are_configurable_per_engine_variant() -> None:
    docs = load_text(ONE_OF_EACH)
    cluster = docs.clusters[0].model_copy(update={"images": {"llama.cpp/vulkan": "registry.lan/llama:vk"}})
    objs = _objects_of(render(docs, cluster).objects, "on-amd")
    assert pods(objs["Deployment"])[0]["containers"][0]["image"] == "registry.lan/llama:vk"
    other = _objects_of(render(docs, cluster).objects, "on-amd-rocm")
    assert pods(other["Deployment"])[0]["containers"][0]["image"].endswith("server-rocm-b11434")


def test_a_bad_image_key_is_refused_naming_the_field() -> None:
    text = ONE_OF_EACH.replace(
        "classes: [h100, mi300x, cpu]", "classes: [h100, mi300x, cpu]\nimages: {llama.cpp/metal: x}"
    )
    with pytest.raises(ConfigError) as err:
        render(load_text(text))
    (problem,) = err.value.problems
    assert problem.field == "images.llama.cpp/metal"
    assert "llama.cpp/vulkan" in problem.message


def test_a_model_on_this_machine_is_refused_naming_its_source() -> None:
    text = ONE_OF_EACH.replace("source: hf://org/repo/m.gguf", "source: /srv/models/m.gguf")
    docs = load_text(text)
    with pytest.raises(ConfigError) as err:
        render(docs)
    assert {p.location for p in err.value.problems} == {"Model m"}
    assert all(p.field == "source" and "publish the model" in p.message for p in err.value.problems)


def test_a_gguf_at_a_hub_revision_is_refused_for_llama_cpp_naming_the_revision() -> None:
    text = ONE_OF_EACH.replace("source: hf://org/repo/m.gguf", "source: hf://org/repo/m.gguf@v1.2")
    with pytest.raises(ConfigError) as err:
        render(load_text(text))
    problems = err.value.problems
    assert problems and {(p.location, p.field) for p in problems} == {("Model m", "source")}
    assert all("drop @v1.2 " in p.message and "{" not in p.message for p in problems)


def test_an_unknown_class_in_a_cluster_is_refused() -> None:
    with pytest.raises(ConfigError) as err:
        render(load_text(ONE_OF_EACH.replace("classes: [h100, mi300x, cpu]", "classes: [h100, mi3000x]")))
    (problem,) = err.value.problems
    assert problem.field == "classes[1]" and "mi300x" in problem.message


def test_object_names_are_valid_for_every_kind() -> None:
    assert object_name("qwen-7b-0") == "qwen-7b-0"
    dotted = object_name("qwen2.5-7b-0")
    assert dotted.startswith("qwen2-5-7b-0-") and "." not in dotted
    assert object_name("7b-0").startswith("r-7b-0-")
    assert object_name("a.b-0") != object_name("a-b-0")
    assert len(object_name("x" * 60 + ".y-0")) <= 63


def test_rendering_what_runs_is_idempotent_and_keeps_every_replica_where_it_is() -> None:
    docs = example("datacenter")
    first = render(docs)
    running, notes = running_replicas(first.objects, "dc-east")
    assert not notes
    assert sorted(r.name for r in running) == sorted(first.rendered)
    again = render(docs, existing=first.objects)
    assert again.objects == first.objects
    assert not again.kept_as_is


def test_the_pod_prefers_the_node_placement_chose_but_may_move() -> None:
    result = render(example("datacenter"))
    for obj in workloads(result.objects):
        placed = json.loads(obj["metadata"]["annotations"]["fleetserve.io/placement"])
        nodes = [s["node"] for s in placed["shards"]]
        for pod, want in zip(pods(obj), [nodes[:1], nodes[1:]], strict=False):
            affinity = pod["affinity"]["nodeAffinity"]
            assert "requiredDuringSchedulingIgnoredDuringExecution" not in affinity
            (term,) = affinity["preferredDuringSchedulingIgnoredDuringExecution"]
            assert term["preference"]["matchExpressions"] == [
                {"key": "kubernetes.io/hostname", "operator": "In", "values": want}
            ]


def test_a_vllm_cpu_pod_runs_as_many_threads_as_its_claim_has_cpus() -> None:
    docs = load_text(
        ONE_OF_EACH
        + """
---
kind: Deployment
name: on-cpu-vllm
model: big
profiles: [{name: p, engine: vllm, runtime: cpu, cpu: {cores: 6, memory: 200GiB}}]
"""
    )
    objs = _objects_of(render(docs).objects, "on-cpu-vllm")
    claim = objs["ResourceClaimTemplate"]["spec"]["spec"]["devices"]["requests"][0]["exactly"]
    container = pods(objs["Deployment"])[0]["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["OMP_NUM_THREADS"] == claim["capacity"]["requests"]["dra.cpu/cpu"] == "6"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    assert container["resources"]["requests"]["cpu"] == "6"
    validate(objs["Deployment"])


@pytest.mark.parametrize(
    ("example_name", "engines"), [("homelab", {"llama.cpp"}), ("datacenter", {"llama.cpp", "vllm"})]
)
@pytest.mark.parametrize(
    ("task", "llama", "vllm"), [("embed", "--embeddings", "embed"), ("rerank", "--reranking", "classify")]
)
def test_a_pod_starts_its_engine_for_the_deployments_task(
    example_name: str, engines: set[str], task: str, llama: str, vllm: str
) -> None:
    from fleetserve.engines.spec import Task

    docs = example(example_name)
    docs.deployments = [d.model_copy(update={"task": Task(task)}) for d in docs.deployments]
    seen = set()
    for obj in workloads(render(docs).objects):
        # A multi-node leader runs its engine in a shell after its Ray head: its words, in order.
        command = " ".join(pods(obj)[0]["containers"][0]["command"]).split()
        if "/app/llama-server" in command:
            seen.add("llama.cpp")
            assert llama in command
        else:
            seen.add("vllm")
            assert command[command.index("--runner") + 1] == "pooling"
            assert command[command.index("--convert") + 1] == vllm
    assert seen == engines


def test_a_deployment_with_lora_adapters_is_refused_naming_the_field() -> None:
    adapter = "kind: Adapter\nname: sql\nbase: m\nsource: hf://org/sql/sql.gguf\nsize: 50MB\n"
    docs = load_text(ONE_OF_EACH + "\n---\n" + adapter)
    docs.deployments = [
        d.model_copy(update={"adapters": ("sql",)}) if d.name == "on-cpu" else d for d in docs.deployments
    ]
    with pytest.raises(ConfigError) as err:
        render(docs)
    [problem] = err.value.problems
    assert (problem.location, problem.field) == ("Deployment on-cpu", "adapters")
    assert "a Kubernetes pod fetches no LoRA adapter" in problem.message
