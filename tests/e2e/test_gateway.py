"""The OpenAI-compatible gateway end to end: the official ``openai`` client (and httpx, where the
statuses themselves are counted) against ``fleetserve server``'s /v1, in front of real
``llama-server`` replicas of the tiny model started by real ``fleetserve agent`` processes.

One server (SQLite) and two agents (gw-a, gw-b) serve the whole module, with two deployments of
the tiny model: ``tiny`` (2 replicas, the default admission policy) and ``busy`` (1 replica,
``admission: {maxWaiting: 1, maxWaitSeconds: 1}``); the server allows one browser origin
(``--cors-origin``). Every process — server, agents and the llama-servers they started — is
stopped at teardown, and an engine left behind fails the module.

The tiny model generates thousands of tokens per second, and a request's generation is bounded by
the 256-token context: a whole answer takes a few milliseconds, too short to overload anything or
to interrupt. Requests that must last pass a GBNF grammar in the request body (llama-server's
``grammar``, which the gateway forwards untouched), and ``ignore_eos`` so that every answer runs
to its max_tokens:

- ``SLOW``: 2000 alternative rules alive at every step, ~10 ms a token (4 busy slots: ~40 ms).
  The 4 slots of a replica share its 256-token KV cache, so concurrent requests stay small
  (~23 prompt + 30 generated tokens each): past 256 tokens in all, llama-server fails requests
  with 500 "Context size has been exceeded".
- ``GROWING``: parse stacks that grow with every token (``x ::= [a-z] x? x?``), for one long
  stream alone on a replica: ~0.5 s for 100 tokens, ~10 s for the whole context on this machine,
  while the engine still answers /metrics.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from e2e_support import (
    GROWING,
    SLOW,
    SLOW_TOKENS,
    AgentFactory,
    AgentProcess,
    ServerFactory,
    ServerProcess,
    cli_env,
    engine_headers,
    engine_ready,
    llama_servers,
    replica_details,
    run_cli,
    short_deadline_args,
    slow_chat,
    tiny_documents,
    wait_for,
)
from openai import OpenAI

from fleetserve.engines.registry import ENGINES
from fleetserve.engines.spec import EngineKind

pytestmark = pytest.mark.slow

NODES = ("gw-a", "gw-b")
# The one origin whose web pages may call the server's /v1 (--cors-origin).
BROWSER_ORIGIN = "https://chat.example.com"
# Grammars that make generation slow on purpose (see the module docstring).
# Routes are re-read from the store every second: wait this long after a replica turned Running
# before counting on the gateway to send it requests.
ROUTE_REFRESH = 1.5


@dataclass
class Fleet:
    server: ServerProcess
    agents: dict[str, AgentProcess]
    key: str  # an API key for every model, no limits
    tmp: Path

    @property
    def base_url(self) -> str:
        return f"{self.server.url}/v1"

    def openai(self, key: str | None = None, **options: Any) -> OpenAI:
        options.setdefault("max_retries", 0)  # the client's own retries would hide the gateway's errors
        options.setdefault("timeout", 60)
        return OpenAI(base_url=self.base_url, api_key=key or self.key, **options)

    def http(self, key: str | None = None, timeout: float = 60) -> httpx.Client:
        headers = {} if key == "" else {"Authorization": f"Bearer {key or self.key}"}
        return httpx.Client(
            base_url=self.base_url,
            headers=headers,
            timeout=timeout,
            limits=httpx.Limits(max_connections=64, max_keepalive_connections=64),
        )

    def replicas(self, deployment: str) -> list[dict[str, Any]]:
        """The replicas of ``deployment`` as GET /api/v1/replicas/NAME shows them (with status)."""
        return replica_details(self.server, deployment)

    def running(self, deployment: str, count: int, min_restarts: int = 0) -> dict[str, int]:
        """{replica: port} once ``count`` replicas of ``deployment`` run and answer, else {}."""
        ports = {
            r["name"]: int(r["status"]["port"])
            for r in self.replicas(deployment)
            if r["state"] == "Running"
            and r["status"].get("port")
            and r["status"].get("restarts", 0) >= min_restarts
        }
        if len(ports) != count or not all(engine_ready(p) for p in ports.values()):
            return {}
        for name, port in ports.items():  # what ``metrics`` needs to read the engine itself
            ENGINE_HEADERS[port] = engine_headers(self.server.database_url, name)
        return ports

    def engine_log(self, deployment: str, replica: str) -> Path:
        [row] = [r for r in self.replicas(deployment) if r["name"] == replica]
        return self.agents[row["shards"][0]["node"]].engine_log_dir / f"{replica}.log"

    def create_key(self, name: str, models: list[str], rpm: int | None = None) -> tuple[int, str]:
        with self.server.client(timeout=10) as api:
            response = api.post("/keys", json={"name": name, "models": models, "rpm": rpm})
        assert response.status_code == 200, response.text
        return int(response.json()["id"]), str(response.json()["key"])


# The engine key of each running replica's port, as ``Fleet.running`` found them: an engine
# refuses a request without its replica's key.
ENGINE_HEADERS: dict[int, dict[str, str]] = {}


def metrics(port: int) -> dict[str, float]:
    """A llama-server's ``llamacpp:`` metrics, scraped from its own port (not through the gateway)
    with its replica's key."""
    with httpx.Client(timeout=10) as http:
        response = http.get(f"http://127.0.0.1:{port}/metrics", headers=ENGINE_HEADERS.get(port, {}))
    assert response.status_code == 200, response.text
    out = {}
    for line in response.text.splitlines():
        if line.startswith("llamacpp:"):
            name, _, value = line.partition(" ")
            out[name.removeprefix("llamacpp:")] = float(value)
    return out


