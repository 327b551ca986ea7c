"""The request the gateway sends an engine, and how the engine's answer is relayed back.

An upstream request is written as raw HTTP/1.1 bytes for ``httpclient``'s pooled connections:
built here, in one place, with the replica's engine key (``routing.engine_auth``), which the
engine requires. Everything a request does not change (an endpoint's origin and Host, a key's
header line) is computed once and cached. Of the answer's headers only those an OpenAI client
reads are relayed, never a cookie, and never a media type a browser would render (``relayed``);
a streamed answer's events pass through as they come
(``relay_stream``), and a stream that breaks off ends with an error event, never as if it were
complete.
"""

from __future__ import annotations

import functools
import logging
import time

from fleetserve.gateway.accounting import Exchange
from fleetserve.gateway.openai_errors import broken_stream_event
from fleetserve.gateway.picker import Endpoint
from fleetserve.gateway.sse import UsageTap
from fleetserve.httpclient import Origin, Response, UpstreamError
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


@functools.lru_cache(maxsize=4096)
def origin_of(url: str) -> tuple[Origin, bytes]:
    """An endpoint URL's origin and its Host header value (cached: URLs repeat)."""
    scheme, _, authority = url.partition("://")
    host, _, port = authority.rpartition(":")
    return Origin(host.strip("[]"), int(port), scheme == "https"), authority.encode()


@functools.lru_cache(maxsize=4096)
def auth_line(engine_key: str | None) -> bytes:
    """The replica's engine key as a header line (none for a replica placed before engine keys)."""
    if engine_key is not None and ("\r" in engine_key or "\n" in engine_key):
        raise UpstreamError("the replica's engine key holds a line break: not sent")
    return b"".join(f"{k}: {v}\r\n".encode("latin-1") for k, v in engine_auth(engine_key).items())


def upstream_request(endpoint: Endpoint, path: bytes, body: bytes) -> tuple[Origin, bytes]:
    """The request to send to an engine, head and body: the one place its headers are built."""
    origin, host = origin_of(endpoint.url)
    # The replica's own engine key: the engine refuses any request without it.
    head = (
        b"POST %s HTTP/1.1\r\nHost: %s\r\n%sContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
        % (
            path,
            host,
            auth_line(endpoint.engine_key),
            len(body),
        )
    )
    return origin, head + body


def relayed(response: Response) -> list[Header]:
    """The engine's answer headers the client gets: ``RELAYED_HEADERS`` and ``RELAYED_PREFIXES``,
    a content type outside ``SAFE_TYPES`` as plain text, and ``nosniff``."""
    out: list[Header] = [NOSNIFF]
    for name, value in response.headers:
        lower = name.lower()
        if lower == b"content-type":
            media = value.partition(b";")[0].strip().lower()
            out.append((lower, value if media in SAFE_TYPES else PLAIN_TEXT))
        elif lower in RELAYED_HEADERS or lower.startswith(RELAYED_PREFIXES):
            out.append((lower, value))
    return out


async def relay_stream(send: Send, response: Response, ex: Exchange, tap: UsageTap) -> None:
    """Pass the engine's events through as they come; a broken upstream is told, not hidden."""
    await send({"type": "http.response.start", "status": response.status, "headers": relayed(response)})
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
