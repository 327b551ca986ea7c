"""Kubernetes objects as fleetserve writes and reads them: names, labels, plain data, YAML.

Every object is built with the official ``kubernetes`` client's models and turned into plain
data here (the API's camelCase field names). Objects fleetserve made carry the replica they run
in an annotation, so a cluster's running replicas can be read back from the objects themselves.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import yaml
from kubernetes.client import ApiClient
from pydantic import ValidationError

from fleetserve.errors import InternalError
from fleetserve.spec.resources import Replica, ReplicaState

MANAGED_BY_KEY = "app.kubernetes.io/managed-by"
MANAGER = "fleetserve"
CLUSTER_LABEL = "fleetserve.io/cluster"
DEPLOYMENT_LABEL = "fleetserve.io/deployment"
REPLICA_LABEL = "fleetserve.io/replica"
PROFILE_LABEL = "fleetserve.io/profile"
PLACEMENT_ANNOTATION = "fleetserve.io/placement"
DRIVER_ANNOTATION = "fleetserve.io/driver"
# Workload kinds whose objects carry a replica's placement.
WORKLOAD_KINDS = frozenset({"Deployment", "LeaderWorkerSet"})

_DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")

_API = ApiClient()


def object_name(replica: str) -> str:
    """The Kubernetes name of a replica's objects: valid for every kind (a DNS-1035 label).

    A replica name that already is one is kept; any other (a dot, a leading digit) is made one
    and given a hash of the original, so two replica names never share an object name.
    """
    if _DNS_LABEL.match(replica):
        return replica
    cleaned = re.sub(r"[^-a-z0-9]", "-", replica.lower()).strip("-")
    if not cleaned or not cleaned[0].isalpha():
        cleaned = "r-" + cleaned
    digest = hashlib.sha256(replica.encode()).hexdigest()[:8]
    return f"{cleaned[:54].rstrip('-')}-{digest}"


def plain(model: Any) -> dict[str, Any]:
    """A client model (or plain data) as the API's JSON: camelCase names, no unset fields."""
    data = _API.sanitize_for_serialization(model)
    if not isinstance(data, dict):
        raise InternalError(f"{type(model).__name__} serialized to {type(data).__name__}, not an object")
    return data


def placement_annotation(replica: Replica) -> str:
    """The annotation value recording where a replica was placed (read back by ``running_replicas``)."""
    # The template revision is the reconciler's (rollouts); Kubernetes rolls its own objects.
    data = replica.model_dump(by_alias=True, mode="json", exclude={"kind", "state", "revision"})
    return json.dumps(data, sort_keys=True, separators=(",", ":"))


def _meta(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    meta = obj.get("metadata")
    return meta if isinstance(meta, Mapping) else {}


def labels_of(obj: Mapping[str, Any]) -> Mapping[str, str]:
    labels = _meta(obj).get("labels")
    return labels if isinstance(labels, Mapping) else {}


def managed(obj: Mapping[str, Any], cluster: str | None = None) -> bool:
    """Whether fleetserve made ``obj`` (for ``cluster``, when given)."""
    labels = labels_of(obj)
    if labels.get(MANAGED_BY_KEY) != MANAGER:
        return False
    return cluster is None or labels.get(CLUSTER_LABEL) == cluster


def running_replicas(objects: Iterable[Mapping[str, Any]], cluster: str) -> tuple[list[Replica], list[str]]:
    """The replicas ``cluster``'s existing workloads run, and a line per unreadable annotation."""
    out: list[Replica] = []
    problems: list[str] = []
    for obj in objects:
        if obj.get("kind") not in WORKLOAD_KINDS or not managed(obj, cluster):
            continue
        annotations = _meta(obj).get("annotations") or {}
        raw = annotations.get(PLACEMENT_ANNOTATION) if isinstance(annotations, Mapping) else None
        name = _meta(obj).get("name", "?")
        if not isinstance(raw, str):
            problems.append(f"{obj.get('kind')} {name}: no {PLACEMENT_ANNOTATION} annotation; left alone")
            continue
        try:
            replica = Replica.model_validate({**json.loads(raw), "state": ReplicaState.RUNNING.value})
        except (ValueError, ValidationError) as exc:
            problems.append(
                f"{obj.get('kind')} {name}: unreadable {PLACEMENT_ANNOTATION} ({exc}); left alone"
            )
            continue
        out.append(replica)
    return out, problems


# What the API server adds to an object: never part of what fleetserve declares.
SERVER_FIELDS = ("managedFields", "resourceVersion", "uid", "creationTimestamp", "generation", "selfLink")


def as_declared(obj: Mapping[str, Any]) -> dict[str, Any]:
    """An object read from a cluster without what the server added (status, resourceVersion, ...)."""
    out = {k: v for k, v in obj.items() if k != "status"}
    meta = out.get("metadata")
    if isinstance(meta, Mapping):
        out["metadata"] = {k: v for k, v in meta.items() if k not in SERVER_FIELDS}
    return out


def objects_of_replica(
    objects: Iterable[Mapping[str, Any]], cluster: str, replica: str
) -> list[dict[str, Any]]:
    """The existing objects fleetserve made for ``replica`` of ``cluster``, as declared."""
    return [
        as_declared(obj)
        for obj in objects
        if managed(obj, cluster) and labels_of(obj).get(REPLICA_LABEL) == replica
    ]


def dump_yaml(objects: Sequence[Mapping[str, Any]]) -> str:
    """Objects as one multi-document YAML stream, in order, keys as written."""
    return yaml.safe_dump_all(
        [dict(o) for o in objects], sort_keys=False, default_flow_style=False, width=1 << 30
    )


def load_yaml_objects(text: str, source: str) -> list[dict[str, Any]]:
    """The Kubernetes objects of a YAML stream (a ``List`` is flattened); ValueError naming ``source``."""
    try:
        docs = list(yaml.safe_load_all(text))
    except yaml.YAMLError as exc:
        raise ValueError(f"{source}: not valid YAML: {exc}") from exc
    out: list[dict[str, Any]] = []
    for i, doc in enumerate(docs, start=1):
        if doc is None:
            continue
        if not isinstance(doc, dict) or "kind" not in doc:
            raise ValueError(f"{source} document {i}: not a Kubernetes object (no kind)")
        if doc["kind"] == "List" or str(doc["kind"]).endswith("List"):
            out.extend(item for item in doc.get("items") or [] if isinstance(item, dict))
        else:
            out.append(doc)
    return out
