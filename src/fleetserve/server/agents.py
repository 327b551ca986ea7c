"""The agents' API (join token): register, heartbeat, assignments by long-poll, status reports,
device classes for discovery, and model files.

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
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from fleetserve.errors import NotFound, UnknownNode
from fleetserve.server.auth import agent
from fleetserve.server.modelfiles import ModelFiles
from fleetserve.server.params import NAME_PATTERN, NameParam
from fleetserve.spec.resources import Node, Replica, ReplicaState
from fleetserve.store.sql import SqlStore
from fleetserve.validation import resolve_profile

# Free text from an agent may hold newlines (stderr), never NUL.
TEXT_PATTERN = r"^[^\x00]*$"
# The longest an assignments request is held open waiting for a change.
MAX_WAIT_SECONDS = 30.0


class HeartbeatRequest(BaseModel):
    """An agent saying its node is alive, for the registration (epoch) it speaks for."""

    model_config = ConfigDict(extra="forbid")
    node: str = Field(min_length=1, max_length=63, pattern=NAME_PATTERN)
    epoch: int | None = Field(default=None, ge=1, le=2**31 - 1)


class ReplicaReport(BaseModel):
    """What the agent knows about one replica it runs."""

    model_config = ConfigDict(extra="forbid")
    state: ReplicaState
    message: str = Field(default="", max_length=4000, pattern=TEXT_PATTERN)
    restarts: int = Field(default=0, ge=0, le=2**31 - 1)
    stderr_tail: list[Annotated[str, Field(max_length=2000, pattern=TEXT_PATTERN)]] = Field(
        default_factory=list, max_length=100, alias="stderrTail"
    )
    port: int | None = Field(default=None, ge=1, le=65535)


class Download(BaseModel):
    """A model download in flight on the node."""

    model_config = ConfigDict(extra="forbid")
    model: str = Field(max_length=63, pattern=NAME_PATTERN)
    state: str = Field(max_length=32, pattern=TEXT_PATTERN)
    done: int = Field(ge=0)
    total: int | None = Field(default=None, ge=0)
    rate: float = Field(default=0.0, ge=0)


class GpuSample(BaseModel):
    """One canonical GPU sample (``fleetserve_gpu_*``) with its node/device/driver/class labels."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(max_length=64, pattern=r"^fleetserve_gpu_[a-z_]+$")
    labels: dict[
        Annotated[str, Field(max_length=16, pattern=r"^(node|device|driver|class)$")],
        Annotated[str, Field(max_length=253, pattern=TEXT_PATTERN)],
    ] = Field(max_length=4)
    value: float = Field(allow_inf_nan=False)


class StatusReport(BaseModel):
    """An agent's periodic report: replica states, cache contents, downloads."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    node: str = Field(min_length=1, max_length=63, pattern=NAME_PATTERN)
    epoch: int = Field(ge=1, le=2**31 - 1)
    replicas: dict[Annotated[str, Field(max_length=63, pattern=NAME_PATTERN)], ReplicaReport] = Field(
        default_factory=dict, max_length=1000
    )
    model_cache: list[Annotated[str, Field(max_length=63, pattern=NAME_PATTERN)]] | None = Field(
        default=None, alias="modelCache", max_length=10_000
    )
    downloads: list[Download] = Field(default_factory=list, max_length=1000)
    problems: list[Annotated[str, Field(max_length=2000, pattern=TEXT_PATTERN)]] = Field(
        default_factory=list, max_length=100
    )
    # Canonical GPU samples the agent read itself (NVML, sysfs) where no exporter runs.
    gpu_metrics: list[GpuSample] = Field(default_factory=list, max_length=10_000, alias="gpuMetrics")


def _doc(resource: BaseModel) -> dict[str, Any]:
    return resource.model_dump(mode="json", by_alias=True)


def revision_of(entries: list[dict[str, Any]]) -> str:
    """A short digest of an assignment set: it changes exactly when the set or a spec changes
    (not when a replica's state does)."""
    stable = [{**e, "replica": {**e["replica"], "state": None}} for e in entries]
    return hashlib.sha256(json.dumps(stable, sort_keys=True).encode()).hexdigest()[:16]


def assignment_entries(store: SqlStore, replicas: list[Replica]) -> list[dict[str, Any]]:
    """What an agent needs to run each replica: the replica, its profile with the runtime variant
    worked out, the model document, and the addresses of the replica's nodes (shard order)."""
    snapshot = store.snapshot()
    nodes = {n.name: n for n in snapshot.nodes}
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
        except (AssertionError, KeyError):
            continue  # its class changed under it: the gate reports it; keep what runs
        out.append(
            {
                "replica": _doc(replica),
                "profile": _doc(profile),
                "runtime": resolved.variant.value,
                "driver": resolved.driver.value,
                "model": _doc(model),
                "context": profile.context,
                "peers": [nodes[s.node].address if s.node in nodes else "" for s in replica.shards],
            }
        )
    return out


def build_agent_router(store: SqlStore, files: ModelFiles) -> APIRouter:
    """The routes agents use, with a join token."""
    api = APIRouter(prefix="/api/v1/agent", dependencies=[agent], tags=["agent"])

    @api.post("/register", summary="Register (or re-register) a node; never clears a cordon")
    def register(node: Annotated[Node, Body()]) -> dict[str, Any]:
        registration = store.register(node)
        store.heartbeat(node.name, datetime.now(UTC))
        entries = assignment_entries(store, store.assignments(node.name))
        return {
            "node": _doc(registration.node),
            "epoch": registration.epoch,
            "created": registration.created,
            "assignments": entries,
            "revision": revision_of(entries),
        }

    @api.post("/heartbeat", summary="Say the node is alive; 409 for an older registration")
    def heartbeat(body: HeartbeatRequest) -> dict[str, Any]:
        try:
            store.heartbeat(body.node, datetime.now(UTC), body.epoch)
        except UnknownNode as exc:
            raise NotFound(f"{exc}; register first") from None
        return {"node": body.node, "epoch": store.epoch(body.node)}

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
    ) -> dict[str, Any]:
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
            revision = revision_of(entries)
            if revision != since or time.monotonic() >= deadline or await request.is_disconnected():
                return {"revision": revision, "epoch": current, "assignments": entries}
            await asyncio.sleep(min(0.5, max(0.0, deadline - time.monotonic())))

    @api.post("/status", summary="Report replica states, cache contents and downloads")
    def status(body: StatusReport) -> dict[str, Any]:
        reports = {
            name: (r.state, r.model_dump(mode="json", by_alias=True, exclude={"state"}))
            for name, r in body.replicas.items()
        }
        agent_status = {
            "downloads": [d.model_dump(mode="json") for d in body.downloads],
            "problems": body.problems,
            "gpuMetrics": [g.model_dump(mode="json") for g in body.gpu_metrics],
            "reportedAt": datetime.now(UTC).isoformat(),
        }
        try:
            stop = store.report(
                body.node, body.epoch, datetime.now(UTC), reports, body.model_cache, agent_status
            )
        except UnknownNode as exc:
            raise NotFound(f"{exc}; register first") from None
        return {"stop": stop}

    @api.get("/models/{name}/file", summary="Download a model file the server holds (Range supported)")
    def model_file(name: NameParam) -> FileResponse:
        stored = files.get(name)
        return FileResponse(
            stored.path, media_type="application/octet-stream", headers={"X-Sha256": stored.sha256}
        )

    return api
