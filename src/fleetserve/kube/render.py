"""Replicas as Kubernetes objects: a claim template, a workload and a Service per replica.

A single-node replica is a Deployment of one pod; a multi-node vLLM replica a LeaderWorkerSet
whose leader runs the Ray head and ``vllm serve`` and whose workers join it. Devices come from a
DRA ``ResourceClaimTemplate`` (``resource.k8s.io/v1``: the driver's DeviceClass, the device
count) or, with ``deviceApi: plugin``, from device-plugin resources. The pod selects its pool by
the driver's label and tolerates that driver's taint only; it prefers the node placement chose
but may move when that node goes. CPU replicas request cpu and memory equal to their limits and
claim (Guaranteed QoS). Model files live on a per-node hostPath cache or a per-replica
ephemeral volume, never one ReadWriteOnce volume every replica shares. Pure: no I/O.
"""

from __future__ import annotations

import json
import math
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kubernetes import client

from fleetserve.drivers import DRIVERS, Driver, host_driver, pool_label, pool_taint
from fleetserve.engines.launch import LaunchContext, LaunchSpec
from fleetserve.engines.registry import ENGINES
from fleetserve.engines.spec import EngineKind, Task
from fleetserve.errors import ConfigError, Problem
from fleetserve.kube.objects import (
    CLUSTER_LABEL,
    DEPLOYMENT_LABEL,
    DRIVER_ANNOTATION,
    MANAGED_BY_KEY,
    MANAGER,
    PLACEMENT_ANNOTATION,
    PROFILE_LABEL,
    REPLICA_LABEL,
    object_name,
    placement_annotation,
    plain,
)
from fleetserve.kube.pods import MODEL_MOUNT, cache_env, image_for, model_args, served_weights
from fleetserve.spec.cluster import Cluster, DeviceApi, StorageMode
from fleetserve.spec.resources import DeviceClass, Model, Profile, Replica
from fleetserve.validation import ResolvedProfile, resolve_profile

CLAIM_NAME = "devices"
MODEL_VOLUME = "models"
HOSTNAME_LABEL = "kubernetes.io/hostname"
FABRIC_LABEL_PREFIX = "fabric.fleetserve.io/"
LWS_API_VERSION = "leaderworkerset.x-k8s.io/v1"
LWS_WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"
# Gated Hugging Face repositories need a token; the Secret is optional.
HF_TOKEN_SECRET = "fleetserve-hf-token"
CPU_CAPACITY = f"{host_driver().value}/cpu"
# A per-replica volume holds the model plus room for the engine's download leftovers.
VOLUME_HEADROOM = 1.2
GIB = 1 << 30
MIB = 1 << 20


@dataclass(frozen=True)
class ReplicaInput:
    """Everything rendering one replica needs."""

    replica: Replica
    profile: Profile
    model: Model
    cluster: Cluster
    classes: Mapping[str, DeviceClass]
    # What the deployment serves: the engine is started for it (``EngineSpec.tasks``).
    task: Task = Task.GENERATE
    # The deployment's LoRA adapters (``Deployment.adapters``): refused, a pod fetches none.
    adapters: tuple[str, ...] = ()


def fabric_label(fabric: str) -> str:
    """The node label key saying a node attaches to ``fabric`` (value ``attached``)."""
    return FABRIC_LABEL_PREFIX + fabric


def _labels(inp: ReplicaInput, engine: EngineKind) -> dict[str, str]:
    r = inp.replica
    return {
        MANAGED_BY_KEY: MANAGER,
        "app.kubernetes.io/name": engine.value.replace(".", ""),
        CLUSTER_LABEL: inp.cluster.name,
        DEPLOYMENT_LABEL: r.deployment,
        REPLICA_LABEL: r.name,
        PROFILE_LABEL: r.profile,
    }


def _meta(inp: ReplicaInput, rp: ResolvedProfile, *, annotate: bool = False) -> client.V1ObjectMeta:
    annotations = None
    if annotate:
        annotations = {
            PLACEMENT_ANNOTATION: placement_annotation(inp.replica),
            DRIVER_ANNOTATION: rp.driver.value,
        }
    return client.V1ObjectMeta(
        name=object_name(inp.replica.name),
        namespace=inp.cluster.namespace,
        labels=_labels(inp, rp.engine),
        annotations=annotations,
    )


