"""The agents' door (``server/agents/door.py``) in the real app, against the answers of the FastAPI
routes it replaced.

For every request of a corpus — accepted, forged, malformed, stale, over its limit, by another
method — the door's answer (status, body, Content-Type, challenge) is the one the routes gave,
recorded from them before they were deleted (``route_answers.json``, at commit dad19d3), but for
the one change of behaviour named in ``CHANGED``, and the dead node's state: it is Lost here (a
NotReady node's calls are accepted since, and make it Ready: ``store/acceptance.py``), so the
recorded sentences' "marked NotReady" reads "marked Lost". Real apps over one real store, on SQLite and on
PostgreSQL; and two servers on one PostgreSQL, where a credential retired on one is refused by the
other at its next request.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import Engine

from builders import cpu_8c_32g
from fleetserve.protocol import AssignmentSet
from fleetserve.server.agents.assignwatch import AssignmentWatch
from fleetserve.server.agents.door import AgentDoor
from fleetserve.server.agents.enrolment import EnrolmentPolicy
from fleetserve.server.app import create_app
from fleetserve.spec.resources import NodeState
from fleetserve.store import SqlStore, TokenKind, make_engine

AGENT = "/api/v1/agent"
MiB = 1024 * 1024
SOURCE = ("10.0.0.5", 40000)


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@dataclass
class Pair:
    """One store, the app in a client, its agents' door, and the tokens."""

    store: SqlStore
    hot: TestClient
    door: AgentDoor
    admin: dict[str, str]
    join: dict[str, str]
    nodes: dict[str, dict[str, str]]


def serve(store: SqlStore) -> FastAPI:
    return create_app(store, enrolment=EnrolmentPolicy(approve_new=True))


# What the FastAPI routes answered, per case, recorded before they were deleted.
RECORDED: dict[str, dict[str, Any]] = json.loads((Path(__file__).parent / "route_answers.json").read_text())
# The one change of behaviour: a poll is judged by the same rule as heartbeats and status reports
# (``store/acceptance.py``), so a node judged Lost is told to register again there too (the
# route answered its set).
CHANGED: dict[str, dict[str, Any]] = {
    "a poll of a node judged dead": {
        "status": 409,
        "headers": {"content-type": "application/json"},
        "body": {
            "error": {
                "type": "stale_epoch",
                "message": "node dead was marked Lost while silent; register again",
                "problems": [],
            }
        },
    }
}


def enrol(client: TestClient, join: dict[str, str], name: str) -> dict[str, str]:
    doc = cpu_8c_32g(name).model_dump(mode="json", by_alias=True)
    response = client.post(f"{AGENT}/register", json=doc, headers=join)
    assert response.status_code == 200, response.text
    return bearer(response.json()["credential"])


@pytest.fixture
def pair(store: SqlStore) -> Iterator[Pair]:
    now = datetime.now(UTC)
    admin = bearer(store.create_token(TokenKind.ADMIN, now).plaintext)
    join = bearer(store.create_token(TokenKind.JOIN, now).plaintext)
    app = serve(store)
    with TestClient(app, raise_server_exceptions=False, client=SOURCE) as hot:
        nodes = {name: enrol(hot, join, name) for name in ("n1", "n2", "dead")}
        store.set_state("dead", NodeState.LOST)
        yield Pair(store, hot, app.state.agent_door, admin, join, nodes)


