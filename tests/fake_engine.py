"""A stand-in engine for tests of the metrics path: an HTTP server answering ``/metrics`` with a
recorded llama-server body, and a store holding one Running replica whose engine it is.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from builders import deployment, node
from fleetserve.protocol import ReplicaStatus
from fleetserve.spec.resources import Model, Replica, ReplicaState, Shard
from fleetserve.store.sql import SqlStore

BUSY = Path(__file__).resolve().parent / "fixtures" / "metrics" / "llamacpp_b11434_tiny_busy_2_slots.prom"
REPLICA = "tiny-0"


def recorded(name: str, body: str | None = None) -> float:
    """The value of the unlabelled series ``name`` in ``body`` (default: the BUSY recording)."""
    text = BUSY.read_text(encoding="utf-8") if body is None else body
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(name + " ")))


@contextmanager
def engine_metrics(body: bytes) -> Iterator[int]:
    """An HTTP server on 127.0.0.1 answering every GET with ``body``; yields its port."""

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


def run_replica_on(store: SqlStore, port: int, model_path: Path) -> None:
    """Record, as an agent would, llama.cpp replica REPLICA Running on node c1 (127.0.0.1) at ``port``."""
    store.put_model(Model.model_validate({"name": "tiny", "source": str(model_path), "format": "gguf"}))
    profile = {"name": "cpu", "engine": "llama.cpp", "cpu": {"cores": 1}}
    store.put_deployment(deployment("tiny", 1, profile, model="tiny"))
    epoch = store.register(node("c1", 4, "8GiB", address="127.0.0.1")).epoch
    shard = Shard(node="c1", cpu_cores=1, memory=1 << 30)
    store.allocate(Replica(name=REPLICA, deployment="tiny", profile="cpu", shards=(shard,)))
    store.report("c1", epoch, datetime.now(UTC), {REPLICA: (ReplicaState.RUNNING, ReplicaStatus(port=port))})