def port_of(engine: Any) -> int | None:
    """The port a llama-server process listens on, from its argv."""
    argv = engine.cmdline()
    return int(argv[argv.index("--port") + 1]) if "--port" in argv else None


def tasks_started(log: Path) -> int:
    """How many requests an engine took on, from its log (one "processing task" line each)."""
    return log.read_text(encoding="utf-8", errors="replace").count("processing task")


def deployment(name: str, replicas: int, admission: dict[str, Any] | None = None) -> dict[str, Any]:
    [_, doc] = tiny_documents(Path("unused"), name, replicas=replicas)
    doc["model"] = "tiny"
    if admission is not None:
        doc["admission"] = admission
    return doc


def error_of(response: httpx.Response) -> dict[str, Any]:
    """The ``error`` object of an answer in OpenAI's shape (fails the test on any other shape)."""
    body = response.json()
    assert set(body) == {"error"}, body
    error: dict[str, Any] = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    return error


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    tmp = tmp_path_factory.mktemp("gateway")
    servers = ServerFactory(tmp)
    agent_factory = AgentFactory(tmp)
    orphans: list[str] = []
    try:
        server = servers.start(
            f"sqlite:///{tmp / 'state.db'}",
            name="server",
            extra_args=(*short_deadline_args(tmp), "--cors-origin", BROWSER_ORIGIN),
        )
        agents = {name: agent_factory.start(server.url, server.join_token, name) for name in NODES}
        with server.client(timeout=10) as api:
            wait_for(
                lambda: {n["name"] for n in api.get("/nodes").json() if n["state"] == "Ready"} >= set(NODES),
                timeout=60,
                what="both agents to register",
            )
        model = tmp / "tiny.gguf"
        out = run_cli("dev", "tiny-model", str(model))
        assert out.returncode == 0 and model.exists(), out.stderr
        [model_doc, _] = tiny_documents(model)
        busy = deployment("busy", 1, {"maxWaiting": 1, "maxWaitSeconds": 1})
        server.apply([model_doc, deployment("tiny", 2), busy])
        fleet = Fleet(server, agents, "", tmp)
        _, fleet.key = fleet.create_key("everything", ["*"])
        started = time.monotonic()
        wait_for(lambda: fleet.running("tiny", 2), timeout=90, what="both tiny replicas to run")
        wait_for(lambda: fleet.running("busy", 1), timeout=90, what="the busy replica to run")
        with fleet.http() as http:
            wait_for(
                lambda: {m["id"] for m in http.get("/models").json()["data"]} == {"tiny", "busy"},
                timeout=30,
                what="the gateway to list tiny and busy",
            )
        time.sleep(ROUTE_REFRESH)  # every Running replica is in the gateway's routes
        print(f"\nfleet serving {time.monotonic() - started:.1f} s after apply")
        yield fleet
    finally:
        orphans = agent_factory.close()
        servers.close()
    if orphans:
        pytest.fail("llama-server processes outlived their agents (killed now):\n" + "\n".join(orphans))


