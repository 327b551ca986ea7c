"""A real ``fleetserve gateway`` process, on its own over the control plane's database, scrapes the
engines as ``fleetserve server`` does: its ``/metrics`` publishes the engine series.

The database holds one llama.cpp replica Running on node c1 (127.0.0.1), recorded as an agent
would; its "engine" answers ``/metrics`` with a recorded llama-server body (tests/fake_engine.py).
No control plane runs: a gateway needs only the database.
"""

from __future__ import annotations

import subprocess

import httpx
import pytest
from e2e_support import FLEETSERVE, clean_env, free_port, wait_for

from fake_engine import BUSY, REPLICA, engine_metrics, recorded, run_replica_on
from fleetserve.store.sql import SqlStore

pytestmark = pytest.mark.slow


def test_a_standalone_gateway_publishes_the_engines_metrics(tmp_path):
    database = tmp_path / "state.db"
    port = free_port()
    with (tmp_path / "gateway.log").open("wb") as log, engine_metrics(BUSY.read_bytes()) as engine_port:
        with SqlStore.open(database) as store:
            run_replica_on(store, engine_port, tmp_path / "tiny.gguf")
        gateway = subprocess.Popen(
            [str(FLEETSERVE), "gateway", "--database-url", f"sqlite:///{database}", "--port", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=clean_env(),
        )
        try:

            def waiting_line() -> str | None:
                if gateway.poll() is not None:
                    raise AssertionError((tmp_path / "gateway.log").read_text(errors="replace"))
                try:
                    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2).text
                except httpx.TransportError:
                    return None
                return next(
                    (x for x in text.splitlines() if x.startswith("fleetserve_requests_waiting{")), None
                )

            line = wait_for(
                waiting_line, timeout=30, what="the gateway to publish the engine's waiting requests"
            )
            assert f'replica="{REPLICA}"' in line
            assert float(line.split()[-1]) == recorded("llamacpp:requests_deferred")
        finally:
            gateway.terminate()
            gateway.wait(timeout=20)
