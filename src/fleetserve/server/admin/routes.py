"""The operators' admin API under ``/api/v1``: every route needs an admin token (or the dashboard's
session, ``server/auth.py``), and every change is recorded in the audit log (``server/admin/audit.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi import Path as FastApiPath
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from fleetserve.errors import ConfigError, NotFound, Problem
from fleetserve.server.admin import audit
from fleetserve.server.admin.apply import apply_batch
from fleetserve.server.agents.modelfiles import ModelFiles
from fleetserve.server.auth import admin
from fleetserve.server.params import TEXT_PATTERN, NameParam, NameQuery
from fleetserve.spec.resources import Node, Replica
from fleetserve.store.audit import AuditAction
from fleetserve.store.credentials import ApiKey, TokenKind, TokenRecord
from fleetserve.store.identity import EnrolmentRecord
from fleetserve.store.sql import SqlStore


class ApplyRequest(BaseModel):
    """A batch of documents (the YAML documents of `fleetserve apply -f`), applied all or nothing."""

    model_config = ConfigDict(extra="forbid")
    documents: list[dict[str, Any]] = Field(min_length=1, max_length=10_000)


class KeyRequest(BaseModel):
    """A new gateway API key: its name, the models it may use ("*" for all), its rate limits."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=63, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    models: list[
        Annotated[str, Field(min_length=1, max_length=63, pattern=r"^(\*|[a-z0-9]([a-z0-9.-]*[a-z0-9])?)$")]
    ] = Field(min_length=1, max_length=1000)
    rpm: int | None = Field(default=None, ge=1, le=10_000_000, description="Requests per minute.")
    tpm: int | None = Field(default=None, ge=1, le=10_000_000_000, description="Tokens per minute.")