# --- the OpenAI API through the official client ---------------------------------------------------


def test_chat_and_completions_answer_through_the_official_client_streamed_or_not(fleet: Fleet) -> None:
    with fleet.openai() as client:
        listed = client.models.list()
        assert sorted(m.id for m in listed.data) == ["busy", "tiny"]
        # Each with what its engine says (llama-server's owned_by and meta: its context per slot).
        assert all(m.owned_by == "llamacpp" and m.object == "model" for m in listed.data)
        assert all((m.model_extra or {})["meta"]["n_ctx"] > 0 for m in listed.data)

        answer = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "Hello!"}],
            max_tokens=16,
            extra_body={"ignore_eos": True},
        )
        assert answer.object == "chat.completion"
        assert answer.model == "tiny"
        assert answer.choices[0].message.role == "assistant"
        assert answer.choices[0].message.content
        assert answer.choices[0].finish_reason == "length"
        assert answer.usage is not None
        assert answer.usage.completion_tokens == 16 and answer.usage.prompt_tokens > 0

        stream = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "Tell me a story."}],
            max_tokens=24,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        with stream:
            chunks = list(stream)
        pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        usage = [c.usage for c in chunks if c.usage is not None]
        assert len(pieces) >= 3, chunks
        assert finishes == ["length"], chunks
        assert len(usage) == 1 and chunks[-1].usage is not None and chunks[-1].choices == [], chunks[-3:]
        assert usage[0].completion_tokens == 24
        assert len({c.id for c in chunks}) == 1

        completion = client.completions.create(
            model="tiny", prompt="Once upon a time", max_tokens=12, extra_body={"ignore_eos": True}
        )
        assert completion.object == "text_completion"
        assert completion.choices[0].text
        assert completion.usage is not None and completion.usage.completion_tokens == 12

        streamed = client.completions.create(
            model="tiny",
            prompt="Once upon a time",
            max_tokens=12,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        with streamed:
            texts = [c.choices[0].text for c in streamed if c.choices]
        assert sum(1 for t in texts if t) >= 3, texts
    print(
        f"chat: {answer.usage.completion_tokens} tokens; stream: {len(chunks)} chunks, {len(pieces)} with "
        f"content, usage last; completions: {completion.usage.completion_tokens} tokens, "
        f"stream of {len(texts)} chunks"
    )


def test_two_replicas_share_the_load(fleet: Fleet) -> None:
    ports = fleet.running("tiny", 2)
    assert len(ports) == 2
    logs = {name: fleet.engine_log("tiny", name) for name in ports}
    before = {name: metrics(port) for name, port in ports.items()}
    tasks_before = {name: tasks_started(log) for name, log in logs.items()}

    def ask(i: int) -> int:
        answer = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": f"Question number {i}?"}], max_tokens=8
        )
        assert answer.choices[0].message.content is not None and answer.usage is not None
        return answer.usage.completion_tokens

    sequential, concurrent = 10, 14
    with fleet.openai() as client:
        tokens = [ask(i) for i in range(sequential)]
        with ThreadPoolExecutor(concurrent) as pool:
            tokens += list(pool.map(ask, range(sequential, sequential + concurrent)))
    total = sequential + concurrent

    def settled() -> dict[str, int] | None:
        counts = {name: tasks_started(log) - tasks_before[name] for name, log in logs.items()}
        return counts if sum(counts.values()) == total else None

    per_replica = wait_for(settled, timeout=10, what=f"the engines' logs to show {total} requests")
    after = {name: metrics(port) for name, port in ports.items()}
    predicted = {
        n: int(after[n]["tokens_predicted_total"] - before[n]["tokens_predicted_total"]) for n in ports
    }
    decodes = {n: int(after[n]["n_decode_total"] - before[n]["n_decode_total"]) for n in ports}
    print(f"{total} requests: per replica {per_replica}; tokens predicted {predicted}; decodes {decodes}")
    # Every token the clients got was generated by one of the two replicas, each of which did work.
    assert sum(predicted.values()) == sum(tokens)
    assert all(n > 0 for n in predicted.values()) and all(n > 0 for n in decodes.values()), (
        predicted,
        decodes,
    )
    # Least outstanding work with random tie-breaks: neither replica is left (nearly) idle.
    assert min(per_replica.values()) >= 3, per_replica