# (what it is, method, route, whose token, body (JSON unless bytes), extra headers, status expected)
Case = tuple[str, str, str, str, Any, dict[str, str], int]
CASES: list[Case] = [
    ("a heartbeat", "POST", "/heartbeat", "n1", {"node": "n1", "epoch": 1}, {}, 200),
    ("a heartbeat for another node", "POST", "/heartbeat", "n1", {"node": "n2", "epoch": 1}, {}, 403),
    ("a heartbeat of an older epoch", "POST", "/heartbeat", "n1", {"node": "n1", "epoch": 7}, {}, 409),
    ("a heartbeat of a node judged dead", "POST", "/heartbeat", "dead", {"node": "dead", "epoch": 1}, {}, 409),
    ("a heartbeat without an epoch", "POST", "/heartbeat", "n1", {"node": "n1"}, {}, 422),
    ("a heartbeat with an unknown field", "POST", "/heartbeat", "n1", {"node": "n1", "epoch": 1, "x": 1}, {}, 422),
    ("a heartbeat with epoch true (lax: 1)", "POST", "/heartbeat", "n1", {"node": "n1", "epoch": True}, {}, 200),
    ("a heartbeat with a bad name", "POST", "/heartbeat", "n1", {"node": "N1!", "epoch": 1}, {}, 422),
    ("a heartbeat that is not JSON", "POST", "/heartbeat", "n1", b"{node: n1", {}, 422),
    ("a heartbeat that is a JSON list", "POST", "/heartbeat", "n1", b"[1]", {}, 422),
    ("a heartbeat as text/plain", "POST", "/heartbeat", "n1", b'{"node":"n1","epoch":1}',
     {"content-type": "text/plain"}, 422),
    ("a heartbeat over 4 KiB", "POST", "/heartbeat", "n1", {"node": "n1", "epoch": 1, "pad": "x" * 5000}, {}, 413),
    ("a heartbeat with the join token", "POST", "/heartbeat", "join", {"node": "n1", "epoch": 1}, {}, 401),
    ("a heartbeat with the admin token", "POST", "/heartbeat", "admin", {"node": "n1", "epoch": 1}, {}, 401),
    ("a heartbeat with a made-up token", "POST", "/heartbeat", "forged", {"node": "n1", "epoch": 1}, {}, 401),
    ("a heartbeat without a token", "POST", "/heartbeat", "none", {"node": "n1", "epoch": 1}, {}, 401),
    ("a heartbeat with Basic auth", "POST", "/heartbeat", "basic", {"node": "n1", "epoch": 1}, {}, 401),
    ("a heartbeat by GET", "GET", "/heartbeat", "n1", None, {}, 405),
    ("a status report", "POST", "/status", "n1",
     {"node": "n1", "epoch": 1, "replicas": {"r-0": {"state": "Running"}}, "modelCache": ["m"]}, {}, 200),
    ("a status report for another node", "POST", "/status", "n1", {"node": "n2", "epoch": 1}, {}, 403),
    ("a status report of an older epoch", "POST", "/status", "n1", {"node": "n1", "epoch": 2}, {}, 409),
    ("a status report of a node judged dead", "POST", "/status", "dead", {"node": "dead", "epoch": 1}, {}, 409),
    ("a status report with another node's GPU samples", "POST", "/status", "n1",
     {"node": "n1", "epoch": 1, "gpuMetrics": [
         {"name": "fleetserve_gpu_utilization_ratio", "value": 1,
          "labels": {"node": "n2", "device": "0", "driver": "nvidia", "class": "h100"}}]}, {}, 422),
    ("a status report with a bad state", "POST", "/status", "n1",
     {"node": "n1", "epoch": 1, "replicas": {"r-0": {"state": "Bogus"}}}, {}, 422),
    ("a status report with the join token", "POST", "/status", "join", {"node": "n1", "epoch": 1}, {}, 401),
    ("a status report with a made-up token", "POST", "/status", "forged", {"node": "n1", "epoch": 1}, {}, 401),
]  # fmt: skip

