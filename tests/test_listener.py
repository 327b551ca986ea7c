"""The listener's bounds (``fleetserve.listener``) on a real uvicorn server over real sockets:
head size and header count (431), head timeout (408), the connection cap (503), keep-alive,
and that requests within the bounds (bodies larger than the head budget, pipelined requests)
are served as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn

from fleetserve.listener import CORK_BYTES, CorkedTransport, ListenerLimits, uvicorn_config

LIMITS = ListenerLimits(head_bytes=4096, header_count=20, head_timeout=0.6, keep_alive=1, max_connections=8)


async def echo_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Answers every request with the number of body bytes it read."""
    if scope["type"] != "http":
        return
    size = 0
    while True:
        message = await receive()
        size += len(message.get("body", b""))
        if not message.get("more_body"):
            break
    body = str(size).encode()
    await send(
        {"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % len(body))]}
    )
    await send({"type": "http.response.body", "body": body})


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = uvicorn.Server(uvicorn_config(echo_app, "127.0.0.1", port, LIMITS, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    yield port
    server.should_exit = True
    thread.join(timeout=10)


def connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    return sock


def read_answer(sock: socket.socket, reader: Any = None) -> tuple[int, dict[str, str], bytes]:
    """One whole answer (status, headers, body) read off ``sock`` (through ``reader``, a buffered
    file of it, to read several)."""
    f = reader if reader is not None else sock.makefile("rb")
    status_line = f.readline()
    if not status_line:
        raise ConnectionError("closed before an answer")
    headers: dict[str, str] = {}
    while (line := f.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.lower()] = value.strip()
    body = f.read(int(headers.get("content-length", "0")))
    return int(status_line.split()[1]), headers, body


def closed(sock: socket.socket) -> bool:
    """Whether the server closed its side (EOF or reset) within the socket's timeout."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def get(port: int, extra: bytes = b"") -> int:
    with connect(port) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: t\r\n" + extra + b"\r\n")
        return read_answer(sock)[0]


def test_a_request_within_the_bounds_is_served(port: int) -> None:
    assert get(port, b"X-A: " + b"a" * 3000 + b"\r\n") == 200


def test_a_head_past_its_byte_budget_is_431_naming_the_flag_and_the_server_goes_on(port: int) -> None:
    with connect(port) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: t\r\nX-Big: ")
        # Far more than the budget: the server answers once it has 4096 bytes and stops reading.
        with contextlib.suppress(OSError):
            for _ in range(64):
                sock.sendall(b"b" * 16384)
        status, headers, body = read_answer(sock)
        assert status == 431
        assert headers["connection"] == "close"
        error = json.loads(body)["error"]
        assert "4096" in error["message"] and "--max-head-bytes" in error["message"]
        assert closed(sock)
    assert get(port) == 200


def test_a_head_exactly_at_the_budget_is_served_and_one_byte_more_is_not(port: int) -> None:
    start = b"GET / HTTP/1.1\r\nHost: t\r\nX-Pad: "
    end = b"\r\n\r\n"
    pad = LIMITS.head_bytes - len(start) - len(end)
    for extra, status in ((0, 200), (1, 431)):
        with connect(port) as sock:
            sock.sendall(start + b"p" * (pad + extra) + end)
            assert read_answer(sock)[0] == status


def test_more_headers_than_the_limit_is_431(port: int) -> None:
    many = b"".join(b"X-%d: v\r\n" % i for i in range(LIMITS.header_count))  # with Host: one too many
    with connect(port) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: t\r\n" + many + b"\r\n")
        status, _, body = read_answer(sock)
    assert status == 431 and "--max-headers" in json.loads(body)["error"]["message"]
    assert get(port, b"".join(b"X-%d: v\r\n" % i for i in range(LIMITS.header_count - 1))) == 200


def test_a_body_larger_than_the_head_budget_is_not_counted_as_head(port: int) -> None:
    body = b"x" * 200_000
    with connect(port) as sock:
        sock.sendall(b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        status, _, answer = read_answer(sock)
    assert (status, answer) == (200, b"200000")


def test_pipelined_requests_on_one_connection_are_each_answered(port: int) -> None:
    one = b"GET / HTTP/1.1\r\nHost: t\r\nX-Pad: " + b"p" * 3000 + b"\r\n\r\n"
    with connect(port) as sock:
        sock.sendall(one * 3)  # 9 KB in one write: more than one head's budget, each head within it
        reader = sock.makefile("rb")
        assert [read_answer(sock, reader)[0] for _ in range(3)] == [200, 200, 200]


def test_a_head_that_never_ends_is_408_after_the_head_timeout(port: int) -> None:
    with connect(port) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: t\r\n")
        started = time.monotonic()
        for _ in range(3):  # still sending, slowly, within the byte budget
            time.sleep(0.1)
            sock.sendall(b"X-Slow: 1\r\n")
        status, _, body = read_answer(sock)
        waited = time.monotonic() - started
        assert status == 408 and "--head-timeout" in json.loads(body)["error"]["message"]
        assert waited >= LIMITS.head_timeout * 0.9
        assert closed(sock)


def test_a_connection_that_sends_nothing_is_408_after_the_head_timeout(port: int) -> None:
    with connect(port) as sock:
        assert read_answer(sock)[0] == 408


def test_a_second_request_on_a_kept_alive_connection_gets_a_fresh_head_timer(port: int) -> None:
    with connect(port) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")
        assert read_answer(sock)[0] == 200
        time.sleep(LIMITS.head_timeout * 0.8)  # idle, within keep-alive
        sock.sendall(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")
        assert read_answer(sock)[0] == 200
        # Then idle past the keep-alive timeout: closed without an answer.
        sock.settimeout(LIMITS.keep_alive + 5)
        assert closed(sock)


def test_connections_past_the_cap_are_503_at_once_and_served_again_when_one_closes(port: int) -> None:
    held = [connect(port) for _ in range(LIMITS.max_connections)]
    try:
        time.sleep(0.2)  # let the server accept them all
        with connect(port) as extra:
            status, _, body = read_answer(extra)
            assert status == 503 and "--max-connections" in json.loads(body)["error"]["message"]
        held.pop().close()
        time.sleep(0.2)
        assert get(port) == 200
    finally:
        for sock in held:
            sock.close()


def test_the_connection_cap_keeps_half_the_open_file_limit_free() -> None:
    assert ListenerLimits(max_connections=4096).connection_cap(open_files=1024) == 512
    assert ListenerLimits(max_connections=100).connection_cap(open_files=1024) == 100


def test_limits_out_of_range_are_refused() -> None:
    with pytest.raises(ValueError):
        ListenerLimits(head_bytes=10)
    with pytest.raises(ValueError):
        ListenerLimits(head_timeout=0)


def test_over_tls_the_head_budget_and_the_head_timeout_hold_too(tmp_path: Path) -> None:
    import ssl

    from fleetserve.tls import ensure_generated

    served = ensure_generated(tmp_path, "server", ["127.0.0.1"])
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    config = uvicorn_config(
        echo_app,
        "127.0.0.1",
        port,
        LIMITS,
        log_level="warning",
        ssl_certfile=str(served.cert_file),
        ssl_keyfile=str(served.key_file),
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.02)
        context = ssl.create_default_context(cafile=str(served.ca_file))

        def tls() -> socket.socket:
            return context.wrap_socket(connect(port), server_hostname="127.0.0.1")

        with tls() as sock:
            sock.sendall(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")
            assert read_answer(sock)[0] == 200
        with tls() as sock:
            sock.sendall(b"GET / HTTP/1.1\r\nHost: t\r\nX-Big: " + b"b" * 8192)
            assert read_answer(sock)[0] == 431
        with tls() as sock:
            sock.sendall(b"GET / HTTP/1.1\r\nHost: t\r\n")
            assert read_answer(sock)[0] == 408
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def test_a_body_that_stalls_is_408_after_the_head_timeout_and_a_slow_steady_one_is_served(port: int) -> None:
    with connect(port) as sock:
        sock.sendall(b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 100\r\n\r\n" + b"x" * 10)
        started = time.monotonic()
        status, _, body = read_answer(sock)
        assert status == 408 and "body stalled" in json.loads(body)["error"]["message"]
        assert time.monotonic() - started >= LIMITS.head_timeout * 0.9
    with connect(port) as sock:
        sock.sendall(b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 6\r\n\r\n")
        for _ in range(6):  # 1.8 s in all, never pausing as long as the 0.6 s head timeout
            time.sleep(0.3)
            sock.sendall(b"y")
        assert read_answer(sock)[0:3:2] == (200, b"6")


# --- forwarded headers: believed only from --forwarded-allow-ips proxies ---------------------------


async def client_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Answers every request with the client address the app sees (what the login throttle, the
    node-address check and the audit log read)."""
    if scope["type"] != "http":
        return
    body = str(scope["client"][0]).encode()
    await send(
        {"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % len(body))]}
    )
    await send({"type": "http.response.body", "body": body})


@contextlib.contextmanager
def serving(app: Any, limits: ListenerLimits) -> Iterator[int]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = uvicorn.Server(uvicorn_config(app, "127.0.0.1", port, limits, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def seen_client(port: int, forwarded: str) -> bytes:
    with connect(port) as sock:
        sock.sendall(f"GET / HTTP/1.1\r\nHost: t\r\nX-Forwarded-For: {forwarded}\r\n\r\n".encode())
        return read_answer(sock)[2]


def test_a_loopback_client_forging_x_forwarded_for_is_seen_as_its_own_address_by_default() -> None:
    with serving(client_app, ListenerLimits()) as port:
        assert seen_client(port, "203.0.113.9") == b"127.0.0.1"


def test_x_forwarded_for_is_believed_from_a_proxy_of_forwarded_allow_ips_only() -> None:
    with serving(client_app, ListenerLimits(forwarded_allow=("127.0.0.1",))) as port:
        assert seen_client(port, "203.0.113.9") == b"203.0.113.9"
    with serving(client_app, ListenerLimits(forwarded_allow=("10.0.0.0/8",))) as port:
        assert seen_client(port, "203.0.113.9") == b"127.0.0.1"


def test_a_forwarded_allow_ips_entry_that_is_no_address_names_the_flag() -> None:
    with pytest.raises(ValueError, match=r"--forwarded-allow-ips 'proxy\.local'"):
        ListenerLimits(forwarded_allow=("proxy.local",))
    assert "--forwarded-allow-ips=10.0.0.5" in ListenerLimits(forwarded_allow=("10.0.0.5",)).flags()


class _Recording(asyncio.Transport):
    """A transport under a ``CorkedTransport``: what it was asked to write, one entry a write."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[bytes] = []
        self.closed = self.eof = self.aborted = False

    def write(self, data: Any) -> None:
        self.writes.append(bytes(data))

    def is_closing(self) -> bool:
        return self.closed or self.aborted

    def close(self) -> None:
        self.closed = True

    def write_eof(self) -> None:
        self.eof = True

    def abort(self) -> None:
        self.aborted = True

    def get_write_buffer_size(self) -> int:
        return 0


def test_what_one_loop_iteration_writes_goes_out_in_one_write_and_closing_writes_it_first() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        under = _Recording()
        corked = CorkedTransport(under, loop)
        corked.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n")
        corked.write(b"{}")
        assert under.writes == [] and corked.get_write_buffer_size() == 40
        await asyncio.sleep(0)
        assert under.writes == [b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}"]
        # A stream's big chunk is not held back; closing and half-closing write what is pending.
        corked.write(b"x" * (CORK_BYTES + 1))
        assert len(under.writes) == 2
        corked.write(b"last")
        corked.write_eof()
        assert under.writes[-1] == b"last" and under.eof
        corked.write(b"bye")
        corked.close()
        assert under.writes[-1] == b"bye" and under.closed
        # Aborting drops it; anything else is the transport's own.
        other = _Recording()
        dropped = CorkedTransport(other, loop)
        dropped.write(b"never")
        dropped.abort()
        await asyncio.sleep(0)
        assert other.writes == [] and other.aborted and dropped.is_closing()

    asyncio.run(main())
