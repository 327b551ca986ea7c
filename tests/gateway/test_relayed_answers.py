"""What the gateway takes from an engine's answer, over real sockets to a scripted engine: only
the headers an OpenAI client reads (``upstream.relayed``: no Set-Cookie, no text/html), and a
body read whole only up to its limit (``Response.read(limit)``: ``AnswerTooLarge``, the rest
never held)."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator

import pytest

from fleetserve.gateway.upstream import relayed
from fleetserve.httpclient import AnswerTooLarge, HttpClient, Origin

REQUEST = b"POST /v1/chat/completions HTTP/1.1\r\nHost: e\r\nContent-Length: 2\r\n\r\n{}"


def scripted_engine(answer: bytes, then: bytes = b"", pieces: int = 0) -> Iterator[int]:
    """A listener answering every connection with ``answer`` then ``then`` ``pieces`` times."""
    listener = socket.create_server(("127.0.0.1", 0))
    sent: list[int] = []

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                conn.recv(65536)
                try:
                    conn.sendall(answer)
                    for _ in range(pieces):
                        conn.sendall(then)
                        sent.append(len(then))
                except OSError:
                    pass

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield listener.getsockname()[1]
    finally:
        listener.close()


def exchange(port: int, limit: int | None) -> tuple[list[tuple[bytes, bytes]], bytes | Exception]:
    async def go() -> tuple[list[tuple[bytes, bytes]], bytes | Exception]:
        client = HttpClient()
        try:
            response = await client.request(Origin("127.0.0.1", port), REQUEST, 10)
            try:
                return relayed(response), await response.read(limit)
            except AnswerTooLarge as exc:
                return relayed(response), exc
            finally:
                response.close()
        finally:
            await client.aclose()

    return asyncio.run(go())


@pytest.fixture
def hostile_headers() -> Iterator[int]:
    body = b"<html><script>steal()</script></html>"
    yield from scripted_engine(
        b"HTTP/1.1 200 OK\r\nContent-Type: text/html\r\nSet-Cookie: session=evil; Path=/\r\n"
        b"Access-Control-Allow-Origin: *\r\nServer: llama.cpp\r\nX-Request-Id: r-1\r\n"
        b"OpenAI-Processing-Ms: 12\r\nX-Ratelimit-Remaining-Requests: 9\r\nRetry-After: 3\r\n"
        b"X-Powered-By: hostile\r\nContent-Length: %d\r\n\r\n" % len(body) + body
    )


def test_only_the_headers_an_openai_client_reads_are_relayed_and_html_is_plain_text(
    hostile_headers: int,
) -> None:
    headers, body = exchange(hostile_headers, None)
    got = dict(headers)
    assert got == {
        b"x-content-type-options": b"nosniff",
        b"content-type": b"text/plain; charset=utf-8",
        b"x-request-id": b"r-1",
        b"openai-processing-ms": b"12",
        b"x-ratelimit-remaining-requests": b"9",
        b"retry-after": b"3",
    }
    assert isinstance(body, bytes) and body.startswith(b"<html>")  # the bytes, as text, not a page


@pytest.mark.parametrize(
    "kind", [b"application/json", b"application/json; charset=utf-8", b"text/event-stream", b"Text/Plain"]
)
def test_the_media_types_of_api_answers_are_relayed_as_the_engine_named_them(kind: bytes) -> None:
    for port in scripted_engine(b"HTTP/1.1 200 OK\r\nContent-Type: %s\r\nContent-Length: 2\r\n\r\n{}" % kind):
        assert (b"content-type", kind) in exchange(port, None)[0]


def test_an_answer_declaring_more_than_the_limit_is_refused_before_its_body_is_read() -> None:
    head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % (1 << 30)
    for port in scripted_engine(head, b"x" * 65536, pieces=4):
        _, got = exchange(port, 1 << 20)
        assert isinstance(got, AnswerTooLarge) and str(1 << 20) in str(got)


def test_a_chunked_answer_past_the_limit_is_refused_as_it_comes() -> None:
    head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    chunk = b"10000\r\n" + b"x" * 65536 + b"\r\n"
    for port in scripted_engine(head, chunk, pieces=64):  # 4 MiB offered
        _, got = exchange(port, 1 << 20)
        assert isinstance(got, AnswerTooLarge)


def test_an_answer_within_the_limit_is_read_whole() -> None:
    head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % (3 * 65536)
    for port in scripted_engine(head, b"y" * 65536, pieces=3):
        _, got = exchange(port, 3 * 65536)
        assert got == b"y" * (3 * 65536)