# --- refusals, in OpenAI's error shape ----------------------------------------------------------------


def test_keys_models_and_revocation_are_enforced(fleet: Fleet) -> None:
    env = cli_env(fleet.server, fleet.tmp / "cli")
    out = run_cli("keys", "create", "busy-only", "--models", "busy", "-o", "json", env=env)
    assert out.returncode == 0, out.stderr
    created = json.loads(out.stdout)
    busy_key, busy_id = created["key"], created["id"]

    with fleet.openai(busy_key) as client:
        assert [m.id for m in client.models.list().data] == ["busy"]
        # A model the key may not use gets the same 404 as one that does not exist: the key
        # learns nothing about models beyond its own.
        with pytest.raises(openai.NotFoundError) as denied:
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
        assert denied.value.status_code == 404
        assert denied.value.code == "model_not_found" and denied.value.param == "model"
        assert denied.value.type == "invalid_request_error" and "tiny" in denied.value.message

        with pytest.raises(openai.NotFoundError) as missing:
            client.chat.completions.create(
                model="no-such-model", messages=[{"role": "user", "content": "hi"}]
            )
        assert missing.value.status_code == 404 and missing.value.code == "model_not_found"
        assert "no-such-model" in missing.value.message

        ok = client.chat.completions.create(
            model="busy", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        assert ok.choices[0].message.content is not None

    with fleet.openai("fs-not-a-key") as client, pytest.raises(openai.AuthenticationError) as bogus:
        client.models.list()
    assert bogus.value.status_code == 401 and bogus.value.code == "invalid_api_key"
    with fleet.http(key="") as http:
        for response in (
            http.get("/models"),
            http.post(
                "/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "x"}]}
            ),
        ):
            assert response.status_code == 401, response.text
            assert error_of(response)["code"] == "invalid_api_key"

    # Revoked through the CLI, the key that was just used is refused; the CLI says "requests with
    # it get 401 from then on".
    out = run_cli("keys", "revoke", str(busy_id), env=env)
    assert out.returncode == 0, out.stderr
    revoked_at = time.monotonic()
    with fleet.http(busy_key) as http:
        first = http.post(
            "/chat/completions",
            json={"model": "busy", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2},
        )
        refused_after = 0.0
        while first.status_code != 401 and refused_after < 15:
            time.sleep(0.1)
            refused_after = time.monotonic() - revoked_at
            if http.get("/models").status_code == 401:
                break
    assert first.status_code == 401, (
        f"a revoked key was still served ({first.status_code}) right after `fleetserve keys revoke`; "
        f"it was refused only {refused_after:.1f} s after the revocation"
    )
    assert error_of(first)["code"] == "invalid_api_key"
    listed = run_cli("keys", "list", "-o", "json", env=env)
    assert {k["id"]: k["revoked"] for k in json.loads(listed.stdout)}[busy_id] is True


def test_a_key_over_its_request_rate_gets_429_with_retry_after(fleet: Fleet) -> None:
    _, limited = fleet.create_key("two-a-minute", ["tiny"], rpm=2)
    ports = fleet.running("tiny", 2)

    def decodes() -> float:
        return sum(metrics(port)["n_decode_total"] for port in ports.values())

    start = decodes()
    with fleet.openai(limited) as client:
        for _ in range(2):
            answer = client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4
            )
            assert answer.choices[0].message.content is not None
        served = decodes()
        sent_at = time.monotonic()
        with pytest.raises(openai.RateLimitError) as limited_error:
            client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4
            )
        refused = decodes()
    error = limited_error.value
    retry_after = int(error.response.headers["retry-after"])
    print(f"third request: 429 {error.code}/{error.type}, Retry-After {retry_after} s: {error.message}")
    assert error.status_code == 429 and error.code == "rate_limit_exceeded" and error.type == "requests"
    # The two admitted requests were sent just now: the window frees them in about a minute.
    assert 60 - (time.monotonic() - sent_at) - 5 <= retry_after <= 60, retry_after
    assert served > start and refused == served, "the refused request must not reach an engine"
    # The limit is the key's, not the deployment's: another key is served at once.
    with fleet.openai() as client:
        assert client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        ).choices


