"""The request the gateway sends an engine, and how the engine's answer is relayed back.

An upstream request is written as raw HTTP/1.1 bytes for ``httpclient``'s pooled connections:
built here, in one place, with the replica's engine key (``routing.engine_auth``), which the
engine requires. Everything a request does not change (an endpoint's origin and Host, a key's
header line) is computed once and cached. Of the answer's headers only those an OpenAI client
reads are relayed, never a cookie, and never a media type a browser would render (``relayed``);
a streamed answer's events pass through as they come
(``relay_stream``), and a stream that breaks off ends with an error event, never as if it were
complete. A whole answer (``relay_answer``) keeps the engine's status, an error's body put in
OpenAI's shape where it is not; one that breaks off mid-body is a 502.

Which failures may go to another replica is decided here too (``BEFORE_ANY_ANSWER``): only those
where no byte of an answer came back (no connection, a reset before the status line, no status
line in time). Once a status line arrived, the engine has answered, and a second try could run a
generation twice.
"""

from __future__ import annotations

import functools
import logging
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

from fleetserve.gateway.accounting import Exchange
from fleetserve.gateway.openai_errors import broken_stream_event, engine_error_body, send_error
from fleetserve.gateway.picker import Endpoint
from fleetserve.gateway.sse import BodyUsage, UsageTap, usage_of_body
from fleetserve.httpclient import (
    AnswerTooLarge,
    ConnectFailed,
    NoAnswer,
    Origin,
    Response,
    UpstreamError,
    UpstreamTimeout,
)
from fleetserve.rawasgi.answers import JSON, answer
from fleetserve.rawasgi.types import Header, Send
from fleetserve.routing import engine_auth

log = logging.getLogger("fleetserve.gateway")

# How long an engine may take to start answering (the head of its answer).
UPSTREAM_TIMEOUT = 600.0
# The engine's answer headers a client gets, and only these (an allowlist: an engine's
# Set-Cookie, CORS or anything else it sets never reaches the gateway's origin, which is also
# the dashboard's): what an OpenAI (or Anthropic) client reads. Framing, Connection, Date and
# Server are the gateway's own (uvicorn's); the gateway's CORS is ``gateway.cors``'s.
RELAYED_HEADERS = frozenset(
    {b"content-type", b"cache-control", b"retry-after", b"x-request-id", b"request-id"}
)
# ... and those of these families: OpenAI's processing time and version, a hosted API's
# rate-limit state (an ``Endpoint`` behind the gateway), Anthropic's.
RELAYED_PREFIXES = (b"openai-", b"x-ratelimit-", b"anthropic-")
# Media types relayed as the engine named them; any other (text/html ...) is relayed as plain
# text, so a browser never renders an engine's answer as a page of the gateway's origin.
SAFE_TYPES = (b"application/json", b"text/event-stream", b"text/plain", b"application/x-ndjson")
PLAIN_TEXT = b"text/plain; charset=utf-8"
NOSNIFF = (b"x-content-type-options", b"nosniff")

# Failures where nothing came back from the engine: no connection, one closed (reset, or the
# engine died) before the status line, or no status line within the timeout (an engine behind a
# partition). The only ones retried on another replica; the request may have reached the engine,
# so a route that must not run twice is not retried (``Gateway._forward``'s ``retry``).
BEFORE_ANY_ANSWER = (ConnectFailed, NoAnswer, UpstreamTimeout)


@functools.lru_cache(maxsize=4096)
def origin_of(url: str) -> tuple[Origin, bytes]:
    """An endpoint URL's origin and its Host header value (cached: URLs repeat). A replica's URL is
    ``http://HOST:PORT``; an Endpoint's may be ``https://`` on the scheme's default port, with a
    path its server's routes live under (``base_path``)."""
    parts = urlsplit(url)
    tls = parts.scheme == "https"
    host = parts.hostname or ""
    port = parts.port or (443 if tls else 80)
    return Origin(host, port, tls), parts.netloc.rpartition("@")[2].encode("ascii")