# More of the same: bodies and queries at the edges, other methods, chunked bodies.
MORE: list[Case] = [
    ('a heartbeat with an empty body', 'POST', '/heartbeat', 'n1', b'', {}, 422),
    ('a heartbeat without a Content-Type', 'POST', '/heartbeat', 'n1', b'{"node":"n1","epoch":1}', {'content-type': None}, 422),
    ('a heartbeat as JSON with a charset', 'POST', '/heartbeat', 'n1', b'{"node":"n1","epoch":1}', {'content-type': 'application/json; charset=utf-8'}, 200),
    ('a heartbeat as a +json type', 'POST', '/heartbeat', 'n1', b'{"node":"n1","epoch":1}', {'content-type': 'application/vnd.x+json'}, 200),
    ('a heartbeat with the epoch as a string (lax: 1)', 'POST', '/heartbeat', 'n1', {'node': 'n1', 'epoch': '1'}, {}, 200),
    ('a heartbeat with a fractional epoch', 'POST', '/heartbeat', 'n1', {'node': 'n1', 'epoch': 1.5}, {}, 422),
    ('a heartbeat with epoch 0', 'POST', '/heartbeat', 'n1', {'node': 'n1', 'epoch': 0}, {}, 422),
    ('a heartbeat with a null node', 'POST', '/heartbeat', 'n1', {'node': None, 'epoch': 1}, {}, 422),
    ('a heartbeat that is not UTF-8', 'POST', '/heartbeat', 'n1', b'{"node":"\xff","epoch":1}', {}, 400),
    ('a heartbeat cut short', 'POST', '/heartbeat', 'n1', b'{"node":"n1",', {}, 422),
    ('a heartbeat that is a JSON string', 'POST', '/heartbeat', 'n1', b'"x"', {}, 422),
    ('a heartbeat that is JSON null', 'POST', '/heartbeat', 'n1', b'null', {}, 422),
    ('a chunked heartbeat that grows over 4 KiB', 'POST', '/heartbeat', 'n1', (b'x' * 3000, b'y' * 3000), {}, 413),
    ('a chunked heartbeat', 'POST', '/heartbeat', 'n1', (b'{"node":"n1",', b'"epoch":1}'), {}, 200),
    ('a heartbeat over 4 KiB without a token', 'POST', '/heartbeat', 'none', b'x' * 5000, {}, 401),
    ('a heartbeat that is not JSON, without a token', 'POST', '/heartbeat', 'none', b'{', {}, 401),
    ('a heartbeat by GET without a token', 'GET', '/heartbeat', 'none', None, {}, 401),
    ('a heartbeat by PUT', 'PUT', '/heartbeat', 'n1', {'node': 'n1', 'epoch': 1}, {}, 405),
    ('a heartbeat for a dead node with the join token', 'POST', '/heartbeat', 'join', {'node': 'dead', 'epoch': 1}, {}, 401),
    ('a heartbeat with an empty bearer token', 'POST', '/heartbeat', 'empty', {'node': 'n1', 'epoch': 1}, {}, 401),
    ('a status report by GET', 'GET', '/status', 'n1', None, {}, 405),
    ('a status report that is not JSON', 'POST', '/status', 'n1', b'{', {}, 422),
    ('a status report that is a JSON list', 'POST', '/status', 'n1', b'[]', {}, 422),
    ('a status report without an epoch', 'POST', '/status', 'n1', {'node': 'n1'}, {}, 422),
    ('a status report over 4 MiB', 'POST', '/status', 'n1', b'x' * (4 * MiB + 1), {}, 413),
    ('a status report without a token', 'POST', '/status', 'none', {'node': 'n1', 'epoch': 1}, {}, 401),
    ('a status report with the admin token', 'POST', '/status', 'admin', {'node': 'n1', 'epoch': 1}, {}, 401),
    ('a status report as text/plain', 'POST', '/status', 'n1', b'{"node":"n1","epoch":1}', {'content-type': 'text/plain'}, 422),
    ('a status report of a node judged dead, its own', 'POST', '/status', 'dead', {'node': 'dead', 'epoch': 1}, {}, 409),
    ('a status report with an empty body', 'POST', '/status', 'n1', b'', {}, 422),
    ('a poll without a token', 'GET', '/assignments?node=n1&epoch=1', 'none', None, {}, 401),
    ('a poll with the join token', 'GET', '/assignments?node=n1&epoch=1', 'join', None, {}, 401),
    ('a poll with a made-up token', 'GET', '/assignments?node=n1&epoch=1', 'forged', None, {}, 401),
    ('a poll by POST', 'POST', '/assignments?node=n1&epoch=1', 'n1', None, {}, 405),
    ('a poll without a query', 'GET', '/assignments', 'n1', None, {}, 422),
    ('a poll without an epoch', 'GET', '/assignments?node=n1', 'n1', None, {}, 422),
    ('a poll with an epoch that is no number', 'GET', '/assignments?node=n1&epoch=abc', 'n1', None, {}, 422),
    ('a poll with a wait that is no number', 'GET', '/assignments?node=n1&epoch=1&wait=abc', 'n1', None, {}, 422),
    ('a poll with a negative wait', 'GET', '/assignments?node=n1&epoch=1&wait=-1', 'n1', None, {}, 422),
    ('a poll with a wait of nan', 'GET', '/assignments?node=n1&epoch=1&wait=nan', 'n1', None, {}, 422),
    ('a poll with a wait of inf', 'GET', '/assignments?node=n1&epoch=1&wait=inf', 'n1', None, {}, 422),
    ('a poll with an epoch over 2**31-1', 'GET', '/assignments?node=n1&epoch=99999999999', 'n1', None, {}, 422),
    ('a poll with a revision over 64 characters', 'GET', '/assignments?node=n1&epoch=1&since=' + 'a' * 65, 'n1', None, {}, 422),
    ('a poll with every parameter wrong', 'GET', '/assignments?node=N!&epoch=0&since=Z&wait=99', 'n1', None, {}, 422),
    ('a poll for another node', 'GET', '/assignments?node=n2&epoch=1', 'n1', None, {}, 403),
    ('a poll of an older epoch', 'GET', '/assignments?node=n1&epoch=3', 'n1', None, {}, 409),
    ('a poll', 'GET', '/assignments?node=n1&epoch=1', 'n1', None, {}, 200),
    ('a poll of a node judged dead', 'GET', '/assignments?node=dead&epoch=1', 'dead', None, {}, 409),
    ('a poll with an empty node', 'GET', '/assignments?node=&epoch=1', 'n1', None, {}, 422),
    ('a poll with a broken percent escape', 'GET', '/assignments?node=n%ZZ1&epoch=1', 'n1', None, {}, 422),
    ('a poll with a wait in exponent notation', 'GET', '/assignments?node=n1&epoch=1&wait=1e-1', 'n1', None, {}, 200),
]  # fmt: skip


