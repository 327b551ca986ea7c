"""From loaded documents to a checked ``ClusterSnapshot``: references resolved, facts read.

This is an edge: it reads model files (GGUF headers). Everything it produces is immutable and
handed to the pure core.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from types import MappingProxyType

from fleetserve.errors import ConfigError, Problem
from fleetserve.gguf_facts import adapter_facts, model_facts
from fleetserve.kube.pods import image_problems
from fleetserve.kube.stack import cluster_problems
from fleetserve.modelfacts import ModelFacts
from fleetserve.snapshot import ClusterSnapshot
from fleetserve.spec.loader import Documents
from fleetserve.validation import adapter_problems, draft_problems, validate_deployment, weights_problems


def _duplicates(kind: str, names: Iterable[str]) -> list[Problem]:
    seen: set[str] = set()
    out = []
    for name in names:
        if name in seen:
            out.append(
                Problem(
                    f"{kind} {name}", "name", f"two {kind} documents are named {name!r}; names must be unique"
                )
            )
        seen.add(name)
    return out


def check_documents(docs: Documents) -> list[Problem]:
    """Every broken reference and engine refusal across the documents."""
    problems: list[Problem] = []
    problems += _duplicates("DeviceClass", (c.name for c in docs.classes))
    problems += _duplicates("Fabric", (f.name for f in docs.fabrics))
    problems += _duplicates("Node", (n.name for n in docs.nodes))
    problems += _duplicates("Model", (m.name for m in docs.models))
    problems += _duplicates("Deployment", (d.name for d in docs.deployments))
    problems += _duplicates("Replica", (r.name for r in docs.replicas))
    problems += _duplicates("Cluster", (c.name for c in docs.clusters))
    problems += _duplicates("Endpoint", (e.name for e in docs.endpoints))
    problems += _duplicates("Adapter", (a.name for a in docs.adapters))
    classes = {c.name: c for c in docs.classes}
    fabrics = {f.name for f in docs.fabrics}
    models = {m.name: m for m in docs.models}
    deployments = {d.name for d in docs.deployments}
    for node in docs.nodes:
        for device in node.devices:
            if device.device_class not in classes:
                problems.append(
                    Problem(
                        f"Node {node.name}",
                        f"devices[{device.index}].class",
                        f"unknown device class {device.device_class!r}; known: "
                        f"{', '.join(sorted(classes)) or 'none defined'}",
                    )
                )
        for hca in node.hcas:
            if hca.fabric not in fabrics:
                problems.append(
                    Problem(
                        f"Node {node.name}",
                        f"hcas.{hca.name}.fabric",
                        f"unknown fabric {hca.fabric!r}; known: "
                        f"{', '.join(sorted(fabrics)) or 'none defined'}",
                    )
                )
    defaults = sorted(d.name for d in docs.deployments if d.routing.default)
    if len(defaults) > 1:
        problems += [
            Problem(
                f"Deployment {name}",
                "routing.default",
                f"deployments {', '.join(defaults)} would each be the fleet's default (the one that "
                "serves requests naming no model or an unknown one); set routing.default: true on one",
            )
            for name in defaults
        ]
    for dep in docs.deployments:
        if dep.model not in models:
            problems.append(
                Problem(
                    f"Deployment {dep.name}",
                    "model",
                    f"unknown model {dep.model!r}; known: {', '.join(sorted(models)) or 'none defined'}",
                )
            )
        else:
            problems += weights_problems(dep, models[dep.model])
        problems += draft_problems(dep, models)
        problems += adapter_problems(dep, {a.name: a for a in docs.adapters})
        problems += validate_deployment(dep, classes)
    problems += endpoint_problems(docs)
    problems += adapter_document_problems(docs)
    for cluster in docs.clusters:
        problems += cluster_problems(cluster, classes)
        problems += image_problems(cluster)
    for replica in docs.replicas:
        if replica.deployment not in deployments:
            problems.append(
                Problem(f"Replica {replica.name}", "deployment", f"unknown deployment {replica.deployment!r}")
            )
    return problems


def endpoint_problems(docs: Documents) -> list[Problem]:
    """A deployment's ``endpoints`` exist and serve the name it is called by; an Endpoint does not
    serve a name a deployment serves without listing it (the deployment's route would hide it)."""
    problems: list[Problem] = []
    endpoints = {e.name: e for e in docs.endpoints}
    for dep in docs.deployments:
        for i, name in enumerate(dep.endpoints):
            endpoint = endpoints.get(name)
            if endpoint is None:
                problems.append(
                    Problem(
                        f"Deployment {dep.name}",
                        f"endpoints[{i}]",
                        f"unknown endpoint {name!r}; known: {', '.join(sorted(endpoints)) or 'none defined'}",
                    )
                )
            elif endpoint.upstream_name(dep.name) is None:
                problems.append(
                    Problem(
                        f"Deployment {dep.name}",
                        f"endpoints[{i}]",
                        f"endpoint {name} does not serve {dep.name!r} (the name clients send this "
                        f"deployment by); add {dep.name} to its models (as {dep.name}: UPSTREAM-NAME "
                        "where the upstream calls it otherwise)",
                    )
                )
        for endpoint in docs.endpoints:
            if endpoint.upstream_name(dep.name) is not None and endpoint.name not in dep.endpoints:
                why = (
                    f"serves {dep.name!r}, which deployment {dep.name} serves without listing endpoint "
                    f"{endpoint.name}; add it to the deployment's endpoints, or drop {dep.name} from "
                    "the endpoint's models"
                )
                problems.append(Problem(f"Endpoint {endpoint.name}", "models", why))
                problems.append(
                    Problem(f"Deployment {dep.name}", "endpoints", f"endpoint {endpoint.name} {why}")
                )
    return problems


def adapter_document_problems(docs: Documents) -> list[Problem]:
    """An Adapter whose base is not a Model, or whose name a Model or Deployment has: a client
    names the adapter as its model, and the node cache keeps it under that name."""
    problems: list[Problem] = []
    models = {m.name for m in docs.models}
    taken = models | {d.name for d in docs.deployments}
    for adapter in docs.adapters:
        where = f"Adapter {adapter.name}"
        if adapter.base not in models:
            known = ", ".join(sorted(models)) or "none defined"
            problems.append(Problem(where, "base", f"unknown model {adapter.base!r}; known: {known}"))
        if adapter.name in taken:
            problems.append(
                Problem(
                    where,
                    "name",
                    f"a Model or Deployment is named {adapter.name!r} too: clients name an adapter as "
                    "their model, so give the adapter a name of its own",
                )
            )
    return problems


def snapshot_from(docs: Documents, base_dir: Path | None = None) -> ClusterSnapshot:
    """Check the documents and build the snapshot placement decides from."""
    problems = check_documents(docs)
    facts: dict[str, ModelFacts] = {}
    for model in docs.models:
        try:
            facts[model.name] = model_facts(model, base_dir)
        except ConfigError as err:
            problems += err.problems
    for adapter in docs.adapters:  # under its own name: no model has it (check_documents)
        try:
            facts[adapter.name] = adapter_facts(adapter, base_dir)
        except ConfigError as err:
            problems += err.problems
    if problems:
        raise ConfigError(problems)
    return ClusterSnapshot(
        classes=MappingProxyType({c.name: c for c in docs.classes}),
        nodes=tuple(docs.nodes),
        fabrics=MappingProxyType({f.name: f for f in docs.fabrics}),
        replicas=tuple(docs.replicas),
        models=MappingProxyType(facts),
    )