def _cel_selector(driver: Driver, cls: DeviceClass | None) -> list[client.V1DeviceSelector] | None:
    """Narrow the driver's DeviceClass to the fleetserve class by its product-name pattern."""
    if cls is None or cls.match.product_name is None:
        return None
    pattern = json.dumps(f"^(?:{cls.match.product_name})$")
    expression = f'device.attributes["{driver.value}"].productName.matches({pattern})'
    return [client.V1DeviceSelector(cel=client.V1CELDeviceSelector(expression=expression))]


def claim_template(inp: ReplicaInput, rp: ResolvedProfile) -> client.V1ResourceClaimTemplate:
    """The DRA claim each pod of the replica gets: its devices per node, or its CPUs."""
    if not DRIVERS[rp.driver].is_accelerator:
        cpu = rp.host_request()
        request = client.V1ExactDeviceRequest(
            device_class_name=rp.driver.value,
            allocation_mode="ExactCount",
            count=1,
            capacity=client.V1CapacityRequirements(requests={CPU_CAPACITY: str(cpu.cores)}),
        )
    else:
        cls = inp.classes.get(rp.device_class or "")
        request = client.V1ExactDeviceRequest(
            device_class_name=rp.driver.value,
            allocation_mode="ExactCount",
            count=rp.devices_per_node,
            selectors=_cel_selector(rp.driver, cls),
        )
    return client.V1ResourceClaimTemplate(
        api_version="resource.k8s.io/v1",
        kind="ResourceClaimTemplate",
        metadata=_meta(inp, rp),
        spec=client.V1ResourceClaimTemplateSpec(
            spec=client.V1ResourceClaimSpec(
                devices=client.V1DeviceClaim(
                    requests=[client.V1DeviceRequest(name=CLAIM_NAME, exactly=request)]
                )
            )
        ),
    )


def _resources(inp: ReplicaInput, rp: ResolvedProfile) -> client.V1ResourceRequirements:
    """Claims (DRA) or device-plugin limits; for CPU replicas requests = limits = the claim."""
    dra = inp.cluster.device_api is DeviceApi.DRA
    limits: dict[str, str] = {}
    requests: dict[str, str] = {}
    if not DRIVERS[rp.driver].is_accelerator:
        cpu = rp.host_request()
        shard = inp.replica.shards[0]
        memory = shard.memory or cpu.memory or 0
        requests = {
            "cpu": str(cpu.cores),
            **({"memory": f"{math.ceil(memory / MIB)}Mi"} if memory else {}),
        }
        limits = dict(requests)
    elif not dra:
        resource = DRIVERS[rp.driver].device_plugin_resource[rp.variant]
        limits = {resource: str(rp.devices_per_node)}
    return client.V1ResourceRequirements(
        claims=[client.CoreV1ResourceClaim(name=CLAIM_NAME)] if dra else None,
        limits=limits or None,
        requests=requests or None,
    )


def _model_volume(inp: ReplicaInput) -> client.V1Volume:
    storage = inp.cluster.storage
    if storage.mode is StorageMode.NODE:
        return client.V1Volume(
            name=MODEL_VOLUME,
            host_path=client.V1HostPathVolumeSource(path=storage.host_path, type="DirectoryOrCreate"),
        )
    size_gib = max(1, math.ceil(inp.model.size * VOLUME_HEADROOM / GIB)) if inp.model.size else 100
    return client.V1Volume(
        name=MODEL_VOLUME,
        ephemeral=client.V1EphemeralVolumeSource(
            volume_claim_template=client.V1PersistentVolumeClaimTemplate(
                spec=client.V1PersistentVolumeClaimSpec(
                    access_modes=["ReadWriteOnce"],
                    storage_class_name=storage.storage_class,
                    resources=client.V1VolumeResourceRequirements(requests={"storage": f"{size_gib}Gi"}),
                )
            )
        ),
    )


def _probe(path: str, period: int, failures: int) -> client.V1Probe:
    return client.V1Probe(
        http_get=client.V1HTTPGetAction(path=path, port="http"),
        period_seconds=period,
        failure_threshold=failures,
        timeout_seconds=5,
    )


