"""A lean HTTP/1.1 client on asyncio with keep-alive pooling: the gateway's upstream requests and
the metrics scraper's fetches (``fleetserve.metrics.fetch.HttpFetcher``).

It grew out of the scraper's own fetcher (measured at a fraction of httpx's CPU per request)
and parses responses with ``httptools`` (llhttp, the parser of Node.js). One
``HttpClient`` keeps idle connections per origin; a request takes one (or opens one), writes the
request bytes the caller built, and returns a ``Response`` as soon as the head has arrived. The
body is then read whole (``read``) or piece by piece as it arrives (``next_piece``), with no
re-framing: chunked transfer coding is decoded, server-sent events pass as the bytes they are.

A connection goes back to the pool the moment its response is complete (the body's remaining
pieces are already buffered in the ``Response``); ``Response.close`` before that aborts it, which
is how a cancelled request stops the engine's work: llama.cpp and vLLM cancel a generation
whose connection closed. A reused connection that the server had closed before answering (its
keep-alive timeout) is retried once on a new connection.

A request whose bytes the upstream's host does not acknowledge within ``UNACKED_SECONDS`` (the
host is gone or behind a partition: a live host's kernel acknowledges at once, however busy its
server) ends its connection there (``TCP_USER_TIMEOUT``): the kernel drops the bytes still queued,
so they cannot reach the server later, when the partition heals, and the request fails with
``NoAnswer``, which the gateway retries elsewhere. Failures raise:

    FleetserveError
    └── UpstreamError        a request to an upstream failed; nothing more is coming from it
        ├── ConnectFailed    no connection could be opened (nothing was sent)
        ├── UpstreamTimeout  no answer within the timeout
        ├── UpstreamBroke    the connection closed or sent malformed HTTP mid-answer
        │   └── NoAnswer     it closed before any byte of the answer (the gateway may retry)
        └── AnswerTooLarge   a body read whole (``read(limit)``) was larger than its limit
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import socket
import ssl
import struct
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import cast

import httptools

from fleetserve.errors import FleetserveError, InternalError

MAX_IDLE_PER_ORIGIN = 64
"""Idle keep-alive connections kept per origin; more are closed when they come back."""

MAX_IDLE = 4096
"""Idle keep-alive connections kept in all, least recently used origin's closed first."""

PAUSE_BYTES = 256 * 1024
"""A response buffering this much unread body stops reading from its socket until it is drained."""


UNACKED_SECONDS = 3.0
"""How long bytes sent to an upstream may stay unacknowledged by its host before the connection is
given up (``TCP_USER_TIMEOUT``, where the platform has it)."""

_FRAMING = (b"content-length", b"transfer-encoding")
# SO_LINGER on with a zero timeout: close() resets the connection and drops what is unsent.
_RESET_ON_CLOSE = struct.pack("ii", 1, 0)


class UpstreamError(FleetserveError):
    """A request to an upstream failed; nothing more is coming from that connection."""


class ConnectFailed(UpstreamError):
    """No connection to the upstream could be opened: nothing was sent."""


class UpstreamTimeout(UpstreamError):
    """The upstream gave no answer within the timeout."""


class UpstreamBroke(UpstreamError):
    """The connection closed, or the upstream sent malformed HTTP, in the middle of an answer."""


class AnswerTooLarge(UpstreamError):
    """An answer's body was larger than the reader's limit: it was not read (close aborts it)."""


class NoAnswer(UpstreamBroke):
    """The connection closed before any byte of the answer: a reused one may just have expired,
    a fresh one's server died or reset it before its status line, or its host never acknowledged
    the request (``unacknowledged``: gone or behind a partition)."""

    def __init__(self, message: str, unacknowledged: bool = False) -> None:
        super().__init__(message)
        self.unacknowledged = unacknowledged


@dataclass(frozen=True)
class Origin:
    """Where to connect: host, port and whether with TLS."""

    host: str
    port: int
    tls: bool = False


