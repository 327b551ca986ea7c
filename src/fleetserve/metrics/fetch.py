"""Fetching one scrape target's body: the ``Fetcher`` seam, its errors, and the default fetcher.

A fetcher answers one URL with its body or raises; the default one, ``HttpFetcher``, speaks lean
HTTP/1.1 over ``fleetserve.httpclient``'s keep-alive connections (``metrics.httpxfetch`` holds one
on httpx, for comparison). A failure raises from this hierarchy, and ``describe`` turns any
exception into the text ``Scrape.error`` shows:

    FleetserveError
    └── ScrapeError           one fetch of one target failed; str() is what Scrape.error shows
        ├── ScrapeTimeout     no complete answer within the timeout
        ├── BadStatus         the target answered with a status other than 200
        ├── BodyTooLarge      the body is over max_body_bytes (declared or read)
        └── FetchFailed       connection refused or reset, malformed HTTP (the cause is chained:
                              a ``fleetserve.httpclient.UpstreamError``)
"""

from __future__ import annotations

import asyncio
import functools
import ssl
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import urlsplit

from fleetserve.errors import FleetserveError
from fleetserve.httpclient import ConnectFailed, HttpClient, Origin, UpstreamError

MAX_BODY_BYTES = 1 << 20
"""The largest body kept for one target; a larger one is that target's error (1 MiB)."""

MAX_ERROR_CHARS = 300
"""Error messages are cut to this length, so a hostile target cannot grow memory through them."""

DEFAULT_MAX_ORIGINS = 4096
"""Origins (scheme, host, port) the default fetcher keeps a connection pool for, least recent dropped."""


class ScrapeError(FleetserveError):
    """One fetch of one target failed; the message is what ``Scrape.error`` shows."""


class ScrapeTimeout(ScrapeError):
    """The target gave no complete answer within the timeout."""

    def __init__(self, timeout: float) -> None:
        super().__init__(f"timeout: no complete answer within {timeout:g}s")


class BadStatus(ScrapeError):
    """The target answered with a status other than 200."""

    def __init__(self, status: int) -> None:
        self.status = status
        super().__init__(f"bad status: HTTP {status}")


class BodyTooLarge(ScrapeError):
    """The body is over the size limit, as declared by Content-Length or as read."""

    def __init__(self, limit: int, size: int | None = None) -> None:
        self.limit = limit
        self.size = size
        got = f"{size} bytes" if size is not None else "more"
        super().__init__(f"body too large: {got}, the limit is {limit} bytes")


class FetchFailed(ScrapeError):
    """The connection failed or the answer was not valid HTTP; the transport's error is chained."""


class Fetcher(Protocol):
    """Fetches one URL's body, sending ``Authorization: Bearer`` with ``bearer`` when given; raises
    (preferably a ``ScrapeError``) on any failure."""

    async def __call__(self, url: str, timeout: float, bearer: str | None = None) -> bytes: ...


def body_error(size: int, declared: int | None, limit: int) -> BodyTooLarge | None:
    """The error for a body of ``size`` bytes read (or ``declared`` by Content-Length), if any."""
    if declared is not None and declared > limit:
        return BodyTooLarge(limit, declared)
    if size > limit:
        return BodyTooLarge(limit, size)
    return None


def describe(exc: BaseException, timeout: float) -> str:
    """The error text a failed scrape records: ours as is, a foreign one with its type name."""
    if isinstance(exc, ScrapeError):
        text = str(exc)
    elif isinstance(exc, TimeoutError):
        text = str(ScrapeTimeout(timeout))
    else:
        text = f"fetch failed: {type(exc).__name__}: {exc}"
    return text[:MAX_ERROR_CHARS]


# ---- the default fetcher: fleetserve.httpclient's keep-alive connections --------------------------


@dataclass(frozen=True)
class _Route:
    """What one URL resolves to: where to connect and the request bytes to send."""

    origin: tuple[str, str, int]
    host: str
    port: int
    tls: bool
    request: bytes

    @property
    def target(self) -> Origin:
        """Where ``fleetserve.httpclient`` connects."""
        return Origin(self.host, self.port, self.tls)


