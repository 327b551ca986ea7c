"""The agents' API: register, heartbeat, assignments by long-poll, status reports, device classes
for discovery, and model files. Every body is a model of ``fleetserve.protocol``.

Identity: the join token only enrols (``POST /register`` for a name, under the server's
``EnrolmentPolicy``) and its answer carries the node's credential; every other call is made with
that credential and speaks for its own node only: its heartbeats, its assignments, its replicas'
states, samples of its own GPUs, and the models its own replicas serve. The address a node gives
must be its connection's source address or an allowed one.

Fencing: every registration bumps the node's epoch. Heartbeats and reports name the epoch they
speak for (it is required); an older one, or any from a node judged NotReady or Lost, gets 409
and the agent must register again — and stop every replica it runs that is not in the
assignments it is then given, so a replica never runs twice under one identity. No answer but
the registration's tells the epoch.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Annotated, Any

from fastapi import APIRouter, Body, Query, Request
from fastapi.responses import FileResponse, Response
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool

from fleetserve.engines.registry import weights_for
from fleetserve.errors import ConfigError, FleetserveError, InternalError, NotFound, Problem, UnknownNode
from fleetserve.protocol import (
    AgentStatus,
    Assignment,
    AssignmentSet,
    HeartbeatReply,
    HeartbeatRequest,
    NodeReport,
    Registered,
    StatusReply,
    StatusReport,
)
from fleetserve.server.agents.assignwatch import RECHECK_SECONDS, AssignmentWatch
from fleetserve.server.agents.enrolment import AddressVerdict, EnrolmentPolicy
from fleetserve.server.agents.modelfiles import ModelFiles
from fleetserve.server.auth import agent, caller_of, node_of, speaks_for
from fleetserve.server.params import NameParam
from fleetserve.server.problems import EnrolmentRefused, Forbidden
from fleetserve.spec.base import NAME_PATTERN
from fleetserve.spec.resources import Deployment, Model, Node, Replica
from fleetserve.store.identity import Refusal, Refused
from fleetserve.store.reports import AgentReport
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
    worked out, the weights its engine serves (``weights_for``), the addresses of the replica's
    nodes (shard order) and its engine's API key. Reads only what these replicas name: the
    classes, their nodes, their deployments and models (each once), never the whole fleet."""
    if not replicas:
        return []
    classes = store.device_classes()
    addresses = store.node_addresses([s.node for r in replicas for s in r.shards])
    keys = store.engine_keys([r.name for r in replicas])
    deployments: dict[str, Deployment | None] = {}
    models: dict[str, Model | None] = {}
    out = []
    for replica in replicas:
        if replica.deployment not in deployments:
            try:
                deployments[replica.deployment] = store.get_deployment(replica.deployment).deployment
            except NotFound:
                deployments[replica.deployment] = None  # deleted: the next cycle releases its replicas
        deployment = deployments[replica.deployment]
        if deployment is None:
            continue
        if deployment.model not in models:
            try:
                models[deployment.model] = store.get_model(deployment.model)
            except NotFound:
                models[deployment.model] = None
        model = models[deployment.model]
        if model is None:
            continue
        profile = next((p for p in deployment.profiles if p.name == replica.profile), None)
        if profile is None:
            continue
        try:
            resolved = resolve_profile(profile, classes)
        except (InternalError, KeyError):
            continue  # its class changed under it: the gate reports it; keep what runs
        out.append(
            Assignment(
                replica=replica,
                profile=profile,
                runtime=resolved.variant,
                driver=resolved.driver,
                # The weights this engine serves (a model's alternate, maybe), never the whole
                # document: the agent fetches exactly these. None loadable (the gate refuses that):
                # the document, which the agent refuses with the reason.
                model=weights_for(model, profile.engine) or model,
                context=profile.context,
                peers=[addresses.get(s.node, "") for s in replica.shards],
                engine_key=keys.get(replica.name),
            )
        )
    return out


def refusal(refused: Refused) -> EnrolmentRefused:
    """The answer to a refused enrolment: what waits, and the command that lets it through."""
    approve = f"an operator must approve it: `fleetserve nodes approve {refused.node}`"
    if refused.reason is Refusal.NAME_TAKEN:
        return EnrolmentRefused(
            refused.reason.value,
            409,
            f"node {refused.node} is enrolled already; a second enrolment under this name "
            f"needs an operator's approval ({approve}); the enrolled node is unaffected",
        )
    return EnrolmentRefused(
        refused.reason.value, 403, f"node {refused.node} is new and waits for approval: {approve}"
    )


