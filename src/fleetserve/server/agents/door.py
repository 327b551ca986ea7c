"""The agents' three most frequent calls — heartbeat, status report and the assignments long-poll —
each answered by ONE raw-ASGI handler, before FastAPI: ``AgentDoor.heartbeat``,
``AgentDoor.status`` and ``AgentDoor.assignments``. There is no route behind them.

At thousands of nodes these are most of the control plane's requests, and FastAPI's middleware,
routing, dependency injection and a trip to a worker thread per database call cost more CPU than
the calls themselves. Concurrent calls of a kind are taken together (``batching.Gather``, per tick): one
statement for a batch of heartbeats (``store.judge_beats``), one for a batch of credential checks
or of judgements, one transaction for a batch of status reports (``store.judge_reports``).

Each handler answers every case itself: the accepted call, and every refusal from the one table of
problems (``refusals.py``), in the API's error shape. What is accepted is the store's one rule
(``store/acceptance.py``: the credential's node is the node named, at its current epoch, not Lost),
applied by the very statement that writes the call; a refused call writes nothing, and the rule's
verdict says why. Requests are read with the shared raw-ASGI pieces (``fleetserve.rawasgi``: the
bearer token, ONE bounded body reader, the disconnect watch, whole answers).

A heartbeat is judged by when it arrived, not by when its write ran: each call is stamped as its
handler starts (``arrived``, before its body is read, before it queues for a batch or a thread),
and a batch is written with its earliest arrival — no call is credited later than it came, none
earlier than the batch's first (the reconciler's judgement: ``reconcile/disruption.py``).

Order of the checks, as the FastAPI stack had them: the credential (401) before the body is judged
(413 from its Content-Length or as it is read, 422 for one that does not validate, 405 for another
method), then whom it speaks for (403) and the rule (404, 409). A status report's credential is
checked before its body (up to 4 MiB) is read. A heartbeat's body (4 KiB at most) is parsed first,
because its credential check and its write are one statement: a caller without a credential costs
one bounded parse and its share of one statement that writes nothing for it.

An assignments poll is answered at once when the agent's revision differs from the node's set;
otherwise it is held in ONE loop (``_poll``) until the set moves (``AssignmentWatch``), its wait
ends, the server stops (the set it holds is answered) or the agent goes away (nothing is).

Which node a credential is kept for a few seconds (``credcache``) for the checks made before a
call is judged; the judgement itself always reads the rows. Each call's CPU is accounted by kind
(``callcpu.CallCpu``: on ``/metrics`` as ``fleetserve_agent_call_cpu_seconds_total`` and
``fleetserve_agent_calls_total``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from datetime import UTC, datetime
from enum import Enum

from starlette.concurrency import run_in_threadpool

from fleetserve.errors import StoreError
from fleetserve.protocol import HeartbeatReply, HeartbeatRequest, StatusReply, StatusReport
from fleetserve.rawasgi.answers import answer
from fleetserve.rawasgi.body import Unread, read_body
from fleetserve.rawasgi.disconnect import until_disconnect
from fleetserve.rawasgi.headers import bearer_token, header
from fleetserve.rawasgi.types import App, Receive, Scope, Send
from fleetserve.server.agents.assignments import assignment_set, rendered
from fleetserve.server.agents.assignwatch import AssignmentWatch
from fleetserve.server.agents.batching import Gather
from fleetserve.server.agents.callcpu import CallCpu, CallKind, charged
from fleetserve.server.agents.credcache import DEFAULT_TTL, CredentialCache
from fleetserve.server.agents.limits import limit_for
from fleetserve.server.agents.parse import PollQuery, json_body, poll_query
from fleetserve.server.agents.refusals import Reason, Refusal, judged, refuse, too_large
from fleetserve.server.agents.reporting import agent_report, gpu_refusal
from fleetserve.server.auth import AGENT_PREFIX
from fleetserve.store.acceptance import Claim, Judgement, Verdict
from fleetserve.store.credentials import TokenKind
from fleetserve.store.protocols import AgentDoorStore

HEARTBEAT = f"{AGENT_PREFIX}/heartbeat"
STATUS = f"{AGENT_PREFIX}/status"
ASSIGNMENTS = f"{AGENT_PREFIX}/assignments"
REGISTER = f"{AGENT_PREFIX}/register"  # FastAPI's route (``routes.py``), timed as it enters it


# How long the first call of a quiet moment waits for others to share its batch (``batching``):
# heartbeats have a latency target (p99 50 ms at 5,000 agents), so a fifth of it; reports
# and polls' judgements have none (a poll is held for seconds anyway), so five times that.
BEAT_TICK = 0.01
REPORT_TICKS = 5


class Held(Enum):
    """How a held poll's wait ended."""

    MOVED = "moved"  # the node's set may differ: build it again
    ENDED = "ended"  # its wait is over, or the server stops: answer the set held
    GONE = "gone"  # the agent went away: nobody to answer


