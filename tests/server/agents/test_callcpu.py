"""The CPU each agent call costs, per kind (``server/agents/callcpu.py``): a timed call is charged
its own steps on the loop, what it hands to a worker thread and its share of a batch, never what
other tasks did meanwhile; and in the real app every kind's counters move on ``/metrics``."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from datetime import UTC, datetime

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from starlette.concurrency import run_in_threadpool

from builders import cpu_8c_32g
from fleetserve.server.agents.batching import Gather
from fleetserve.server.agents.callcpu import CallCpu, CallKind, charged, current_bill
from fleetserve.server.agents.enrolment import EnrolmentPolicy
from fleetserve.server.app import create_app
from fleetserve.store import SqlStore, TokenKind

AGENT = "/api/v1/agent"


def burn(seconds: float) -> None:
    """Spend about ``seconds`` of this thread's CPU."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_a_timed_call_is_charged_its_own_steps_and_not_what_others_do_between_them() -> None:
    cpu = CallCpu()

    async def call() -> str:
        burn(0.03)
        await asyncio.sleep(0.05)  # another task burns 0.2 s meanwhile
        burn(0.03)
        return "answered"

    async def other() -> None:
        await asyncio.sleep(0.001)
        burn(0.2)

    async def main() -> str:
        answer, _ = await asyncio.gather(cpu.timed(CallKind.HEARTBEAT, call()), other())
        return answer

    assert asyncio.run(main()) == "answered"
    seconds, calls = cpu.totals()[CallKind.HEARTBEAT]
    assert calls == 1
    assert 0.06 <= seconds < 0.15, seconds
    assert cpu.totals()[CallKind.STATUS] == (0.0, 0)


def test_a_worker_threads_cpu_is_the_calls_that_handed_it_over() -> None:
    cpu = CallCpu()

    async def call() -> None:
        assert current_bill() is not None
        await run_in_threadpool(charged(burn), 0.05)  # the bill follows the call into the thread
        burn(0.01)

    async def main() -> None:
        await cpu.timed(CallKind.REGISTER, call())
        assert current_bill() is None  # only the timed call carries a bill
        charged(burn)(0.01)  # no call: nobody is charged

    asyncio.run(main())
    seconds, calls = cpu.totals()[CallKind.REGISTER]
    assert calls == 1 and 0.06 <= seconds < 0.12, seconds


def test_a_batch_is_split_evenly_over_the_calls_it_held() -> None:
    cpu = CallCpu()

    def many(arguments: Sequence[int]) -> list[int]:
        burn(0.08)
        return [a * 2 for a in arguments]

    gather: Gather[int, int] = Gather(many, name="test-batch")

    async def main() -> list[int]:
        # All five arrive before the batch starts: one batch of five, 0.016 s each.
        calls = [cpu.timed(CallKind.HEARTBEAT if i % 2 else CallKind.STATUS, gather(i)) for i in range(5)]
        return list(await asyncio.gather(*calls))

    assert asyncio.run(main()) == [0, 2, 4, 6, 8]
    assert gather.batches == 1
    status, beats = cpu.totals()[CallKind.STATUS], cpu.totals()[CallKind.HEARTBEAT]
    assert (status[1], beats[1]) == (3, 2)
    assert 0.08 * 2 / 5 <= beats[0] < 0.08 * 2 / 5 + 0.01, beats
    assert 0.08 * 3 / 5 <= status[0] < 0.08 * 3 / 5 + 0.01, status


def test_a_cancelled_call_is_cancelled_inside_and_still_accounted() -> None:
    cpu = CallCpu()
    seen: list[str] = []

    async def call() -> None:
        burn(0.02)
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            seen.append("cancelled inside")
            raise

    async def main() -> None:
        task = asyncio.ensure_future(cpu.timed(CallKind.ASSIGNMENTS, call()))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert seen == ["cancelled inside"]
    seconds, calls = cpu.totals()[CallKind.ASSIGNMENTS]
    assert calls == 1 and seconds >= 0.02


def metric(client: TestClient, name: str) -> dict[str, float]:
    """Per ``kind`` label, the value of ``name`` on ``/metrics``."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for sample in family.samples:
            if sample.name == name:
                out[sample.labels["kind"]] = sample.value
    return out


def test_every_kind_of_agent_call_moves_its_counters_in_the_real_app(sqlite_store: SqlStore) -> None:
    store = sqlite_store
    join = store.create_token(TokenKind.JOIN, datetime.now(UTC)).plaintext
    app = create_app(store, enrolment=EnrolmentPolicy(approve_new=True))
    with TestClient(app, client=("10.0.0.5", 40000)) as client:
        kinds = [kind.value for kind in CallKind]
        assert metric(client, "fleetserve_agent_calls_total") == dict.fromkeys(kinds, 0.0)
        doc = cpu_8c_32g("n1").model_dump(mode="json", by_alias=True)
        enrolled = client.post(f"{AGENT}/register", json=doc, headers={"Authorization": f"Bearer {join}"})
        assert enrolled.status_code == 200, enrolled.text
        auth = {"Authorization": f"Bearer {enrolled.json()['credential']}"}
        for _ in range(3):
            assert (
                client.post(f"{AGENT}/heartbeat", json={"node": "n1", "epoch": 1}, headers=auth).status_code
                == 200
            )
        for _ in range(2):
            report = {"node": "n1", "epoch": 1, "replicas": {}}
            assert client.post(f"{AGENT}/status", json=report, headers=auth).status_code == 200
        assert client.get(f"{AGENT}/assignments?node=n1&epoch=1", headers=auth).status_code == 200
        # A refused call is a call too.
        forged = {"Authorization": "Bearer forged"}
        assert (
            client.post(f"{AGENT}/heartbeat", json={"node": "n1", "epoch": 1}, headers=forged).status_code
            == 401
        )

        calls = metric(client, "fleetserve_agent_calls_total")
        seconds = metric(client, "fleetserve_agent_call_cpu_seconds_total")
    assert calls == {"heartbeat": 4.0, "status": 2.0, "assignments": 1.0, "register": 1.0}
    assert all(seconds[kind] > 0 for kind in kinds), seconds
    # The registration (a FastAPI route, a worker thread, several statements) costs more than a heartbeat.
    assert seconds["register"] > seconds["heartbeat"] / 4
