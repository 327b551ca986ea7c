"""A cluster's whole rendering: its stack, placement onto its pools, and every replica's objects.

The cluster's pools are the nodes whose devices are all of the classes it lists (devices-less
nodes when it lists ``cpu``). Replicas already running there — read back from the objects
fleetserve made, or given as Replica documents — are kept where they are. A kept replica whose
profile can no longer be rendered (its class now claims a driver the stack cannot provide, its
profile or deployment is gone) keeps its existing objects exactly as they are: the gate sets a
condition and never tears down what runs. Pure: no I/O beyond reading model headers placement
needs (``snapshot_from``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubernetes import client

from fleetserve.errors import ConfigError, Problem
from fleetserve.fleet import snapshot_from
from fleetserve.kube.objects import (
    MANAGED_BY_KEY,
    MANAGER,
    managed,
    objects_of_replica,
    plain,
    running_replicas,
)
from fleetserve.kube.pods import image_problems, model_args
from fleetserve.kube.render import ReplicaInput, render_replica
from fleetserve.kube.stack import (
    AGENTS_ONLY_FIX,
    CPU_CLASS,
    StackPlan,
    agents_only,
    cluster_problems,
    components_recorded,
    compose,
    stack_configmap,
    stack_configmap_name,
)
from fleetserve.placement.placer import DeploymentDecision, SearchKind, plan
from fleetserve.spec.cluster import Cluster
from fleetserve.spec.loader import Documents
from fleetserve.spec.resources import Deployment, DeviceClass, Node, Replica
from fleetserve.validation import resolve_profile


@dataclass(frozen=True)
class ClusterRender:
    """What rendering a cluster produced, and why."""

    cluster: Cluster
    stack: StackPlan
    decisions: list[DeploymentDecision]
    # The objects rendered now, in apply order.
    applied: list[dict[str, Any]]
    # The existing objects of replicas kept as they run: carried unchanged, never applied.
    carried: list[dict[str, Any]] = field(default_factory=list)
    rendered: tuple[str, ...] = ()
    # Kept replicas whose existing objects pass through unchanged, with the reason.
    kept_as_is: Mapping[str, str] = field(default_factory=dict)
    surplus: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()

    @property
    def objects(self) -> list[dict[str, Any]]:
        """Every object the cluster should have: the rendered ones, then the carried ones."""
        return self.applied + self.carried


def pick_cluster(docs: Documents, name: str | None) -> Cluster:
    """The Cluster document named ``name``, or the only one; ConfigError saying what exists."""
    known = [c.name for c in docs.clusters]
    if name is None:
        if len(docs.clusters) == 1:
            return docs.clusters[0]
        why = "no Cluster document was given" if not known else f"several clusters: {', '.join(known)}"
        raise ConfigError(
            [Problem("kube", "cluster", f"{why}; name one with --cluster (a Cluster lists its classes)")]
        )
    for cluster in docs.clusters:
        if cluster.name == name:
            return cluster
    raise ConfigError(
        [Problem("kube", "cluster", f"no Cluster named {name!r}; defined: {', '.join(known) or 'none'}")]
    )


def cluster_nodes(cluster: Cluster, nodes: Sequence[Node]) -> list[Node]:
    """The nodes of the cluster's pools: every device of a listed class (or none, with ``cpu``)."""
    listed = set(cluster.classes)
    out = []
    for node in nodes:
        if node.devices:
            if all(d.device_class in listed for d in node.devices):
                out.append(node)
        elif CPU_CLASS in listed:
            out.append(node)
    return out


def namespace_object(cluster: Cluster) -> dict[str, Any]:
    return plain(
        client.V1Namespace(
            api_version="v1",
            kind="Namespace",
            metadata=client.V1ObjectMeta(name=cluster.namespace, labels={MANAGED_BY_KEY: MANAGER}),
        )
    )


def _existing_stack(existing: Sequence[Mapping[str, Any]], cluster: Cluster) -> Mapping[str, Any] | None:
    for obj in existing:
        meta = obj.get("metadata") or {}
        if (
            obj.get("kind") == "ConfigMap"
            and meta.get("name") == stack_configmap_name(cluster.name)
            and meta.get("namespace", cluster.namespace) == cluster.namespace
            and managed(obj, cluster.name)
        ):
            return obj
    return None


