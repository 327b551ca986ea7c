"""The admin API's Adapters (LoRA adapters on a base model): listed, read and deleted; an Adapter
document itself is created by ``apply``."""

from __future__ import annotations

from fastapi import APIRouter, Request

from fleetserve.adminapi.values import Deleted
from fleetserve.server.admin import audit
from fleetserve.server.params import NameParam
from fleetserve.spec.adapter import Adapter
from fleetserve.store.audit import AuditAction
from fleetserve.store.sql import SqlStore


def build_adapters_router(store: SqlStore) -> APIRouter:
    """``/adapters``."""
    api = APIRouter()

    @api.get("/adapters", tags=["adapters"])
    def list_adapters() -> list[Adapter]:
        return store.list_adapters()

    @api.get("/adapters/{name}", tags=["adapters"])
    def get_adapter(name: NameParam) -> Adapter:
        return store.get_adapter(name)

    @api.delete("/adapters/{name}", tags=["adapters"])
    def delete_adapter(name: NameParam, request: Request) -> Deleted:
        store.delete_adapter(name)
        audit.record(store, request, AuditAction.DELETE, f"Adapter/{name}")
        return Deleted(deleted=name)

    return api
