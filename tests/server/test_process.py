"""The processes ``fleetserve server`` and ``fleetserve gateway`` are assembled by one wiring
(fleetserve.server.process): an extra gateway scrapes the engines like the control plane does,
so its picker sees the engines' load and its ``/metrics`` publishes the engine series.

A replica is Running on a node at 127.0.0.1 whose "engine" answers ``/metrics`` with a recorded
llama-server body (tests/fake_engine.py). tests/e2e/test_gateway_process.py checks the same on a
real ``fleetserve gateway`` process.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from fake_engine import BUSY, REPLICA, engine_metrics, recorded, run_replica_on
from fleetserve.server.process import ControlPlane, gateway_app, heartbeat_policy, server_app
from fleetserve.store.sql import SqlStore


@pytest.fixture
def running_store(tmp_path: Path) -> Iterator[SqlStore]:
    """A store holding one Running llama.cpp replica whose stand-in engine is up."""
    with engine_metrics(BUSY.read_bytes()) as port, SqlStore.open(tmp_path / "state.db") as store:
        run_replica_on(store, port, tmp_path / "tiny.gguf")
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
    waiting = recorded("llamacpp:requests_deferred")
    running = recorded("llamacpp:requests_processing")
    with TestClient(app) as client:
        text = _scraped(client, app)
        line = next(x for x in text.splitlines() if x.startswith("fleetserve_requests_waiting{"))
        assert f'replica="{REPLICA}"' in line and float(line.split()[-1]) == waiting
        line = next(x for x in text.splitlines() if x.startswith("fleetserve_requests_running{"))
        assert f'replica="{REPLICA}"' in line and float(line.split()[-1]) == running
        # The picker counts the engine's queue: the gateway's in-flight count is 0 here.
        assert app.state.gateway._load(REPLICA).outstanding() == int(waiting)