@functools.lru_cache(maxsize=4096)
def base_path(url: str) -> bytes:
    """The path an endpoint URL's server's routes live under (an Endpoint's ``/openai``), or b""."""
    return urlsplit(url).path.rstrip("/").encode("ascii")


@functools.lru_cache(maxsize=4096)
def auth_line(engine_key: str | None) -> bytes:
    """The replica's engine key as a header line (none for a replica placed before engine keys)."""
    if engine_key is not None and ("\r" in engine_key or "\n" in engine_key):
        raise UpstreamError("the replica's engine key holds a line break: not sent")
    return b"".join(f"{k}: {v}\r\n".encode("latin-1") for k, v in engine_auth(engine_key).items())


# Client headers an engine reads that a client relies on, forwarded as they came: content
# negotiation, the OpenAI and Anthropic API versions and betas, request ids and trace context, and
# llama.cpp's conversation id (tools/server/server-stream.cpp: a stream it can resume). Nothing
# else: never hop-by-hop headers, nor credentials (Authorization, X-Api-Key, Cookie, Proxy-*),
# which are the gateway's to read; the engine gets the replica's own key.
FORWARDED_HEADERS = frozenset(
    {
        b"accept",
        b"openai-beta",
        b"openai-organization",
        b"openai-project",
        b"anthropic-version",
        b"anthropic-beta",
        b"x-request-id",
        b"x-conversation-id",
        b"traceparent",
        b"tracestate",
    }
)


_UNSAFE_VALUE = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f-\xff]")
_UNSAFE_TARGET = re.compile(rb"[\x00-\x20\x7f-\xff]")


def _safe(value: bytes) -> bool:
    """Whether ``value`` can go into a request head as it is: printable ASCII and tabs (no line break)."""
    return _UNSAFE_VALUE.search(value) is None


@dataclass(frozen=True)
class Call:
    """What a request asks of an engine: method, target (path and query string, as the client sent
    them) and the client's forwarded header lines; the body goes beside it."""

    method: bytes
    target: bytes
    headers: bytes = b""
    # Whether a body goes with it (a JSON one); a GET has none.
    body: bool = True

    @classmethod
    def of(
        cls, method: str, path: bytes, query: bytes, client_headers: Iterable[Header], body: bool
    ) -> Call | None:
        """The call for a client's request, or None when its target cannot be relayed as it is."""
        target = path + b"?" + query if query else path
        if _UNSAFE_TARGET.search(target) is not None or not target.startswith(b"/"):
            return None
        lines = b"".join(
            b"%s: %s\r\n" % (name, value)
            for name, value in client_headers
            if name in FORWARDED_HEADERS and _safe(value)
        )
        return cls(method.encode("ascii"), target, lines, body)


POST_CALLS: dict[bytes, Call] = {}


def post(path: bytes) -> Call:
    """A plain ``POST path`` with a JSON body and no client headers (cached)."""
    call = POST_CALLS.get(path)
    if call is None:
        call = POST_CALLS[path] = Call(b"POST", path)
    return call


def upstream_request(endpoint: Endpoint, call: Call | bytes, body: bytes) -> tuple[Origin, bytes]:
    """The request to send to an engine, head and body: the one place its headers are built. A
    ``call`` given as a path is a ``POST`` of JSON to it."""
    if isinstance(call, bytes):
        call = post(call)
    origin, host = origin_of(endpoint.url)
    # The replica's own engine key (an Endpoint's key): the engine refuses any request without it.
    auth = auth_line(endpoint.engine_key)
    base = base_path(endpoint.url)
    if base:
        call = Call(call.method, base + call.target, call.headers, call.body)
    if not call.body:
        head = b"%s %s HTTP/1.1\r\nHost: %s\r\n%s%s\r\n" % (
            call.method,
            call.target,
            host,
            auth,
            call.headers,
        )
        return origin, head
    head = (
        b"%s %s HTTP/1.1\r\nHost: %s\r\n%s%sContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
        % (
            call.method,
            call.target,
            host,
            auth,
            call.headers,
            len(body),
        )
    )
    return origin, head + body