def headers_for(pair: Pair, whose: str) -> dict[str, str]:
    if whose in pair.nodes:
        return pair.nodes[whose]
    return {
        "join": pair.join,
        "admin": pair.admin,
        "forged": bearer("fs_node_" + "A" * 43),
        "none": {},
        "basic": {"Authorization": "Basic bjE6bjE="},
        "empty": {"Authorization": "Bearer "},
    }[whose]


def send(client: TestClient, pair: Pair, case: Case) -> Any:
    _, method, route, whose, body, extra, _ = case
    headers = {**headers_for(pair, whose), **{k: v for k, v in extra.items() if v is not None}}
    if isinstance(body, bytes | tuple):
        if "content-type" not in extra:
            headers["content-type"] = "application/json"
        content = iter(body) if isinstance(body, tuple) else body  # a tuple: sent chunked
        return client.request(method, AGENT + route, content=content, headers=headers)
    if body is None:
        return client.request(method, AGENT + route, headers=headers)
    return client.request(method, AGENT + route, json=body, headers=headers)


def recorded(case: Case) -> dict[str, Any]:
    answer = CHANGED.get(case[0], RECORDED[case[0]])
    # The dead node is Lost (a NotReady one is accepted now): the recorded sentence names its state.
    return json.loads(json.dumps(answer).replace("marked NotReady while silent", "marked Lost while silent"))


@pytest.mark.parametrize("case", CASES + MORE, ids=[c[0] for c in CASES + MORE])
def test_every_answer_is_the_one_the_routes_gave(pair: Pair, case: Case) -> None:
    got = send(pair.hot, pair, case)
    assert got.status_code == case[-1], got.text
    headers = {k: got.headers[k] for k in ("content-type", "www-authenticate", "allow") if k in got.headers}
    assert {"status": got.status_code, "headers": headers, "body": got.json()} == recorded(case)


def test_the_recorded_answers_are_the_cases_and_one_changed_as_named() -> None:
    assert set(RECORDED) == {c[0] for c in CASES + MORE}
    assert set(CHANGED) <= set(RECORDED)
    for name, now in CHANGED.items():
        assert RECORDED[name]["status"] == 200 and now["status"] == 409


