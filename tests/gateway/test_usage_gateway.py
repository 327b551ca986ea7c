"""Usage accounting on the real data path: uvicorn serving the gateway in this process in front of
fake OpenAI engines, over a SQLite store. Requests, streamed or not, and errors are counted per
minute, key and model and written as aggregated rows, never a row per request."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest

from fake_engine import ServedGateway, engines_on
from fleetserve.store.sql import SqlStore
from fleetserve.store.usage import UsageCounts


def quiet(gw: ServedGateway) -> ServedGateway:
    """The gateway with its periodic write put off: the test decides when counts are written."""
    flusher = gw.gateway.usage_flusher
    assert flusher is not None
    flusher.interval = 3600.0
    return gw


@pytest.fixture
def served(tmp_path: Path) -> Iterator[ServedGateway]:
    with SqlStore.open(tmp_path / "state.db") as store, quiet(ServedGateway(store, engines=1)) as gw:
        engines_on(store, [e.port for e in gw.engines], tmp_path / "tiny.gguf")
        deadline = time.monotonic() + 10
        while not (gw.gateway.table.routes.get("tiny") and gw.gateway.table.routes["tiny"].endpoints):
            assert time.monotonic() < deadline, "the replica never reached the routes"
            time.sleep(0.02)
        yield gw


def flush(gw: ServedGateway) -> int:
    """Write the gateway's counts now, in its own event loop (as its 10-second loop would)."""
    flusher = gw.gateway.usage_flusher
    assert flusher is not None
    written: int = asyncio.run_coroutine_threadsafe(flusher.flush(), gw.loop).result(30)
    return written


def chat(**fields: object) -> dict[str, object]:
    return {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, **fields}


def stream_usage(text: str) -> dict[str, int]:
    import json

    events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    usage: dict[str, int] = events[-1]["usage"]
    return usage


def test_requests_streams_and_errors_are_counted_and_written_as_aggregated_rows(
    served: ServedGateway,
) -> None:
    store = served.store
    started = datetime.now(UTC)
    alice_key, alice = store.create_api_key("alice", ["*"], None, None, started)
    bob_key, bob = store.create_api_key("bob", ["*"], None, None, started)
    expected = {alice_key.id: UsageCounts(), bob_key.id: UsageCounts()}
    with httpx.Client(base_url=f"{served.url}/v1", timeout=30) as http:
        for key, token, body in [
            (alice_key, alice, chat()),
            (alice_key, alice, chat(max_tokens=7)),
            (alice_key, alice, chat(stream=True, stream_options={"include_usage": True})),
            (alice_key, alice, chat(stream=True, max_tokens=9, stream_options={"include_usage": True})),
            (bob_key, bob, chat(max_tokens=2)),
            (bob_key, bob, chat(stream=True, stream_options={"include_usage": True})),
        ]:
            response = http.post("/chat/completions", json=body, headers={"Authorization": f"Bearer {token}"})
            assert response.status_code == 200, response.text
            usage = stream_usage(response.text) if body.get("stream") else response.json()["usage"]
            expected[key.id] += UsageCounts(1, 0, usage["prompt_tokens"], usage["completion_tokens"])
        failed = http.post(
            "/chat/completions", json=chat(fake_status=400), headers={"Authorization": f"Bearer {alice}"}
        )
        assert failed.status_code == 400
        expected[alice_key.id] += UsageCounts(1, 1, 0, 0)
    requests = 7

    written = flush(served)
    minutes = {datetime.now(UTC).replace(second=0, microsecond=0), started.replace(second=0, microsecond=0)}
    # Aggregated: at most one row per minute, key and model, never one per request.
    assert 2 <= written <= len(minutes) * 2 * 1 < requests
    rows = store.usage(started - timedelta(minutes=1), datetime.now(UTC) + timedelta(minutes=1))
    assert {r.model for r in rows} == {"tiny"}
    totals = store.usage_totals(
        started - timedelta(minutes=1), datetime.now(UTC) + timedelta(minutes=1), "key"
    )
    assert totals == expected
    assert expected[alice_key.id].completion_tokens == 4 + 7 + 4 + 9
    # Nothing is left to write, and nothing is written twice.
    assert flush(served) == 0
    assert (
        store.usage_totals(started - timedelta(minutes=1), datetime.now(UTC) + timedelta(minutes=1), "key")
        == expected
    )


def test_a_request_for_an_unknown_model_counts_as_an_error_of_the_unknown_model(
    served: ServedGateway,
) -> None:
    _, token = served.store.create_api_key("carol", ["*"], None, None, datetime.now(UTC))
    with httpx.Client(base_url=f"{served.url}/v1", timeout=30) as http:
        response = http.post(
            "/chat/completions", json=chat(model="nope"), headers={"Authorization": f"Bearer {token}"}
        )
    assert response.status_code == 404
    flush(served)
    now = datetime.now(UTC)
    assert served.store.usage_totals(now - timedelta(minutes=2), now + timedelta(minutes=1), "model") == {
        "unknown": UsageCounts(1, 1, 0, 0)
    }


def test_what_was_counted_is_written_when_the_gateway_stops(tmp_path: Path) -> None:
    with SqlStore.open(tmp_path / "state.db") as store:
        with quiet(ServedGateway(store, engines=1)) as gw:
            engines_on(store, [e.port for e in gw.engines], tmp_path / "tiny.gguf")
            key, token = store.create_api_key("dave", ["*"], None, None, datetime.now(UTC))
            deadline = time.monotonic() + 10
            while not (gw.gateway.table.routes.get("tiny") and gw.gateway.table.routes["tiny"].endpoints):
                assert time.monotonic() < deadline, "the replica never reached the routes"
                time.sleep(0.02)
            with httpx.Client(base_url=f"{gw.url}/v1", timeout=30) as http:
                for _ in range(3):
                    ok = http.post(
                        "/chat/completions", json=chat(), headers={"Authorization": f"Bearer {token}"}
                    )
                    assert ok.status_code == 200
            assert (
                store.usage_totals(datetime.now(UTC) - timedelta(minutes=2), datetime.now(UTC), "key") == {}
            )
        # The gateway stopped (its lifespan ended): the last counts were written on the way out.
        now = datetime.now(UTC)
        totals = store.usage_totals(now - timedelta(minutes=2), now + timedelta(minutes=1), "key")
        assert totals[key.id].requests == 3 and totals[key.id].completion_tokens == 12
