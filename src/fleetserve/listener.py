"""Bounds on every HTTP listener (``fleetserve server``, ``gateway``, ``up``): what one client may
cost the process before it is answered, and the one uvicorn configuration that applies them.

uvicorn's httptools protocol has no limit on a request's head (one 112 MB header held the event
loop for 20 s: the parser's header buffers grow by concatenation), never times out a head that
does not end (slowloris), and answers its ``limit_concurrency`` only once a head is complete — a
socket that never completes one is never refused. ``BoundedHttpTools`` adds, per connection:

- a head budget: the bytes of a request head fed to the parser are counted *before* they are
  fed, and at most ``head_bytes`` of them reach it; past that, 431 and the connection closes.
  Past ``header_count`` headers, 431 too;
- a head timer, armed when the connection opens and when a new request's head begins, cancelled
  when the head is complete: a head not complete within ``head_timeout`` seconds is answered 408;
  so is a request body that pauses that long (a slowloris on the body), while the app reads it;
- a connection cap: a connection past ``max_connections`` open in this process is answered 503
  at once, before anything is read from it.

What one loop iteration writes to a connection goes out in one write (``CorkedTransport``):
uvicorn writes a response's head and its body apart, two system calls and two loopback segments
per answer, about a tenth of the control plane's CPU under thousands of agents' heartbeats.

Idle keep-alive connections close after ``keep_alive`` seconds (uvicorn's own timer).
``X-Forwarded-For`` and ``X-Forwarded-Proto`` are believed only from the proxies of
``forwarded_allow`` (``--forwarded-allow-ips``; none by default: uvicorn's own default trusts any
loopback peer, so a local process could forge the address the login throttle, the node-address
check and the audit log see). A refusal
is a small JSON body in OpenAI's error shape naming the limit and the flag that raises it; the
connection then stops being read and closes (half-closed first, so a client still sending
reads the answer rather than a reset).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import math
import resource
from dataclasses import dataclass
from typing import Any

import httptools
import uvicorn
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from fleetserve.errors import FleetserveError
from fleetserve.gateway.openai_errors import error_body

HEAD_BYTES = 64 * 1024
HEADER_COUNT = 100
HEAD_TIMEOUT = 10.0
KEEP_ALIVE = 5.0
MAX_CONNECTIONS = 4096
# A refused client still sending may go on this long before its connection is dropped.
LINGER_SECONDS = 2.0


@dataclass(frozen=True)
class ListenerLimits:
    """What one connection may cost a listener before it is answered (the flags of the same names)."""

    head_bytes: int = HEAD_BYTES  # --max-head-bytes: request line and headers
    header_count: int = HEADER_COUNT  # --max-headers
    head_timeout: float = HEAD_TIMEOUT  # --head-timeout: seconds to send a head; longest body pause
    keep_alive: float = KEEP_ALIVE  # --keep-alive-timeout: seconds an idle connection stays open
    max_connections: int = MAX_CONNECTIONS  # --max-connections: open at once in this process
    # --forwarded-allow-ips: proxies (addresses or networks) whose X-Forwarded-* are believed.
    forwarded_allow: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.head_bytes < 1024 or self.header_count < 1 or self.max_connections < 1:
            raise ValueError("head bytes must be at least 1024, headers and connections at least 1")
        if self.head_timeout <= 0 or self.keep_alive <= 0:
            raise ValueError("the head and keep-alive timeouts must be positive")
        for proxy in self.forwarded_allow:
            try:
                ipaddress.ip_network(proxy, strict=False)
            except ValueError:
                raise ValueError(
                    f"--forwarded-allow-ips {proxy!r} is not an address or network; give the "
                    "proxy's address (e.g. 10.0.0.5 or 10.0.0.0/24)"
                ) from None

    def flags(self) -> tuple[str, ...]:
        """These limits as the flags of ``fleetserve server`` (``up`` passes them on)."""
        return (
            f"--max-head-bytes={self.head_bytes}",
            f"--max-headers={self.header_count}",
            f"--head-timeout={self.head_timeout:g}",
            f"--keep-alive-timeout={self.keep_alive:g}",
            f"--max-connections={self.max_connections}",
            *(f"--forwarded-allow-ips={proxy}" for proxy in self.forwarded_allow),
        )

    def connection_cap(self, open_files: int | None = None) -> int:
        """``max_connections``, but at most half the process's open-file limit: the other half
        stays for what the requests open (engine connections, the database, model files)."""
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0] if open_files is None else open_files
        if soft == resource.RLIM_INFINITY:
            return self.max_connections
        return max(1, min(self.max_connections, soft // 2))


def refusal(status: int, message: str, code: str) -> bytes:
    """A whole HTTP/1.1 answer that closes the connection: ``status``, OpenAI's error shape."""
    kind = "service_unavailable" if status == 503 else "invalid_request_error"
    body = error_body(message, kind, code)
    return b"".join(
        (
            STATUS_LINE[status],
            b"content-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n" % len(body),
            body,
        )
    )