def models_of(store: SqlStore, node: str) -> set[str]:
    """The models the replicas assigned to ``node`` serve: the only ones it may fetch."""
    out = set()
    for replica in store.assignments(node):
        try:
            out.add(store.get_deployment(replica.deployment).deployment.model)
        except NotFound:
            continue
    return out


def check_gpu_samples(store: SqlStore, report: StatusReport) -> None:
    """Refuse (422, naming the sample) GPU samples that are not of the reporting node's own
    devices: a node speaks for its own GPUs only."""
    if not report.gpu_metrics:
        return
    try:
        devices = {str(d.index) for d in store.get_node(report.node).devices}
    except UnknownNode as exc:
        raise NotFound(f"{exc}; register first") from None
    problems = []
    for i, sample in enumerate(report.gpu_metrics):
        node, device = sample.labels.get("node"), sample.labels.get("device")
        if node != report.node:
            problems.append(
                Problem(
                    "StatusReport",
                    f"gpuMetrics[{i}].labels.node",
                    f"{node!r} is not the reporting node {report.node!r}",
                )
            )
        elif device not in devices:
            problems.append(
                Problem(
                    "StatusReport",
                    f"gpuMetrics[{i}].labels.device",
                    f"{device!r} is not a device of node {report.node}",
                )
            )
        if len(problems) >= 10:
            break  # enough to name the fault
    if problems:
        raise ConfigError(problems)


def rendered(answer: AssignmentSet) -> Response:
    """An assignment set as its JSON answer, serialised by pydantic in one go: the model as
    FastAPI would send it, without validating again what was built from validated documents (a
    node's set is tens of KiB, and thousands of agents re-poll every 20 s)."""
    return Response(answer.model_dump_json(by_alias=True), media_type="application/json")


def record_heartbeat(store: SqlStore, beat: HeartbeatRequest) -> None:
    """Record a heartbeat the caller may make (it speaks for ``beat.node``): NotFound for a node
    not registered, StaleEpoch (409) for an older registration or a node judged dead."""
    try:
        store.heartbeat(beat.node, datetime.now(UTC), beat.epoch)
    except UnknownNode as exc:
        raise NotFound(f"{exc}; register first") from None


def record_report(store: SqlStore, report: StatusReport) -> list[str]:
    """Record a status report the caller may make (it speaks for ``report.node``); the reported
    replicas the node must stop. GPU samples of anything but its own devices are refused (422)."""
    check_gpu_samples(store, report)
    now = datetime.now(UTC)
    try:
        r = agent_report(report, now)
        return store.report(r.node, r.epoch, now, r.replicas, r.model_cache, r.agent_status)
    except UnknownNode as exc:
        raise NotFound(f"{exc}; register first") from None


def record_reports(store: SqlStore, reports: Sequence[StatusReport]) -> list[list[str] | None]:
    """``record_report`` of many at once (each caller speaks for its report's node), in one
    transaction; per report, the replicas its node must stop, or None where it was not recorded
    (``record_report`` then says why: GPU samples not its own, a stale epoch, an unknown node)."""
    now = datetime.now(UTC)
    taken: list[int] = []
    for i, report in enumerate(reports):
        try:
            check_gpu_samples(store, report)
        except FleetserveError:
            continue
        taken.append(i)
    stops = store.reports([agent_report(reports[i], now) for i in taken], now)
    out: list[list[str] | None] = [None] * len(reports)
    for i, stop in zip(taken, stops, strict=True):
        out[i] = stop
    return out


def agent_report(report: StatusReport, now: datetime) -> AgentReport:
    """A status report as the store takes it, received at ``now``."""
    return AgentReport(
        node=report.node,
        epoch=report.epoch,
        replicas={name: (r.state, r.status()) for name, r in report.replicas.items()},
        model_cache=report.model_cache,
        agent_status=AgentStatus(
            downloads=report.downloads,
            problems=report.problems,
            gpuMetrics=report.gpu_metrics,
            reportedAt=now.isoformat(),
        ),
    )