def test_a_refused_heartbeat_writes_nothing_and_an_accepted_one_moves_the_last_heartbeat(pair: Pair) -> None:
    def last(node: str) -> datetime | None:
        return {h.name: h.last_heartbeat for h in pair.store.node_heartbeats()}[node]

    n2, dead = last("n2"), last("dead")
    for case in CASES:
        if case[2] == "/heartbeat" and case[-1] != 200:
            send(pair.hot, pair, case)
    assert (last("n2"), last("dead")) == (n2, dead)
    assert pair.store.get_node("dead").state is NodeState.LOST
    n1 = last("n1")
    assert send(pair.hot, pair, CASES[0]).status_code == 200
    after = last("n1")
    assert after is not None and (n1 is None or after > n1)


def test_a_status_report_keeps_draining_replicas_draining_and_writes_only_what_changed(pair: Pair) -> None:
    # A replica of n1's, placed by the reconciler.
    docs = [
        {"kind": "Model", "name": "tiny", "source": "/models/tiny.gguf", "format": "gguf", "size": "1MB"},
        {
            "kind": "Deployment", "name": "tiny", "model": "tiny", "replicas": 1,
            "profiles": [{"name": "cpu", "engine": "llama.cpp", "cpu": {"cores": 1}}],
        },
    ]  # fmt: skip
    assert pair.hot.post("/api/v1/apply", json={"documents": docs}, headers=pair.admin).status_code == 200
    pair.store.delete_node("n2")
    from fleetserve.server.reconciler.loop import Reconciler

    Reconciler(pair.store).run_once()
    (replica,) = pair.store.replicas()
    assert replica.shards[0].node == "n1"
    report = {"node": "n1", "epoch": 1, "replicas": {replica.name: {"state": "Running", "port": 8001}}}
    response = pair.hot.post(f"{AGENT}/status", json=report, headers=pair.nodes["n1"])
    assert response.json() == {"stop": []}
    assert pair.store.get_replica(replica.name).state.value == "Running"
    assert pair.store.replica_status(replica.name).port == 8001
    pair.store.start_draining([replica.name], datetime.now(UTC))
    report["replicas"] = {replica.name: {"state": "Running", "port": 8002}}
    assert pair.hot.post(f"{AGENT}/status", json=report, headers=pair.nodes["n1"]).status_code == 200
    assert pair.store.get_replica(replica.name).state.value == "Draining"  # the control plane's word
    assert pair.store.replica_status(replica.name).port == 8002


def test_a_long_poll_answers_the_assignment_set_as_fastapi_would_serialise_it(pair: Pair) -> None:
    docs = [
        {"kind": "Model", "name": "tiny", "source": "/models/tiny.gguf", "format": "gguf", "size": "1MB"},
        {
            "kind": "Deployment", "name": "tiny", "model": "tiny", "replicas": 2,
            "profiles": [{"name": "cpu", "engine": "llama.cpp", "cpu": {"cores": 1}}],
        },
    ]  # fmt: skip
    assert pair.hot.post("/api/v1/apply", json={"documents": docs}, headers=pair.admin).status_code == 200
    pair.store.delete_node("n2")
    from fleetserve.server.reconciler.loop import Reconciler

    Reconciler(pair.store).run_once()
    response = pair.hot.get(f"{AGENT}/assignments?node=n1&epoch=1", headers=pair.nodes["n1"])
    assert response.status_code == 200 and response.headers["content-type"] == "application/json"
    got = response.json()
    assert len(got["assignments"]) == 2 and got["assignments"][0]["engine_key"]
    # What FastAPI's response model would have sent: the same document, every field by its alias.
    assert got == AssignmentSet.model_validate(got).model_dump(mode="json", by_alias=True)
    # The first re-issued poll is held (the watch starts ticking) and keeps the set it builds with
    # the fingerprint it took; the next, nothing having moved, is answered from that set, unbuilt.
    again = f"{AGENT}/assignments?node=n1&epoch=1&since={got['revision']}"
    assert pair.hot.get(again + "&wait=1", headers=pair.nodes["n1"]).json() == got
    assert pair.hot.get(again + "&wait=0", headers=pair.nodes["n1"]).json() == got
    built = pair.door.built
    held = pair.hot.get(again + "&wait=0", headers=pair.nodes["n1"])
    assert held.json() == got
    assert pair.door.built == built
    assert (response.content, response.headers["content-type"]) == (
        held.content,
        held.headers["content-type"],
    )