CORK_BYTES = 64 * 1024  # pending past this, written at once (a stream's chunk is not held back)


class CorkedTransport:
    """A transport whose writes within one loop iteration are joined into one write of the
    transport under it, at the end of the iteration (or at once past ``CORK_BYTES``); closing
    or half-closing writes what is pending first, aborting drops it. Anything else is the
    transport's own."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._pending: list[bytes] = []
        self._size = 0

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not self._pending:
            self._loop.call_soon(self.flush)
        self._pending.append(bytes(data))
        self._size += len(data)
        if self._size > CORK_BYTES:
            self.flush()

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        """Write what is pending now (a no-op when nothing is)."""
        if not self._pending:
            return
        data = self._pending[0] if len(self._pending) == 1 else b"".join(self._pending)
        self._pending, self._size = [], 0
        if not self._transport.is_closing():
            self._transport.write(data)

    def write_eof(self) -> None:
        self.flush()
        self._transport.write_eof()

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def abort(self) -> None:
        self._pending, self._size = [], 0
        self._transport.abort()

    def get_write_buffer_size(self) -> int:
        return self._size + self._transport.get_write_buffer_size()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class _TooManyHeaders(FleetserveError):
    """Raised from the parser's header callback past ``header_count`` (the parser stops)."""


class BoundedHttpTools(HttpToolsProtocol):
    """uvicorn's httptools protocol with a head budget, a head timer and a connection cap."""

    limits: ListenerLimits = ListenerLimits()
    cap: int = MAX_CONNECTIONS

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Bytes of the current head the parser may still get; None: past the head (a body).
        self._head_left: int | None = self.limits.head_bytes
        self._headers_seen = 0
        self._head_timer: asyncio.TimerHandle | None = None
        # The body's stall timer, and when its last bytes came (one timer per body, not per piece).
        self._body_timer: asyncio.TimerHandle | None = None
        self._body_at = 0.0
        self._refused = False

    # -- asyncio.Protocol --

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.transport = CorkedTransport(transport, self.loop)  # type: ignore[assignment]
        if len(self.connections) > self.cap:
            # Refused at once and closed without lingering: under a flood a lingering refusal
            # would hold the file descriptor the cap is there to keep free (a client that had
            # already sent its request may see a reset instead of the 503).
            self.connections.discard(self)
            self._refuse(
                503,
                f"The server holds {self.cap} connections, its limit (--max-connections); retry later.",
                "too_many_connections",
                linger=False,
            )
            return
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # answered already: what still comes is read and dropped until the close
        self._unset_keepalive_if_required()
        # Never more than the head's budget reaches the parser while a head is being read.
        while self._head_left is not None and len(data) > self._head_left:
            piece, data = data[: self._head_left], data[self._head_left :]
            self._head_left = 0
            if piece and not self._feed(piece):
                return
            if self._head_left == 0:  # the head did not end within its budget
                self._refuse(
                    431,
                    f"Request head larger than {self.limits.head_bytes} bytes, the server's limit "
                    "(--max-head-bytes).",
                    "request_header_fields_too_large",
                )
                return
        if self._head_left is not None:
            self._head_left -= len(data)
        if data:
            self._feed(data)

    def _feed(self, data: bytes) -> bool:
        """Feed the parser as uvicorn does; whether the connection is still being read."""
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
        except httptools.HttpParserError:
            if self._headers_seen > self.limits.header_count:
                self._refuse(
                    431,
                    f"More than {self.limits.header_count} request headers, the server's limit "
                    "(--max-headers).",
                    "request_header_fields_too_large",
                )
            else:
                self.logger.warning("Invalid HTTP request received.")
                self.send_400_response("Invalid HTTP request received.")
            return False
        return not self._refused and not self.transport.is_closing()

    # -- parser callbacks --

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._headers_seen = 0
        self._arm_head_timer()

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers_seen += 1
        if self._headers_seen > self.limits.header_count:
            raise _TooManyHeaders
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._head_left = None
        self._cancel_head_timer()
        super().on_headers_complete()
        # Until the body is complete, a pause in it longer than the head timeout is a stall.
        self._body_at = self.loop.time()
        if self._body_timer is None:
            self._body_timer = self.loop.call_later(self.limits.head_timeout, self._body_check)

    def on_body(self, body: bytes) -> None:
        self._body_at = self.loop.time()
        super().on_body(body)

    def on_message_complete(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None
        super().on_message_complete()
        self._head_left = self.limits.head_bytes  # what comes next is the next request's head

    # -- the head timer --

    def _arm_head_timer(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.limits.head_timeout, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            self.transport.close()  # an answer is being written: a 408 would land inside it
            return
        self._refuse(
            408,
            f"Request head not complete within {self.limits.head_timeout:g} s, the server's limit "
            "(--head-timeout).",
            "request_timeout",
        )

    def _body_check(self) -> None:
        self._body_timer = None
        if self.transport.is_closing():
            return
        quiet = self.loop.time() - self._body_at
        if quiet < self.limits.head_timeout or self.flow.read_paused:
            # Bytes came since, or the app is not reading (flow control paused the socket).
            wait = (
                max(self.limits.head_timeout - quiet, 0.05)
                if not self.flow.read_paused
                else self.limits.head_timeout
            )
            self._body_timer = self.loop.call_later(wait, self._body_check)
            return
        if self.cycle is not None and self.cycle.response_started:
            self.transport.close()  # an answer is being written: a 408 would land inside it
            return
        self._refuse(
            408,
            f"Request body stalled: no bytes for {self.limits.head_timeout:g} s, the server's limit "
            "(--head-timeout).",
            "request_timeout",
        )

    # -- refusing --

    def _refuse(self, status: int, message: str, code: str, linger: bool = True) -> None:
        """Answer ``status`` and stop: no more parsing, the write side closed, the connection
        dropped once the client stops sending or after ``LINGER_SECONDS``."""
        self._refused = True
        self._cancel_head_timer()
        self._unset_keepalive_if_required()
        transport = self.transport
        if transport.is_closing():
            return
        transport.write(refusal(status, message, code))
        if linger and transport.can_write_eof():
            with contextlib.suppress(OSError, RuntimeError):
                transport.write_eof()
            self.loop.call_later(LINGER_SECONDS, self._drop)
        else:
            transport.close()

    def _drop(self) -> None:
        if not self.transport.is_closing():
            self.transport.abort()

    def eof_received(self) -> None:
        # A refused client that finished sending: close now rather than after the linger.
        if self._refused:
            self.transport.close()


def bounded_protocol(limits: ListenerLimits) -> type[BoundedHttpTools]:
    """The protocol class uvicorn instantiates per connection, with ``limits`` applied."""

    class Bounded(BoundedHttpTools):
        pass

    Bounded.limits = limits
    Bounded.cap = limits.connection_cap()
    return Bounded


def uvicorn_config(app: Any, host: str, port: int, limits: ListenerLimits, **options: Any) -> uvicorn.Config:
    """The uvicorn configuration of every fleetserve listener: uvloop, httptools bounded by
    ``limits``, forwarded headers only from ``limits.forwarded_allow``; ``options`` are passed on
    (log level, TLS, graceful shutdown)."""
    return uvicorn.Config(
        app,
        loop="uvloop",
        http=bounded_protocol(limits),
        host=host,
        port=port,
        timeout_keep_alive=max(1, math.ceil(limits.keep_alive)),
        proxy_headers=bool(limits.forwarded_allow),
        forwarded_allow_ips=list(limits.forwarded_allow),
        **options,
    )