def build_agent_router(
    store: SqlStore, files: ModelFiles, policy: EnrolmentPolicy, watch: AssignmentWatch | None = None
) -> APIRouter:
    """The routes agents use: the join token enrols, the node's credential does the rest. Held
    assignment polls are woken by ``watch`` (one per process; made here if not given)."""
    api = APIRouter(prefix="/api/v1/agent", dependencies=[agent], tags=["agent"])
    watch = watch or AssignmentWatch(store)

    def own_model(request: Request, name: str) -> None:
        node = node_of(request)
        if name not in models_of(store, node):
            raise Forbidden(f"model {name} is not served by a replica assigned to node {node}")

    @api.post(
        "/register",
        summary="Enrol a node (join token: answers its credential) or register it again (its credential)",
    )
    def register(request: Request, report: Annotated[NodeReport, Body()]) -> Registered:
        caller = caller_of(request)
        node: Node = report.node()
        source = request.client.host if request.client else ""
        if policy.check_address(node.address, source) is AddressVerdict.REFUSED:
            raise Forbidden(
                f"node {node.name} gives the address {node.address!r}, but connects from {source!r}; "
                "give the address it connects from, or have the operator allow its network "
                "(fleetserve server --node-address-allow CIDR)"
            )
        credential = None
        if caller.node is not None:
            speaks_for(request, node.name)
            registration = store.register(node)
        else:
            outcome = store.enrol(node, datetime.now(UTC), approve_new=policy.approve_new, source=source)
            if isinstance(outcome, Refused):
                raise refusal(outcome)
            registration, credential = outcome.registration, outcome.credential
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
            credential=credential,
        )

    @api.post("/heartbeat", summary="Say the node is alive; 409 for an older registration or a dead node")
    def heartbeat(request: Request, body: HeartbeatRequest) -> HeartbeatReply:
        speaks_for(request, body.node)
        record_heartbeat(store, body)
        return HeartbeatReply(node=body.node)

    @api.get("/classes", summary="Device classes, for matching discovered devices")
    def classes() -> list[dict[str, Any]]:
        return [_doc(c) for c in sorted(store.device_classes().values(), key=lambda c: c.name)]

    @api.get("/models/{name}", summary="A model document, for fetching it (one the node's replicas serve)")
    def model(request: Request, name: NameParam) -> dict[str, Any]:
        own_model(request, name)
        return _doc(store.get_model(name))

    @api.get(
        "/assignments",
        summary="The replicas a node must run; held open until they change",
        response_model=AssignmentSet,
    )
    async def assignments(
        request: Request,
        node: Annotated[str, Query(min_length=1, max_length=63, pattern=NAME_PATTERN)],
        epoch: Annotated[int, Query(ge=1, le=2**31 - 1)],
        since: Annotated[str | None, Query(max_length=64, pattern=r"^[0-9a-f]*$")] = None,
        wait: Annotated[float, Query(ge=0, le=MAX_WAIT_SECONDS)] = 0.0,
    ) -> Response:
        speaks_for(request, node)
        deadline = time.monotonic() + wait
        while True:
            # Taken before the build: a change while building moves it, and wakes the poll below.
            seen = watch.current(node)
            held = watch.answered(node, epoch, since)
            if held is not None:
                answer = held  # the agent has this set, and nothing it is built from moved
            else:
                current = await run_in_threadpool(store.epoch, node)
                if current == 0:
                    raise NotFound(f"no node named {node!r} is registered; register first")
                if current != epoch:
                    # The same check as heartbeats: an older registration must register again.
                    await run_in_threadpool(store.heartbeat, node, datetime.now(UTC), epoch)
                assigned = await run_in_threadpool(store.assignments, node)
                entries = await run_in_threadpool(assignment_entries, store, assigned)
                keep = kept(assigned, entries)
                answer = AssignmentSet(
                    revision=revision_of(entries, keep), epoch=current, assignments=entries, keep=keep
                )
                watch.remember(node, seen, answer)
                if answer.revision != since:
                    return rendered(answer)
            # Held: woken when the node's fingerprint moves; between wakes, look at the request
            # itself (a server shutting down answers at once: a held poll would hold its shutdown).
            while True:
                left = deadline - time.monotonic()
                stopping = bool(getattr(request.app.state, "stopping", False))
                if left <= 0 or stopping or await request.is_disconnected():
                    return rendered(answer)
                if await watch.changed(node, seen, min(left, RECHECK_SECONDS)):
                    break

    @api.post("/status", summary="Report replica states, cache contents, downloads and GPU samples")
    def status(request: Request, body: StatusReport) -> StatusReply:
        speaks_for(request, body.node)
        return StatusReply(stop=record_report(store, body))

    @api.get("/models/{name}/file", summary="Download a model file the server holds (Range supported)")
    def model_file(request: Request, name: NameParam) -> FileResponse:
        own_model(request, name)
        stored = files.get(name)
        return FileResponse(
            stored.path, media_type="application/octet-stream", headers={"X-Sha256": stored.sha256}
        )

    return api
