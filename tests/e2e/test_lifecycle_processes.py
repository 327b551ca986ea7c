"""Lossless lifecycle with real processes: a real ``fleetserve server`` (SQLite), real agents on
this machine's CPU running the real llama-server on the tiny model, clients through the server's
own /v1 gateway.

- A model whose URL answers 404: its replica fails again and again; the store never holds more
  than the one allocation it asked for, and the ``ReplicaFailure`` condition names the 404.
- A drain (``POST /nodes/NAME/drain``, what ``fleetserve drain`` calls) during a streamed answer of 20 chunks: the client gets all 20 chunks and
  ``[DONE]``; non-streamed requests sent meanwhile all complete; the replica leaves the routes,
  waits for its request and is released; nothing leaks.
- A rolling update (the deployment's model changes) under request load: 0 failed, 0 truncated
  non-streamed requests; ``fleetserve rollout status`` follows it and ``rollout undo`` rolls back.
- SIGTERM to ``fleetserve gateway`` and to ``fleetserve server`` mid-stream: the stream finishes
  (20 chunks, ``[DONE]``), then the process exits; an engine killed mid-stream ends the client's
  stream with an error event, never ``[DONE]``.
- Deleting a deployment mid-stream: the stream finishes, then the replica is released and its
  engine stopped.

Each scenario prints its counts (sent / completed / failed / truncated, leaked allocations).
"""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from e2e_support import (
    FLEETSERVE,
    AgentFactory,
    ServerFactory,
    ServerProcess,
    clean_env,
    cli_env,
    free_port,
    port_answers,
    read_state,
    run_cli,
    short_deadline_args,
    tiny_documents,
    wait_for,
)

from load import LoadCounts, one_request, run_load

pytestmark = pytest.mark.slow

# One slow-ish token at a time: 20 tokens take seconds, so a drain lands mid-stream.
SLOW_GRAMMAR = {
    "grammar": "root ::= " + " | ".join(f"r{i}" for i in range(12000)) + "\n"
    + "\n".join(f"r{i} ::= [a-z]*" for i in range(12000)),
    "ignore_eos": True,
}  # fmt: skip


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("model") / "tiny.gguf"
    out = run_cli("dev", "tiny-model", str(path))
    assert out.returncode == 0 and path.exists(), out.stderr
    return path


@pytest.fixture
def not_found_url() -> Iterator[str]:
    """An HTTP server on loopback that answers every GET with 404."""

    class NotFound(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), NotFound)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/models/tiny.gguf"
    finally:
        httpd.shutdown()
        httpd.server_close()


def content_of(event: str) -> list[str]:
    """The content piece of one streamed chat event, if it has one."""
    if event == "[DONE]":
        return []
    delta = (json.loads(event).get("choices") or [{}])[0].get("delta") or {}
    return [delta["content"]] if delta.get("content") else []


def start(
    servers: ServerFactory,
    agents: AgentFactory,
    tmp_path: Path,
    nodes: list[str],
    agent_args: tuple[str, ...] = (),
) -> ServerProcess:
    server = servers.start(
        f"sqlite:///{tmp_path / 'state.db'}", name="server", extra_args=short_deadline_args(tmp_path)
    )
    for node in nodes:
        agents.start(server.url, server.join_token, node, extra_args=agent_args)

    def registered() -> bool:
        with server.client(timeout=10) as api:
            ready = {n["name"] for n in api.get("/nodes").json() if n["state"] == "Ready"}
        return ready >= set(nodes)

    wait_for(registered, timeout=60, what=f"{nodes} to register")
    return server


def api_key(server: ServerProcess) -> dict[str, str]:
    with server.client(timeout=10) as api:
        response = api.post("/keys", json={"name": "load", "models": ["*"]})
    assert response.status_code == 200, response.text
    return {"Authorization": f"Bearer {response.json()['key']}"}


def deployment_view(server: ServerProcess, name: str) -> dict[str, Any]:
    with server.client(timeout=10) as api:
        response = api.get(f"/deployments/{name}")
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


def running(server: ServerProcess, name: str, count: int) -> list[dict[str, Any]]:
    replicas = [r for r in deployment_view(server, name)["replicas"] if r["state"] == "Running"]
    return replicas if len(replicas) == count else []


def leaked(server: ServerProcess, deployment: str, desired: int) -> int:
    """Allocations beyond the deployment's desired count, plus every broken store invariant."""
    state = read_state(server.database_url)
    assert state.violations() == [], state.violations()
    held = [n for n in state.replicas_of(deployment) if state.replicas[n]["state"] != "Draining"]
    return max(0, len(held) - desired)