def _launch(inp: ReplicaInput, rp: ResolvedProfile, shard_index: int, head: str) -> LaunchSpec:
    pod = ENGINES[rp.engine].pod
    if rp.draft is not None:
        # The engine downloads its one model itself in a pod; nothing fetches a second one there.
        raise ConfigError(
            [
                Problem(
                    f"Deployment {inp.replica.deployment}",
                    f"profiles.{rp.name}.speculative.draft",
                    "a Kubernetes pod fetches no draft model: use method: ngram there, "
                    "or serve the draft profile with fleetserve agents",
                )
            ]
        )
    if inp.adapters:
        # As a draft: the engine downloads its one model itself in a pod; nothing fetches adapters.
        raise ConfigError(
            [
                Problem(
                    f"Deployment {inp.replica.deployment}",
                    "adapters",
                    "a Kubernetes pod fetches no LoRA adapter: drop adapters there, or serve the "
                    "deployment with fleetserve agents",
                )
            ]
        )
    ctx = LaunchContext(
        replica=inp.replica,
        shard_index=shard_index,
        profile=inp.profile,
        variant=rp.variant,
        driver=rp.driver,
        model_path=Path(MODEL_MOUNT),
        binary=pod.binary,
        host="0.0.0.0",
        port=pod.port,
        context=rp.context,
        peer_addresses=(head,),
        model_args=model_args(rp.engine, inp.model),
        task=inp.task,
    )
    return ENGINES[rp.engine].adapter.launch(ctx)


