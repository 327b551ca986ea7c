"""GPU metrics exporters found through the Kubernetes API: DCGM's and AMD's, by their pods.

Each driver whose stack runs an exporter (the driver table's ``metrics_exporter``) names the
label selectors its exporter pods carry and the container port they serve on. ``read_exporter_pods``
lists the pods of every selector in all namespaces (the only function here that talks to a
cluster); ``exporters_from_pods`` is the pure conversion: a Running pod with an IP, a node and a
container port of that name becomes an ``ExporterTarget`` at ``http://podIP:port/metrics`` for the
fleetserve node ``spec.nodeName`` (nodes are named as Kubernetes names them). A pod found twice (by
two selectors of one driver) is one target. Nothing is dropped silently: a pod that is not Running,
has no IP or node, or lacks the named port leaves one sentence in ``ExporterDiscovery.skipped``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import HTTPError as TransportError

from fleetserve.drivers import Driver, MetricsExporter, metrics_exporters
from fleetserve.kube.apply import REQUEST_TIMEOUT, KubeError, describe_api_error
from fleetserve.kube.objects import plain
from fleetserve.metrics.exporters import ExporterTarget, exporter_url

RUNNING = "Running"


@dataclass(frozen=True)
class ExporterDiscovery:
    """The exporters found, and a sentence per exporter pod that could not be used."""

    targets: list[ExporterTarget] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)


def _map(value: object) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _list(value: object) -> list[Any]:
    return list(value) if isinstance(value, list | tuple) else []


def _named_port(spec: Mapping[str, Any], name: str) -> int | None:
    for container in _list(spec.get("containers")):
        for port in _list(_map(container).get("ports")):
            number = _map(port).get("containerPort")
            if _map(port).get("name") == name and isinstance(number, int) and 0 < number < 65536:
                return number
    return None


def _target(
    driver: Driver, exporter: MetricsExporter, pod: Mapping[str, Any]
) -> tuple[ExporterTarget | None, str]:
    meta, spec, status = _map(pod.get("metadata")), _map(pod.get("spec")), _map(pod.get("status"))
    where = f"{meta.get('namespace') or 'default'}/{meta.get('name') or '?'}"
    what = f"{exporter.name} pod {where}"
    phase = status.get("phase") or "no phase"
    if phase != RUNNING:
        return None, f"{what} is {phase}, not {RUNNING}; not scraped"
    node, ip = spec.get("nodeName"), status.get("podIP")
    if not isinstance(node, str) or not node:
        return None, f"{what} is bound to no node (no spec.nodeName); not scraped"
    if not isinstance(ip, str) or not ip:
        return None, f"{what} on node {node} has no IP (status.podIP); not scraped"
    port = _named_port(spec, exporter.port_name)
    if port is None:
        return None, (f"{what} on node {node} has no container port named {exporter.port_name}; not scraped")
    return ExporterTarget(driver=driver, node=node, url=exporter_url(exporter, ip, port), pod=where), ""


def exporters_from_pods(pods: Mapping[Driver, Sequence[Mapping[str, Any]]]) -> ExporterDiscovery:
    """The scrape targets of the exporter pods listed per driver (plain camelCase pod JSON)."""
    table = metrics_exporters()
    found: dict[str, ExporterTarget] = {}
    skipped: list[str] = []
    for driver, listed in pods.items():
        exporter = table.get(driver)
        if exporter is None:
            skipped.extend(
                f"pod {_map(p.get('metadata')).get('name')}: driver {driver.value} runs no metrics "
                "exporter; not scraped"
                for p in listed
            )
            continue
        for pod in listed:
            target, why = _target(driver, exporter, pod)
            if target is None:
                if why not in skipped:
                    skipped.append(why)
            else:
                found.setdefault(target.key, target)
    targets = sorted(found.values(), key=lambda t: (list(table).index(t.driver), t.node, t.pod))
    return ExporterDiscovery(targets=targets, skipped=skipped)


# --- I/O ---------------------------------------------------------------------------------------


def read_exporter_pods(api: client.ApiClient) -> dict[Driver, list[dict[str, Any]]]:
    """Per driver with an exporter, the pods any of its selectors picks, in every namespace.

    KubeError says which listing failed (refused, or the API server cannot be reached)."""
    core = client.CoreV1Api(api)
    out: dict[Driver, list[dict[str, Any]]] = {}
    for driver, exporter in metrics_exporters().items():
        pods: list[dict[str, Any]] = []
        for selector in exporter.pod_selectors:
            what = f"listing the {exporter.name} pods ({selector})"
            try:
                listed = core.list_pod_for_all_namespaces(
                    label_selector=selector, _request_timeout=REQUEST_TIMEOUT
                ).items
            except ApiException as exc:
                raise KubeError(f"{what}: {describe_api_error(exc)}") from exc
            except (TransportError, OSError) as exc:
                raise KubeError(f"{what}: cannot reach the Kubernetes API: {exc}") from exc
            pods.extend({"apiVersion": "v1", "kind": "Pod", **plain(item)} for item in listed)
        out[driver] = pods
    return out


def discover_exporters(api: client.ApiClient) -> ExporterDiscovery:
    """The cluster's GPU metrics exporters as scrape targets (KubeError: the API refused)."""
    return exporters_from_pods(read_exporter_pods(api))
