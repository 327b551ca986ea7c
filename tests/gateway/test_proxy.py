"""The gateway's data path over real sockets: uvicorn (uvloop, httptools) serving the raw-ASGI
/v1 in this process, in front of two fake OpenAI engines (fleetserve.dev.fake_openai), over a
SQLite store holding their replicas. The clients are httpx and the official ``openai`` client.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime

import httpx
import openai
import pytest

from fake_engine import ServedGateway, engines_on
from fleetserve.store.sql import SqlStore


def wait_for(check, timeout: float = 10.0, what: str = "it"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedGateway]:
    tmp = tmp_path_factory.mktemp("proxy")
    with SqlStore.open(tmp / "state.db") as store, ServedGateway(store, engines=2) as gw:
        engines_on(store, [e.port for e in gw.engines], tmp / "tiny.gguf")
        wait_for(
            lambda: (
                len(gw.gateway.table.routes.get("tiny", None).endpoints or ()) == 2
                if gw.gateway.table.routes.get("tiny")
                else False
            ),
            what="both replicas in the routes",
        )
        yield gw


def key(
    gw: ServedGateway,
    name: str,
    models: list[str] | None = None,
    rpm: int | None = None,
    tpm: int | None = None,
) -> str:
    _, plaintext = gw.store.create_api_key(name, models or ["*"], rpm, tpm, datetime.now(UTC))
    return plaintext


def client(gw: ServedGateway, token: str) -> httpx.Client:
    return httpx.Client(base_url=f"{gw.url}/v1", headers={"Authorization": f"Bearer {token}"}, timeout=30)


def chat(**fields: object) -> dict[str, object]:
    return {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8, **fields}


def events(text: str) -> list[str]:
    return [line[6:] for line in text.splitlines() if line.startswith("data: ")]


def test_answers_streamed_or_not_through_the_official_client(served):
    with openai.OpenAI(base_url=f"{served.url}/v1", api_key=key(served, "official"), max_retries=0) as oc:
        assert [m.id for m in oc.models.list().data] == ["tiny"]
        answer = oc.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5
        )
        assert answer.usage is not None and answer.usage.completion_tokens == 5
        assert answer.choices[0].message.content == "hi " * 5
        stream = oc.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=7,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "hi " * 7
        assert (
            chunks[-1].usage is not None
            and chunks[-1].usage.completion_tokens == 7
            and chunks[-1].choices == []
        )
        completion = oc.completions.create(model="tiny", prompt="x", max_tokens=3)
        assert completion.choices[0].text == "hi " * 3
        # A generate deployment is no embedder: the gateway says so, as the official client reads it.
        with pytest.raises(openai.BadRequestError, match="task generate"):
            oc.embeddings.create(model="tiny", input="x")


def test_a_stream_whose_client_did_not_ask_for_usage_is_counted_and_gets_none(served):
    token = key(served, "tpm-stream", tpm=30)
    with client(served, token) as http:
        response = http.post("/chat/completions", json=chat(stream=True, max_tokens=40))
        assert response.status_code == 200
        got = events(response.text)
        assert got[-1] == "[DONE]"
        assert not any('"usage"' in e for e in got), got[-3:]
        assert len(got) == 40 + 2  # 40 content events, the finish event, [DONE]
        # The engine was asked for the usage event (the gateway added it) ...
        asked = [b for e in served.engines for b in e.served.bodies if b.get("max_tokens") == 40]
        assert asked and asked[-1]["stream_options"] == {"include_usage": True}
        # ... and its 40+ tokens count: the key's 30 tokens a minute are used up.
        again = http.post("/chat/completions", json=chat(stream=True))
    assert again.status_code == 429, again.text
    assert again.json()["error"]["type"] == "tokens" and int(again.headers["retry-after"]) >= 1


def test_parallel_requests_see_each_others_reservations(served):
    """tpm 100: a slow request reserving 80 tokens is in flight; a second one is refused at once."""
    token = key(served, "tpm-parallel", tpm=100)
    with client(served, token) as http, ThreadPoolExecutor(1) as pool:
        slow = pool.submit(
            http.post, "/chat/completions", json=chat(max_tokens=80, fake_delay=0.01, stream=True)
        )
        wait_for(
            lambda: served.gateway.in_flight and sum(served.gateway.in_flight.values()) > 0,
            what="the slow request in flight",
        )
        refused = http.post("/chat/completions", json=chat(max_tokens=10))
        assert slow.result().status_code == 200
    assert refused.status_code == 429, refused.text
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"


def test_a_key_without_the_model_gets_the_same_404_as_a_missing_model(served):
    token = key(served, "other-only", models=["other"])
    with client(served, token) as http:
        denied = http.post("/chat/completions", json=chat())
        missing = http.post("/chat/completions", json=chat(model="no-such"))
    assert denied.status_code == missing.status_code == 404
    a, b = denied.json()["error"], missing.json()["error"]
    assert (
        (a["type"], a["code"], a["param"])
        == (b["type"], b["code"], b["param"])
        == (
            "invalid_request_error",
            "model_not_found",
            "model",
        )
    )
    assert a["message"].replace("tiny", "X") == b["message"].replace("no-such", "X")


def test_a_deployment_is_served_from_its_apply_on_not_from_the_next_refresh(tmp_path):
    """The replica of a just-applied deployment can be Running before the gateway's next refresh
    (llama.cpp on the tiny model is healthy within a second); a request then must be served, not
    told the model does not exist. The periodic refresh is an hour here: only the miss reads."""
    with SqlStore.open(tmp_path / "state.db") as store:
        gw = ServedGateway(store, engines=1)
        gw.gateway.table.refresh_seconds = 3600.0
        with gw:
            table = gw.gateway.table
            assert "tiny" not in table.routes
            engines_on(store, [gw.engines[0].port], tmp_path / "tiny.gguf")
            with client(gw, key(gw, "all")) as http:
                answered = http.post("/chat/completions", json=chat())
            assert answered.status_code == 200, answered.text
            reads = table.reads
            # A key that may not use a model costs the store nothing; a missing model for a key that
            # may costs one read of the change counter, not of the fleet, while nothing changed.
            with client(gw, key(gw, "other-only", models=["other"])) as http:
                assert http.post("/chat/completions", json=chat(model="ghost")).status_code == 404
            with client(gw, key(gw, "all-2")) as http:
                for _ in range(3):
                    assert http.post("/chat/completions", json=chat(model="ghost")).status_code == 404
            assert table.reads == reads


@pytest.mark.parametrize(
    "body",
    [
        b"[" * 100_000 + b"]" * 100_000,
        b'{"model": "tiny", "x": ' + b"[" * 5000 + b"]" * 5000 + b"}",
        b"{nope",
    ],
    ids=["deeply-nested-array", "deeply-nested-field", "invalid"],
)
def test_a_body_that_is_not_json_it_can_parse_gets_400(served, body):
    with client(served, key(served, f"nested-{len(body)}")) as http:
        response = http.post("/chat/completions", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["type"] == "invalid_request_error"


def test_refused_requests_are_not_activity_for_scale_to_zero(served):
    limited = key(served, "one-a-minute", rpm=1)
    served.gateway.last_request.pop("tiny", None)
    with client(served, "fs-bogus") as http:
        assert http.post("/chat/completions", json=chat()).status_code == 401
    with client(served, key(served, "nothing", models=["other"])) as http:
        assert http.post("/chat/completions", json=chat()).status_code == 404
    with client(served, limited) as http:
        first = http.post("/chat/completions", json=chat())
        served.gateway.last_request.pop("tiny", None)
        assert first.status_code == 200
        assert http.post("/chat/completions", json=chat()).status_code == 429
    assert "tiny" not in served.gateway.last_request
    with client(served, key(served, "served")) as http:
        assert http.post("/chat/completions", json=chat()).status_code == 200
    assert "tiny" in served.gateway.last_request


def test_a_client_that_disconnects_mid_stream_cancels_the_engine(served):
    before = sum(e.served.streams_cut for e in served.engines)
    with (
        client(served, key(served, "leaver")) as http,
        http.stream(
            "POST", "/chat/completions", json=chat(stream=True, max_tokens=1000, fake_delay=0.01)
        ) as response,
    ):
        lines = response.iter_lines()
        for _ in range(5):
            next(lines)
    wait_for(
        lambda: sum(e.served.streams_cut for e in served.engines) == before + 1,
        timeout=5,
        what="the engine's stream to be cut",
    )
    wait_for(lambda: sum(served.gateway.in_flight.values()) == 0, what="nothing in flight")


def test_a_replica_that_refuses_connections_is_retried_on_the_other(served):
    victim = served.engines[0]
    asyncio.run_coroutine_threadsafe(victim.stop(), served.loop).result(5)
    try:
        with client(served, key(served, "retry")) as http:
            statuses = [http.post("/chat/completions", json=chat()).status_code for _ in range(10)]
        assert statuses == [200] * 10
    finally:
        asyncio.run_coroutine_threadsafe(victim.start(victim.port), served.loop).result(5)


def test_an_engine_error_reaches_the_client_as_the_engine_said_it_and_is_not_retried(served):
    before = sum(e.served.requests for e in served.engines)
    with client(served, key(served, "fails")) as http:
        response = http.post("/chat/completions", json=chat(fake_status=500))
    assert response.status_code == 500, response.text
    assert response.json()["error"]["message"] == "fake failure"
    assert "retry-after" not in response.headers
    assert sum(e.served.requests for e in served.engines) == before + 1


def test_metrics_carry_ttft_itl_and_per_key_figures_with_bounded_labels(served):
    token = key(served, "metered")
    with client(served, token) as http:
        assert http.post("/chat/completions", json=chat(stream=True, max_tokens=6)).status_code == 200
        assert http.post("/chat/completions", json=chat(max_tokens=4)).status_code == 200
        assert http.post("/chat/completions", json=chat(model="made-up-" + "x" * 40)).status_code == 404
        text = httpx.get(f"{served.url}/metrics").text
    lines = text.splitlines()
    assert any(
        line.startswith("fleetserve_gateway_ttft_seconds_count{")
        and 'deployment="tiny"' in line
        and 'engine="llama.cpp"' in line
        and 'replica="tiny-' in line
        for line in lines
    ), text
    assert any(
        line.startswith("fleetserve_gateway_inter_token_seconds_count{") and 'engine="llama.cpp"' in line
        for line in lines
    )
    completion = [
        line
        for line in lines
        if line.startswith("fleetserve_gateway_tokens_total{")
        and 'key="metered"' in line
        and 'kind="completion"' in line
    ]
    assert completion and float(completion[0].split()[-1]) == 10.0, completion
    assert any(
        'key="metered"' in line and 'model="unknown"' in line
        for line in lines
        if line.startswith("fleetserve_gateway_key_request_seconds_count")
    )
    assert "made-up" not in text


def test_a_request_body_is_forwarded_as_sent_and_unknown_routes_are_404(served):
    with client(served, key(served, "verbatim")) as http:
        raw = b'{"model":"tiny","prompt":"p","max_tokens":2,"extra":{"nested":[1,2,3]}}'
        assert http.post("/completions", content=raw).status_code == 200
        assert any(b.get("extra") == {"nested": [1, 2, 3]} for e in served.engines for b in e.served.bodies)
        assert http.post("/nope", json={}).status_code == 404
        assert http.get("/chat/completions").status_code == 405
    # The admin API stays on FastAPI, beside /v1 on the same listener.
    assert httpx.get(f"{served.url}/healthz").json()["status"] == "ok"
    assert json.loads(httpx.get(f"{served.url}/v1/models").text)["error"]["code"] == "invalid_api_key"


def test_each_engine_gets_its_own_replicas_key_from_the_one_place_headers_are_built(served):
    keys = served.store.engine_keys(["tiny-0", "tiny-1"])
    assert len(set(keys.values())) == 2 and all(keys.values())
    with client(served, key(served, "keyed")) as http:
        for _ in range(6):
            assert http.post("/chat/completions", json=chat()).status_code == 200
    by_port = {e.port: e for e in served.engines}
    for endpoint in served.gateway.table.routes["tiny"].endpoints:
        engine = by_port[int(endpoint.url.rpartition(":")[2])]
        sent = {h.get(b"authorization") for h in engine.served.headers}
        assert sent == {f"Bearer {keys[endpoint.replica]}".encode()}, (endpoint.replica, sent)


def test_an_engine_key_with_a_line_break_is_never_sent():
    from fleetserve.gateway.picker import Endpoint
    from fleetserve.gateway.upstream import upstream_request
    from fleetserve.httpclient import UpstreamError

    _, request = upstream_request(
        Endpoint("r", "http://127.0.0.1:9", engine_key="k1"), b"/v1/completions", b"{}"
    )
    assert request.startswith(
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:9\r\nAuthorization: Bearer k1\r\n"
    )
    assert request.endswith(b"Content-Length: 2\r\n\r\n{}")
    with pytest.raises(UpstreamError):
        upstream_request(
            Endpoint("r", "http://127.0.0.1:9", engine_key="k\r\nX-Evil: 1"), b"/v1/completions", b"{}"
        )


def test_a_stream_whose_engine_breaks_off_is_signalled_never_ended_as_complete(served):
    with client(served, key(served, "broken")) as http:
        response = http.post("/chat/completions", json=chat(stream=True, max_tokens=20, fake_break_after=3))
        assert response.status_code == 200
        got = events(response.text)
        assert "[DONE]" not in got
        assert len(got) == 4 and json.loads(got[-1])["error"]["code"] == "stream_broken", got
        # The gateway is none the worse: the next stream is whole.
        again = events(http.post("/chat/completions", json=chat(stream=True, max_tokens=5)).text)
        assert again[-1] == "[DONE]" and len(again) == 7
    wait_for(lambda: sum(served.gateway.in_flight.values()) == 0, what="nothing in flight")
