"""The admin API's models: listed, read, deleted, and their weights uploaded for agents to fetch
(``fleetserve://NAME``); a model document itself is created by ``apply``."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool

from fleetserve.adminapi.fleet import UndoneModel, UploadedFile
from fleetserve.adminapi.values import Deleted
from fleetserve.server.admin import audit
from fleetserve.server.agents.modelfiles import ModelFiles
from fleetserve.server.params import NameParam
from fleetserve.spec.resources import Model
from fleetserve.store.audit import AuditAction
from fleetserve.store.sql import SqlStore


def build_models_router(store: SqlStore, files: ModelFiles) -> APIRouter:
    """``/models``; uploaded files are kept in ``files``."""
    api = APIRouter()

    @api.get("/models", tags=["models"])
    def list_models() -> list[Model]:
        return store.list_models()

    @api.get("/models/{name}", tags=["models"])
    def get_model(name: NameParam) -> Model:
        return store.get_model(name)

    @api.post(
        "/models/{name}/undo",
        tags=["models"],
        summary="Apply the model's previous spec again (its deployments roll back to its previous weights)",
    )
    def undo_model(name: NameParam, request: Request) -> UndoneModel:
        model = store.undo_model(name)
        weights = model.weights_digest()
        audit.record(store, request, AuditAction.ROLLOUT_UNDO, f"Model/{name}", {"weights": weights})
        return UndoneModel(**dict(model), weights_revision=weights)

    @api.delete("/models/{name}", tags=["models"])
    def delete_model(name: NameParam, request: Request) -> Deleted:
        store.delete_model(name)
        audit.record(store, request, AuditAction.DELETE, f"Model/{name}")
        return Deleted(deleted=name)

    @api.put("/models/{name}/file", tags=["models"], summary="Upload the model's file for agents to fetch")
    async def upload_model_file(name: NameParam, request: Request) -> UploadedFile:
        model = await run_in_threadpool(store.get_model, name)
        stored = await files.put(name, request.stream(), model.sha256, model.size)
        await run_in_threadpool(
            audit.record, store, request, AuditAction.MODEL_UPLOAD, f"Model/{name}",
            {"sha256": stored.sha256, "size": stored.size},
        )  # fmt: skip
        return UploadedFile(model=name, sha256=stored.sha256, size=stored.size)

    return api