def test_a_browser_gets_the_gateways_cors_for_its_origin_only_never_the_engines(fleet: Fleet) -> None:
    ports = fleet.running("tiny", 2)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    # llama-server itself allows whatever origin asks: that must not pass through the gateway.
    port = next(iter(ports.values()))
    direct = httpx.post(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        headers={**ENGINE_HEADERS[port], "Origin": "https://evil.example"},
        json=body,
        timeout=30,
    )
    print(f"llama-server's own CORS: {direct.headers.get_list('access-control-allow-origin')}")
    preflight = httpx.options(
        f"{fleet.base_url}/chat/completions",
        headers={
            "Origin": BROWSER_ORIGIN,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        },
        timeout=10,
    )
    assert preflight.status_code == 204, preflight.text
    assert preflight.headers["access-control-allow-origin"] == BROWSER_ORIGIN
    with fleet.http() as http:
        for stream in (False, True):
            allowed = http.post(
                "/chat/completions", headers={"Origin": BROWSER_ORIGIN}, json={**body, "stream": stream}
            )
            assert allowed.status_code == 200, allowed.text
            assert allowed.headers.get_list("access-control-allow-origin") == [BROWSER_ORIGIN]
            other = http.post(
                "/chat/completions",
                headers={"Origin": "https://evil.example"},
                json={**body, "stream": stream},
            )
            assert other.status_code == 200, other.text
            assert [n for n in other.headers if n.startswith("access-control-")] == []


def test_a_body_over_the_limit_gets_413_without_reaching_an_engine(fleet: Fleet) -> None:
    ports = fleet.running("tiny", 2)
    before = {name: metrics(port) for name, port in ports.items()}
    huge = "x" * (9 << 20)  # over the gateway's 8 MiB
    with fleet.openai() as client, pytest.raises(openai.APIStatusError) as too_big:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": huge}])
    assert too_big.value.status_code == 413, too_big.value
    assert too_big.value.type == "invalid_request_error" and "larger than" in too_big.value.message

    # The same without a Content-Length (chunked): refused once the body read grows past the limit.
    def chunks() -> Iterator[bytes]:
        yield b'{"model": "tiny", "messages": [{"role": "user", "content": "'
        for _ in range(9):
            yield b"x" * (1 << 20)
        yield b'"}]}'

    with fleet.http() as http:
        response = http.post(
            "/chat/completions", content=chunks(), headers={"content-type": "application/json"}
        )
    assert response.status_code == 413, response.text
    assert error_of(response)["type"] == "invalid_request_error"
    after = {name: metrics(port) for name, port in ports.items()}
    for name in ports:
        for counter in ("prompt_tokens_total", "n_decode_total", "tokens_predicted_total"):
            assert after[name][counter] == before[name][counter], (name, counter, before[name], after[name])


