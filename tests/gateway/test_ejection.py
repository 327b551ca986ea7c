"""Outlier ejection, over a real socket: the gateway's upstream client (fleetserve.httpclient)
raises ConnectFailed for a replica nothing listens on (its host dropped off the network, its
engine died), and that failure, handed to the endpoint table as the gateway does on every failed
try, ejects the replica from this gateway's picks at once; the retry and every later request
pick the other replica until the backoff runs out.
"""

from __future__ import annotations

import asyncio
import random
import socket

from test_endpoints import LLAMA_CPU, Routes, stored

from builders import deployment
from fleetserve.gateway.endpoints import EndpointTable
from fleetserve.gateway.picker import pick
from fleetserve.httpclient import ConnectFailed, HttpClient, UpstreamError
from fleetserve.protocol import ReplicaStatus
from fleetserve.routing import ReplicaEndpoint
from fleetserve.spec.resources import Replica, ReplicaState, Shard


def dead_port() -> int:
    """A loopback port nothing listens on (connections to it are refused)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def replica(name: str, port: int) -> ReplicaEndpoint:
    r = Replica(
        name=name,
        deployment="chat",
        profile="cpu",
        shards=(Shard(node="n1", cpu_cores=1),),
        state=ReplicaState.RUNNING,
    )
    return ReplicaEndpoint(r, "127.0.0.1", ReplicaStatus(port=port))


def test_a_replica_that_refuses_connections_is_ejected_and_left_alone_by_later_picks():
    dead = dead_port()
    source = Routes(stored(deployment("chat", 2, LLAMA_CPU)), [replica("chat-0", dead), replica("chat-1", 9)])

    async def scenario() -> tuple[UpstreamError | None, list[str]]:
        table = EndpointTable(source)
        await table.refresh()
        client = HttpClient()
        failure: UpstreamError | None = None
        try:
            from fleetserve.gateway.upstream import origin_of

            origin, host = origin_of(f"http://127.0.0.1:{dead}")
            await client.request(origin, b"GET /health HTTP/1.1\r\nHost: " + host + b"\r\n\r\n", 5.0)
        except UpstreamError as exc:
            failure = exc
            table.failed("chat-0", exc)  # what the gateway does with a failed try
        finally:
            await client.aclose()
        route = table.routes["chat"]
        rng = random.Random(1)
        picks = [pick(route.endpoints, {}, rng, exclude=table.ejected("chat")) for _ in range(20)]
        return failure, [p.replica for p in picks if p is not None]

    failure, picked = asyncio.run(scenario())
    assert isinstance(failure, ConnectFailed), failure
    assert picked == ["chat-1"] * 20
