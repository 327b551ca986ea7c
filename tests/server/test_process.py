"""The processes ``fleetserve server`` and ``fleetserve gateway`` are assembled by one wiring
(fleetserve.server.process): an extra gateway scrapes the engines like the control plane does,
so its picker sees the engines' load and its ``/metrics`` publishes the engine series.

A replica is Running on a node at 127.0.0.1 whose "engine" is a small HTTP server answering
``/metrics`` with a recorded llama-server body (tests/fixtures/metrics).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from fleetserve.server.process import ControlPlane, gateway_app, heartbeat_policy, server_app
from fleetserve.spec.resources import Deployment, Model, Node, Replica, ReplicaState, Shard
from fleetserve.store.sql import SqlStore

BUSY = Path(__file__).resolve().parents[1] / "fixtures" / "metrics" / "llamacpp_b11434_tiny_busy_2_slots.prom"
REPLICA = "tiny-0"


def _value(body: str, name: str) -> float:
    return float(next(line.split()[-1] for line in body.splitlines() if line.startswith(name + " ")))


@pytest.fixture
def engine() -> Iterator[int]:
    """A stand-in llama-server answering /metrics with the recorded body; yields its port."""
    body = BUSY.read_bytes()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def running_store(tmp_path: Path, engine: int) -> Iterator[SqlStore]:
    """A store holding one Running llama.cpp replica whose engine listens on ``engine``."""
    with SqlStore.open(tmp_path / "state.db") as store:
        store.put_model(
            Model.model_validate({"name": "tiny", "source": str(tmp_path / "t.gguf"), "format": "gguf"})
        )
        store.put_deployment(
            Deployment.model_validate(
                {
                    "name": "tiny",
                    "model": "tiny",
                    "profiles": [{"name": "cpu", "engine": "llama.cpp", "cpu": {"cores": 1}}],
                }
            )
        )
        node = Node.model_validate(
            {"name": "c1", "address": "127.0.0.1", "cpu": {"cores": 4, "memory": "8GiB"}}
        )
        epoch = store.register(node).epoch
        shard = Shard(node="c1", cpu_cores=1, memory=1 << 30)
        store.allocate(Replica(name=REPLICA, deployment="tiny", profile="cpu", shards=(shard,)))
        store.report("c1", epoch, datetime.now(UTC), {REPLICA: (ReplicaState.RUNNING, {"port": engine})})
        yield store


def _scraped(client: TestClient, app: FastAPI) -> str:
    deadline = time.monotonic() + 15
    text = ""
    while time.monotonic() < deadline:
        text = client.get("/metrics").text
        if "fleetserve_requests_waiting{" in text and app.state.gateway.engine_waiting(REPLICA):
            return text
        time.sleep(0.2)
    raise AssertionError(f"the engine's figures never reached the process; /metrics was:\n{text}")


@pytest.mark.parametrize("kind", ["server", "gateway"])
def test_both_processes_see_the_engines_load_and_publish_it(kind, running_store, tmp_path):
    if kind == "server":
        control = ControlPlane(tmp_path / "models", 0.2, heartbeat_policy(40, 300), None)
        app = server_app(running_store, control)
    else:
        app = gateway_app(running_store)
    busy = BUSY.read_text(encoding="utf-8")
    waiting, running = (
        _value(busy, "llamacpp:requests_deferred"),
        _value(busy, "llamacpp:requests_processing"),
    )
    with TestClient(app) as client:
        text = _scraped(client, app)
        line = next(x for x in text.splitlines() if x.startswith("fleetserve_requests_waiting{"))
        assert f'replica="{REPLICA}"' in line and float(line.split()[-1]) == waiting
        line = next(x for x in text.splitlines() if x.startswith("fleetserve_requests_running{"))
        assert f'replica="{REPLICA}"' in line and float(line.split()[-1]) == running
        # The picker counts the engine's queue: the gateway's in-flight count is 0 here.
        assert app.state.gateway._load(REPLICA).outstanding() == int(waiting)
