"""Talking to a Kubernetes API server through the official client: server-side apply, and reading back.

``apply_objects`` sends every object as a server-side apply patch (field manager ``fleetserve``):
the server merges it with what others own, creates what is missing, and never deletes anything.
``read_existing`` lists the objects fleetserve made for a cluster, so rendering keeps the
replicas that run and the stack components that exist.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import HTTPError as TransportError

from fleetserve.errors import FleetserveError
from fleetserve.kube.objects import CLUSTER_LABEL, MANAGED_BY_KEY, MANAGER, plain
from fleetserve.kube.render import LWS_API_VERSION
from fleetserve.kube.stack import stack_configmap_name

FIELD_MANAGER = "fleetserve"
APPLY_PATCH = "application/apply-patch+yaml"
LWS_GROUP, LWS_VERSION = LWS_API_VERSION.split("/")
LWS_PLURAL = "leaderworkersets"
# Seconds one API call may take (connect, read): a hung server is an error, never a hang.
REQUEST_TIMEOUT = (10.0, 60.0)


class KubeError(FleetserveError):
    """The Kubernetes API refused or could not be reached; the message says which object and why."""


def api_client(kubeconfig: Path | None = None, context: str | None = None) -> client.ApiClient:
    """A client for the cluster a kubeconfig (or the pod's service account) names."""
    configuration = client.Configuration()
    try:
        if kubeconfig is None and context is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
            config.load_incluster_config(client_configuration=configuration)
        else:
            config.load_kube_config(
                config_file=str(kubeconfig) if kubeconfig else None,
                context=context,
                client_configuration=configuration,
            )
    except (config.ConfigException, OSError) as exc:
        where = kubeconfig or os.environ.get("KUBECONFIG") or "~/.kube/config"
        raise KubeError(f"cannot load the Kubernetes configuration from {where}: {exc}") from exc
    return client.ApiClient(configuration)


Patcher = Callable[[client.ApiClient, str, str, dict[str, Any], Mapping[str, Any]], Any]


def _core(api: client.ApiClient) -> client.CoreV1Api:
    return client.CoreV1Api(api)


# One row per kind fleetserve writes: how to server-side apply it. (name, namespace, body, options)
PATCHERS: Mapping[tuple[str, str], Patcher] = {
    ("v1", "Namespace"): lambda api, name, ns, body, kw: _core(api).patch_namespace(name, body, **kw),
    ("v1", "ConfigMap"): lambda api, name, ns, body, kw: _core(api).patch_namespaced_config_map(
        name, ns, body, **kw
    ),
    ("v1", "Service"): lambda api, name, ns, body, kw: _core(api).patch_namespaced_service(
        name, ns, body, **kw
    ),
    ("apps/v1", "Deployment"): lambda api, name, ns, body, kw: client.AppsV1Api(
        api
    ).patch_namespaced_deployment(name, ns, body, **kw),
    ("resource.k8s.io/v1", "ResourceClaimTemplate"): lambda api, name, ns, body, kw: client.ResourceV1Api(
        api
    ).patch_namespaced_resource_claim_template(name, ns, body, **kw),
    (LWS_API_VERSION, "LeaderWorkerSet"): lambda api, name, ns, body, kw: client.CustomObjectsApi(
        api
    ).patch_namespaced_custom_object(LWS_GROUP, LWS_VERSION, ns, LWS_PLURAL, name, body, **kw),
}


@dataclass(frozen=True)
class Applied:
    """One object sent: its kind, namespace and name, and what the server said."""

    kind: str
    namespace: str
    name: str
    result: str  # applied | dry-run


def describe_api_error(exc: ApiException) -> str:
    """An API refusal in one line: status, reason and the start of the server's body."""
    body = exc.body.decode(errors="replace") if isinstance(exc.body, bytes) else str(exc.body or "")
    return f"HTTP {exc.status} {exc.reason}: {body[:500]}".strip()


def apply_objects(
    api: client.ApiClient,
    objects: Sequence[Mapping[str, Any]],
    *,
    dry_run: bool = False,
    force_conflicts: bool = False,
    on_applied: Callable[[Applied], None] | None = None,
) -> list[Applied]:
    """Server-side apply every object in order; stop at the first refusal with a KubeError.

    Objects applied before the refusal stay applied (each is whole on its own); the error names
    the object and the server's reason, and how many were applied.
    """
    done: list[Applied] = []
    for obj in objects:
        key = (str(obj.get("apiVersion")), str(obj.get("kind")))
        patch = PATCHERS.get(key)
        meta = obj.get("metadata") or {}
        name, ns = str(meta.get("name", "")), str(meta.get("namespace", ""))
        if patch is None:
            raise KubeError(f"{key[1]} {name}: fleetserve does not apply {key[0]} {key[1]} objects")
        options: dict[str, Any] = {
            "field_manager": FIELD_MANAGER,
            "_content_type": APPLY_PATCH,
            "_request_timeout": REQUEST_TIMEOUT,
        }
        if force_conflicts:
            options["force"] = True
        if dry_run:
            options["dry_run"] = "All"
        try:
            patch(api, name, ns, dict(obj), options)
        except ApiException as exc:
            hint = ""
            if exc.status == 409:
                hint = " (another field manager owns these fields; --force-conflicts takes them over)"
            if exc.status == 404 and key[1] == "LeaderWorkerSet":
                hint = " (is the LeaderWorkerSet controller installed? it serves multi-node replicas)"
            raise KubeError(
                f"{key[1]} {ns + '/' if ns else ''}{name}: {describe_api_error(exc)}{hint}; "
                f"{len(done)} object(s) were applied before it"
            ) from exc
        except (TransportError, OSError) as exc:
            raise KubeError(
                f"{key[1]} {name}: cannot reach the Kubernetes API: {exc}; "
                f"{len(done)} object(s) were applied before it"
            ) from exc
        applied = Applied(key[1], ns, name, "dry-run" if dry_run else "applied")
        done.append(applied)
        if on_applied is not None:
            on_applied(applied)
    return done


def read_existing(api: client.ApiClient, cluster: str, namespace: str) -> list[dict[str, Any]]:
    """What fleetserve made for ``cluster`` in ``namespace``: stack record, claims, workloads, Services."""
    selector = f"{MANAGED_BY_KEY}={MANAGER},{CLUSTER_LABEL}={cluster}"
    out: list[dict[str, Any]] = []
    core, apps = client.CoreV1Api(api), client.AppsV1Api(api)
    try:
        try:
            out.append(
                plain(
                    core.read_namespaced_config_map(
                        stack_configmap_name(cluster), namespace, _request_timeout=REQUEST_TIMEOUT
                    )
                )
            )
        except ApiException as exc:
            if exc.status != 404:
                raise
        listings: list[tuple[str, str, Callable[[], Any]]] = [
            (
                "resource.k8s.io/v1",
                "ResourceClaimTemplate",
                lambda: client.ResourceV1Api(api).list_namespaced_resource_claim_template(
                    namespace, label_selector=selector, _request_timeout=REQUEST_TIMEOUT
                ),
            ),
            (
                "apps/v1",
                "Deployment",
                lambda: apps.list_namespaced_deployment(
                    namespace, label_selector=selector, _request_timeout=REQUEST_TIMEOUT
                ),
            ),
            (
                "v1",
                "Service",
                lambda: core.list_namespaced_service(
                    namespace, label_selector=selector, _request_timeout=REQUEST_TIMEOUT
                ),
            ),
        ]
        for api_version, kind, listing in listings:
            for item in listing().items:
                data = plain(item)
                # List items come without their type; put it back so they read like objects.
                out.append({"apiVersion": api_version, "kind": kind, **data})
        try:
            lws = client.CustomObjectsApi(api).list_namespaced_custom_object(
                LWS_GROUP,
                LWS_VERSION,
                namespace,
                LWS_PLURAL,
                label_selector=selector,
                _request_timeout=REQUEST_TIMEOUT,
            )
            items = lws.get("items", []) if isinstance(lws, dict) else []
            out.extend(item for item in items if isinstance(item, dict))
        except ApiException as exc:
            if exc.status != 404:  # no LeaderWorkerSet CRD: no multi-node replicas
                raise
    except ApiException as exc:
        raise KubeError(
            f"reading cluster {cluster}'s objects in namespace {namespace}: {describe_api_error(exc)}"
        ) from exc
    except (TransportError, OSError) as exc:
        raise KubeError(f"cannot reach the Kubernetes API: {exc}") from exc
    return out
