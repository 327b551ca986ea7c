"""A credential's node kept a bounded time by the agents' door (``server/agents/credcache.py``):
the cache itself, and an attacker who keeps calling with a credential that was replaced — every
call the rows judge is refused from the first one on, and the checks made before a call is judged
(whether a report's body is read) refuse it within the cache's bound."""

from __future__ import annotations

import asyncio
import json
import time
from datetime import UTC, datetime
from typing import Any

import pytest

from builders import cpu_8c_32g
from fleetserve.server.agents.assignwatch import AssignmentWatch
from fleetserve.server.agents.credcache import CredentialCache
from fleetserve.server.agents.door import HEARTBEAT, STATUS, AgentDoor
from fleetserve.store import SqlStore
from fleetserve.store.identity import Enrolled


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_found_credential_is_kept_for_its_ttl_and_no_longer() -> None:
    clock = Clock()
    cache = CredentialCache(ttl=5.0, clock=clock)
    assert cache.node("fs_node_a") is None
    cache.found("fs_node_a", "n1")
    clock.now += 4.9
    assert cache.node("fs_node_a") == "n1"
    clock.now += 0.1
    assert cache.node("fs_node_a") is None and len(cache) == 0  # dropped at the bound
    cache.found("fs_node_a", "n1")
    cache.forget("fs_node_a")
    assert cache.node("fs_node_a") is None


def test_the_cache_keeps_at_most_its_limit_the_oldest_dropped_first_and_nothing_at_ttl_0() -> None:
    cache = CredentialCache(ttl=5.0, limit=2, clock=Clock())
    for token, node in (("a", "n1"), ("b", "n2"), ("c", "n3")):
        cache.found(token, node)
    assert [cache.node(t) for t in ("a", "b", "c")] == [None, "n2", "n3"]
    off = CredentialCache(ttl=0.0)
    off.found("a", "n1")
    assert off.node("a") is None and len(off) == 0
    with pytest.raises(ValueError):
        CredentialCache(ttl=-1.0)


def enrol(store: SqlStore, name: str) -> str:
    outcome = store.enrol(cpu_8c_32g(name), datetime.now(UTC), approve_new=True, source="10.0.0.5")
    assert isinstance(outcome, Enrolled)
    return outcome.credential


def report_call(
    door: AgentDoor, token: str, body: dict[str, Any], declared: int | None = None
) -> tuple[int, bool]:
    """A status report to ``door``: its answer's status, and whether its body was read."""
    raw = json.dumps(body).encode()
    read: list[bool] = []
    sent: list[Any] = []

    async def receive() -> dict[str, Any]:
        read.append(True)
        return {"type": "http.request", "body": raw, "more_body": False}

    async def send(message: Any) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "method": "POST",
        "path": STATUS,
        "headers": [
            (b"authorization", f"Bearer {token}".encode()),
            (b"content-type", b"application/json"),
            (b"content-length", str(declared if declared is not None else len(raw)).encode()),
        ],
    }
    asyncio.run(door.status(scope, receive, send))
    return sent[0]["status"], bool(read)


HUGE = 5 * 1024 * 1024  # declared over a report's 4 MiB: 413 once the credential's check is passed
REPORT = {"node": "n1", "epoch": 1, "replicas": {}}


def replace_credential(store: SqlStore) -> float:
    """The operator lets one re-enrolment of n1 through and it happens: n1's old credential dies."""
    store.approve("n1", datetime.now(UTC))
    enrol(store, "n1")
    return time.monotonic()


def test_a_thief_with_a_replaced_credential_is_refused_at_its_next_judged_call(store: SqlStore) -> None:
    door = AgentDoor(store, AssignmentWatch(store), credential_ttl=60.0)
    stolen = enrol(store, "n1")
    assert report_call(door, stolen, REPORT) == (200, True)
    assert report_call(door, stolen, REPORT, declared=HUGE)[0] == 413  # n1 is kept for the credential
    replace_credential(store)
    # The rows judge the report: refused at once, whatever is kept (and the kept node forgotten).
    assert report_call(door, stolen, {**REPORT, "epoch": 2}) == (401, True)
    assert report_call(door, stolen, REPORT, declared=HUGE) == (401, False)
    assert report_call(door, stolen, {**REPORT, "epoch": 2}) == (401, False)  # unknown: never kept


def test_a_kept_credential_stops_letting_bodies_through_within_the_bound(store: SqlStore) -> None:
    ttl = 2.0
    door = AgentDoor(store, AssignmentWatch(store), credential_ttl=ttl)
    stolen = enrol(store, "n1")
    assert report_call(door, stolen, REPORT) == (200, True)
    replaced = replace_credential(store)
    # Calls that are never judged (each declares a body over the limit) pass the kept check...
    answers = []
    while True:
        status, read = report_call(door, stolen, REPORT, declared=HUGE)
        waited = time.monotonic() - replaced
        answers.append(status)
        assert not read
        if status == 401:
            break
        assert status == 413 and waited < ttl + 1.0, answers
        time.sleep(0.05)
    # ... until the bound: the first ones passed it, then refused within ttl of the replacement.
    assert answers[0] == 413 and set(answers[:-1]) == {413}
    assert waited < ttl + 1.0


def beat_call(door: AgentDoor, token: str) -> int:
    sent: list[Any] = []
    raw = json.dumps({"node": "n1", "epoch": 1}).encode()

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": raw, "more_body": False}

    async def send(message: Any) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "method": "POST",
        "path": HEARTBEAT,
        "headers": [(b"authorization", f"Bearer {token}".encode()), (b"content-type", b"application/json")],
    }
    asyncio.run(door.heartbeat(scope, receive, send))
    return int(sent[0]["status"])


def test_an_accepted_heartbeat_spares_the_next_report_its_lookup(store: SqlStore) -> None:
    door = AgentDoor(store, AssignmentWatch(store), credential_ttl=60.0)
    token = enrol(store, "n1")
    assert beat_call(door, token) == 200
    assert report_call(door, token, REPORT) == (200, True)
    assert door.credentials.calls == 0  # no credential lookup: the heartbeat's acceptance was enough
    # A refused heartbeat keeps nothing.
    other = AgentDoor(store, AssignmentWatch(store), credential_ttl=60.0)
    assert beat_call(other, "fs_node_forged") == 401 and len(other.known) == 0
