"""The admin API's deployments: listed and read with their status, rolled back (``undo``),
deleted, and explained by the placement decisions the reconciler recorded for them."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request

from fleetserve.adminapi.fleet import (
    DecisionView,
    DeploymentDetail,
    DeploymentView,
    Explanation,
    UndoneDeployment,
)
from fleetserve.adminapi.values import Deleted, extend
from fleetserve.errors import NotFound
from fleetserve.server.admin import audit
from fleetserve.server.params import NameParam, NameQuery
from fleetserve.spec.resources import Deployment
from fleetserve.store.audit import AuditAction
from fleetserve.store.sql import SqlStore


def revision(store: SqlStore, deployment: Deployment) -> str:
    """The revision the reconciler rolls ``deployment``'s replicas to: its template and the weights
    its model names now (``ClusterSnapshot.revision_of``, from the stored documents)."""
    try:
        weights = store.get_model(deployment.model).weights_digest()
    except NotFound:
        weights = ""
    return deployment.template_revision(weights)


def build_deployments_router(store: SqlStore) -> APIRouter:
    """``/deployments`` and ``/decisions``. A status and a decision are answered as stored: only
    their fields that were set (``response_model_exclude_unset``)."""
    api = APIRouter()

    @api.get("/deployments", tags=["deployments"], response_model_exclude_unset=True)
    def list_deployments() -> list[DeploymentView]:
        return [
            extend(DeploymentView, d.deployment, generation=d.generation, status=d.status)
            for d in store.list_deployments()
        ]

    @api.get("/deployments/{name}", tags=["deployments"], response_model_exclude_unset=True)
    def get_deployment(name: NameParam) -> DeploymentDetail:
        d = store.get_deployment(name)
        replicas = [r.model_dump(mode="json", by_alias=True) for r in store.replicas(deployment=name)]
        return extend(
            DeploymentDetail,
            d.deployment,
            replicas=replicas,
            generation=d.generation,
            revision=revision(store, d.deployment),
            status=d.status,
        )

    @api.post(
        "/deployments/{name}/undo",
        tags=["deployments"],
        summary="Apply the deployment's previous spec again (a rollout back to the previous revision)",
    )
    def undo_deployment(name: NameParam, request: Request) -> UndoneDeployment:
        d = store.undo_deployment(name)
        now = revision(store, d.deployment)
        audit.record(
            store, request, AuditAction.ROLLOUT_UNDO, f"Deployment/{name}",
            {"generation": d.generation, "revision": now},
        )  # fmt: skip
        return UndoneDeployment(**dict(d.deployment), generation=d.generation, revision=now)

    @api.delete("/deployments/{name}", tags=["deployments"], summary="Delete; its replicas are stopped")
    def delete_deployment(name: NameParam, request: Request) -> Deleted:
        store.delete_deployment(name)
        audit.record(store, request, AuditAction.DELETE, f"Deployment/{name}")
        return Deleted(deleted=name)

    @api.get(
        "/deployments/{name}/explain",
        tags=["deployments"],
        summary="The latest placement decision",
        response_model_exclude_unset=True,
    )
    def explain(name: NameParam) -> Explanation:
        d = store.get_deployment(name)
        latest = store.list_decisions(name, limit=1)
        return Explanation(
            deployment=name,
            generation=d.generation,
            status=d.status,
            decision=latest[0].explanation if latest else None,
            decided_at=latest[0].created_at if latest else None,
        )

    @api.get(
        "/decisions",
        tags=["deployments"],
        summary="Recorded decisions, newest first",
        response_model_exclude_unset=True,
    )
    def decisions(
        deployment: NameQuery = None,
        limit: Annotated[int, Query(ge=1, le=1000)] = 50,
    ) -> list[DecisionView]:
        return [
            DecisionView(id=d.id, deployment=d.deployment, created_at=d.created_at, decision=d.explanation)
            for d in store.list_decisions(deployment, limit)
        ]

    return api