def test_a_model_url_answering_404_fails_its_replica_again_and_again_without_leaking_capacity(
    servers: ServerFactory, agents: AgentFactory, tmp_path: Path, not_found_url: str
) -> None:
    # The 404 server is on loopback: the agent must be allowed to fetch from a private address.
    server = start(servers, agents, tmp_path, ["node-f"], agent_args=("--allow-private-sources",))
    docs: list[dict[str, Any]] = [
        {
            "kind": "Model",
            "name": "gone",
            "source": not_found_url,
            "format": "gguf",
            "size": "1MB",
            "architecture": {"layers": 2, "kvHeads": 4, "headDim": 16, "contextLength": 256},
        },
        {
            "kind": "Deployment",
            "name": "gone",
            "model": "gone",
            "replicas": 1,
            "profiles": [{"name": "cpu", "engine": "llama.cpp", "cpu": {"cores": 1}, "context": 256}],
        },
    ]
    server.apply(docs)
    failures = 3  # backoffs of 5 s and 10 s between them
    seen: set[str] = set()
    most_held = 0

    def failed_enough() -> bool:
        nonlocal most_held
        state = read_state(server.database_url)
        assert state.violations() == [], state.violations()
        mine = state.replicas_of("gone")
        most_held = max(most_held, len(mine))
        assert len(mine) <= 1, f"a deployment of 1 replica holds {mine}"
        seen.update(mine)
        status = state.deployments["gone"]["status"]
        return int((status.get("failures") or {}).get("count", 0)) >= failures

    wait_for(failed_enough, timeout=90, what=f"{failures} failures of the replica", interval=0.3)
    status = deployment_view(server, "gone")["status"]
    [condition] = [c for c in status["conditions"] if c["type"] == "ReplicaFailure"]
    assert condition["status"] is True and condition["reason"] == "ReplicaFailed"
    assert "404" in condition["message"], condition
    state = read_state(server.database_url)
    cores = sum(s[3] for s in state.shards if s[0] in state.replicas_of("gone"))
    print(
        f"failed replicas: {len(seen)} identities over {status['failures']['count']} failures; "
        f"at most {most_held} allocation held; {cores} core(s) held now; leaked allocations "
        f"{leaked(server, 'gone', 1)}"
    )
    assert len(seen) >= failures - 1, "each failure after a backoff was a replacement"
    assert cores <= 1 and leaked(server, "gone", 1) == 0


def test_a_drain_during_a_stream_delivers_all_20_chunks_and_loses_no_request(
    servers: ServerFactory, agents: AgentFactory, tmp_path: Path, tiny_model: Path
) -> None:
    server = start(servers, agents, tmp_path, ["node-a", "node-b"])
    server.apply(tiny_documents(tiny_model))
    [replica] = wait_for(lambda: running(server, "tiny", 1), timeout=90, what="the tiny replica to run")
    node = replica["shards"][0]["node"]
    headers = api_key(server)
    url = server.url + "/v1"
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Tell me a story."}],
        "max_tokens": 20,
        "stream": True,
        **SLOW_GRAMMAR,
    }
    stop = threading.Event()
    load: dict[str, LoadCounts] = {}
    loader = threading.Thread(
        target=lambda: load.setdefault("counts", run_load(url, "tiny", stop, headers=headers, workers=1))
    )
    pieces: list[str] = []
    events: list[str] = []
    states_while_streaming: set[str] = set()
    started = time.monotonic()
    with (
        httpx.Client(timeout=120) as http,
        http.stream("POST", f"{url}/chat/completions", json=body, headers=headers) as response,
    ):
        assert response.status_code == 200, response.read()
        stream = (line[6:] for line in response.iter_lines() if line.startswith("data: "))
        for event in stream:
            events.append(event)
            pieces += content_of(event)
            if len(pieces) == 2:
                break
        # Mid-stream: drain the node that serves it, with other requests arriving meanwhile.
        loader.start()
        with server.client(timeout=30) as api:
            drained = api.post(f"/nodes/{node}/drain", json={"reason": "maintenance"})
        assert drained.status_code == 200, drained.text
        assert drained.json()["draining"] == [replica["name"]], drained.json()
        for event in stream:
            events.append(event)
            pieces += content_of(event)
            with server.client(timeout=10) as api:
                view = api.get(f"/replicas/{replica['name']}")
            if view.status_code == 200:
                states_while_streaming.add(view.json()["state"])
    streamed = time.monotonic() - started
    errors = [e for e in events if e != "[DONE]" and "error" in json.loads(e)]
    print(f"stream: {len(pieces)} content chunks in {streamed:.1f} s, last event {events[-1]!r}")
    assert "Draining" in states_while_streaming, "the drain landed while the stream was running"
    assert len(pieces) == 20 and events[-1] == "[DONE]" and not errors, events[-3:]

    def released() -> bool:
        with server.client(timeout=10) as api:
            return api.get(f"/replicas/{replica['name']}").status_code == 404

    wait_for(released, timeout=60, what=f"{replica['name']} to be released after its stream")
    released_after = time.monotonic() - started
    [moved] = wait_for(lambda: running(server, "tiny", 1), timeout=90, what="the replacement to run")
    assert moved["shards"][0]["node"] != node
    with httpx.Client(timeout=60) as http:
        one_request(http, url, "tiny", load.setdefault("after", LoadCounts()), headers=headers)
    stop.set()
    loader.join(120)
    counts = load["counts"]
    print(
        f"drain: non-streamed {counts.summary()}; released {released_after:.1f} s after the stream began "
        f"(drainSeconds 30); leaked allocations {leaked(server, 'tiny', 1)}"
    )
    assert counts.sent > 0 and counts.failed == 0 and counts.truncated == 0, counts.errors
    assert load["after"].completed == 1
    assert leaked(server, "tiny", 1) == 0