def _container(
    inp: ReplicaInput, rp: ResolvedProfile, spec: LaunchSpec, *, serves: bool
) -> client.V1Container:
    engine = ENGINES[rp.engine]
    # In a pod the claim (or device plugin) decides which devices the container sees, numbered
    # from 0: the host indices placement chose would be wrong, so no visible-devices variable.
    # The rest of the launch's environment (a CPU replica's thread count) goes with the engine.
    hidden = set(DRIVERS[rp.driver].visible_devices_env.get(rp.variant, ()))
    env = [client.V1EnvVar(name=k, value=v) for k, v in spec.env.items() if k not in hidden]
    env += [client.V1EnvVar(name=k, value=v) for k, v in cache_env(rp.engine).items()]
    env.append(
        client.V1EnvVar(
            name="HF_TOKEN",
            value_from=client.V1EnvVarSource(
                secret_key_ref=client.V1SecretKeySelector(name=HF_TOKEN_SECRET, key="token", optional=True)
            ),
        )
    )
    command = list(spec.argv)
    if spec.sidecars:
        # The Ray head must see the same GPUs as vllm serve: one container, head started first
        # (without --block, so it daemonizes), then the engine replaces the shell.
        head = [a for a in spec.sidecars[0] if a != "--block"]
        command = ["/bin/sh", "-c", f"{shlex.join(head)} && exec {shlex.join(spec.argv)}"]
    mounts = [client.V1VolumeMount(name=MODEL_VOLUME, mount_path=MODEL_MOUNT)]
    if engine.pod.shared_memory:
        mounts.append(client.V1VolumeMount(name="shm", mount_path="/dev/shm"))
    return client.V1Container(
        name="engine",
        image=image_for(inp.cluster, rp.engine, rp.variant),
        command=command,
        ports=[client.V1ContainerPort(name="http", container_port=engine.pod.port)] if serves else None,
        env=env,
        resources=_resources(inp, rp),
        volume_mounts=mounts,
        startup_probe=_probe(engine.health_path, 10, max(1, engine.pod.startup_seconds // 10))
        if serves
        else None,
        readiness_probe=_probe(engine.health_path, 5, 3) if serves else None,
        liveness_probe=_probe(engine.health_path, 15, 4) if serves else None,
    )


def _pod_spec(
    inp: ReplicaInput, rp: ResolvedProfile, container: client.V1Container, prefer: list[str]
) -> client.V1PodSpec:
    key, value = pool_label(rp.driver)
    selector = {key: value}
    if inp.replica.fabric:
        selector[fabric_label(inp.replica.fabric)] = "attached"
    taint = pool_taint(rp.driver)
    volumes = [_model_volume(inp)]
    if ENGINES[rp.engine].pod.shared_memory:
        volumes.append(client.V1Volume(name="shm", empty_dir=client.V1EmptyDirVolumeSource(medium="Memory")))
    dra = inp.cluster.device_api is DeviceApi.DRA
    return client.V1PodSpec(
        containers=[container],
        node_selector=selector,
        tolerations=[
            client.V1Toleration(key=taint.key, operator="Equal", value=taint.value, effect=taint.effect)
        ],
        # Placement's choice, as a preference: the scheduler may move the pod if the node goes.
        affinity=client.V1Affinity(
            node_affinity=client.V1NodeAffinity(
                preferred_during_scheduling_ignored_during_execution=[
                    client.V1PreferredSchedulingTerm(
                        weight=100,
                        preference=client.V1NodeSelectorTerm(
                            match_expressions=[
                                client.V1NodeSelectorRequirement(
                                    key=HOSTNAME_LABEL, operator="In", values=prefer
                                )
                            ]
                        ),
                    )
                ]
            )
        ),
        resource_claims=(
            [
                client.V1PodResourceClaim(
                    name=CLAIM_NAME, resource_claim_template_name=object_name(inp.replica.name)
                )
            ]
            if dra
            else None
        ),
        volumes=volumes,
    )


def _template(inp: ReplicaInput, rp: ResolvedProfile, spec: client.V1PodSpec) -> client.V1PodTemplateSpec:
    return client.V1PodTemplateSpec(
        metadata=client.V1ObjectMeta(labels=_labels(inp, rp.engine)),
        spec=spec,
    )


def _service(inp: ReplicaInput, rp: ResolvedProfile, leader_only: bool) -> client.V1Service:
    selector = {REPLICA_LABEL: inp.replica.name}
    if leader_only:
        selector[LWS_WORKER_INDEX_LABEL] = "0"
    port = ENGINES[rp.engine].pod.port
    return client.V1Service(
        api_version="v1",
        kind="Service",
        metadata=_meta(inp, rp),
        spec=client.V1ServiceSpec(
            type="ClusterIP",
            selector=selector,
            ports=[client.V1ServicePort(name="http", port=port, target_port="http", protocol="TCP")],
        ),
    )


def _deployment(inp: ReplicaInput, rp: ResolvedProfile) -> client.V1Deployment:
    spec = _launch(inp, rp, 0, head="")
    pod = _pod_spec(inp, rp, _container(inp, rp, spec, serves=True), [inp.replica.shards[0].node])
    return client.V1Deployment(
        api_version="apps/v1",
        kind="Deployment",
        metadata=_meta(inp, rp, annotate=True),
        spec=client.V1DeploymentSpec(
            replicas=1,
            # A replica holds its devices: the old pod must go before the new one can claim them.
            strategy=client.V1DeploymentStrategy(type="Recreate"),
            selector=client.V1LabelSelector(match_labels={REPLICA_LABEL: inp.replica.name}),
            template=_template(inp, rp, pod),
        ),
    )


def _leader_worker_set(inp: ReplicaInput, rp: ResolvedProfile) -> dict[str, Any]:
    """A LeaderWorkerSet (a CRD: no client model) around pod templates built with client models."""
    head = "$(LWS_LEADER_ADDRESS)"
    leader_spec = _launch(inp, rp, 0, head=head)
    worker_spec = _launch(inp, rp, 1, head=head)
    nodes = [s.node for s in inp.replica.shards]
    leader = _pod_spec(inp, rp, _container(inp, rp, leader_spec, serves=True), nodes[:1])
    worker = _pod_spec(inp, rp, _container(inp, rp, worker_spec, serves=False), nodes[1:])
    return {
        "apiVersion": LWS_API_VERSION,
        "kind": "LeaderWorkerSet",
        "metadata": plain(_meta(inp, rp, annotate=True)),
        "spec": {
            "replicas": 1,
            "startupPolicy": "LeaderCreated",
            "leaderWorkerTemplate": {
                "size": len(inp.replica.shards),
                # The whole group starts over when one pod restarts: a replica fails whole.
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": plain(_template(inp, rp, leader)),
                "workerTemplate": plain(_template(inp, rp, worker)),
            },
        },
    }


def render_replica(inp: ReplicaInput) -> list[dict[str, Any]]:
    """A replica's objects, in apply order: claim template (DRA), workload, Service."""
    rp = resolve_profile(inp.profile, inp.classes)
    # Everything below (the engine's source arguments, the volume's size) is of the weights this
    # engine serves: the model's primary ones or an alternate.
    inp = replace(inp, model=served_weights(rp.engine, inp.model)[0])
    out: list[dict[str, Any]] = []
    if inp.cluster.device_api is DeviceApi.DRA:
        out.append(plain(claim_template(inp, rp)))
    multi = len(inp.replica.shards) > 1
    out.append(_leader_worker_set(inp, rp) if multi else plain(_deployment(inp, rp)))
    out.append(plain(_service(inp, rp, leader_only=multi)))
    return out
