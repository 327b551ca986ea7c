"""The admin API's Endpoints: listed and read with their health, deleted; an Endpoint document itself
is created by ``apply``. Its key stays in its file: no answer here holds it."""

from __future__ import annotations

from fastapi import APIRouter, Request

from fleetserve.adminapi.endpoints import EndpointHealthView, EndpointView
from fleetserve.adminapi.values import Deleted, extend
from fleetserve.server.admin import audit
from fleetserve.server.params import NameParam
from fleetserve.store.audit import AuditAction
from fleetserve.store.endpoints import StoredEndpoint
from fleetserve.store.sql import SqlStore


def endpoint_view(stored: StoredEndpoint) -> EndpointView:
    """An Endpoint as the admin API answers it."""
    health = EndpointHealthView(
        state=stored.state, last_error=stored.last_error, checked_at=stored.checked_at
    )
    return extend(EndpointView, stored.endpoint, status=health.model_dump(mode="json", by_alias=True))


def build_endpoints_router(store: SqlStore) -> APIRouter:
    """``/endpoints``."""
    api = APIRouter()

    @api.get("/endpoints", tags=["endpoints"])
    def list_endpoints() -> list[EndpointView]:
        return [endpoint_view(e) for e in store.list_endpoints()]

    @api.get("/endpoints/{name}", tags=["endpoints"])
    def get_endpoint(name: NameParam) -> EndpointView:
        return endpoint_view(store.get_endpoint(name))

    @api.delete("/endpoints/{name}", tags=["endpoints"])
    def delete_endpoint(name: NameParam, request: Request) -> Deleted:
        store.delete_endpoint(name)
        audit.record(store, request, AuditAction.DELETE, f"Endpoint/{name}")
        return Deleted(deleted=name)

    return api