def test_a_rolling_update_under_load_loses_no_request_and_can_be_undone(
    servers: ServerFactory, agents: AgentFactory, tmp_path: Path, tiny_model: Path
) -> None:
    server = start(servers, agents, tmp_path, ["node-a", "node-b"])
    docs = tiny_documents(tiny_model, replicas=2)
    server.apply(docs)
    wait_for(lambda: running(server, "tiny", 2), timeout=120, what="two tiny replicas to run")
    first = deployment_view(server, "tiny")["revision"]
    headers = api_key(server)
    url = server.url + "/v1"
    env = cli_env(server, tmp_path)

    stop = threading.Event()
    load: dict[str, LoadCounts] = {}
    loader = threading.Thread(
        target=lambda: load.setdefault("counts", run_load(url, "tiny", stop, headers=headers, workers=2))
    )
    loader.start()
    time.sleep(1.0)
    # The same weights under another model name: a new template revision, so every replica rolls.
    second_model = {**docs[0], "name": "tiny-b"}
    server.apply([second_model, {**docs[1], "model": "tiny-b"}])
    started = time.monotonic()
    out = run_cli("rollout", "status", "tiny", "--timeout", "180", env=env, timeout=200)
    rolled = time.monotonic() - started
    assert out.returncode == 0, out.stdout + out.stderr
    assert "rolled out" in out.stdout.splitlines()[-1], out.stdout
    view = deployment_view(server, "tiny")
    assert view["revision"] != first and view["status"]["previousRevision"] == first
    assert all(r["revision"] == view["revision"] for r in view["replicas"])

    out = run_cli("rollout", "undo", "tiny", env=env)
    assert out.returncode == 0, out.stderr
    assert f"rolled back to revision {first}" in out.stdout
    out = run_cli("rollout", "status", "tiny", "--timeout", "180", env=env, timeout=200)
    assert out.returncode == 0, out.stdout + out.stderr
    stop.set()
    loader.join(120)
    counts = load["counts"]
    view = deployment_view(server, "tiny")
    print(
        f"rollout: {rolled:.1f} s; under load {counts.summary()}; "
        f"leaked allocations {leaked(server, 'tiny', 2)}"
    )
    assert view["model"] == "tiny" and view["revision"] == first
    assert counts.completed > 0 and counts.failed == 0 and counts.truncated == 0, counts.errors
    assert leaked(server, "tiny", 2) == 0


def stream_events(http: httpx.Client, url: str, headers: dict[str, str]) -> Iterator[str]:
    """The data of every server-sent event of one slow streamed chat answer of 20 tokens."""
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Tell me a story."}],
        "max_tokens": 20,
        "stream": True,
        **SLOW_GRAMMAR,
    }
    with http.stream("POST", f"{url}/chat/completions", json=body, headers=headers) as response:
        assert response.status_code == 200, response.read()
        yield from (line[6:] for line in response.iter_lines() if line.startswith("data: "))