def agents_only_profiles(
    deployments: Sequence[Deployment], classes: Mapping[str, DeviceClass]
) -> list[Problem]:
    """Every profile whose class claims a driver the Kubernetes backend has no path for (the driver
    table's ``kube_supported``: Apple Silicon), named with the fix."""
    out = []
    for dep in deployments:
        for profile in dep.profiles:
            cls = classes.get(profile.device_class or "")
            why = agents_only(cls.driver) if cls is not None else None
            if cls is not None and why is not None:
                out.append(
                    Problem(
                        f"Deployment {dep.name}",
                        f"profiles.{profile.name}",
                        f"profile {profile.name} uses class {cls.name}, whose {why}; {AGENTS_ONLY_FIX}",
                    )
                )
    return out


def _why_not_renderable(
    replica: Replica,
    deployments: Mapping[str, Deployment],
    classes: Mapping[str, DeviceClass],
    stack: StackPlan,
) -> str | None:
    dep = deployments.get(replica.deployment)
    if dep is None:
        return f"deployment {replica.deployment} is no longer defined"
    if not any(p.name == replica.profile for p in dep.profiles):
        return f"profile {replica.profile} is no longer in deployment {dep.name}"
    if replica.device_class is not None:
        cls = classes.get(replica.device_class)
        if cls is None:
            return f"class {replica.device_class} is no longer defined"
        if cls.driver not in {d.value for d in stack.provided}:
            return f"class {cls.name} claims driver {cls.driver}, which this cluster's stack does not provide"
    return None


def render_cluster(
    docs: Documents,
    cluster: Cluster,
    existing: Sequence[Mapping[str, Any]] = (),
    base_dir: Path | None = None,
) -> ClusterRender:
    """Render ``cluster``: compose its stack, place the deployments on its pools, build the objects.

    ``existing`` is what the cluster holds now (objects fleetserve made before): its running
    replicas are kept, and its stack's components are never dropped.
    """
    classes = {c.name: c for c in docs.classes}
    # What only agents can serve, and the cluster's own class errors, all in one answer.
    refused = cluster_problems(cluster, classes) + agents_only_profiles(docs.deployments, classes)
    if refused:
        raise ConfigError(refused)
    stack = compose(cluster, classes, components_recorded(_existing_stack(existing, cluster)))
    problems = image_problems(cluster)
    if problems:
        raise ConfigError(problems)
    running, notes = running_replicas(existing, cluster.name)
    deployments = {d.name: d for d in docs.deployments}
    kept_as_is: dict[str, str] = {}
    by_name: dict[str, Replica] = {r.name: r for r in docs.replicas}
    for replica in running:
        if replica.deployment not in deployments:
            kept_as_is[replica.name] = f"deployment {replica.deployment} is no longer defined"
            continue
        by_name[replica.name] = replica
    scoped = Documents(
        classes=docs.classes,
        fabrics=docs.fabrics,
        nodes=cluster_nodes(cluster, docs.nodes),
        models=docs.models,
        deployments=docs.deployments,
        replicas=list(by_name.values()),
        adapters=docs.adapters,
    )
    snapshot = snapshot_from(scoped, base_dir=base_dir)
    decisions = plan(docs.deployments, snapshot, SearchKind.INDEXED)
    models = {m.name: m for m in docs.models}
    objects: list[dict[str, Any]] = [namespace_object(cluster), plain(stack_configmap(stack))]
    rendered: list[str] = []
    surplus: list[str] = []
    for decision in decisions:
        dep = deployments[decision.deployment]
        surplus.extend(decision.surplus)
        todo = [by_name[n] for n in decision.kept] + [p.replica for p in decision.placed]
        for replica in todo:
            why = _why_not_renderable(replica, deployments, classes, stack)
            if why is not None:
                kept_as_is[replica.name] = why
                continue
            profile = next(p for p in dep.profiles if p.name == replica.profile)
            model = models[dep.model]
            try:
                model_args(resolve_profile(profile, classes).engine, model)
            except ConfigError as err:
                problems.extend(
                    Problem(p.location, p.field, f"{p.message} (deployment {dep.name})") for p in err.problems
                )
                continue
            given = ReplicaInput(replica, profile, model, cluster, classes, dep.task, dep.adapters)
            objects.extend(render_replica(given))
            rendered.append(replica.name)
    if problems:
        raise ConfigError(list(dict.fromkeys(problems)))
    carried: list[dict[str, Any]] = []
    for name in kept_as_is:
        of_replica = objects_of_replica(existing, cluster.name, name)
        if not of_replica:
            notes.append(f"replica {name}: {kept_as_is[name]}, and the cluster holds no object of it")
        carried.extend(of_replica)
    return ClusterRender(
        cluster=cluster,
        stack=stack,
        decisions=decisions,
        applied=objects,
        carried=carried,
        rendered=tuple(rendered),
        kept_as_is=kept_as_is,
        surplus=tuple(surplus),
        notes=tuple(notes),
    )
