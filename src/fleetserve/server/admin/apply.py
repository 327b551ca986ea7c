"""Applying documents to the control plane (``POST /api/v1/apply``): check everything against the
stored state first, then write all of it in one transaction, so a bad batch changes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel

from fleetserve.adminapi.fleet import AppliedDocument, ApplyRequest, ApplyResult
from fleetserve.errors import ConfigError, Problem
from fleetserve.fleet import check_documents
from fleetserve.gguf_facts import adapter_facts, model_facts
from fleetserve.server.admin import audit
from fleetserve.spec.cluster import Cluster
from fleetserve.spec.loader import Documents, parse_document
from fleetserve.spec.resources import Replica
from fleetserve.store.audit import AuditAction
from fleetserve.store.sql import SqlStore
from fleetserve.validation import weights_problems


@dataclass(frozen=True)
class Applied:
    """What applying one document did."""

    kind: str
    name: str
    result: str  # created | configured | unchanged


def parse_batch(raws: Sequence[Any]) -> Documents:
    """Parse every document of a request; collect every problem before refusing."""
    docs = Documents()
    problems: list[Problem] = []
    for i, raw in enumerate(raws, start=1):
        try:
            resource = parse_document(raw, f"document {i}")
        except ConfigError as err:
            problems.extend(err.problems)
            continue
        if isinstance(resource, Replica):
            problems.append(
                Problem(
                    f"document {i} (Replica {resource.name})",
                    "kind",
                    "replicas are created by the reconciler, not applied; apply a Deployment",
                )
            )
            continue
        if isinstance(resource, Cluster):
            problems.append(
                Problem(
                    f"document {i} (Cluster {resource.name})",
                    "kind",
                    "a Cluster describes a Kubernetes cluster for `fleetserve kube`; the server does not "
                    "store it",
                )
            )
            continue
        docs.add(resource)
    if problems:
        raise ConfigError(problems)
    return docs


def _key(resource: BaseModel) -> str:
    return f"{type(resource).__name__} {getattr(resource, 'name', '')}"


def _overlay(stored: Sequence[Any], incoming: Sequence[Any]) -> list[Any]:
    by_name = {r.name: r for r in stored}
    by_name.update({r.name: r for r in incoming})
    return list(by_name.values())


def check_batch(docs: Documents, store: SqlStore) -> None:
    """Raise ConfigError if the batch, laid over the stored state, breaks a reference or a rule.

    Only problems of the incoming documents count: a stored deployment that is already broken
    does not block an unrelated apply.
    """
    snapshot = store.snapshot()
    merged = Documents(
        classes=_overlay(list(snapshot.classes.values()), docs.classes),
        fabrics=_overlay(list(snapshot.fabrics.values()), docs.fabrics),
        nodes=_overlay(list(snapshot.nodes), docs.nodes),
        models=_overlay(store.list_models(), docs.models),
        deployments=_overlay([d.deployment for d in store.list_deployments()], docs.deployments),
        endpoints=_overlay([e.endpoint for e in store.list_endpoints()], docs.endpoints),
        adapters=_overlay(store.list_adapters(), docs.adapters),
    )
    incoming = {_key(r) for r in docs.all()}
    problems = [p for p in check_documents(merged) if p.location in incoming]
    # Duplicates inside the batch itself.
    seen: set[str] = set()
    for resource in docs.all():
        key = _key(resource)
        if key in seen:
            problems.append(Problem(key, "name", "appears twice in this batch"))
        seen.add(key)
    for adapter in docs.adapters:
        try:
            adapter_facts(adapter)
        except ConfigError as err:
            problems.extend(err.problems)
    for model in docs.models:
        try:
            model_facts(model)
        except ConfigError as err:
            problems.extend(err.problems)
        # A stored deployment this batch leaves alone still serves the model: dropping the
        # alternate its engine loads is this Model's problem.
        for dep in merged.deployments:
            if dep.model == model.name and f"Deployment {dep.name}" not in incoming:
                problems += [
                    Problem(
                        f"Model {model.name}", "alternates", f"deployment {dep.name}: {p.field}: {p.message}"
                    )
                    for p in weights_problems(dep, model)
                ]
    if problems:
        raise ConfigError(problems)


def apply_batch(raws: Sequence[Any], store: SqlStore) -> list[Applied]:
    """Parse, check and write a batch of documents, all or nothing."""
    docs = parse_batch(raws)
    check_batch(docs, store)
    return [Applied(*row) for row in store.apply_documents(docs)]


def build_apply_router(store: SqlStore) -> APIRouter:
    """``POST /apply``: a batch of documents, all or nothing, each recorded in the audit log."""
    api = APIRouter()

    @api.post("/apply", tags=["apply"], summary="Apply documents, all or nothing")
    def apply(body: ApplyRequest, request: Request) -> ApplyResult:
        applied = apply_batch(body.documents, store)
        audit.record_all(
            store,
            (
                audit.entry(request, AuditAction.APPLY, f"{a.kind}/{a.name}", {"result": a.result})
                for a in applied
            ),
        )
        return ApplyResult(
            applied=[AppliedDocument(kind=a.kind, name=a.name, result=a.result) for a in applied]
        )

    return api