PICK_HEADER = b"x-fleetserve-pick"
"""The answer header saying why its replica was picked, sent to a client that asked for it."""


def relayed(response: Response, pick: bytes | None = None) -> list[Header]:
    """The engine's answer headers the client gets: ``RELAYED_HEADERS`` and ``RELAYED_PREFIXES``,
    a content type outside ``SAFE_TYPES`` as plain text, ``nosniff``, and the pick's reason when
    given (``PICK_HEADER``)."""
    out: list[Header] = [NOSNIFF] if pick is None else [NOSNIFF, (PICK_HEADER, pick)]
    for name, value in response.headers:
        lower = name.lower()
        if lower == b"content-type":
            media = value.partition(b";")[0].strip().lower()
            out.append((lower, value if media in SAFE_TYPES else PLAIN_TEXT))
        elif lower in RELAYED_HEADERS or lower.startswith(RELAYED_PREFIXES):
            out.append((lower, value))
    return out


async def answer_failed(send: Send, replica: str, error: UpstreamError) -> int:
    """Tell the client that ``replica`` was reached but its answer never came whole (or, on its
    last try, at all): 504 when it gave no answer in time, else 502; the status sent."""
    if isinstance(error, UpstreamTimeout):
        message = f"Replica {replica} did not answer in time ({error})."
        status, code = 504, "upstream_timeout"
    elif isinstance(error, AnswerTooLarge):
        message = (
            f"The answer of replica {replica} was not relayed: {error}; an operator may raise "
            "the limit, or the client may ask for a stream."
        )
        status, code = 502, "answer_too_large"
    elif isinstance(error, NoAnswer):
        message = f"Replica {replica} closed the connection without answering ({error})."
        status, code = 502, "no_answer"
    else:
        message = f"The answer of replica {replica} broke off before it was complete ({error})."
        status, code = 502, "answer_broken"
    log.warning("%s", message)
    await send_error(send, status, message, "upstream_error", code)
    return status


REDACTED = b"[redacted]"
"""What an Endpoint's key is replaced by in an answer held whole that repeats it."""

HOLD_BYTES = 1 << 20
"""A non-streamed answer up to this size is held whole before it is relayed (its usage read, an
error put in OpenAI's shape); a larger one passes in pieces as it comes (``relay_answer``)."""


def _declared_length(response: Response) -> int | None:
    value = next((v for n, v in response.headers if n.lower() == b"content-length"), None)
    return int(value) if value is not None and value.strip().isdigit() else None


async def relay_answer(send: Send, response: Response, ex: Exchange, limit: int) -> int:
    """Relay the engine's non-streamed answer with its status, whatever it is; the status sent.

    An error (4xx, 5xx) goes in OpenAI's shape where the engine's body is not
    (``engine_error_body``) and counts no tokens unless the engine reported some. An answer is
    held whole up to ``HOLD_BYTES``; a larger one passes in pieces as it comes, its usage read as
    it passes (``BodyUsage``), so the gateway never holds more than that of it. None is relayed
    past ``limit`` bytes (``--max-answer-bytes``): refused before its first byte when its length
    says so (502), else cut off where it passes the limit (the client's connection closed before
    the answer's end, never ended as if it were complete).
    """
    replica = ex.endpoint.replica if ex.endpoint else "?"
    declared = _declared_length(response)
    whole = response.status >= 400 or (declared is not None and declared <= HOLD_BYTES)
    parts: list[bytes] = []
    try:
        if whole:
            parts.append(await response.read(limit))
        else:
            if declared is not None and declared > limit:
                await response.read(limit)  # raises AnswerTooLarge, naming the limit
            held = 0
            while held <= HOLD_BYTES:
                piece = await response.next_piece()
                if not piece:
                    whole = True  # it all came: as small as one held whole
                    break
                parts.append(piece)
                held += len(piece)
    except UpstreamError as exc:  # the status line came: the engine answered, so no retry
        response.close()
        return await answer_failed(send, replica, exc)
    if not whole:
        return await _relay_in_pieces(send, response, ex, limit, parts)
    response.close()
    content = parts[0] if len(parts) == 1 else b"".join(parts)
    if ex.endpoint is not None and ex.endpoint.redact and ex.endpoint.engine_key:
        # A server that repeats the key it was sent (an error naming it) never shows it to a client.
        content = content.replace(ex.endpoint.engine_key.encode("latin-1"), REDACTED)
    status = response.status
    headers = relayed(response, ex.pick_header)
    if status >= 400:
        kind = next((v for n, v in headers if n.lower() == b"content-type"), b"")
        shaped = engine_error_body(status, content, kind)
        if shaped is not None:
            content = shaped
            headers = [(n, v) for n, v in headers if n.lower() != b"content-type"]
            headers.append(JSON)
    usage = usage_of_body(content, ex.counts)
    if usage is not None:
        ex.usage_total, ex.prompt, ex.completion = usage.total, usage.prompt, usage.completion
    elif status >= 400:
        ex.usage_total = 0  # an error with no usage: the client got no tokens
    await answer(send, status, content, headers)
    return status