class Response:
    """An upstream's answer: status and headers at once, the body as it arrives."""

    __slots__ = ("_conn", "_done", "_error", "_pieces", "_size", "_waiter", "headers", "status")

    def __init__(self, conn: _Connection, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.status = status
        self.headers = headers
        self._conn: _Connection | None = conn
        self._pieces: deque[bytes] = deque()
        self._size = 0
        self._done = False
        self._error: UpstreamError | None = None
        self._waiter: asyncio.Future[None] | None = None

    @property
    def complete(self) -> bool:
        """Whether the whole body has arrived (it may still be buffered here)."""
        return self._done

    async def next_piece(self) -> bytes:
        """The body bytes that arrived since the last call (waiting for some); b"" at the end.

        Raises ``UpstreamBroke`` if the connection failed before the body was complete.
        """
        while not self._pieces:
            if self._done:
                return b""
            if self._error is not None:
                raise self._error
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        pieces = self._pieces
        piece = pieces.popleft() if len(pieces) == 1 else b"".join(pieces)
        pieces.clear()
        if self._size >= PAUSE_BYTES and self._conn is not None:
            self._conn.resume()
        self._size = 0
        return piece

    async def read(self, limit: int | None = None) -> bytes:
        """The whole body; past ``limit`` bytes (a Content-Length over it, or the bytes as they
        come), ``AnswerTooLarge``: at most ``limit`` plus ``PAUSE_BYTES`` are ever held."""
        too_large = f"the answer is larger than {limit} bytes, the gateway's limit (--max-answer-bytes)"
        if limit is not None:
            declared = next((v for n, v in self.headers if n.lower() == b"content-length"), None)
            if declared is not None and declared.strip().isdigit() and int(declared) > limit:
                raise AnswerTooLarge(too_large)
        parts: list[bytes] = []
        size = 0
        while piece := await self.next_piece():
            size += len(piece)
            if limit is not None and size > limit:
                parts.clear()
                raise AnswerTooLarge(too_large)
            parts.append(piece)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def close(self) -> None:
        """Done with this answer: an incomplete one aborts its connection (cancelling the work)."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.abort()

    # -- fed by the connection --

    def _feed(self, data: bytes) -> None:
        self._pieces.append(data)
        self._size += len(data)
        if self._size >= PAUSE_BYTES and self._conn is not None:
            self._conn.pause()
        self._wake()

    def _finish(self) -> None:
        self._done = True
        self._conn = None
        self._wake()

    def _fail(self, error: UpstreamError) -> None:
        self._error = error
        self._conn = None
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class _Connection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection to one origin, one request at a time."""

    def __init__(self, client: HttpClient, origin: Origin) -> None:
        self._client = client
        self.origin = origin
        self._transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self._head: asyncio.Future[Response] | None = None
        self._response: Response | None = None
        self._headers: list[tuple[bytes, bytes]] = []
        self._received = 0
        self._until_close = False
        self.closed = False

    # -- asyncio.Protocol --

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's TCPTransport is a stream transport without subclassing asyncio.Transport.
        self._transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self._received += len(data)
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._broke(UpstreamBroke("the upstream switched protocols"))
        except httptools.HttpParserError as exc:
            self._broke(UpstreamBroke(f"malformed answer from the upstream: {exc}"))

    def eof_received(self) -> bool | None:
        return None  # let the transport close itself; connection_lost settles what is pending

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._client._lost(self)
        because = f": {exc}" if exc is not None else ""
        head, response = self._head, self._response
        if head is not None and not head.done():
            if self._received == 0:
                # ETIMEDOUT: what it sent was never acknowledged (TCP_USER_TIMEOUT ran out)
                unacked = isinstance(exc, OSError) and exc.errno == errno.ETIMEDOUT
                head.set_exception(NoAnswer(f"the connection closed before the answer{because}", unacked))
            else:
                head.set_exception(UpstreamBroke(f"the connection closed in the answer's head{because}"))
        elif response is not None:
            self._response = None
            if self._until_close:
                response._finish()  # a body delimited by the close is complete now
            else:
                response._fail(UpstreamBroke(f"the connection closed mid-answer{because}"))

    # -- httptools callbacks --

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name, value))

    def on_headers_complete(self) -> None:
        headers = self._headers
        response = Response(self, self._parser.get_status_code(), headers)
        self._headers = []
        self._until_close = not any(n.lower() in _FRAMING for n, _ in headers)
        self._response = response
        head = self._head
        if head is not None and not head.done():
            head.set_result(response)

    def on_body(self, body: bytes) -> None:
        if self._response is not None:
            self._response._feed(body)

    def on_message_complete(self) -> None:
        response, self._response = self._response, None
        self._head = None
        keep = self._parser.should_keep_alive()
        if response is not None:
            response._finish()
        if keep and not self.closed:
            self._client._put_idle(self)
        else:
            self.abort()

    # -- used by the client and the response --

    def send(self, request: bytes) -> asyncio.Future[Response]:
        transport = self._transport
        if transport is None or self.closed:
            raise InternalError(f"a request on a connection to {self.origin} that is not open")
        self._received = 0
        self._head = head = asyncio.get_running_loop().create_future()
        transport.write(request)
        return head

    def _broke(self, error: UpstreamError) -> None:
        head, response = self._head, self._response
        self._head = self._response = None
        if head is not None and not head.done():
            head.set_exception(error)
        if response is not None:
            response._fail(error)
        self.abort()

    def pause(self) -> None:
        if self._transport is not None:
            self._transport.pause_reading()

    def resume(self) -> None:
        if self._transport is not None and not self.closed:
            self._transport.resume_reading()

    def raw_socket(self) -> socket.socket | None:
        """The connection's socket (None once closed)."""
        return None if self._transport is None else self._transport.get_extra_info("socket")

    def abort(self) -> None:
        """Drop the connection at once: a reset, not a close. asyncio's ``abort`` alone empties
        only its own buffer; the kernel would still deliver what it had queued, and retransmit it
        for minutes. A request given up on (an engine behind a partition, a cancelled stream) must
        not reach the engine later, when the partition heals: with a zero linger the kernel drops
        it and sends a reset. One the kernel closed already (``connection_lost``) has nothing left
        to drop."""
        self.closed = True
        transport = self._transport
        if transport is not None and not transport.is_closing():
            sock = transport.get_extra_info("socket")
            if sock is not None:
                # ValueError: uvloop's socket of a descriptor closed meanwhile
                with contextlib.suppress(OSError, ValueError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET_ON_CLOSE)
            transport.abort()


