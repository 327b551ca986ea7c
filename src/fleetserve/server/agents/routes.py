"""The agents' API routes on FastAPI: register (enrol with the join token, or register again with
the node's credential), device classes for discovery, and model files. Every body is a model of
``fleetserve.protocol``. The three most frequent calls — heartbeat, status report, assignments
poll — are not routes: the agents' door answers them before FastAPI (``door.py``).

Identity: the join token only enrols (``POST /register`` for a name, under the server's
``EnrolmentPolicy``) and its answer carries the node's credential; every other call is made with
that credential and speaks for its own node only: its heartbeats, its assignments, its replicas'
states, samples of its own GPUs, and the models its own replicas serve. The address a node gives
must be its connection's source address or an allowed one. A node's hardware is not its word: a
registration claiming more than the operator approved is held (``Registered.held``) and the node
placed with the approved facts until ``fleetserve nodes approve NAME`` (``store.identity``).

Fencing: every registration bumps the node's epoch. Heartbeats and reports name the epoch they
speak for (it is required); an older one, or any from a node judged Lost, gets 409
and the agent must register again — and stop every replica it runs that is not in the
assignments it is then given, so a replica never runs twice under one identity. No answer but
the registration's tells the epoch.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Any

from fastapi import APIRouter, Body, Request
from fastapi.responses import FileResponse
from pydantic import BaseModel

from fleetserve.errors import NotFound
from fleetserve.protocol import NodeReport, Registered
from fleetserve.server.agents.assignments import assignment_entries, kept, revision_of
from fleetserve.server.agents.callcpu import charged
from fleetserve.server.agents.enrolment import AddressVerdict, EnrolmentPolicy
from fleetserve.server.agents.modelfiles import ModelFiles
from fleetserve.server.auth import agent, caller_of, node_of, speaks_for
from fleetserve.server.params import NameParam
from fleetserve.server.problems import EnrolmentRefused, Forbidden
from fleetserve.spec.resources import Node
from fleetserve.store.identity import Refusal, Refused
from fleetserve.store.sql import SqlStore


def _doc(resource: BaseModel) -> dict[str, Any]:
    return resource.model_dump(mode="json", by_alias=True)


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


def build_agent_router(store: SqlStore, files: ModelFiles, policy: EnrolmentPolicy) -> APIRouter:
    """The agents' routes on FastAPI: the join token enrols, the node's credential does the rest."""
    api = APIRouter(prefix="/api/v1/agent", dependencies=[agent], tags=["agent"])

    def own_model(request: Request, name: str) -> None:
        node = node_of(request)
        if name not in models_of(store, node):
            raise Forbidden(f"model {name} is not served by a replica assigned to node {node}")

    @api.post(
        "/register",
        summary="Enrol a node (join token: answers its credential) or register it again (its credential)",
    )
    def register(request: Request, report: Annotated[NodeReport, Body()]) -> Registered:
        # On FastAPI's worker thread: its CPU is the call's (``callcpu``, kind register).
        return charged(registered)(request, report)

    def registered(request: Request, report: NodeReport) -> Registered:
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
            # Judged against its approved hardware: a claim beyond it is held (``held``).
            registration = store.reregister(node, datetime.now(UTC), source=source)
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
            held=registration.held,
        )

    @api.get("/classes", summary="Device classes, for matching discovered devices")
    def classes() -> list[dict[str, Any]]:
        return [_doc(c) for c in sorted(store.device_classes().values(), key=lambda c: c.name)]

    @api.get("/models/{name}", summary="A model document, for fetching it (one the node's replicas serve)")
    def model(request: Request, name: NameParam) -> dict[str, Any]:
        own_model(request, name)
        return _doc(store.get_model(name))

    @api.get("/models/{name}/file", summary="Download a model file the server holds (Range supported)")
    def model_file(request: Request, name: NameParam) -> FileResponse:
        own_model(request, name)
        stored = files.get(name)
        return FileResponse(
            stored.path, media_type="application/octet-stream", headers={"X-Sha256": stored.sha256}
        )

    return api
