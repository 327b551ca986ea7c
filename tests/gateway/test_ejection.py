"""Outlier ejection through the gateway itself: a replica nothing listens on (its host dropped off
the network, its engine died) costs one connect failure, retried on the other replica before the
first byte; this gateway sends it nothing more until its backoff runs out.

Real sockets: the live "engine" is an HTTP server on loopback answering every POST with a chat
completion; the dead one is a loopback port nothing listens on. The store is held in memory.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
from fastapi import FastAPI

from builders import deployment
from fleetserve.gateway.app import Gateway, build_gateway_router
from fleetserve.protocol import ReplicaStatus
from fleetserve.routing import ReplicaEndpoint
from fleetserve.spec.resources import Replica, ReplicaState, Shard
from fleetserve.store.credentials import ApiKey
from fleetserve.store.deployments import StoredDeployment

ANSWER = json.dumps(
    {"object": "chat.completion", "choices": [{"message": {"role": "assistant", "content": "hi"}}]}
).encode()


@contextmanager
def engine() -> Iterator[int]:
    """An HTTP server on 127.0.0.1 answering every POST with a chat completion; yields its port."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("content-length", "0")))
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(ANSWER)))
            self.end_headers()
            self.wfile.write(ANSWER)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield int(server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()


def dead_port() -> int:
    """A loopback port nothing listens on (connections to it are refused)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def replica(name: str, port: int) -> ReplicaEndpoint:
    shard = Shard(node="n1", cpu_cores=1)
    r = Replica(name=name, deployment="chat", profile="cpu", shards=(shard,), state=ReplicaState.RUNNING)
    return ReplicaEndpoint(r, "127.0.0.1", ReplicaStatus(port=port))


@dataclass
class Store:
    """A GatewayStore in memory: one deployment, its endpoints, one API key for every model."""

    endpoints: list[ReplicaEndpoint] = field(default_factory=list)

    def list_deployments(self) -> list[StoredDeployment]:
        dep = deployment("chat", 2, {"name": "cpu", "engine": "llama.cpp", "cpu": {"cores": 1}})
        return [StoredDeployment(dep, 1, {})]

    def replica_endpoints(self) -> list[ReplicaEndpoint]:
        return list(self.endpoints)

    def verify_api_key(self, plaintext: str) -> ApiKey | None:
        return ApiKey(1, "k", ("*",), None, None, datetime.now(UTC), False) if plaintext == "k" else None


class Counting(httpx.AsyncHTTPTransport):
    """The real transport, counting the requests sent to each port."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: dict[int, int] = {}

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        port = request.url.port or 80
        self.sent[port] = self.sent.get(port, 0) + 1
        return await super().handle_async_request(request)


def test_a_replica_that_refuses_connections_costs_one_retry_then_is_left_alone():
    with engine() as live:
        dead = dead_port()
        store = Store([replica("chat-0", dead), replica("chat-1", live)])

        async def scenario() -> tuple[list[int], dict[int, int], frozenset[str]]:
            gateway = Gateway(store, seed=1)
            await gateway.start()
            counting = Counting()
            real, gateway.http = gateway.http, httpx.AsyncClient(transport=counting)
            if real is not None:
                await real.aclose()
            app = FastAPI()
            app.include_router(build_gateway_router(gateway))
            statuses = []
            try:
                async with httpx.AsyncClient(
                    transport=httpx.ASGITransport(app=app), base_url="http://gateway"
                ) as client:
                    for _ in range(20):
                        response = await client.post(
                            "/v1/chat/completions",
                            json={"model": "chat", "messages": [{"role": "user", "content": "hello"}]},
                            headers={"Authorization": "Bearer k"},
                        )
                        statuses.append(response.status_code)
                return statuses, counting.sent, gateway.table.ejected("chat")
            finally:
                await gateway.stop()

        statuses, sent, ejected = asyncio.run(scenario())
    assert statuses == [200] * 20
    assert sent.get(dead, 0) == 1, f"the dead replica was tried {sent.get(dead, 0)} times, not once"
    assert sent[live] == 20
    assert ejected == {"chat-0"}
