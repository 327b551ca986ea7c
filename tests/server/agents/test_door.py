"""The agents' door (``server/agents/door.py``) over an in-memory store: every refusal of its table
(``refusals.PROBLEMS``) and the accepted call of each of heartbeat, status report and assignments
poll, without a database, FastAPI or a server.

The fake store (``FakeStore``) holds who each credential is and, as data, the rule's verdict on
the calls it is asked about (``store/acceptance.py`` is pinned on the real backends by
``tests/store/test_acceptance.py``); the door's part is what it asks, and how it answers.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import pytest

from builders import cpu_8c_32g, nvidia_h100_80gb_x8
from fleetserve.errors import NotFound, StoreError, UnknownNode
from fleetserve.server.agents.assignwatch import AssignmentWatch
from fleetserve.server.agents.door import ASSIGNMENTS, HEARTBEAT, STATUS, AgentDoor
from fleetserve.server.agents.refusals import PROBLEMS, Reason
from fleetserve.spec.resources import DeviceClass, Model, Node, NodeState, Replica
from fleetserve.store.acceptance import ACCEPTED, Claim, Judgement, Verdict
from fleetserve.store.credentials import TokenKind
from fleetserve.store.deployments import StoredDeployment
from fleetserve.store.reports import AgentReport, AssignmentInputs

MiB = 1024 * 1024


@dataclass
class FakeStore:
    """An in-memory ``AgentDoorStore``: credentials by token, the rule's verdicts by (node, epoch)
    (a credential naming another node, or none, is judged by the credentials), the calls it
    wrote, and a switch that makes every call fail as a broken database does."""

    credentials: dict[str, str] = field(default_factory=lambda: {"cred-n1": "n1", "cred-n2": "n2"})
    join_tokens: set[str] = field(default_factory=lambda: {"join-token"})
    verdicts: dict[tuple[str, int], Judgement] = field(default_factory=dict)
    nodes: dict[str, Node] = field(
        default_factory=lambda: {"n1": cpu_8c_32g("n1"), "g1": nvidia_h100_80gb_x8("g1")}
    )
    stop: list[str] = field(default_factory=lambda: ["strayed-0"])
    written: list[Claim] = field(default_factory=list)
    reported: list[AgentReport] = field(default_factory=list)
    down: bool = False

    def _up(self) -> None:
        if self.down:
            raise StoreError("state store: reading failed: OperationalError (the database is gone)")

    def nodes_for_credentials(self, plaintexts: Sequence[str]) -> list[str | None]:
        self._up()
        return [self.credentials.get(p) for p in plaintexts]

    def verify_token(self, plaintext: str, kind: TokenKind, now: datetime | None = None) -> bool:
        return kind is TokenKind.JOIN and plaintext in self.join_tokens

    def judge(self, claims: Sequence[Claim]) -> list[Judgement]:
        self._up()
        out = []
        for c in claims:
            bound = self.credentials.get(c.credential or "")
            if bound is None:
                out.append(Judgement(Verdict.UNKNOWN_CREDENTIAL))
            elif bound != c.node:
                out.append(Judgement(Verdict.ANOTHER_NODE, bound, NodeState.READY))
            else:
                out.append(self.verdicts.get((c.node, c.epoch), ACCEPTED))
        return out

    def judge_beats(self, beats: Sequence[Claim], now: datetime) -> list[Judgement]:
        judged = self.judge(beats)
        self.written += [b for b, j in zip(beats, judged, strict=True) if j.accepted]
        return judged

    def judge_reports(self, batch: Sequence[AgentReport], now: datetime) -> list[list[str] | Judgement]:
        judged = self.judge([r.claim for r in batch])
        self.reported += [r for r, j in zip(batch, judged, strict=True) if j.accepted]
        return [list(self.stop) if j.accepted else j for j in judged]

    def get_node(self, name: str) -> Node:
        if name not in self.nodes:
            raise UnknownNode(f"no node named {name!r} is registered")
        return self.nodes[name]

    def assignments(self, node: str) -> list[Replica]:
        self._up()
        return []

    def device_classes(self) -> dict[str, DeviceClass]:
        return {}

    def node_addresses(self, names: Sequence[str]) -> dict[str, str]:
        return {}

    def engine_keys(self, replicas: Sequence[str]) -> dict[str, str]:
        return {}

    def get_deployment(self, name: str) -> StoredDeployment:
        raise NotFound(name)

    def get_model(self, name: str) -> Model:
        raise NotFound(name)

    def assignment_inputs(self) -> AssignmentInputs:
        return AssignmentInputs((), {"n1": 1}, {}, "")

    def fleet_changes(self) -> int:
        return 0


@dataclass(frozen=True)
class Sent:
    """What the door sent: status, headers, and the body as JSON."""

    status: int
    headers: dict[bytes, bytes]
    body: Any


@dataclass(frozen=True)
class Call:
    """One request to the door: method, path, token, body (JSON unless bytes; a tuple is sent in
    chunks), query, and extra headers."""

    method: str
    path: str
    token: str | None = "cred-n1"
    body: Any = None
    query: str = ""
    headers: tuple[tuple[bytes, bytes], ...] = ()


async def call(door: AgentDoor, c: Call, gone: asyncio.Event | None = None) -> Sent | None:
    """Send ``c`` to the door; what it answered (None: nothing). After its body the client stays
    until ``gone`` is set (never, without one)."""
    raw = (
        c.body
        if isinstance(c.body, bytes | tuple)
        else b""
        if c.body is None
        else json.dumps(c.body).encode()
    )
    chunks = list(raw) if isinstance(raw, tuple) else [raw]
    headers = [(b"content-type", b"application/json"), *c.headers]
    if not isinstance(raw, tuple):
        headers.append((b"content-length", str(len(raw)).encode()))
    if c.token is not None:
        headers.append((b"authorization", f"Bearer {c.token}".encode()))
    scope = {
        "type": "http",
        "method": c.method,
        "path": c.path,
        "query_string": c.query.encode(),
        "headers": headers,
    }
    pending = [
        {"type": "http.request", "body": chunk, "more_body": i < len(chunks) - 1}
        for i, chunk in enumerate(chunks)
    ]
    leaving = gone or asyncio.Event()

    async def receive() -> dict[str, Any]:
        if pending:
            return pending.pop(0)
        await leaving.wait()
        return {"type": "http.disconnect"}

    messages: list[dict[str, Any]] = []

    async def send(message: Any) -> None:
        messages.append(message)

    handler = {HEARTBEAT: door.heartbeat, STATUS: door.status, ASSIGNMENTS: door.assignments}[c.path]
    await handler(scope, receive, send)
    if not messages:
        return None
    start, body = messages
    return Sent(start["status"], dict(start["headers"]), json.loads(body["body"]))


def run(store: FakeStore, c: Call) -> Sent | None:
    async def go() -> Sent | None:
        watch = AssignmentWatch(store, tick=0.05)
        try:
            return await call(AgentDoor(store, watch), c)
        finally:
            await watch.aclose()

    return asyncio.run(go())


BEAT = {"node": "n1", "epoch": 1}
SAMPLE = {"name": "fleetserve_gpu_utilization_ratio", "value": 1, "labels": {"node": "n1", "device": "0"}}


def test_the_heartbeats_of_one_tick_share_one_batch_and_each_is_answered() -> None:
    store = FakeStore()
    store.nodes["n2"] = cpu_8c_32g("n2")

    async def go() -> list[Sent | None]:
        watch = AssignmentWatch(store, tick=0.05)
        door = AgentDoor(store, watch, tick=0.2)
        try:
            return await asyncio.gather(
                call(door, Call("POST", HEARTBEAT, body=BEAT)),
                call(door, Call("POST", HEARTBEAT, token="cred-n2", body={"node": "n2", "epoch": 1})),
                call(door, Call("POST", HEARTBEAT, token="cred-n2", body=BEAT)),  # n2's credential
            )
        finally:
            assert (door.beats.batches, door.beats.calls) == (1, 3)
            await watch.aclose()

    first, second, third = asyncio.run(go())
    assert first is not None and (first.status, first.body["node"]) == (200, "n1")
    assert second is not None and (second.status, second.body["node"]) == (200, "n2")
    assert third is not None and third.status == PROBLEMS[Reason.ANOTHER_NODE].status
    assert store.written == [Claim("cred-n1", "n1", 1), Claim("cred-n2", "n2", 1)]


@dataclass(frozen=True)
class Refused:
    """A refusal case: the call, what the store says, and the reason, status and sentence
    expected (a fragment of it; None: the row's sentence has no facts to check)."""

    case: str
    call: Call
    reason: Reason
    says: str | None = None
    store: dict[str, Any] = field(default_factory=dict)


REFUSED = [
    Refused("a heartbeat without a token", Call("POST", HEARTBEAT, token=None, body=BEAT), Reason.NO_CREDENTIAL),
    Refused("a status report without a token", Call("POST", STATUS, token=None, body=BEAT), Reason.NO_CREDENTIAL),
    Refused("a poll without a token", Call("GET", ASSIGNMENTS, token=None, query="node=n1&epoch=1"),
            Reason.NO_CREDENTIAL),
    Refused("a heartbeat with the join token", Call("POST", HEARTBEAT, token="join-token", body=BEAT),
            Reason.JOIN_TOKEN),
    Refused("a status report with the join token, its body unread", Call("POST", STATUS, token="join-token",
            body=b"not even JSON"), Reason.JOIN_TOKEN),
    Refused("a poll with a made-up token", Call("GET", ASSIGNMENTS, token="forged", query="node=n1&epoch=1"),
            Reason.NOT_A_CREDENTIAL),
    Refused("a heartbeat with a made-up token and a broken body: the credential first",
            Call("POST", HEARTBEAT, token="forged", body=b"{"), Reason.NOT_A_CREDENTIAL),
    Refused("a heartbeat that is not UTF-8", Call("POST", HEARTBEAT, body=b'{"node": "\xff"}'),
            Reason.UNPARSABLE_BODY),
    Refused("a heartbeat by GET", Call("GET", HEARTBEAT), Reason.METHOD_NOT_ALLOWED),
    Refused("a status report by PUT", Call("PUT", STATUS, body=BEAT), Reason.METHOD_NOT_ALLOWED),
    Refused("a poll by POST", Call("POST", ASSIGNMENTS, query="node=n1&epoch=1"), Reason.METHOD_NOT_ALLOWED),
    Refused("a heartbeat for another node", Call("POST", HEARTBEAT, body={"node": "n2", "epoch": 1}),
            Reason.ANOTHER_NODE, "this credential is node n1's; it cannot speak for node n2"),
    Refused("a status report for another node", Call("POST", STATUS, body={"node": "n2", "epoch": 1}),
            Reason.ANOTHER_NODE, "cannot speak for node n2"),
    Refused("a poll for another node", Call("GET", ASSIGNMENTS, query="node=n2&epoch=1"), Reason.ANOTHER_NODE,
            "cannot speak for node n2"),
    Refused("a heartbeat of a node not registered", Call("POST", HEARTBEAT, body=BEAT), Reason.UNKNOWN_NODE,
            "no node named 'n1' is registered; register first",
            {"verdicts": {("n1", 1): Judgement(Verdict.UNKNOWN_NODE, "n1")}}),
    Refused("a status report with GPU samples of a node not registered",
            Call("POST", STATUS, token="cred-n9", body={"node": "n9", "epoch": 1, "gpuMetrics": [SAMPLE]}),
            Reason.UNKNOWN_NODE, "no node named 'n9'", {"credentials": {"cred-n9": "n9"}}),
    Refused("a heartbeat of an older registration", Call("POST", HEARTBEAT, body=BEAT), Reason.STALE_EPOCH,
            "node n1 registered again since this registration",
            {"verdicts": {("n1", 1): Judgement(Verdict.STALE_EPOCH, "n1", NodeState.READY)}}),
    Refused("a poll of an older registration", Call("GET", ASSIGNMENTS, query="node=n1&epoch=1"),
            Reason.STALE_EPOCH, "register again",
            {"verdicts": {("n1", 1): Judgement(Verdict.STALE_EPOCH, "n1", NodeState.READY)}}),
    Refused("a status report of a node judged Lost", Call("POST", STATUS, body=BEAT), Reason.NOT_READY,
            "node n1 was marked Lost while silent; register again",
            {"verdicts": {("n1", 1): Judgement(Verdict.NOT_READY, "n1", NodeState.LOST)}}),
    Refused("a heartbeat whose Content-Length is over 4 KiB", Call("POST", HEARTBEAT, body=b"x" * 5000),
            Reason.BODY_TOO_LARGE, "the body of POST /api/v1/agent/heartbeat is over its limit of 4 KiB (4096 bytes)"),
    Refused("a chunked status report that grows over 4 MiB",
            Call("POST", STATUS, body=(b"x" * (3 * MiB), b"y" * (2 * MiB))), Reason.BODY_TOO_LARGE,
            "over its limit of 4 MiB"),
    Refused("a heartbeat without an epoch", Call("POST", HEARTBEAT, body={"node": "n1"}), Reason.INVALID_REQUEST),
    Refused("a poll with its wait over 30 s", Call("GET", ASSIGNMENTS, query="node=n1&epoch=1&wait=31"),
            Reason.INVALID_REQUEST),
    Refused("a status report with samples of devices the node lacks",
            Call("POST", STATUS, body={"node": "n1", "epoch": 1, "gpuMetrics": [SAMPLE]}),
            Reason.INVALID_DOCUMENT, "1 problem(s) in the input"),
    Refused("a heartbeat while the store is down", Call("POST", HEARTBEAT, body=BEAT), Reason.STORE_UNAVAILABLE,
            "the database is gone", {"down": True}),
    Refused("a poll while the store is down", Call("GET", ASSIGNMENTS, query="node=n1&epoch=1"),
            Reason.STORE_UNAVAILABLE, "the database is gone", {"down": True}),
]  # fmt: skip


@pytest.mark.parametrize("refused", REFUSED, ids=[r.case for r in REFUSED])
def test_each_refusal_is_answered_from_its_row_of_the_table_and_writes_nothing(refused: Refused) -> None:
    store = FakeStore(**refused.store)
    sent = run(store, refused.call)
    row = PROBLEMS[refused.reason]
    assert sent is not None
    assert (sent.status, sent.body["error"]["type"]) == (row.status, row.kind)
    assert sent.headers[b"content-type"] == b"application/json"
    assert (sent.headers.get(b"www-authenticate") == b"Bearer") is (row.status == 401)
    if refused.says is not None:
        assert refused.says in sent.body["error"]["message"]
    assert (store.written, store.reported) == ([], [])


def test_every_row_of_the_table_is_exercised() -> None:
    assert {r.reason for r in REFUSED} == set(Reason)


def test_a_422_names_each_field_and_its_reason() -> None:
    sent = run(FakeStore(), Call("GET", ASSIGNMENTS, query="node=N1&epoch=0&since=XYZ&wait=99"))
    assert sent is not None
    assert [p["field"] for p in sent.body["error"]["problems"]] == ["node", "epoch", "since", "wait"]


def test_an_accepted_heartbeat_is_written_and_answered_without_its_epoch() -> None:
    store = FakeStore()
    sent = run(store, Call("POST", HEARTBEAT, body=BEAT))
    assert sent is not None and (sent.status, sent.body) == (200, {"node": "n1", "ok": True})
    assert store.written == [Claim("cred-n1", "n1", 1)]


def test_an_accepted_status_report_is_recorded_with_its_credential_and_answers_what_to_stop() -> None:
    store = FakeStore()
    report = {"node": "n1", "epoch": 1, "replicas": {"r-0": {"state": "Running", "port": 8001}}}
    sent = run(store, Call("POST", STATUS, body=report))
    assert sent is not None and (sent.status, sent.body) == (200, {"stop": ["strayed-0"]})
    (recorded,) = store.reported
    assert (recorded.node, recorded.epoch, recorded.credential) == ("n1", 1, "cred-n1")
    assert recorded.replicas["r-0"][1].port == 8001


def test_a_first_poll_is_answered_at_once_with_the_set_and_a_re_issued_one_is_held_until_its_wait_ends() -> (
    None
):
    store = FakeStore()

    async def scenario() -> tuple[Sent | None, Sent | None, float, int]:
        watch = AssignmentWatch(store, tick=0.05)
        door = AgentDoor(store, watch)
        try:
            first = await call(door, Call("GET", ASSIGNMENTS, query="node=n1&epoch=1"))
            assert first is not None
            began = asyncio.get_running_loop().time()
            since = first.body["revision"]
            again = await call(
                door, Call("GET", ASSIGNMENTS, query=f"node=n1&epoch=1&since={since}&wait=0.3")
            )
            return first, again, asyncio.get_running_loop().time() - began, door.held
        finally:
            await watch.aclose()

    first, again, took, held = asyncio.run(scenario())
    assert first is not None and first.status == 200 and first.body["assignments"] == []
    assert first.body["epoch"] == 1
    assert again is not None and again.body == first.body
    assert 0.3 <= took < 2 and held == 1


def test_a_held_poll_whose_agent_goes_away_is_not_answered() -> None:
    store = FakeStore()

    async def scenario() -> Sent | None:
        watch = AssignmentWatch(store, tick=0.05)
        door = AgentDoor(store, watch)
        try:
            first = await call(door, Call("GET", ASSIGNMENTS, query="node=n1&epoch=1"))
            assert first is not None
            gone = asyncio.Event()
            query = f"node=n1&epoch=1&since={first.body['revision']}&wait=20"
            held = asyncio.create_task(call(door, Call("GET", ASSIGNMENTS, query=query), gone))
            await asyncio.sleep(0.2)
            gone.set()
            return await asyncio.wait_for(held, 5)
        finally:
            await watch.aclose()

    assert asyncio.run(scenario()) is None


@dataclass
class SlowStore(FakeStore):
    """A FakeStore whose first batch of each kind takes ``hold`` seconds (a busy database), and
    that keeps the time every batch was written with."""

    hold: float = 0.5
    stamped: list[tuple[str, datetime]] = field(default_factory=list)

    def _slow(self, kind: str, now: datetime) -> None:
        if not any(k == kind for k, _ in self.stamped):
            time.sleep(self.hold)
        self.stamped.append((kind, now))

    def judge_beats(self, beats: Sequence[Claim], now: datetime) -> list[Judgement]:
        self._slow("heartbeat", now)
        return super().judge_beats(beats, now)

    def judge_reports(self, batch: Sequence[AgentReport], now: datetime) -> list[list[str] | Judgement]:
        self._slow("report", now)
        return super().judge_reports(batch, now)


@pytest.mark.parametrize(("path", "kind"), [(HEARTBEAT, "heartbeat"), (STATUS, "report")])
def test_a_call_queued_behind_a_slow_batch_is_stamped_when_it_arrived(path: str, kind: str) -> None:
    """A heartbeat is judged by when it arrived, not when its write ran: the second call waits
    out the first one's slow batch, but is written with its own arrival."""
    store = SlowStore(credentials={"cred-n1": "n1", "cred-n2": "n2"})
    store.nodes["n2"] = cpu_8c_32g("n2")

    async def go() -> datetime:
        watch = AssignmentWatch(store, tick=0.05)
        door = AgentDoor(store, watch)
        try:
            first = asyncio.create_task(call(door, Call("POST", path, body=BEAT)))
            await asyncio.sleep(0.3)  # the first batch is in the database now (after its tick)
            arrived = datetime.now(UTC)
            second = await call(door, Call("POST", path, token="cred-n2", body={"node": "n2", "epoch": 1}))
            assert second is not None and second.status == 200, second
            await first
            return arrived
        finally:
            await watch.aclose()

    arrived = asyncio.run(go())
    ((_, written),) = [s for s in store.stamped[1:] if s[0] == kind]
    # Written at least 0.4 s after it arrived, stamped with its arrival.
    assert abs((written - arrived).total_seconds()) < 0.05, (written, arrived)