async def _relay_in_pieces(
    send: Send, response: Response, ex: Exchange, limit: int, held: list[bytes]
) -> int:
    """Relay a large answer in pieces: ``held`` first, then the rest as it comes."""
    headers = relayed(response, ex.pick_header)
    declared = _declared_length(response)
    if declared is not None:
        headers.append((b"content-length", b"%d" % declared))
    meter = BodyUsage(ex.counts)
    size = 0
    await send({"type": "http.response.start", "status": response.status, "headers": headers})
    try:
        for piece in held:
            meter.feed(piece)
            size += len(piece)
            await send({"type": "http.response.body", "body": piece, "more_body": True})
        while piece := await response.next_piece():
            size += len(piece)
            if size > limit:
                raise AnswerTooLarge(
                    f"the answer passed {limit} bytes, the gateway's limit (--max-answer-bytes)"
                )
            meter.feed(piece)
            await send({"type": "http.response.body", "body": piece, "more_body": True})
    except UpstreamError as exc:
        # Part of the answer reached the client: it cannot be told in a status any more. Its
        # connection is closed before the answer's end (uvicorn does so when an app returns with
        # the answer unfinished), so no client takes what it got for the whole answer.
        ex.broken = True
        log.warning(
            "answer from %s cut off after %d bytes: %s",
            ex.endpoint.replica if ex.endpoint else "?",
            size,
            exc,
        )
        return response.status
    finally:
        response.close()
    await send({"type": "http.response.body", "body": b"", "more_body": False})
    usage = meter.usage()
    if usage is not None:
        ex.usage_total, ex.prompt, ex.completion = usage.total, usage.prompt, usage.completion
    return response.status


async def relay_stream(send: Send, response: Response, ex: Exchange, tap: UsageTap) -> None:
    """Pass the engine's events through as they come; a broken upstream is told, not hidden."""
    await send(
        {
            "type": "http.response.start",
            "status": response.status,
            "headers": relayed(response, ex.pick_header),
        }
    )
    try:
        while True:
            piece = await response.next_piece()
            if not piece:
                break
            now = time.monotonic()
            if ex.first_at is None:
                ex.first_at = now
            ex.last_at = now
            out = tap.feed(piece)
            if out:
                await send({"type": "http.response.body", "body": out, "more_body": True})
        await send({"type": "http.response.body", "body": tap.flush(), "more_body": False})
    except UpstreamError as exc:
        # Never end a broken stream as if it were complete: the client gets an error event
        # (OpenAI clients raise on it) and no [DONE].
        replica = ex.endpoint.replica if ex.endpoint else "?"
        ex.broken = True
        log.warning("stream from %s broke off: %s", replica, exc)
        await send({"type": "http.response.body", "body": broken_stream_event(replica), "more_body": False})
    finally:
        response.close()
        if tap.usage is not None:
            ex.usage_total, ex.prompt, ex.completion = (
                tap.usage.total,
                tap.usage.prompt,
                tap.usage.completion,
            )