def tiny_docs(replicas: int) -> list[dict[str, Any]]:
    return [
        {"kind": "Model", "name": "tiny", "source": "/models/tiny.gguf", "format": "gguf", "size": "1MB"},
        {
            "kind": "Deployment", "name": "tiny", "model": "tiny", "replicas": replicas,
            "profiles": [{"name": "cpu", "engine": "llama.cpp", "cpu": {"cores": 1}}],
        },
    ]  # fmt: skip


def placed_on_n1(pair: Pair, replicas: int) -> str:
    """Apply a deployment of ``replicas`` on n1 alone and place it; n1's revision after a first poll."""
    docs = tiny_docs(replicas)
    assert pair.hot.post("/api/v1/apply", json={"documents": docs}, headers=pair.admin).status_code == 200
    if "n2" in {n.name for n in pair.store.nodes()}:
        pair.store.delete_node("n2")
    from fleetserve.server.reconciler.loop import Reconciler

    Reconciler(pair.store).run_once()
    first = pair.hot.get(f"{AGENT}/assignments?node=n1&epoch=1", headers=pair.nodes["n1"])
    assert first.status_code == 200
    revision: str = first.json()["revision"]
    return revision


def test_a_re_issued_poll_is_judged_before_it_is_held(pair: Pair) -> None:
    """Re-issued polls with another node's credential, a made-up one, or a query that does not
    validate (a field twice counts its last; an unknown one is ignored; out of range is a 422):
    refused as the route refused them, never held."""
    revision = placed_on_n1(pair, 1)
    base = f"node=n1&epoch=1&since={revision}&wait=0"
    polls = [
        (base, pair.nodes["dead"], 403, "forbidden"),
        (base, bearer("fs_node_" + "A" * 43), 401, "unauthorized"),
        (base, pair.admin, 401, "unauthorized"),
        (base + "&since=00", pair.nodes["n1"], 200, None),  # twice: the last counts
        (base + "&x=1", pair.nodes["n1"], 200, None),
        (f"node=n1&epoch=1&since={revision}&wait=31", pair.nodes["n1"], 422, "invalid_request"),
        (f"node=n1&epoch=0&since={revision}&wait=0", pair.nodes["n1"], 422, "invalid_request"),
        ("node=n1&epoch=1&since=XYZ&wait=0", pair.nodes["n1"], 422, "invalid_request"),
        (f"node=n1&epoch=2&since={revision}&wait=0", pair.nodes["n1"], 409, "stale_epoch"),
        (f"node=N1&epoch=1&since={revision}&wait=0", pair.nodes["n1"], 422, "invalid_request"),
    ]
    for query, headers, status, kind in polls:
        held = pair.door.held
        got = pair.hot.get(f"{AGENT}/assignments?{query}", headers=headers)
        assert got.status_code == status, (query, got.text)
        if kind is not None:
            assert got.json()["error"]["type"] == kind, query
            assert pair.door.held == held, query


def test_a_held_poll_whose_node_moves_is_answered_with_the_new_set(pair: Pair) -> None:
    import threading
    import time

    from fleetserve.server.reconciler.loop import Reconciler

    revision = placed_on_n1(pair, 1)
    again = f"{AGENT}/assignments?node=n1&epoch=1&since={revision}"
    for wait in (1, 0):  # the route holds these; the watch ticks and keeps n1's set
        assert pair.hot.get(f"{again}&wait={wait}", headers=pair.nodes["n1"]).json()["revision"] == revision
    held = pair.door.held

    def scale_up() -> None:
        time.sleep(1.0)
        pair.store.delete_deployment("tiny")  # its replica leaves n1
        Reconciler(pair.store).run_once()

    mover = threading.Thread(target=scale_up)
    began = time.monotonic()
    mover.start()
    moved = pair.hot.get(f"{again}&wait=20", headers=pair.nodes["n1"])
    took = time.monotonic() - began
    mover.join()
    assert moved.status_code == 200 and moved.json()["revision"] != revision
    assert moved.json()["assignments"] == []
    assert took < 15, took  # woken by the move, not by the end of its wait
    # Held, then woken by the move: the set built again, in the same loop.
    assert pair.door.held == held + 1


