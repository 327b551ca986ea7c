"""Held assignment long-polls woken by one shared check (``server/agents/assignwatch.py``): the pure
fingerprints, the watch over a fake store, and a poll held by the real app over SQLite that
answers with a replica allocated while it was held."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime

import pytest
from fastapi.testclient import TestClient

from builders import cpu_8c_32g, safetensors_8gb
from builders import deployment as build_deployment
from fleetserve.protocol import AssignmentSet
from fleetserve.server.agents.assignwatch import AssignmentWatch, fingerprints
from fleetserve.server.agents.enrolment import EnrolmentPolicy
from fleetserve.server.app import create_app
from fleetserve.spec.resources import Replica, Shard
from fleetserve.store import SqlStore, TokenKind
from fleetserve.store.reports import AssignmentInputs

AGENT = "/api/v1/agent"


def inputs(
    shards: tuple[tuple[str, str, str], ...] = (("d-0", "n1", "d"), ("d-1", "n2", "d"), ("e-0", "n2", "e")),
    epochs: dict[str, int] | None = None,
    deployments: dict[str, str] | None = None,
    shared: str = "models+classes",
) -> AssignmentInputs:
    return AssignmentInputs(
        shards=shards,
        epochs=epochs or {"n1": 1, "n2": 1, "n3": 1},
        deployments=deployments or {"d": '{"replicas":2}', "e": '{"replicas":1}'},
        shared=shared,
    )


def moved(before: AssignmentInputs, after: AssignmentInputs) -> set[str]:
    a, b = fingerprints(before), fingerprints(after)
    return {n for n in ("n1", "n2", "n3", "unknown") if a.of(n) != b.of(n)}


@pytest.mark.parametrize(
    ("after", "expected"),
    [
        (inputs(), set()),
        (inputs(shards=(("d-0", "n1", "d"), ("d-1", "n2", "d"))), {"n2"}),  # e-0 released
        (
            inputs(shards=(("d-0", "n1", "d"), ("d-1", "n2", "d"), ("e-0", "n2", "e"), ("d-2", "n3", "d"))),
            {"n3"},
        ),
        (inputs(deployments={"d": '{"replicas":3}', "e": '{"replicas":1}'}), {"n1", "n2"}),
        (inputs(deployments={"d": '{"replicas":2}'}), {"n2"}),  # e deleted: its replica is kept, not run
        (inputs(epochs={"n1": 2, "n2": 1, "n3": 1}), {"n1"}),  # re-registered
        (inputs(shared="models+classes, edited"), {"n1", "n2", "n3", "unknown"}),
    ],
    ids=[
        "nothing changed moves nothing",
        "a released replica moves its node only",
        "a new replica moves its node only",
        "an edited deployment moves the nodes of its replicas",
        "a deleted deployment moves the nodes of its replicas",
        "a registration moves the node",
        "an edited model or class moves every node",
    ],
)
def test_a_fingerprint_moves_exactly_for_the_nodes_whose_assignments_may_differ(
    after: AssignmentInputs, expected: set[str]
) -> None:
    assert moved(inputs(), after) == expected


def test_a_peer_registering_again_moves_every_node_of_a_multi_node_replica() -> None:
    before = inputs(shards=(("big-0", "n1", "big"), ("big-0", "n2", "big")), deployments={"big": "{}"})
    after = AssignmentInputs(before.shards, {"n1": 1, "n2": 2, "n3": 1}, before.deployments, before.shared)
    assert moved(before, after) == {"n1", "n2"}  # n1's assignment names n2's address


class CountingSource:
    """An in-memory ``AssignmentSource`` that counts its reads; its change counter moves whenever
    its inputs are replaced."""

    def __init__(self) -> None:
        self._inputs = inputs()
        self.changes = 0
        self.reads = 0

    @property
    def inputs(self) -> AssignmentInputs:
        return self._inputs

    @inputs.setter
    def inputs(self, value: AssignmentInputs) -> None:
        self._inputs = value
        self.changes += 1

    def fleet_changes(self) -> int:
        return self.changes

    def assignment_inputs(self) -> AssignmentInputs:
        self.reads += 1
        return self._inputs


def test_many_held_polls_share_one_read_per_tick_and_only_the_changed_node_wakes() -> None:
    source = CountingSource()

    async def scenario() -> tuple[list[bool], int]:
        watch = AssignmentWatch(source, tick=0.05)
        changed = asyncio.create_task(watch.changed("n1", None, 5))  # no tick yet: the first wakes it
        assert await changed
        seen = {n: watch.current(n) for n in ("n1", "n2", "n3")}
        waits = [asyncio.create_task(watch.changed(n, seen[n], 1.0)) for n in ("n1", "n2", "n3") * 20]
        await asyncio.sleep(0.2)
        source.inputs = inputs(epochs={"n1": 1, "n2": 1, "n3": 2})  # n3 registered again
        results = await asyncio.gather(*waits)
        await watch.aclose()
        return results, watch.reads

    results, reads = asyncio.run(scenario())
    assert results == [False, False, True] * 20
    # Sixty held polls over about a second of ticks: one read per tick, never one per poll.
    assert reads == source.reads and reads < 60


def test_a_stopping_server_wakes_every_held_poll_at_its_next_tick_and_a_lost_agent_its_own() -> None:
    source = CountingSource()
    stopping = [False]

    async def scenario() -> tuple[list[bool], list[bool], float]:
        watch = AssignmentWatch(source, tick=0.05, stopping=lambda: stopping[0])
        assert await watch.changed("n1", None, 5)  # the first tick
        seen = {n: watch.current(n) for n in ("n1", "n2", "n3")}
        # Held for 30 s each, as the hot path holds them: one wait, no re-arming.
        first = [asyncio.create_task(watch.changed(n, seen[n], 30)) for n in ("n1", "n2", "n3")]
        await asyncio.sleep(0.2)
        watch.wake("n2")  # n2's agent went away: only its own poll wakes (to find it gone)
        await asyncio.sleep(0.1)
        lost = [task.done() for task in first]
        began = time.monotonic()
        stopping[0] = True
        woken = await asyncio.gather(*first)
        took = time.monotonic() - began
        await watch.aclose()
        return lost, woken, took

    lost, woken, took = asyncio.run(scenario())
    assert lost == [False, True, False]
    assert woken == [True, True, True]  # none waited out its 30 s
    assert took < 5, took


# --- a poll held by the real app -----------------------------------------------------------------


@pytest.fixture
def plane(sqlite_store: SqlStore) -> Iterator[tuple[TestClient, SqlStore, str]]:
    store = sqlite_store
    now = datetime.now(UTC)
    join = store.create_token(TokenKind.JOIN, now).plaintext
    store.put_model(safetensors_8gb("m"))
    store.put_deployment(
        build_deployment("chat", 1, {"name": "cpu", "engine": "llama.cpp", "cpu": {"cores": 2}})
    )
    app = create_app(store, enrolment=EnrolmentPolicy(approve_new=True))
    with TestClient(app, raise_server_exceptions=False) as client:
        got = client.post(
            f"{AGENT}/register",
            json=cpu_8c_32g("n1").model_dump(mode="json", by_alias=True),
            headers={"Authorization": f"Bearer {join}"},
        )
        assert got.status_code == 200, got.text
        yield client, store, got.json()["credential"]


def test_a_held_poll_answers_with_the_replica_allocated_while_it_was_held(
    plane: tuple[TestClient, SqlStore, str],
) -> None:
    client, store, credential = plane
    headers = {"Authorization": f"Bearer {credential}"}
    first = client.get(f"{AGENT}/assignments", params={"node": "n1", "epoch": 1}, headers=headers).json()
    assert first["assignments"] == []
    replica = Replica(
        name="chat-0", deployment="chat", profile="cpu", shards=(Shard(node="n1", cpu_cores=2),)
    )
    later = threading.Timer(0.5, store.allocate, args=(replica,))
    later.start()
    try:
        held = client.get(
            f"{AGENT}/assignments",
            params={"node": "n1", "epoch": 1, "since": first["revision"], "wait": 20},
            headers=headers,
        )
    finally:
        later.join()
    assert held.status_code == 200, held.text
    # Answered with the new set: a poll left to its deadline would answer the set it began with.
    assert [a["replica"]["name"] for a in held.json()["assignments"]] == ["chat-0"], held.json()
    assert held.json()["revision"] != first["revision"]


def test_a_held_poll_of_an_unchanged_node_answers_its_own_set_at_the_deadline(
    plane: tuple[TestClient, SqlStore, str],
) -> None:
    client, _, credential = plane
    headers = {"Authorization": f"Bearer {credential}"}
    first = client.get(f"{AGENT}/assignments", params={"node": "n1", "epoch": 1}, headers=headers).json()
    held = client.get(
        f"{AGENT}/assignments",
        params={"node": "n1", "epoch": 1, "since": first["revision"], "wait": 1},
        headers=headers,
    )
    assert held.status_code == 200 and held.json()["revision"] == first["revision"]


def test_a_kept_answer_serves_a_re_issued_poll_only_while_nothing_it_was_built_from_moved() -> None:
    source = CountingSource()
    answer = AssignmentSet(revision="r1", epoch=1, assignments=[], keep=[])

    async def scenario() -> list[bool]:
        watch = AssignmentWatch(source, tick=0.05)
        await watch.changed("n1", None, 5)  # the first tick
        watch.remember("n1", watch.current("n1"), answer)
        got = [
            watch.answered("n1", 1, "r1") is answer,
            watch.answered("n1", 1, "r0") is None,  # the agent holds another set
            watch.answered("n1", 2, "r1") is None,  # another registration
            watch.answered("n2", 1, "r1") is None,  # nothing kept for n2
        ]
        source.inputs = inputs(shards=(("d-0", "n1", "d"), ("d-9", "n1", "d")))
        await watch.changed("n1", watch.current("n1"), 5)
        got.append(watch.answered("n1", 1, "r1") is None)  # built from inputs that moved
        await watch.aclose()
        return got

    assert asyncio.run(scenario()) == [True, True, True, True, True]
