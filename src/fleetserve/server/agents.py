"""The agents' API (join token): register, heartbeat, assignments by long-poll, status reports,
device classes for discovery, and model files. Every body is a model of ``fleetserve.protocol``.

Fencing: every registration bumps the node's epoch. Heartbeats and reports name the epoch they
speak for; an older one gets 409 and the agent must register again — and stop every replica it
runs that is not in the assignments it is then given, so a replica never runs twice under one
identity.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from datetime import UTC, datetime
from typing import Annotated, Any

from fastapi import APIRouter, Body, Query, Request
from fastapi.responses import FileResponse
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool

from fleetserve.errors import InternalError, NotFound, UnknownNode
from fleetserve.protocol import (
    AgentStatus,
    Assignment,
    AssignmentSet,
    HeartbeatReply,
    HeartbeatRequest,
    Registered,
    StatusReply,
    StatusReport,
)
from fleetserve.server.auth import agent
from fleetserve.server.modelfiles import ModelFiles
from fleetserve.server.params import NameParam
from fleetserve.spec.resources import NAME_PATTERN, Node, Replica
from fleetserve.store.sql import SqlStore
from fleetserve.validation import resolve_profile

# The longest an assignments request is held open waiting for a change.
MAX_WAIT_SECONDS = 30.0


def _doc(resource: BaseModel) -> dict[str, Any]:
    return resource.model_dump(mode="json", by_alias=True)


def revision_of(assignments: list[Assignment], keep: list[str] | None = None) -> str:
    """A short digest of an assignment set: it changes exactly when the set or a spec changes
    (not when a replica's state does)."""
    entries = [_doc(a) for a in assignments]
    stable = [{**e, "replica": {**e["replica"], "state": None}} for e in entries]
    if keep:
        stable.append({"keep": sorted(keep)})
    return hashlib.sha256(json.dumps(stable, sort_keys=True).encode()).hexdigest()[:16]


def kept(replicas: list[Replica], entries: list[Assignment]) -> list[str]:
    """The node's replicas with no assignment entry (their deployment is gone): kept while they
    drain, never started."""
    built = {e.replica.name for e in entries}
    return sorted(r.name for r in replicas if r.name not in built)


def assignment_entries(store: SqlStore, replicas: list[Replica]) -> list[Assignment]:
    """What an agent needs to run each replica: the replica, its profile with the runtime variant
    worked out, the model document, the addresses of the replica's nodes (shard order) and its
    engine's API key."""
    snapshot = store.snapshot()
    nodes = {n.name: n for n in snapshot.nodes}
    keys = store.engine_keys([r.name for r in replicas])
    out = []
    for replica in replicas:
        try:
            deployment = store.get_deployment(replica.deployment).deployment
            model = store.get_model(deployment.model)
        except NotFound:
            continue  # deleted meanwhile: the next reconcile cycle releases the replica
        profile = next((p for p in deployment.profiles if p.name == replica.profile), None)
        if profile is None:
            continue
        try:
            resolved = resolve_profile(profile, snapshot.classes)
        except (InternalError, KeyError):
            continue  # its class changed under it: the gate reports it; keep what runs
        out.append(
            Assignment(
                replica=replica,
                profile=profile,
                runtime=resolved.variant,
                driver=resolved.driver,
                model=model,
                context=profile.context,
                peers=[nodes[s.node].address if s.node in nodes else "" for s in replica.shards],
                engine_key=keys.get(replica.name),
            )
        )
    return out


def build_agent_router(store: SqlStore, files: ModelFiles) -> APIRouter:
    """The routes agents use, with a join token."""
    api = APIRouter(prefix="/api/v1/agent", dependencies=[agent], tags=["agent"])

    @api.post("/register", summary="Register (or re-register) a node; never clears a cordon")
    def register(node: Annotated[Node, Body()]) -> Registered:
        registration = store.register(node)
        store.heartbeat(node.name, datetime.now(UTC))
        assigned = store.assignments(node.name)
        entries = assignment_entries(store, assigned)
        keep = kept(assigned, entries)
        return Registered(
            node=registration.node,
            epoch=registration.epoch,
            created=registration.created,
            assignments=entries,
            keep=keep,
            revision=revision_of(entries, keep),
        )

    @api.post("/heartbeat", summary="Say the node is alive; 409 for an older registration")
    def heartbeat(body: HeartbeatRequest) -> HeartbeatReply:
        try:
            store.heartbeat(body.node, datetime.now(UTC), body.epoch)
        except UnknownNode as exc:
            raise NotFound(f"{exc}; register first") from None
        return HeartbeatReply(node=body.node, epoch=store.epoch(body.node))

    @api.get("/classes", summary="Device classes, for matching discovered devices")
    def classes() -> list[dict[str, Any]]:
        return [_doc(c) for c in sorted(store.snapshot().classes.values(), key=lambda c: c.name)]

    @api.get("/models/{name}", summary="A model document, for fetching it")
    def model(name: NameParam) -> dict[str, Any]:
        return _doc(store.get_model(name))

    @api.get("/assignments", summary="The replicas a node must run; held open until they change")
    async def assignments(
        request: Request,
        node: Annotated[str, Query(min_length=1, max_length=63, pattern=NAME_PATTERN)],
        epoch: Annotated[int, Query(ge=1, le=2**31 - 1)],
        since: Annotated[str | None, Query(max_length=64, pattern=r"^[0-9a-f]*$")] = None,
        wait: Annotated[float, Query(ge=0, le=MAX_WAIT_SECONDS)] = 0.0,
    ) -> AssignmentSet:
        deadline = time.monotonic() + wait
        while True:
            current = await run_in_threadpool(store.epoch, node)
            if current == 0:
                raise NotFound(f"no node named {node!r} is registered; register first")
            if current != epoch:
                # The same check as heartbeats: an older registration must register again.
                await run_in_threadpool(store.heartbeat, node, datetime.now(UTC), epoch)
            assigned = await run_in_threadpool(store.assignments, node)
            entries = await run_in_threadpool(assignment_entries, store, assigned)
            keep = kept(assigned, entries)
            revision = revision_of(entries, keep)
            # A server shutting down answers at once: a held poll would hold its shutdown.
            stopping = bool(getattr(request.app.state, "stopping", False))
            if (
                revision != since
                or time.monotonic() >= deadline
                or stopping
                or await request.is_disconnected()
            ):
                return AssignmentSet(revision=revision, epoch=current, assignments=entries, keep=keep)
            await asyncio.sleep(min(0.5, max(0.0, deadline - time.monotonic())))

    @api.post("/status", summary="Report replica states, cache contents and downloads")
    def status(body: StatusReport) -> StatusReply:
        reports = {name: (r.state, r.status()) for name, r in body.replicas.items()}
        agent_status = AgentStatus(
            downloads=body.downloads,
            problems=body.problems,
            gpuMetrics=body.gpu_metrics,
            reportedAt=datetime.now(UTC).isoformat(),
        )
        try:
            stop = store.report(
                body.node, body.epoch, datetime.now(UTC), reports, body.model_cache, agent_status
            )
        except UnknownNode as exc:
            raise NotFound(f"{exc}; register first") from None
        return StatusReply(stop=stop)

    @api.get("/models/{name}/file", summary="Download a model file the server holds (Range supported)")
    def model_file(name: NameParam) -> FileResponse:
        stored = files.get(name)
        return FileResponse(
            stored.path, media_type="application/octet-stream", headers={"X-Sha256": stored.sha256}
        )

    return api