def test_an_embeddings_request_to_a_chat_model_is_refused_by_the_gateway(fleet: Fleet) -> None:
    """The deployments serve task generate: an embeddings request gets the gateway's 400 naming
    the task, never the engine's 501 (llama-server started without ``--embeddings``)."""
    with fleet.http() as http:
        started = time.monotonic()
        response = http.post("/embeddings", json={"model": "tiny", "input": "hello"})
        took = time.monotonic() - started
    print(f"embeddings to a generate model: {response.status_code} {response.text} in {took * 1000:.0f} ms")
    assert response.status_code == 400, response.text
    error = error_of(response)
    assert error["type"] == "invalid_request_error" and error["code"] == "model_task_mismatch", error
    assert "task generate" in error["message"] and "task embed" in error["message"], error
    with fleet.openai() as client, pytest.raises(openai.BadRequestError) as raised:
        client.embeddings.create(model="tiny", input="hello")
    assert "task embed" in raised.value.message


# --- overload, disconnects and failures ---------------------------------------------------------------


def test_overload_gets_429_with_retry_after_and_never_a_5xx(fleet: Fleet) -> None:
    """``busy``: 1 replica, so as many requests in service as llama.cpp has slots (4); 1 may wait,
    for 1 s. 20 long streams at once."""
    [port] = fleet.running("busy", 1).values()
    results: list[tuple[int, str | None, str, float]] = []

    def one(i: int) -> tuple[int, str | None, str, float]:
        body = slow_chat("busy", f"s{i}", stream=True)
        started = time.monotonic()
        with http.stream("POST", "/chat/completions", json=body) as response:
            text = response.read().decode()
        return response.status_code, response.headers.get("retry-after"), text, time.monotonic() - started

    burst = 20
    started = time.monotonic()
    with fleet.http(timeout=120) as http, ThreadPoolExecutor(burst) as pool:
        results = list(pool.map(one, range(burst)))
    took = time.monotonic() - started
    statuses = sorted(status for status, *_ in results)
    counts = {s: statuses.count(s) for s in set(statuses)}
    print(
        f"{burst} concurrent long streams in {took:.1f} s: statuses {counts}; Retry-After "
        f"{sorted({r for s, r, *_ in results if s == 429})}; 429s answered within "
        f"{max((t for s, _, _, t in results if s == 429), default=0):.2f} s"
    )
    assert not [s for s in statuses if s >= 500], counts
    assert set(statuses) <= {200, 429}, counts
    slots = ENGINES[EngineKind.LLAMACPP].concurrency_per_replica
    assert counts.get(200, 0) >= slots, counts  # the deployment's capacity was used
    assert counts.get(429, 0) >= 1, counts
    # Refused at once (queue full) or after the 1 s wait, never after queueing for long.
    assert all(t < 3.0 for s, _, _, t in results if s == 429), results
    for status, retry_after, text, _ in results:
        if status == 429:
            assert retry_after is not None and int(retry_after) >= 1, (retry_after, text)
            error = json.loads(text)["error"]
            assert error["code"] == "overloaded" and error["type"] == "overloaded", error
        else:
            events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]", text[-300:]
            choices = [c for e in events[:-1] for c in json.loads(e)["choices"]]
            content = "".join(c.get("delta", {}).get("content") or "" for c in choices)
            finishes = [c["finish_reason"] for c in choices if c.get("finish_reason")]
            assert finishes == ["length"] and len(content) >= SLOW_TOKENS, text[-300:]  # a whole answer
    # Nothing stays counted once the burst is over: the engine is idle and a request is served.
    assert metrics(port)["requests_processing"] == 0
    with fleet.openai() as client:
        assert client.chat.completions.create(
            model="busy", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        ).choices