class TokenRequest(BaseModel):
    """A new admin or join token, optionally refused after ``expiresIn`` seconds."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    kind: TokenKind
    expires_in: float | None = Field(
        default=None, gt=0, le=10 * 365 * 24 * 3600, alias="expiresIn", description="Seconds from now."
    )


def _token_view(token: TokenRecord, now: datetime) -> dict[str, Any]:
    return {
        "id": token.id, "kind": token.kind.value, "createdAt": token.created_at.isoformat(),
        "expiresAt": token.expires_at.isoformat() if token.expires_at else None,
        "revoked": token.revoked, "valid": token.valid(now),
    }  # fmt: skip


def _enrolment_view(record: EnrolmentRecord) -> dict[str, Any]:
    return {
        "node": record.node, "enrolled": record.enrolled,
        "issuedAt": record.issued_at.isoformat() if record.issued_at else None,
        "approved": record.approved,
        "requestedAt": record.requested_at.isoformat() if record.requested_at else None,
        "requestedFrom": record.requested_from,
    }  # fmt: skip


class CordonRequest(BaseModel):
    """Why the node is cordoned; shown to every operator who looks at it."""

    model_config = ConfigDict(extra="forbid")
    reason: str = Field(min_length=1, max_length=1000, pattern=TEXT_PATTERN)


def _doc(resource: BaseModel) -> dict[str, Any]:
    return resource.model_dump(mode="json", by_alias=True)


def _key_view(key: ApiKey) -> dict[str, Any]:
    return {
        "id": key.id, "name": key.name, "models": list(key.models), "rpm": key.rpm, "tpm": key.tpm,
        "createdAt": key.created_at.isoformat(), "revoked": key.revoked,
    }  # fmt: skip


def _replicas_by_node(replicas: list[Replica]) -> dict[str, list[Replica]]:
    out: dict[str, list[Replica]] = {}
    for replica in replicas:
        for shard in replica.shards:
            out.setdefault(shard.node, []).append(replica)
    return out


def _node_view(node: Node, store: SqlStore, replicas: list[Replica], beats: dict[str, Any]) -> dict[str, Any]:
    beat = beats.get(node.name)
    held = sorted({d for r in replicas for s in r.shards if s.node == node.name for d in s.devices})
    return {
        **_doc(node),
        "status": {
            "epoch": beat.epoch if beat else 0,
            "lastHeartbeat": beat.last_heartbeat.isoformat() if beat and beat.last_heartbeat else None,
            "allocatedDevices": held,
            "replicas": sorted({r.name for r in replicas}),
            "agent": store.agent_status(node.name).stored(),
        },
    }


def build_admin_router(
    store: SqlStore,
    files: ModelFiles,
    on_key_revoked: Callable[[], None] | None = None,
    engine_values: Callable[[], Mapping[str, Mapping[str, float]]] | None = None,
) -> APIRouter:
    """Every admin route; each needs an admin token. Every change is recorded in the audit log
    with its actor once it succeeded (``server.audit``). ``engine_values``: per replica, the latest
    canonical engine samples this process scraped (the observer's)."""
    api = APIRouter(prefix="/api/v1", dependencies=[admin])

    @api.post("/apply", tags=["apply"], summary="Apply documents, all or nothing")
    def apply(body: ApplyRequest, request: Request) -> dict[str, Any]:
        applied = apply_batch(body.documents, store)
        audit.record_all(
            store,
            (
                audit.entry(request, AuditAction.APPLY, f"{a.kind}/{a.name}", {"result": a.result})
                for a in applied
            ),
        )
        return {"applied": [{"kind": a.kind, "name": a.name, "result": a.result} for a in applied]}

    @api.post("/keys", tags=["keys"], summary="Create a gateway API key (shown once, stored hashed)")
    def create_key(body: KeyRequest, request: Request) -> dict[str, Any]:
        key, plaintext = store.create_api_key(body.name, body.models, body.rpm, body.tpm, datetime.now(UTC))
        audit.record(
            store, request, AuditAction.KEY_CREATE, f"ApiKey/{key.id}",
            {"name": key.name, "models": list(key.models), "rpm": key.rpm, "tpm": key.tpm},
        )  # fmt: skip
        return {**_key_view(key), "key": plaintext}

    @api.get("/keys", tags=["keys"], summary="Gateway API keys (no secrets)")
    def list_keys() -> list[dict[str, Any]]:
        return [_key_view(k) for k in store.list_api_keys()]

    @api.delete("/keys/{key_id}", tags=["keys"], summary="Revoke a gateway API key")
    def revoke_key(
        key_id: Annotated[int, FastApiPath(ge=1, le=2**31 - 1)], request: Request
    ) -> dict[str, Any]:
        store.revoke_api_key(key_id)
        audit.record(store, request, AuditAction.KEY_REVOKE, f"ApiKey/{key_id}")
        if on_key_revoked is not None:
            on_key_revoked()  # this process's gateway forgets it now; others within seconds
        return {"revoked": key_id}

    @api.post("/tokens", tags=["tokens"], summary="Create an admin or join token (shown once, stored hashed)")
    def create_token(body: TokenRequest, request: Request) -> dict[str, Any]:
        now = datetime.now(UTC)
        until = now + timedelta(seconds=body.expires_in) if body.expires_in is not None else None
        issued = store.create_token(body.kind, now, until)
        audit.record(
            store, request, AuditAction.TOKEN_CREATE, f"Token/{issued.id}",
            {"kind": issued.kind.value, "expiresAt": until.isoformat() if until else None},
        )  # fmt: skip
        record = next(t for t in store.list_tokens() if t.id == issued.id)
        return {**_token_view(record, now), "token": issued.plaintext}

    @api.get("/tokens", tags=["tokens"], summary="Admin and join tokens (no secrets)")
    def list_tokens() -> list[dict[str, Any]]:
        now = datetime.now(UTC)
        return [_token_view(t, now) for t in store.list_tokens()]

    @api.delete("/tokens/{token_id}", tags=["tokens"], summary="Revoke an admin or join token")
    def revoke_token(
        token_id: Annotated[int, FastApiPath(ge=1, le=2**31 - 1)], request: Request
    ) -> dict[str, Any]:
        now = datetime.now(UTC)
        tokens = {t.id: t for t in store.list_tokens()}
        target = tokens.get(token_id)
        valid_admins = [t for t in tokens.values() if t.kind is TokenKind.ADMIN and t.valid(now)]
        if target is not None and target.kind is TokenKind.ADMIN and valid_admins == [target]:
            raise ConfigError(
                [
                    Problem(
                        f"Token {token_id}",
                        "",
                        "the last valid admin token cannot be revoked; create another first",
                    )
                ]
            )
        store.revoke_token(token_id)
        audit.record(
            store, request, AuditAction.TOKEN_REVOKE, f"Token/{token_id}",
            {"kind": target.kind.value} if target is not None else None,
        )  # fmt: skip
        return {"revoked": token_id}

    @api.get("/enrolments", tags=["nodes"], summary="Node identities: enrolled, approved, waiting")
    def list_enrolments() -> list[dict[str, Any]]:
        return [_enrolment_view(r) for r in store.enrolments()]

    @api.post(
        "/nodes/{name}/approve",
        tags=["nodes"],
        summary="Let the next enrolment under a name through (a new name, or one enrolled already)",
    )
    def approve(name: NameParam, request: Request) -> dict[str, Any]:
        approved = store.approve(name, datetime.now(UTC))
        audit.record(
            store, request, AuditAction.NODE_APPROVE, f"Node/{name}", {"reEnrolment": approved.enrolled}
        )
        return _enrolment_view(approved)

    @api.get("/classes", tags=["classes"])
    def list_classes() -> list[dict[str, Any]]:
        return [_doc(c) for c in sorted(store.snapshot().classes.values(), key=lambda c: c.name)]

    @api.get("/classes/{name}", tags=["classes"])
    def get_class(name: NameParam) -> dict[str, Any]:
        cls = store.snapshot().classes.get(name)
        if cls is None:
            raise NotFound(f"no device class named {name!r}")
        return _doc(cls)

    @api.delete("/classes/{name}", tags=["classes"])
    def delete_class(name: NameParam, request: Request) -> dict[str, str]:
        store.delete_class(name)
        audit.record(store, request, AuditAction.DELETE, f"DeviceClass/{name}")
        return {"deleted": name}

    @api.get("/fabrics", tags=["fabrics"])
    def list_fabrics() -> list[dict[str, Any]]:
        return [_doc(f) for f in sorted(store.snapshot().fabrics.values(), key=lambda f: f.name)]

    @api.get("/nodes", tags=["nodes"])
    def list_nodes() -> list[dict[str, Any]]:
        by_node = _replicas_by_node(store.replicas())
        beats = {h.name: h for h in store.node_heartbeats()}
        return [_node_view(n, store, by_node.get(n.name, []), beats) for n in store.nodes()]

    @api.get("/nodes/{name}", tags=["nodes"])
    def get_node(name: NameParam) -> dict[str, Any]:
        node = store.get_node(name)
        beats = {h.name: h for h in store.node_heartbeats()}
        return _node_view(node, store, _replicas_by_node(store.replicas()).get(name, []), beats)

    @api.post("/nodes/{name}/cordon", tags=["nodes"], summary="Keep new replicas off a node")
    def cordon(name: NameParam, body: CordonRequest, request: Request) -> dict[str, Any]:
        node = store.cordon(name, body.reason)
        audit.record(store, request, AuditAction.CORDON, f"Node/{name}", {"reason": body.reason})
        return _doc(node)

    @api.post("/nodes/{name}/uncordon", tags=["nodes"])
    def uncordon(name: NameParam, request: Request) -> dict[str, Any]:
        node = store.uncordon(name)
        audit.record(store, request, AuditAction.UNCORDON, f"Node/{name}")
        return _doc(node)

    @api.post("/nodes/{name}/drain", tags=["nodes"], summary="Cordon a node and move its replicas away")
    def drain(name: NameParam, body: CordonRequest, request: Request) -> dict[str, Any]:
        # One transaction: serving replicas turn Draining (out of every route, released once their
        # requests are done), the others are released; the reconciler places replacements elsewhere.
        node, released, draining = store.drain(name, body.reason)
        audit.record(
            store, request, AuditAction.DRAIN, f"Node/{name}",
            {"reason": body.reason, "released": [r.name for r in released], "draining": list(draining)},
        )  # fmt: skip
        return {**_doc(node), "released": [r.name for r in released], "draining": draining}

    @api.delete("/nodes/{name}", tags=["nodes"], summary="Forget a node that holds no replica")
    def delete_node(name: NameParam, request: Request) -> dict[str, str]:
        store.delete_node(name)
        audit.record(store, request, AuditAction.DELETE, f"Node/{name}")
        return {"deleted": name}

    @api.get("/models", tags=["models"])
    def list_models() -> list[dict[str, Any]]:
        return [_doc(m) for m in store.list_models()]

    @api.get("/models/{name}", tags=["models"])
    def get_model(name: NameParam) -> dict[str, Any]:
        return _doc(store.get_model(name))

    @api.delete("/models/{name}", tags=["models"])
    def delete_model(name: NameParam, request: Request) -> dict[str, str]:
        store.delete_model(name)
        audit.record(store, request, AuditAction.DELETE, f"Model/{name}")
        return {"deleted": name}

    @api.put("/models/{name}/file", tags=["models"], summary="Upload the model's file for agents to fetch")
    async def upload_model_file(name: NameParam, request: Request) -> dict[str, Any]:
        model = await run_in_threadpool(store.get_model, name)
        stored = await files.put(name, request.stream(), model.sha256)
        await run_in_threadpool(
            audit.record, store, request, AuditAction.MODEL_UPLOAD, f"Model/{name}",
            {"sha256": stored.sha256, "size": stored.size},
        )  # fmt: skip
        return {"model": name, "sha256": stored.sha256, "size": stored.size}

    @api.get("/deployments", tags=["deployments"])
    def list_deployments() -> list[dict[str, Any]]:
        return [
            {**_doc(d.deployment), "generation": d.generation, "status": dict(d.status)}
            for d in store.list_deployments()
        ]

    @api.get("/deployments/{name}", tags=["deployments"])
    def get_deployment(name: NameParam) -> dict[str, Any]:
        d = store.get_deployment(name)
        replicas = [_doc(r) for r in store.replicas(deployment=name)]
        return {
            **_doc(d.deployment),
            "generation": d.generation,
            "revision": d.deployment.template_revision(),
            "status": dict(d.status),
            "replicas": replicas,
        }

    @api.post(
        "/deployments/{name}/undo",
        tags=["deployments"],
        summary="Apply the deployment's previous spec again (a rollout back to the previous revision)",
    )
    def undo_deployment(name: NameParam, request: Request) -> dict[str, Any]:
        d = store.undo_deployment(name)
        audit.record(
            store, request, AuditAction.ROLLOUT_UNDO, f"Deployment/{name}",
            {"generation": d.generation, "revision": d.deployment.template_revision()},
        )  # fmt: skip
        return {
            **_doc(d.deployment),
            "generation": d.generation,
            "revision": d.deployment.template_revision(),
        }

    @api.delete("/deployments/{name}", tags=["deployments"], summary="Delete; its replicas are stopped")
    def delete_deployment(name: NameParam, request: Request) -> dict[str, str]:
        store.delete_deployment(name)
        audit.record(store, request, AuditAction.DELETE, f"Deployment/{name}")
        return {"deleted": name}

    @api.get("/deployments/{name}/explain", tags=["deployments"], summary="The latest placement decision")
    def explain(name: NameParam) -> dict[str, Any]:
        d = store.get_deployment(name)
        latest = store.list_decisions(name, limit=1)
        return {
            "deployment": name,
            "generation": d.generation,
            "status": dict(d.status),
            "decision": dict(latest[0].explanation) if latest else None,
            "decidedAt": latest[0].created_at.isoformat() if latest else None,
        }

    @api.get("/decisions", tags=["deployments"], summary="Recorded decisions, newest first")
    def decisions(
        deployment: NameQuery = None,
        limit: Annotated[int, Query(ge=1, le=1000)] = 50,
    ) -> list[dict[str, Any]]:
        return [
            {
                "id": d.id,
                "deployment": d.deployment,
                "createdAt": d.created_at.isoformat(),
                "decision": dict(d.explanation),
            }
            for d in store.list_decisions(deployment, limit)
        ]

    @api.get("/replicas", tags=["replicas"])
    def list_replicas(deployment: NameQuery = None) -> list[dict[str, Any]]:
        return [_doc(r) for r in store.replicas(deployment=deployment)]

    @api.get(
        "/replicas/{name}/logs", tags=["replicas"], summary="The last lines of a replica's engine output"
    )
    def replica_logs(name: NameParam) -> dict[str, Any]:
        replica = store.get_replica(name)
        status = store.replica_status(name)
        return {
            "replica": name,
            "state": replica.state.value,
            "message": status.message,
            "restarts": status.restarts,
            "lines": status.stderr_tail,
        }

    @api.get(
        "/replicas/{name}/metrics",
        tags=["replicas"],
        summary="The replica's latest engine metrics as this server scraped them (canonical names)",
    )
    def replica_metrics(name: NameParam) -> dict[str, Any]:
        store.get_replica(name)  # 404 for an unknown replica
        values = engine_values() if engine_values is not None else {}
        return {"replica": name, "metrics": dict(sorted(values.get(name, {}).items()))}

    @api.get("/replicas/{name}", tags=["replicas"])
    def get_replica(name: NameParam) -> dict[str, Any]:
        return {**_doc(store.get_replica(name)), "status": store.replica_status(name).stored()}

    return api
