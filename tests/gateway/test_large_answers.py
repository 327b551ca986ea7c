"""Large non-streamed answers through the gateway, from a scripted engine over real sockets: held
whole up to ``upstream.HOLD_BYTES``, passed in pieces beyond, byte for byte, their usage read as
they pass; one past ``--max-answer-bytes`` is cut off, never ended as if it were whole."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest

from fake_engine import ServedGateway, engines_on
from fleetserve.gateway.upstream import HOLD_BYTES
from fleetserve.store.sql import SqlStore

ROWS = 2000  # an embeddings answer of about 5 MiB: well past HOLD_BYTES


def big_answer() -> bytes:
    data = [{"object": "embedding", "index": i, "embedding": [0.123456] * 300} for i in range(ROWS)]
    usage = {"prompt_tokens": 4321, "total_tokens": 4321}
    return json.dumps({"object": "list", "data": data, "model": "tiny", "usage": usage}).encode()


def scripted(body: bytes, chunked: bool, repeat: int = 1) -> tuple[socket.socket, int]:
    """An engine answering every request with ``body`` (``repeat`` times, chunked or with its length)."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=answer, args=(conn,), daemon=True).start()

    def answer(conn: socket.socket) -> None:
        with conn:
            head = b""
            while b"\r\n\r\n" not in head:
                got = conn.recv(65536)
                if not got:
                    return
                head += got
            length = int(next((line.split(b":")[1] for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length")), b"0"))  # fmt: skip
            rest = head.split(b"\r\n\r\n", 1)[1]
            while len(rest) < length:
                rest += conn.recv(65536)
            try:
                if chunked:
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                                 b"Transfer-Encoding: chunked\r\n\r\n")  # fmt: skip
                    for _ in range(repeat):
                        for at in range(0, len(body), 1 << 16):
                            piece = body[at : at + (1 << 16)]
                            conn.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
                    conn.sendall(b"0\r\n\r\n")
                else:
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))  # fmt: skip
            except OSError:
                pass

    threading.Thread(target=serve, daemon=True).start()
    return listener, listener.getsockname()[1]


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[tuple[ServedGateway, Path]]:
    with SqlStore.open(tmp_path / "state.db") as store, ServedGateway(store, engines=0) as gw:
        yield gw, tmp_path


def serve_from(gw: ServedGateway, tmp: Path, port: int) -> str:
    engines_on(gw.store, [port], tmp / "tiny.gguf", task="embed")  # its answers are embeddings
    deadline = time.monotonic() + 10
    while not (gw.gateway.table.routes.get("tiny") and gw.gateway.table.routes["tiny"].endpoints):
        assert time.monotonic() < deadline, "the replica never reached the routes"
        time.sleep(0.02)
    _, token = gw.store.create_api_key(f"k{port}", ["*"], None, None, datetime.now(UTC))
    return token


def counted(gw: ServedGateway) -> tuple[int, int]:
    flusher = gw.gateway.usage_flusher
    assert flusher is not None
    asyncio.run_coroutine_threadsafe(flusher.flush(), gw.loop).result(30)
    now = datetime.now(UTC)
    totals = gw.store.usage_totals(now - timedelta(minutes=2), now + timedelta(minutes=1), "key")
    return sum(t.prompt_tokens for t in totals.values()), sum(t.completion_tokens for t in totals.values())


@pytest.mark.parametrize("chunked", [False, True], ids=["with-length", "chunked"])
def test_a_large_answer_passes_in_pieces_byte_for_byte_and_its_usage_is_counted(gateway, chunked) -> None:
    gw, tmp = gateway
    body = big_answer()
    assert len(body) > 4 * HOLD_BYTES
    listener, port = scripted(body, chunked)
    with listener:
        token = serve_from(gw, tmp, port)
        got = httpx.post(
            f"{gw.url}/v1/embeddings",
            json={"model": "tiny", "input": "x"},
            headers={"Authorization": f"Bearer {token}"},
            timeout=30,
        )
    assert got.status_code == 200
    assert got.content == body
    assert got.headers["content-type"] == "application/json"
    deadline = time.monotonic() + 10
    while counted(gw) != (4321, 0):
        assert time.monotonic() < deadline, f"counted {counted(gw)}, not the answer's usage"
        time.sleep(0.1)


def test_an_answer_passing_the_limit_as_it_comes_is_cut_off_not_ended_as_if_whole(gateway) -> None:
    gw, tmp = gateway
    body = big_answer()
    gw.gateway.limits = replace(gw.gateway.limits, answer_bytes=3 * len(body))
    listener, port = scripted(body, chunked=True, repeat=5)  # 5 bodies: past the limit of 3
    with listener:
        token = serve_from(gw, tmp, port)
        auth = {"Authorization": f"Bearer {token}"}
        # The connection closed mid-answer:
        with httpx.Client(timeout=30) as client, pytest.raises(httpx.RemoteProtocolError):
            client.post(f"{gw.url}/v1/embeddings", json={"model": "tiny", "input": "x"}, headers=auth)
        # The gateway goes on serving.
        assert httpx.get(f"{gw.url}/v1/models", headers=auth, timeout=10).status_code == 200


def test_a_large_answers_first_pieces_reach_the_client_before_its_end_left_the_engine(gateway) -> None:
    """Relayed as it comes, not held whole: the engine sends the rest of its answer only once the
    client has read the first part (a gateway holding the whole answer would wait forever)."""
    gw, tmp = gateway
    first, rest = b"[" + b"1," * (HOLD_BYTES + 1), b"1" * 1000 + b"]"
    go_on = threading.Event()
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(first) + len(rest), first))  # fmt: skip
            if go_on.wait(20):
                conn.sendall(rest)

    threading.Thread(target=serve, daemon=True).start()
    with listener:
        token = serve_from(gw, tmp, listener.getsockname()[1])
        with httpx.stream(
            "POST",
            f"{gw.url}/v1/embeddings",
            json={"model": "tiny", "input": "x"},
            headers={"Authorization": f"Bearer {token}"},
            timeout=30,
        ) as got:
            assert got.status_code == 200
            received = b""
            for piece in got.iter_raw():
                received += piece
                if len(received) >= len(first):
                    go_on.set()
            assert go_on.is_set() and received == first + rest