def test_a_client_that_disconnects_mid_stream_cancels_the_upstream_request(fleet: Fleet) -> None:
    [port] = fleet.running("busy", 1).values()
    before = metrics(port)
    assert before["requests_processing"] == 0
    read = 0
    with fleet.openai() as client:
        stream = client.chat.completions.create(
            model="busy",
            messages=[{"role": "user", "content": "Tell me a long story."}],
            max_tokens=2000,
            stream=True,
            extra_body=GROWING,
        )
        with stream:
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    read += 1
                if read >= 110:
                    break
            busy = metrics(port)["requests_processing"]
        closed_at = time.monotonic()  # leaving the with block closed the connection
    assert busy == 1, "the engine was generating when the client went away"
    idle = wait_for(
        lambda: metrics(port)["requests_processing"] == 0,
        timeout=20,
        what="the engine to stop",
        interval=0.05,
    )
    stopped_after = time.monotonic() - closed_at
    decoded = int(metrics(port)["n_decode_total"] - before["n_decode_total"])
    print(
        f"client read {read} chunks and closed; engine idle {stopped_after:.2f} s later, after {decoded} "
        f"decodes (the whole answer is ~235 tokens, ~10 s here)"
    )
    assert idle
    assert stopped_after < 2.0, f"the engine kept generating for {stopped_after:.1f} s"
    assert decoded < read + 60, f"{decoded} tokens generated for a client that read {read}"


def test_a_replica_killed_mid_batch_fails_no_request(fleet: Fleet) -> None:
    ports = fleet.running("tiny", 2)
    victim = sorted(ports)[0]
    [engine] = [p for p in llama_servers(fleet.tmp) if port_of(p) == ports[victim]]
    # Watched through the engine's log, not its /metrics: with every HTTP thread of llama-server
    # (slots + 2) waiting on a request, /metrics answers only once one of them is done.
    log = fleet.engine_log("tiny", victim)
    seen = len(log.read_bytes())

    def in_its_slots() -> int:
        text = log.read_bytes()[seen:].decode(errors="replace")
        return text.count("processing task") - text.count("stop processing")

    batch = 16

    def one(i: int) -> tuple[int, str]:
        answer = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": f"s{i}"}],
            max_tokens=SLOW_TOKENS,
            extra_body=SLOW,
        )
        assert answer.usage is not None
        return answer.usage.completion_tokens, answer.choices[0].message.content or ""

    with fleet.openai() as client, ThreadPoolExecutor(batch) as pool:
        futures = [pool.submit(one, i) for i in range(batch)]
        in_flight = wait_for(
            lambda: (n := in_its_slots()) >= 2 and n,
            timeout=30,
            what=f"{victim} to be busy",
            interval=0.02,
        )
        killed_at = time.monotonic()
        engine.send_signal(signal.SIGKILL)
        results = []
        failures = []
        for future in futures:
            try:
                results.append(future.result(timeout=120))
            except Exception as exc:  # every failure is reported below
                failures.append(repr(exc))
    took = time.monotonic() - killed_at
    print(
        f"kill -9 {victim} with {in_flight} requests in its slots: {len(results)}/{batch} answered, "
        f"{len(failures)} failed, last one {took:.1f} s after the kill"
    )
    assert failures == [], failures
    assert all(tokens == SLOW_TOKENS and len(text) >= SLOW_TOKENS for tokens, text in results), results

    # The agent restarts the engine: both replicas serve again (later requests may count on it).
    def both_serving() -> list[Any]:
        serving = fleet.running("tiny", 2)
        engines = [p for p in llama_servers(fleet.tmp) if port_of(p) in serving.values()]
        return engines if len(engines) == 2 and engine.pid not in {p.pid for p in engines} else []

    wait_for(both_serving, timeout=60, what=f"{victim} to run again")
    time.sleep(ROUTE_REFRESH)