def test_a_held_poll_answers_its_set_at_once_when_the_server_stops(pair: Pair) -> None:
    """Held with one wait for all of its 20 s: the server stopping (SIGTERM sets
    ``app.state.stopping``) wakes it at the watch's next tick, and it answers the set it holds."""
    import threading
    import time

    revision = placed_on_n1(pair, 1)
    again = f"{AGENT}/assignments?node=n1&epoch=1&since={revision}"
    for wait in (1, 0):  # the route holds these; the watch ticks and keeps n1's set
        pair.hot.get(f"{again}&wait={wait}", headers=pair.nodes["n1"])
    held = pair.door.held
    app = pair.hot.app

    def stop() -> None:
        time.sleep(1.0)
        app.state.stopping = True  # type: ignore[attr-defined]

    stopper = threading.Thread(target=stop)
    began = time.monotonic()
    stopper.start()
    try:
        got = pair.hot.get(f"{again}&wait=20", headers=pair.nodes["n1"])
    finally:
        stopper.join()
        app.state.stopping = False  # type: ignore[attr-defined]
    took = time.monotonic() - began
    assert got.status_code == 200 and got.json()["revision"] == revision
    assert 1.0 <= took < 10, took
    assert pair.door.held == held + 1


def test_a_status_report_with_a_wrong_credential_is_refused_with_its_body_unread(store: SqlStore) -> None:
    door = AgentDoor(store, AssignmentWatch(store))
    read: list[bool] = []
    sent: list[Any] = []

    async def receive() -> dict[str, Any]:
        read.append(True)
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send_(message: Any) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "method": "POST",
        "path": f"{AGENT}/status",
        "headers": [
            (b"authorization", b"Bearer fs_node_not-a-credential"),
            (b"content-type", b"application/json"),
            (b"content-length", b"2"),
        ],
    }
    asyncio.run(door.status(scope, receive, send_))
    assert sent[0]["status"] == 401 and read == []


# --- two servers on one PostgreSQL ----------------------------------------------------------------


@pytest.fixture
def second_engine(postgres_url: str, postgres_schema: str, postgres_store: SqlStore) -> Iterator[Engine]:
    engine = make_engine(postgres_url, connect_args={"options": f"-csearch_path={postgres_schema}"})
    try:
        yield engine
    finally:
        engine.dispose()


def test_a_credential_retired_on_one_server_is_refused_by_the_other_at_its_next_request(
    postgres_store: SqlStore, second_engine: Engine
) -> None:
    now = datetime.now(UTC)
    admin = bearer(postgres_store.create_token(TokenKind.ADMIN, now).plaintext)
    join = bearer(postgres_store.create_token(TokenKind.JOIN, now).plaintext)
    with (
        TestClient(serve(postgres_store), raise_server_exceptions=False, client=SOURCE) as a,
        TestClient(serve(SqlStore(second_engine)), raise_server_exceptions=False, client=SOURCE) as b,
    ):
        old = enrol(a, join, "n1")
        beat = {"node": "n1", "epoch": 1}
        assert b.post(f"{AGENT}/heartbeat", json=beat, headers=old).status_code == 200
        # The operator lets one re-enrolment through on server A; the thief's old credential dies.
        assert a.post("/api/v1/nodes/n1/approve", headers=admin).status_code == 200
        new = enrol(a, join, "n1")
        for client in (b, a):
            refused = client.post(f"{AGENT}/heartbeat", json={"node": "n1", "epoch": 2}, headers=old)
            assert refused.status_code == 401, refused.text
            report = {"node": "n1", "epoch": 2, "replicas": {}}
            assert client.post(f"{AGENT}/status", json=report, headers=old).status_code == 401
        assert b.post(f"{AGENT}/heartbeat", json={"node": "n1", "epoch": 2}, headers=new).status_code == 200
        # Deleting the node on B forgets its credential: A refuses it at once.
        assert b.delete("/api/v1/nodes/n1", headers=admin).status_code == 200
        assert a.post(f"{AGENT}/heartbeat", json={"node": "n1", "epoch": 2}, headers=new).status_code == 401
