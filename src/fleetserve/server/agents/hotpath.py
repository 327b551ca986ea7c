"""The agents' three most frequent calls — heartbeat, status report and the re-issued assignments
long-poll — as raw ASGI before FastAPI.

At thousands of nodes these are most of the control plane's requests, and FastAPI's middleware,
routing, dependency injection and a trip to a worker thread per database call cost more CPU than
the calls themselves (the gateway's /v1 is raw ASGI for the same reason, ``gateway/asgi.py``).
Concurrent calls of a kind are taken together (``server/agents/batching.py``): one trip to a worker
thread and two statements for a batch of heartbeats (``store.beats``), one statement for a batch
of credential checks (``store.nodes_for_credentials``), one transaction for a batch of status
reports (``store.reports``, each accepted or not on its own node's row).

Only the accepted call is answered here. Anything else — no node credential, a body over its
limit or not JSON, a document that does not validate, a node speaking for another, a stale
epoch, an unknown node, a store error — goes on to the FastAPI app unchanged (its body handed on
as it came), whose middleware and route answer it as they always have: the same 401, 403, 409,
413, 422 or 503, from the same code. Status reports run the route's own logic
(``agents.record_reports``, ``record_report`` of many); a heartbeat accepted here is the route's
accepted case (the credential's own node, its current epoch, Ready: the same condition as
``store.heartbeat``'s, and the same write), so what is accepted and what is stored is the same.

An assignments poll is held here only when the route would hold it without building anything:
the agent shows the revision it holds, for its epoch, and nothing that set was built from has
moved since (``AssignmentWatch.answered``), and its credential is the node's own. It is answered
as the route answers it (the same bytes) when its wait ends or the server stops; if the node's
fingerprint moves while it is held, it goes on to the route with what is left of its wait. Any
other poll (the first of a registration, a query the route would judge, a node whose assignments
moved) goes to the route.

Order of checks: a status report's credential is checked before its body (up to 4 MiB) is read,
as the token middleware (``server/auth.py``) has it. A heartbeat's body (at most 4 KiB, declared
in its Content-Length; uvicorn has it buffered with the headers already) is parsed first, because
its credential check and its write go together (``store.beats``): a caller without a credential
costs one bounded parse and its share of two indexed statements that write nothing for it, and is
then refused by the middleware as before.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from urllib.parse import parse_qsl, urlencode

from pydantic import ValidationError

from fleetserve.errors import FleetserveError
from fleetserve.gateway.asgi import App, RawRoute
from fleetserve.protocol import AssignmentSet, HeartbeatReply, HeartbeatRequest, StatusReply, StatusReport
from fleetserve.rawasgi.types import Receive, Scope, Send
from fleetserve.server.agents.assignwatch import AssignmentWatch
from fleetserve.server.agents.batching import Gather
from fleetserve.server.agents.limits import BODY_LIMITS, replay
from fleetserve.server.agents.routes import MAX_WAIT_SECONDS, record_reports, rendered
from fleetserve.server.auth import AGENT_PREFIX
from fleetserve.spec.base import NAME_PATTERN
from fleetserve.store.identity import Beat
from fleetserve.store.sql import SqlStore

HEARTBEAT = f"{AGENT_PREFIX}/heartbeat"
STATUS = f"{AGENT_PREFIX}/status"
ASSIGNMENTS = f"{AGENT_PREFIX}/assignments"
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


_NAME = re.compile(NAME_PATTERN)
_HEX = re.compile(r"[0-9a-f]{1,64}")
_WAIT = re.compile(r"[0-9]{1,2}(\.[0-9]{1,6})?")


@dataclass(frozen=True)
class Poll:
    """A re-issued assignments poll, as the hot path takes it: every field given once, in its
    plainest spelling (anything else is the route's to judge)."""

    node: str
    epoch: int
    since: str
    wait: float


def poll_of(query: bytes) -> Poll | None:
    """The poll a query string asks for, if the hot path may hold it: exactly ``node``, ``epoch``,
    ``since`` and ``wait``, each once, each in range (None otherwise: the route judges it)."""
    try:
        pairs = parse_qsl(query.decode("ascii"), keep_blank_values=True, strict_parsing=True)
    except (UnicodeDecodeError, ValueError):
        return None
    fields = dict(pairs)
    if len(fields) != len(pairs) or set(fields) != {"node", "epoch", "since", "wait"}:
        return None
    node, epoch, since, wait = fields["node"], fields["epoch"], fields["since"], fields["wait"]
    if len(node) > 63 or not _NAME.fullmatch(node) or not _HEX.fullmatch(since):
        return None
    if not (epoch.isascii() and epoch.isdigit() and len(epoch) <= 10) or not _WAIT.fullmatch(wait):
        return None
    number, seconds = int(epoch), float(wait)
    if not 1 <= number <= 2**31 - 1 or seconds > MAX_WAIT_SECONDS:
        return None
    return Poll(node, number, since, seconds)


async def _until_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _answer(send: Send, body: bytes) -> None:
    headers = [*_JSON_HEADERS, (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class AgentHotPath:
    """Heartbeats, status reports and held assignment polls over ``store``, answered without
    FastAPI when accepted. Polls are held only with ``watch`` (the process's one, shared with the
    route); ``stopping`` tells whether the server is shutting down (held polls then answer)."""

    def __init__(
        self,
        store: SqlStore,
        watch: AssignmentWatch | None = None,
        stopping: Callable[[], bool] = lambda: False,
    ) -> None:
        self.store = store
        self.watch = watch
        self.stopping = stopping
        self.answered = 0  # calls answered here (not handed on), for tests and the curious
        self.held = 0  # assignment polls held here (answered here, or handed on when moved)
        self.beats: Gather[Beat, bool] = Gather(self._beats, name="heartbeats")
        self.credentials: Gather[str, str | None] = Gather(
            self.store.nodes_for_credentials, name="credentials"
        )
        self.reports: Gather[tuple[str, bytes], bytes | None] = Gather(
            self._reports, limit=64, name="reports"
        )

    def routes(self) -> dict[str, RawRoute]:
        """Per exact path, its raw route (for ``ServingApp``)."""
        return {HEARTBEAT: self.heartbeat, STATUS: self.status, ASSIGNMENTS: self.assignments}

    async def heartbeat(self, scope: Scope, receive: Receive, send: Send, app: App) -> None:
        token, length = bearer_token(scope), declared_length(scope)
        if scope["method"] != "POST" or token is None or length is None or length > BODY_LIMITS["/heartbeat"]:
            await app(scope, receive, send)
            return
        body = await read_body(receive)
        if body is None:
            return  # gone
        node = await self._beat(token, body)
        if node is None:
            await app(scope, replay(body, receive), send)
            return
        self.answered += 1
        await _answer(send, HeartbeatReply(node=node).model_dump_json().encode())

    async def _beat(self, token: str, body: bytes) -> str | None:
        """The node whose heartbeat was recorded here (None: the FastAPI path answers). Recorded
        only for the node the credential is bound to, at its current registration, while Ready
        (``store.beats``); anything else (another node's name, a stale epoch, an unknown or
        revoked credential, a store error) writes nothing and goes on to the route, which says
        why."""
        try:
            beat = HeartbeatRequest.model_validate_json(body)
        except ValidationError:
            return None
        try:
            recorded = await self.beats(Beat(token, beat.node, beat.epoch))
        except FleetserveError:
            return None
        return beat.node if recorded else None

    def _beats(self, beats: Sequence[Beat]) -> list[bool]:
        return self.store.beats(beats, datetime.now(UTC))

    async def status(self, scope: Scope, receive: Receive, send: Send, app: App) -> None:
        token, length = bearer_token(scope), declared_length(scope)
        if scope["method"] != "POST" or token is None or length is None or length > BODY_LIMITS["/status"]:
            await app(scope, receive, send)
            return
        node = await self._node(token)
        if node is None:
            await app(scope, receive, send)  # nothing read: the middleware refuses it
            return
        body = await read_body(receive)
        if body is None:
            return
        try:
            reply = await self.reports((node, body))
        except FleetserveError:
            reply = None
        if reply is None:
            await app(scope, replay(body, receive), send)
            return
        self.answered += 1
        await _answer(send, reply)

    def _reports(self, calls: Sequence[tuple[str, bytes]]) -> list[bytes | None]:
        """Per (credential's node, body), the status report's answer, or None for the FastAPI
        path to answer (a body that does not validate, a node speaking for another, a report
        not recorded): those that validate are recorded together (``record_reports``)."""
        valid: list[tuple[int, StatusReport]] = []
        for i, (node, body) in enumerate(calls):
            try:
                report = StatusReport.model_validate_json(body)
            except ValidationError:
                continue
            if report.node == node:
                valid.append((i, report))
        stops = record_reports(self.store, [report for _, report in valid])
        out: list[bytes | None] = [None] * len(calls)
        for (i, _), stop in zip(valid, stops, strict=True):
            if stop is not None:
                out[i] = StatusReply(stop=stop).model_dump_json().encode()
        return out

    async def _node(self, token: str) -> str | None:
        """The node whose credential ``token`` is (None: not a node credential, or the store
        could not tell: the middleware then answers)."""
        try:
            return await self.credentials(token)
        except FleetserveError:
            return None

    async def assignments(self, scope: Scope, receive: Receive, send: Send, app: App) -> None:
        """A re-issued poll held here, or handed to the route (module docstring)."""
        watch, poll = self.watch, poll_of(scope.get("query_string", b""))
        if scope["method"] != "GET" or watch is None or poll is None:
            await app(scope, receive, send)
            return
        # Taken before anything is decided, as the route does: a move after this wakes the hold.
        seen = watch.current(poll.node)
        held = watch.answered(poll.node, poll.epoch, poll.since)
        token = bearer_token(scope)
        if held is None or token is None or await self._node(token) != poll.node:
            await app(scope, receive, send)
            return
        self.held += 1
        deadline = time.monotonic() + poll.wait
        gone = asyncio.ensure_future(_until_disconnect(receive))
        gone.add_done_callback(lambda _: watch.wake(poll.node))
        try:
            while True:
                left = deadline - time.monotonic()
                if gone.done():
                    return  # the agent went away: nobody to answer
                if left <= 0 or self.stopping():
                    self.answered += 1
                    await _send_set(scope, receive, send, held)
                    return
                # One wait for all that is left (at 5,000 agents a wait re-armed every few seconds
                # was most of what the collector scanned): woken when the node moves, when the
                # agent goes (``gone``) or the server stops (the watch's next tick).
                if await watch.changed(poll.node, seen, left) and watch.current(poll.node) != seen:
                    break
        finally:
            gone.cancel()
        # Its node moved: the route builds (or holds again) with what is left of the wait.
        rest = max(0.0, deadline - time.monotonic())
        query = urlencode(
            {"node": poll.node, "epoch": poll.epoch, "since": poll.since, "wait": f"{rest:.3f}"}
        )
        await app({**scope, "query_string": query.encode()}, replay(b"", receive), send)


async def _send_set(scope: Scope, receive: Receive, send: Send, answer: AssignmentSet) -> None:
    await rendered(answer)(scope, receive, send)