@functools.lru_cache(maxsize=8192)
def route(url: str, bearer: str | None = None) -> _Route:
    """Split a scrape URL into its origin and the GET request to send, with ``bearer`` as its
    Authorization (cached: URLs repeat)."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise FetchFailed(f"bad URL {url[:100]!r}: {exc}") from exc
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise FetchFailed(f"bad URL {url[:100]!r}: http:// or https:// and a host are needed")
    tls = parts.scheme == "https"
    port = port if port is not None else (443 if tls else 80)
    authority = parts.netloc.rpartition("@")[2]
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    if bearer is not None and any(c in bearer for c in "\r\n"):
        raise FetchFailed("a bearer token may not hold a line break")
    authorization = f"Authorization: Bearer {bearer}\r\n" if bearer else ""
    request = (
        f"GET {target} HTTP/1.1\r\nHost: {authority}\r\nUser-Agent: fleetserve-scraper\r\n"
        f"Accept: text/plain\r\nAccept-Encoding: identity\r\n{authorization}\r\n"
    ).encode("latin-1", "replace")
    return _Route((parts.scheme, parts.hostname, port), parts.hostname, port, tls, request)


class HttpFetcher:
    """The default fetcher: lean HTTP/1.1 (``fleetserve.httpclient``, the gateway's upstream
    client), a reused keep-alive connection per origin, bodies capped at ``max_body_bytes``.

    Measured (bench/scrape.py) at a fraction of httpx's CPU per scrape. Idle connections are kept
    per origin (at most ``per_origin``) and in all (at most ``max_idle``, least recent closed); a
    reused connection that turns out to have been closed by the server is retried once on a new one.
    """

    def __init__(
        self,
        *,
        max_body_bytes: int = MAX_BODY_BYTES,
        max_idle: int = DEFAULT_MAX_ORIGINS,
        per_origin: int = 2,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.max_body_bytes = max_body_bytes
        self._client = HttpClient(max_idle_per_origin=per_origin, max_idle=max_idle, ssl_context=ssl_context)

    async def __call__(self, url: str, timeout: float, bearer: str | None = None) -> bytes:
        where = route(url, bearer)
        try:
            async with asyncio.timeout(timeout):
                return await self._fetch(where)
        except TimeoutError as exc:
            raise ScrapeTimeout(timeout) from exc

    async def _fetch(self, where: _Route) -> bytes:
        try:
            response = await self._client.request(where.target, where.request)
        except ConnectFailed as exc:
            raise FetchFailed(f"connect failed: {exc.__cause__ or exc}") from exc
        except UpstreamError as exc:
            raise FetchFailed(f"fetch failed: {exc}") from exc
        try:
            problem = check_head(response.status, response.headers, self.max_body_bytes)
            if problem is not None:
                raise problem
            parts: list[bytes] = []
            size = 0
            while piece := await response.next_piece():
                size += len(piece)
                if size > self.max_body_bytes:
                    raise BodyTooLarge(self.max_body_bytes, size)
                parts.append(piece)
            return parts[0] if len(parts) == 1 else b"".join(parts)
        except UpstreamError as exc:
            raise FetchFailed(f"fetch failed: {exc}") from exc
        finally:
            response.close()  # a complete answer's connection is back in the pool already

    @property
    def idle_connections(self) -> int:
        """Open connections waiting in the pool for their origin's next scrape."""
        return self._client.idle_connections

    async def aclose(self) -> None:
        """Close every connection, idle or not."""
        await self._client.aclose()


def check_head(status: int, headers: list[tuple[bytes, bytes]], limit: int) -> ScrapeError | None:
    """What is wrong with an answer's head for a scrape: a status other than 200, a body coding
    other than identity (identity was asked for), a declared body over ``limit``; None if nothing."""
    if status != 200:
        return BadStatus(status)
    for raw_name, raw_value in headers:
        name = raw_name.lower()
        value = raw_value.decode("latin-1").strip()
        if name == b"content-length":
            if not value.isdigit():
                return FetchFailed(f"malformed response: Content-Length {value[:40]!r}")
            too_large = body_error(0, int(value), limit)
            if too_large is not None:
                return too_large
        elif name == b"transfer-encoding" and value.lower().rsplit(",", 1)[-1].strip() != "chunked":
            return FetchFailed(f"unsupported Transfer-Encoding {value[:40]!r}")
        elif name == b"content-encoding" and value.lower() not in ("", "identity"):
            return FetchFailed(f"unsupported Content-Encoding {value[:40]!r} (identity was asked)")
    return None


__all__ = [
    "DEFAULT_MAX_ORIGINS",
    "MAX_BODY_BYTES",
    "BadStatus",
    "BodyTooLarge",
    "FetchFailed",
    "Fetcher",
    "HttpFetcher",
    "ScrapeError",
    "ScrapeTimeout",
    "body_error",
    "check_head",
    "describe",
    "route",
]
