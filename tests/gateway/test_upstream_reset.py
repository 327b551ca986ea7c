"""A request the gateway gives up on is reset, not closed, over a real socket.

Behind a partition, what the gateway wrote to an engine sits in the kernel's send queue and is
retransmitted until it gets through: after the heal, the engine would start a generation nobody
waits for (the lab's partition scenario saw one). An abortive close (zero linger) drops that queue
and resets the connection. On loopback the bytes are delivered at once, so what this shows is the
other half: the engine's side sees a reset, never an orderly end of the request stream.
"""

from __future__ import annotations

import asyncio
import socket
import threading

import pytest

from fleetserve.httpclient import HttpClient, Origin, UpstreamTimeout


def _silent_server() -> tuple[socket.socket, threading.Event, list[str]]:
    """A listener that accepts one connection, waits to be told, then reads it to its end."""
    listener = socket.create_server(("127.0.0.1", 0))
    go = threading.Event()
    seen: list[str] = []

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            go.wait(10)
            conn.settimeout(5)
            try:
                while chunk := conn.recv(65536):
                    seen.append(f"{len(chunk)} bytes")
                seen.append("orderly close")
            except ConnectionResetError:
                seen.append("reset")

    threading.Thread(target=serve, daemon=True).start()
    return listener, go, seen


def test_a_request_given_up_on_resets_its_connection() -> None:
    listener, go, seen = _silent_server()
    port = listener.getsockname()[1]

    async def scenario() -> None:
        client = HttpClient()
        try:
            with pytest.raises(UpstreamTimeout):
                await client.request(
                    Origin("127.0.0.1", port), b"POST /v1/completions HTTP/1.1\r\nHost: e\r\n\r\n", 0.2
                )
        finally:
            await client.aclose()

    asyncio.run(scenario())
    go.set()
    for _ in range(100):
        if seen and seen[-1] in ("reset", "orderly close"):
            break
        threading.Event().wait(0.05)
    listener.close()
    assert seen[-1] == "reset", seen