NOT_ALLOWED = Refusal(Reason.METHOD_NOT_ALLOWED)

# A status report's outcome: the replicas to stop, the rule's verdict, or a refusal of its own.
Reported = list[str] | Judgement | Refusal


def arrived() -> datetime:
    """When a call reached the server: the wall clock as its handler starts."""
    return datetime.now(UTC)


class AgentDoor:
    """Heartbeats, status reports and assignment polls over ``store``, every answer given here.
    Held polls wait on ``watch`` (the process's one); ``stopping`` tells whether the server is
    shutting down (held polls then answer at once); ``cpu`` accounts each call's CPU (default: an
    account of its own, exposed nowhere); a credential's node is kept ``credential_ttl`` seconds
    for the checks before a call is judged (``credcache``; 0: asked at every call); heartbeats and
    credential checks are batched per ``tick`` seconds, reports and polls' judgements per
    ``REPORT_TICKS`` ticks (``batching``; 0: each batch starts at once)."""

    def __init__(
        self,
        store: AgentDoorStore,
        watch: AssignmentWatch,
        stopping: Callable[[], bool] = lambda: False,
        cpu: CallCpu | None = None,
        credential_ttl: float = DEFAULT_TTL,
        tick: float = BEAT_TICK,
    ) -> None:
        self.store = store
        self.cpu = cpu if cpu is not None else CallCpu()
        self.known = CredentialCache(credential_ttl)
        self.watch = watch
        self.stopping = stopping
        # Assignment polls held (not answered at once), and assignment sets built: for tests and
        # the curious.
        self.held = 0
        self.built = 0
        slow = tick * REPORT_TICKS
        self.beats: Gather[tuple[Claim, datetime], Judgement] = Gather(
            self._beats, name="heartbeats", tick=tick
        )
        self.credentials: Gather[str, str | None] = Gather(
            store.nodes_for_credentials, name="credentials", tick=tick
        )
        self.judgements: Gather[Claim, Judgement] = Gather(store.judge, name="judgements", tick=slow)
        self.reports: Gather[tuple[str, StatusReport, datetime], Reported] = Gather(
            self._reports, limit=64, name="reports", tick=slow
        )

    def routes(self) -> dict[str, App]:
        """Per exact path, its one handler: a plain ASGI app that ``ServingApp`` answers before FastAPI."""
        return {HEARTBEAT: self.heartbeat, STATUS: self.status, ASSIGNMENTS: self.assignments}

    # --- the three calls ----------------------------------------------------------------------

    async def heartbeat(self, scope: Scope, receive: Receive, send: Send) -> None:
        """``POST /heartbeat``: the node is alive, at the registration it names."""
        await self.cpu.timed(
            CallKind.HEARTBEAT, self._answering(self._heartbeat(scope, receive, send, arrived()), send)
        )

    async def status(self, scope: Scope, receive: Receive, send: Send) -> None:
        """``POST /status``: the node's replicas' states, cache, downloads and GPU samples."""
        await self.cpu.timed(
            CallKind.STATUS, self._answering(self._status(scope, receive, send, arrived()), send)
        )

    async def assignments(self, scope: Scope, receive: Receive, send: Send) -> None:
        """``GET /assignments``: the replicas the node must run, held open until they change."""
        await self.cpu.timed(
            CallKind.ASSIGNMENTS, self._answering(self._assignments(scope, receive, send), send)
        )

    async def _answering(self, call: Awaitable[Refusal | None], send: Send) -> None:
        """Run a call's handling; send the refusal it returns (a store failure: 503)."""
        try:
            refusal = await call
        except StoreError as exc:
            refusal = Refusal(Reason.STORE_UNAVAILABLE, {"error": str(exc)})
        if refusal is not None:
            await refuse(send, refusal)

    async def _heartbeat(self, scope: Scope, receive: Receive, send: Send, at: datetime) -> Refusal | None:
        token = bearer_token(scope)
        if token is None:
            return Refusal(Reason.NO_CREDENTIAL)
        body = await self._body(scope, receive, "POST")
        if body is None:
            return None  # the agent went away
        beat = (
            body
            if isinstance(body, Refusal)
            else json_body(HeartbeatRequest, body, header(scope, b"content-type"))
        )
        if isinstance(beat, Refusal):
            return await self._unless_unauthorized(token, beat)
        judgement = await self.beats((Claim(token, beat.node, beat.epoch), at))
        if not judgement.accepted:
            return await self._refusal(token, judgement, beat.node)
        self.known.found(token, beat.node)  # the rows accepted it just now: the next report needs no lookup
        await answer(send, 200, HeartbeatReply(node=beat.node).model_dump_json().encode())
        return None

    async def _status(self, scope: Scope, receive: Receive, send: Send, at: datetime) -> Refusal | None:
        token = bearer_token(scope)
        if token is None:
            return Refusal(Reason.NO_CREDENTIAL)
        own = await self._node_of(token)  # before the body is read
        if own is None:
            return await self._unauthorized(token)
        body = await self._body(scope, receive, "POST")
        if body is None or isinstance(body, Refusal):
            return body
        report = json_body(StatusReport, body, header(scope, b"content-type"))
        if isinstance(report, Refusal):
            return report
        if report.node != own:
            return Refusal(Reason.ANOTHER_NODE, {"own": own, "node": report.node})
        reported = await self.reports((token, report, at))
        if isinstance(reported, Refusal):
            return reported
        if isinstance(reported, Judgement):
            return await self._refusal(token, reported, report.node)
        await answer(send, 200, StatusReply(stop=reported).model_dump_json().encode())
        return None

    async def _assignments(self, scope: Scope, receive: Receive, send: Send) -> Refusal | None:
        token = bearer_token(scope)
        if token is None:
            return Refusal(Reason.NO_CREDENTIAL)
        if scope["method"] != "GET":
            return await self._unless_unauthorized(token, NOT_ALLOWED)
        query = poll_query(scope.get("query_string", b""))
        if isinstance(query, Refusal):
            return await self._unless_unauthorized(token, query)
        claim = Claim(token, query.node, query.epoch)
        refused = await self._judge(claim)
        if refused is not None:
            return refused
        return await self._poll(claim, query, receive, send)

    # --- the one hold loop --------------------------------------------------------------------

    async def _poll(self, claim: Claim, query: PollQuery, receive: Receive, send: Send) -> Refusal | None:
        """Answer the node's set when it differs from the agent's (``since``); hold it otherwise
        until the set moves (then build and judge again), the wait ends or the server stops
        (the set held is answered), or the agent goes away (nothing is). ``claim`` is judged
        accepted already."""
        watch, node = self.watch, claim.node
        deadline = time.monotonic() + query.wait
        gone: asyncio.Future[None] | None = None
        judged_now = True
        try:
            while True:
                # Taken before anything is decided: a move after this wakes the hold below.
                seen = watch.current(node)
                held = watch.answered(node, claim.epoch, query.since)
                if held is None:  # the agent's revision is not the node's set, or it moved
                    refused = None if judged_now else await self._judge(claim)
                    if refused is not None:
                        return refused
                    held = await run_in_threadpool(charged(assignment_set), self.store, node, claim.epoch)
                    self.built += 1
                    watch.remember(node, seen, held)
                    if held.revision != query.since:
                        await answer(send, 200, rendered(held))
                        return None
                judged_now = False
                if gone is None:
                    self.held += 1
                    gone = asyncio.ensure_future(until_disconnect(receive))
                    gone.add_done_callback(lambda _: watch.wake(node))
                ended = await self._hold(node, seen, deadline, gone)
                if ended is Held.GONE:
                    return None  # nobody to answer
                if ended is Held.ENDED:
                    await answer(send, 200, rendered(held))
                    return None
        finally:
            if gone is not None:
                gone.cancel()

    async def _hold(self, node: str, seen: int | None, deadline: float, gone: asyncio.Future[None]) -> Held:
        """Hold a poll with one wait for all that is left, until the node's set moves, the wait
        ends (or the server stops), or the agent goes away (``gone``)."""
        while True:
            left = deadline - time.monotonic()
            if gone.done():
                return Held.GONE
            if left <= 0 or self.stopping():
                return Held.ENDED
            # Woken when the node moves, when the agent goes (``gone``) or the server stops (the
            # watch's next tick); at 5,000 agents a wait re-armed every few seconds was most of
            # what the collector scanned.
            if await self.watch.changed(node, seen, left) and self.watch.current(node) != seen:
                return Held.MOVED

    # --- checks shared by the calls -----------------------------------------------------------

    async def _body(self, scope: Scope, receive: Receive, method: str) -> bytes | Refusal | None:
        """The body of a ``method`` call within its path's limit, or its refusal (413, 405);
        None when the client went away first."""
        limit = limit_for(scope["path"]) or 0
        declared = header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return too_large(scope["method"], scope["path"], limit)
        if scope["method"] != method:
            return NOT_ALLOWED
        body = await read_body(receive, limit)
        if body is Unread.GONE:
            return None
        if body is Unread.OVER_LIMIT:
            return too_large(scope["method"], scope["path"], limit)
        return body

    async def _judge(self, claim: Claim) -> Refusal | None:
        """The refusal of a call the rule refuses as the rows stand (None: accepted)."""
        judgement = await self.judgements(claim)
        return (
            None if judgement.accepted else await self._refusal(claim.credential or "", judgement, claim.node)
        )

    async def _refusal(self, token: str, judgement: Judgement, node: str) -> Refusal:
        if judgement.verdict is Verdict.UNKNOWN_CREDENTIAL:
            self.known.forget(token)  # revoked or replaced since it was found: ask again
            return await self._unauthorized(token)
        return judged(judgement, node)

    async def _unless_unauthorized(self, token: str, refusal: Refusal) -> Refusal:
        """``refusal``, unless ``token`` is no node's credential: the 401 comes first."""
        return refusal if await self._node_of(token) is not None else await self._unauthorized(token)

    async def _node_of(self, token: str) -> str | None:
        """The node ``token`` is the credential of (None: no node's), kept a while (``known``)."""
        node = self.known.node(token)
        if node is None:
            node = await self.credentials(token)
            if node is not None:
                self.known.found(token, node)
        return node

    async def _unauthorized(self, token: str) -> Refusal:
        """The 401 of a token that is no node's credential: the join token is told it only enrols."""
        join = await run_in_threadpool(charged(self.store.verify_token), token, TokenKind.JOIN)
        return Refusal(Reason.JOIN_TOKEN if join else Reason.NOT_A_CREDENTIAL)

    # --- batches (each on its gather's own thread) -------------------------------------------

    def _beats(self, calls: Sequence[tuple[Claim, datetime]]) -> list[Judgement]:
        return self.store.judge_beats([claim for claim, _ in calls], min(at for _, at in calls))

    def _reports(self, calls: Sequence[tuple[str, StatusReport, datetime]]) -> list[Reported]:
        """Per (credential, report, arrival), its outcome: reports whose GPU samples are their
        node's own are judged and recorded together, in one transaction (``store.judge_reports``),
        stamped with the batch's earliest arrival."""
        now = min(at for _, _, at in calls)
        out: list[Reported] = []
        taken: list[int] = []
        for i, (_, report, _) in enumerate(calls):
            refusal = gpu_refusal(self.store, report)
            out.append([] if refusal is None else refusal)
            if refusal is None:
                taken.append(i)
        batch = [agent_report(calls[i][1], now, calls[i][0]) for i in taken]
        for i, reported in zip(taken, self.store.judge_reports(batch, now), strict=True):
            out[i] = reported
        return out