def test_gateway_and_server_on_sigterm_finish_their_streams_and_a_broken_upstream_is_signalled(
    servers: ServerFactory, agents: AgentFactory, tmp_path: Path, tiny_model: Path
) -> None:
    server = start(servers, agents, tmp_path, ["node-a"])
    server.apply(tiny_documents(tiny_model))
    wait_for(lambda: running(server, "tiny", 1), timeout=90, what="the tiny replica to run")
    headers = api_key(server)
    port = free_port()
    log = (tmp_path / "gateway.log").open("wb")
    gateway = subprocess.Popen(
        [str(FLEETSERVE), "gateway", "--database-url", server.database_url, "--port", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=clean_env(),
    )
    url = f"http://127.0.0.1:{port}/v1"
    try:
        wait_for(lambda: port_answers(port, "/healthz"), timeout=60, what="the gateway to answer")
        events: list[str] = []
        with httpx.Client(timeout=120) as http:
            stream = stream_events(http, url, headers)
            for event in stream:
                events.append(event)
                if len([p for e in events for p in content_of(e)]) == 2:
                    break
            gateway.send_signal(signal.SIGTERM)
            stopped = time.monotonic()
            time.sleep(0.5)
            with pytest.raises(httpx.TransportError):
                httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2)  # no longer accepting
            events += list(stream)
        pieces = [p for e in events for p in content_of(e)]
        code = gateway.wait(timeout=40)
        print(
            f"SIGTERM mid-stream: {len(pieces)} chunks, then exit {code} {time.monotonic() - stopped:.1f} s later"
        )
        assert len(pieces) == 20 and events[-1] == "[DONE]", events[-3:]
    finally:
        if gateway.poll() is None:
            gateway.kill()
            gateway.wait()
        log.close()

    # An engine killed mid-stream: the client sees an error event, never a normal end.
    [replica] = running(server, "tiny", 1)
    [engine] = agents.started[0].engines()
    events = []
    with httpx.Client(timeout=120) as http:
        stream = stream_events(http, server.url + "/v1", headers)
        for event in stream:
            events.append(event)
            if len([p for e in events for p in content_of(e)]) == 2:
                engine.kill()
                break
        events += list(stream)
    errors = [json.loads(e)["error"] for e in events if e != "[DONE]" and "error" in json.loads(e)]
    print(f"engine of {replica['name']} killed mid-stream: last event {events[-1][:120]!r}")
    assert "[DONE]" not in events
    assert [e["code"] for e in errors] == ["stream_broken"], events[-2:]

    # The control plane on SIGTERM, mid-stream: the stream finishes, then the server exits.
    wait_for(lambda: running(server, "tiny", 1), timeout=90, what="the killed engine to be restarted")
    wait_for(lambda: agents.started[0].engines(), timeout=30, what="the engine process")
    events = []
    with httpx.Client(timeout=120) as http:
        stream = stream_events(http, server.url + "/v1", headers)
        for event in stream:
            events.append(event)
            if len([p for e in events for p in content_of(e)]) == 2:
                server.proc.send_signal(signal.SIGTERM)
                stopped = time.monotonic()
                break
        events += list(stream)
    code = server.proc.wait(timeout=40)
    pieces = [p for e in events for p in content_of(e)]
    print(
        f"server SIGTERM mid-stream: {len(pieces)} chunks, exit {code} {time.monotonic() - stopped:.1f} s later"
    )
    assert len(pieces) == 20 and events[-1] == "[DONE]", events[-3:]


def test_deleting_a_deployment_during_a_stream_lets_the_stream_finish_then_stops_the_engine(
    servers: ServerFactory, agents: AgentFactory, tmp_path: Path, tiny_model: Path
) -> None:
    server = start(servers, agents, tmp_path, ["node-a"])
    server.apply(tiny_documents(tiny_model))
    [replica] = wait_for(lambda: running(server, "tiny", 1), timeout=90, what="the tiny replica to run")
    headers = api_key(server)
    events: list[str] = []
    with httpx.Client(timeout=120) as http:
        stream = stream_events(http, server.url + "/v1", headers)
        for event in stream:
            events.append(event)
            if len([p for e in events for p in content_of(e)]) == 2:
                break
        out = run_cli("delete", "deployment", "tiny", env=cli_env(server, tmp_path))
        assert out.returncode == 0, out.stderr
        events += list(stream)
    pieces = [p for e in events for p in content_of(e)]
    print(f"deleted mid-stream: {len(pieces)} chunks, last event {events[-1]!r}")
    assert len(pieces) == 20 and events[-1] == "[DONE]", events[-3:]

    def released() -> bool:
        with server.client(timeout=10) as api:
            return api.get(f"/replicas/{replica['name']}").status_code == 404

    wait_for(released, timeout=30, what=f"{replica['name']} to be released once its stream ended")
    wait_for(lambda: not agents.started[0].engines(), timeout=30, what="the engine to stop")
    assert read_state(server.database_url).violations() == []