def _expire(head: asyncio.Future[Response], timeout: float) -> None:
    if not head.done():
        head.set_exception(UpstreamTimeout(f"no answer within {timeout:g}s"))


class HttpClient:
    """Keep-alive HTTP/1.1 connections to many origins, a pool of idle ones per origin."""

    def __init__(
        self,
        *,
        connect_timeout: float = 5.0,
        unacked_timeout: float | None = UNACKED_SECONDS,
        max_idle_per_origin: int = MAX_IDLE_PER_ORIGIN,
        max_idle: int = MAX_IDLE,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.connect_timeout = connect_timeout
        self.unacked_timeout = unacked_timeout
        self._per_origin = max_idle_per_origin
        self._max_idle = max_idle
        self._ssl = ssl_context
        # Origins by last use, oldest first: past ``max_idle`` in all, the oldest idle one closes.
        self._idle: OrderedDict[Origin, list[_Connection]] = OrderedDict()
        self._idle_count = 0
        self._open: set[_Connection] = set()

    async def request(self, origin: Origin, request: bytes, timeout: float | None = None) -> Response:
        """Send ``request`` (a whole HTTP/1.1 request, head and body) and wait for the answer's head.

        ``timeout`` bounds the wait for the head; the body is read from the ``Response``.
        """
        conn = self._take_idle(origin)
        if conn is not None:
            try:
                return await self._exchange(conn, request, timeout)
            except NoAnswer as exc:
                if exc.unacknowledged:
                    raise  # the host is unreachable: a fresh connection would wait as long again
                # the server closed it while idle: once more on a fresh connection
        return await self._exchange(await self._connect(origin), request, timeout)

    async def _exchange(self, conn: _Connection, request: bytes, timeout: float | None) -> Response:
        head = conn.send(request)
        # A timer on the loop rather than wait_for: one handle per request, no extra future.
        timer = (
            None
            if timeout is None
            else asyncio.get_running_loop().call_later(timeout, _expire, head, timeout)
        )
        try:
            return await head
        except BaseException:
            conn.abort()  # cancelled, timed out or failed halfway: the connection's state is unknown
            raise
        finally:
            if timer is not None:
                timer.cancel()

    async def _connect(self, origin: Origin) -> _Connection:
        loop = asyncio.get_running_loop()
        context = None
        if origin.tls:
            if self._ssl is None:
                self._ssl = ssl.create_default_context()
            context = self._ssl
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, conn = await loop.create_connection(
                    lambda: _Connection(self, origin),
                    origin.host,
                    origin.port,
                    ssl=context,
                    server_hostname=origin.host if context is not None else None,
                )
        except TimeoutError as exc:
            raise ConnectFailed(f"connecting to {origin.host}:{origin.port} timed out") from exc
        except OSError as exc:
            raise ConnectFailed(f"connecting to {origin.host}:{origin.port} failed: {exc}") from exc
        self._open.add(conn)
        if self.unacked_timeout is not None and hasattr(socket, "TCP_USER_TIMEOUT"):
            sock = conn.raw_socket()
            if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
                with contextlib.suppress(OSError):
                    sock.setsockopt(
                        socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(self.unacked_timeout * 1000)
                    )
        return conn

    def _take_idle(self, origin: Origin) -> _Connection | None:
        conns = self._idle.get(origin)
        while conns:
            conn = conns.pop()
            self._idle_count -= 1
            if not conns:
                del self._idle[origin]
            if not conn.closed:
                return conn
        return None

    def _put_idle(self, conn: _Connection) -> None:
        conns = self._idle.setdefault(conn.origin, [])
        self._idle.move_to_end(conn.origin)
        if len(conns) >= self._per_origin:
            conn.abort()
            return
        conns.append(conn)
        self._idle_count += 1
        while self._idle_count > self._max_idle:
            oldest_origin, oldest = next(iter(self._idle.items()))
            oldest.pop(0).abort()
            self._idle_count -= 1
            if not oldest:
                del self._idle[oldest_origin]

    def _lost(self, conn: _Connection) -> None:
        # An idle connection the server closed (its keep-alive timeout) leaves the pool at once.
        self._open.discard(conn)
        conns = self._idle.get(conn.origin)
        if conns is not None and conn in conns:
            conns.remove(conn)
            self._idle_count -= 1
            if not conns:
                del self._idle[conn.origin]

    @property
    def idle_connections(self) -> int:
        """Open connections waiting in the pool."""
        return self._idle_count

    async def aclose(self) -> None:
        """Close every connection, idle or not."""
        self._idle.clear()
        self._idle_count = 0
        for conn in list(self._open):
            conn.abort()
        await asyncio.sleep(0)  # let the transports run connection_lost


__all__ = [
    "AnswerTooLarge",
    "ConnectFailed",
    "HttpClient",
    "NoAnswer",
    "Origin",
    "Response",
    "UpstreamBroke",
    "UpstreamError",
    "UpstreamTimeout",
]
