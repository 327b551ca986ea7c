"""The operators' admin API under ``/api/v1``, assembled from its routers by resource: every route
needs an admin token (or the dashboard's session, ``server/auth.py``), and every change is recorded
in the audit log (``server/admin/audit.py``). The bodies are ``adminapi``'s models.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from fastapi import APIRouter

from fleetserve.server.admin.adapters import build_adapters_router
from fleetserve.server.admin.apply import build_apply_router
from fleetserve.server.admin.catalog import build_catalog_router
from fleetserve.server.admin.credentials import build_credentials_router
from fleetserve.server.admin.deployments import build_deployments_router
from fleetserve.server.admin.endpoints import build_endpoints_router
from fleetserve.server.admin.models import build_models_router
from fleetserve.server.admin.nodes import build_nodes_router
from fleetserve.server.admin.replicas import build_replicas_router
from fleetserve.server.agents.modelfiles import ModelFiles
from fleetserve.server.auth import admin
from fleetserve.store.sql import SqlStore


def build_admin_router(
    store: SqlStore,
    files: ModelFiles,
    on_key_revoked: Callable[[], None] | None = None,
    engine_values: Callable[[], Mapping[str, Mapping[str, float]]] | None = None,
) -> APIRouter:
    """Every admin route but the records' (``records.py``); each needs an admin token. Every change
    is recorded in the audit log with its actor once it succeeded. ``on_key_revoked``: tells this
    process's gateway to forget keys; ``engine_values``: per replica, the latest canonical engine
    samples this process scraped (the observer's)."""
    api = APIRouter(prefix="/api/v1", dependencies=[admin])
    for router in (
        build_apply_router(store),
        build_credentials_router(store, on_key_revoked),
        build_catalog_router(store),
        build_nodes_router(store),
        build_models_router(store, files),
        build_deployments_router(store),
        build_replicas_router(store, engine_values),
        build_endpoints_router(store),
        build_adapters_router(store),
    ):
        api.include_router(router)
    return api
