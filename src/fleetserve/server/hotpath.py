"""The agents' two most frequent calls, heartbeat and status report, as raw ASGI before FastAPI.

At thousands of nodes these are most of the control plane's requests, and FastAPI's middleware,
routing, dependency injection and a trip to a worker thread per database call cost more CPU than
the calls themselves (the gateway's /v1 is raw ASGI for the same reason, ``gateway/asgi.py``).
Here each takes one trip to a worker thread (a status report two), and its database work is one
statement for a heartbeat (``store.beat_with_credential``) and one transaction for a report
(``store.report``).

Only the accepted call is answered here. Anything else — no node credential, a body over its
limit or not JSON, a document that does not validate, a node speaking for another, a stale
epoch, an unknown node, a store error — goes on to the FastAPI app unchanged (its body handed on
as it came), whose middleware and route answer it as they always have: the same 401, 403, 409,
413, 422 or 503, from the same code. A status report runs the route's own logic
(``agents.record_report``); a heartbeat accepted here is the route's accepted case in one
statement (the credential's own node, its current epoch, Ready: the same condition as
``store.heartbeat``'s, and the same write), so what is accepted and what is stored is the same.

Order of checks: a status report's credential is checked before its body (up to 4 MiB) is read,
as the token middleware (``server/auth.py``) has it. A heartbeat's body (at most 4 KiB, declared
in its Content-Length; uvicorn has it buffered with the headers already) is parsed first, because
its credential check and its write are one statement (``beat_with_credential``): a caller without
a credential costs one bounded parse and one indexed statement that writes nothing, and is then
refused by the middleware as before.
"""

from __future__ import annotations

from datetime import UTC, datetime

from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from fleetserve.errors import FleetserveError
from fleetserve.gateway.app import Receive, Scope, Send
from fleetserve.gateway.asgi import App, RawRoute
from fleetserve.protocol import HeartbeatReply, HeartbeatRequest, StatusReply, StatusReport
from fleetserve.server.agents import record_report
from fleetserve.server.auth import AGENT_PREFIX
from fleetserve.server.limits import BODY_LIMITS, replay
from fleetserve.store.sql import SqlStore

HEARTBEAT = f"{AGENT_PREFIX}/heartbeat"
STATUS = f"{AGENT_PREFIX}/status"
_JSON_HEADERS = [(b"content-type", b"application/json")]


def bearer_token(scope: Scope) -> str | None:
    """The token of the request's ``Authorization: Bearer TOKEN`` header (None: no such header,
    or more than one)."""
    found = [value for name, value in scope.get("headers", ()) if name == b"authorization"]
    if len(found) != 1:
        return None
    scheme, _, token = found[0].decode("latin-1").partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


def declared_length(scope: Scope) -> int | None:
    """The request's Content-Length if it declares exactly one JSON body (None otherwise: the
    FastAPI path then reads and judges it)."""
    length = kind = None
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            if length is not None or not value.isdigit():
                return None
            length = int(value)
        elif name == b"content-type":
            if kind is not None:
                return None
            kind = value.split(b";", 1)[0].strip().lower()
        elif name == b"transfer-encoding":
            return None
    return length if kind == b"application/json" else None


async def read_body(receive: Receive) -> bytes | None:
    """The whole request body (None: the client went away before it was complete)."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


async def _answer(send: Send, body: bytes) -> None:
    headers = [*_JSON_HEADERS, (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class AgentHotPath:
    """Heartbeats and status reports over ``store``, answered without FastAPI when accepted."""

    def __init__(self, store: SqlStore) -> None:
        self.store = store
        self.answered = 0  # calls answered here (not handed on), for tests and the curious

    def routes(self) -> dict[str, RawRoute]:
        """Per exact path, its raw route (for ``ServingApp``)."""
        return {HEARTBEAT: self.heartbeat, STATUS: self.status}

    async def heartbeat(self, scope: Scope, receive: Receive, send: Send, app: App) -> None:
        token, length = bearer_token(scope), declared_length(scope)
        if scope["method"] != "POST" or token is None or length is None or length > BODY_LIMITS["/heartbeat"]:
            await app(scope, receive, send)
            return
        body = await read_body(receive)
        if body is None:
            return  # gone
        reply = await run_in_threadpool(self._beat, token, body)
        if reply is None:
            await app(scope, replay(body, receive), send)
            return
        self.answered += 1
        await _answer(send, reply)

    def _beat(self, token: str, body: bytes) -> bytes | None:
        """The heartbeat's answer, or None for the FastAPI path to answer. The credential check
        and the write are one statement (``beat_with_credential``): recorded only for the node
        the credential is bound to, at its current registration, while Ready; anything else
        (another node's name, a stale epoch, an unknown or revoked credential) writes nothing
        and goes on to the route, which says why."""
        try:
            beat = HeartbeatRequest.model_validate_json(body)
        except ValidationError:
            return None
        try:
            recorded = self.store.beat_with_credential(token, beat.node, beat.epoch, datetime.now(UTC))
        except FleetserveError:
            return None
        if not recorded:
            return None
        return HeartbeatReply(node=beat.node).model_dump_json().encode()

    async def status(self, scope: Scope, receive: Receive, send: Send, app: App) -> None:
        token, length = bearer_token(scope), declared_length(scope)
        if scope["method"] != "POST" or token is None or length is None or length > BODY_LIMITS["/status"]:
            await app(scope, receive, send)
            return
        node = await run_in_threadpool(self._node, token)
        if node is None:
            await app(scope, receive, send)  # nothing read: the middleware refuses it
            return
        body = await read_body(receive)
        if body is None:
            return
        reply = await run_in_threadpool(self._report, node, body)
        if reply is None:
            await app(scope, replay(body, receive), send)
            return
        self.answered += 1
        await _answer(send, reply)

    def _report(self, node: str, body: bytes) -> bytes | None:
        """The status report's answer, or None for the FastAPI path to answer."""
        try:
            report = StatusReport.model_validate_json(body)
        except ValidationError:
            return None
        if report.node != node:
            return None
        try:
            stop = record_report(self.store, report)
        except FleetserveError:
            return None
        return StatusReply(stop=stop).model_dump_json().encode()

    def _node(self, token: str) -> str | None:
        """The node whose credential ``token`` is (None: not a node credential, or the store
        could not tell: the middleware then answers)."""
        try:
            return self.store.node_for_credential(token)
        except FleetserveError:
            return None
