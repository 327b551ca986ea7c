"""The admin API's catalog of hardware kinds: device classes (listed, read, deleted) and fabrics
(listed); both are created by ``apply``."""

from __future__ import annotations

from fastapi import APIRouter, Request

from fleetserve.adminapi.values import Deleted
from fleetserve.errors import NotFound
from fleetserve.server.admin import audit
from fleetserve.server.params import NameParam
from fleetserve.spec.resources import DeviceClass, Fabric
from fleetserve.store.audit import AuditAction
from fleetserve.store.sql import SqlStore


def build_catalog_router(store: SqlStore) -> APIRouter:
    """``/classes`` and ``/fabrics``."""
    api = APIRouter()

    @api.get("/classes", tags=["classes"])
    def list_classes() -> list[DeviceClass]:
        return sorted(store.snapshot().classes.values(), key=lambda c: c.name)

    @api.get("/classes/{name}", tags=["classes"])
    def get_class(name: NameParam) -> DeviceClass:
        cls = store.snapshot().classes.get(name)
        if cls is None:
            raise NotFound(f"no device class named {name!r}")
        return cls

    @api.delete("/classes/{name}", tags=["classes"])
    def delete_class(name: NameParam, request: Request) -> Deleted:
        store.delete_class(name)
        audit.record(store, request, AuditAction.DELETE, f"DeviceClass/{name}")
        return Deleted(deleted=name)

    @api.get("/fabrics", tags=["fabrics"])
    def list_fabrics() -> list[Fabric]:
        return sorted(store.snapshot().fabrics.values(), key=lambda f: f.name)

    return api
