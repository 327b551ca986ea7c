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
from typing import TYPE_CHECKING

from builders import deployment, node
from fleetserve.protocol import ReplicaStatus
from fleetserve.spec.resources import Model, Replica, ReplicaState, Shard
from fleetserve.store.sql import SqlStore

if TYPE_CHECKING:
    from fleetserve.dev.fake_openai import FakeEngine

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


# --- a gateway in this process, in front of fake OpenAI engines -----------------------------------


class ServedGateway:
    """A gateway app served by uvicorn (uvloop, httptools) on 127.0.0.1 in a thread of its own, in
    front of fake OpenAI engines (fleetserve.dev.fake_openai) in the same event loop; with
    ``cors_origins``, its /v1 answers browsers of those origins; with ``endpoint_keys``, Endpoints'
    keys are read there; with ``probe_endpoints``, it checks their health as the server does."""

    def __init__(
        self,
        store: SqlStore,
        engines: int = 1,
        redis_url: str | None = None,
        namespace: str = "t",
        cors_origins: tuple[str, ...] = (),
        endpoint_keys: Path | None = None,
        probe_endpoints: bool = False,
    ):
        import asyncio

        import uvicorn
        import uvloop

        from fleetserve.dev.fake_openai import FakeEngine
        from fleetserve.endpointkeys import EndpointKeys
        from fleetserve.gateway.cors import Cors
        from fleetserve.server.app import Serving, create_gateway_app

        self.store = store
        self.engines = [FakeEngine() for _ in range(engines)]
        self.app = create_gateway_app(
            store,
            serving=Serving.build(
                store,
                redis_url=redis_url,
                redis_namespace=namespace,
                cors=Cors.of(cors_origins),
                endpoint_keys=EndpointKeys(endpoint_keys) if endpoint_keys is not None else None,
                probe_endpoints=probe_endpoints,
            ),
        )
        self.loop = uvloop.new_event_loop()
        self._ready = threading.Event()
        self._server: uvicorn.Server | None = None
        self.port = 0

        async def main() -> None:
            for engine in self.engines:
                await engine.start()
            config = uvicorn.Config(
                self.app, host="127.0.0.1", port=0, http="httptools", log_level="warning", lifespan="on"
            )
            self._server = uvicorn.Server(config)
            serving = asyncio.ensure_future(self._server.serve())
            while not self._server.started and not serving.done():
                await asyncio.sleep(0.01)
            if self._server.started:
                self.port = self._server.servers[0].sockets[0].getsockname()[1]
            self._ready.set()
            await serving
            for engine in self.engines:
                await engine.stop()

        self._thread = threading.Thread(target=self.loop.run_until_complete, args=(main(),), daemon=True)

    @property
    def gateway(self):  # the Gateway object, for tests that look inside
        return self.app.state.gateway

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ServedGateway:
        self._thread.start()
        if not self._ready.wait(30) or not self.port:
            raise AssertionError("the gateway did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._server is not None:
            self._server.should_exit = True
        self._thread.join(20)


def engines_on(
    store: SqlStore, ports: list[int], model_path: Path, engine_args: tuple[str, ...] = (), **fields: object
) -> list[str]:
    """Record llama.cpp replicas of deployment ``tiny`` Running on node c1 (127.0.0.1), one per port,
    their profile's engineArgs ``engine_args``."""
    store.put_model(Model.model_validate({"name": "tiny", "source": str(model_path), "format": "gguf"}))
    profile: dict[str, object] = {"name": "cpu", "engine": "llama.cpp", "cpu": {"cores": 1}}
    if engine_args:
        profile["engineArgs"] = list(engine_args)
    store.put_deployment(deployment("tiny", len(ports), profile, model="tiny", **fields))
    epoch = store.register(node("c1", 8, "8GiB", address="127.0.0.1")).epoch
    names = [f"tiny-{i}" for i in range(len(ports))]
    for name in names:
        shard = Shard(node="c1", cpu_cores=1, memory=1 << 30)
        store.allocate(Replica(name=name, deployment="tiny", profile="cpu", shards=(shard,)))
    store.report(
        "c1",
        epoch,
        datetime.now(UTC),
        {n: (ReplicaState.RUNNING, ReplicaStatus(port=p)) for n, p in zip(names, ports, strict=True)},
    )
    return names


@contextmanager
def fake_openai_engine() -> Iterator[int]:
    """A fake OpenAI engine (fleetserve.dev.fake_openai) on 127.0.0.1 in a thread; yields its port."""
    with fake_upstream() as engine:
        yield engine.port


@contextmanager
def fake_upstream(key: str | None = None, models: tuple[str, ...] = ("fake",)) -> Iterator[FakeEngine]:
    """A fake OpenAI server (fleetserve.dev.fake_openai) on 127.0.0.1 in a thread, requiring ``key``
    when given and listing ``models``: an Endpoint's server. Yields it (its ``port``, ``served``)."""
    import asyncio

    import uvloop

    from fleetserve.dev.fake_openai import FakeEngine

    loop = uvloop.new_event_loop()
    engine = FakeEngine(key, models)
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(engine.start(), loop).result(10)
    try:
        yield engine
    finally:
        asyncio.run_coroutine_threadsafe(engine.stop(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
