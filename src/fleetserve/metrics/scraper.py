"""The metrics scraper: every engine's ``/metrics`` fetched once per interval, the last raw body kept.

The scraper stores bytes, never parsed samples: a caller parses on demand (``parse_on_demand``
memoises one parse per target until the next body arrives). Each cycle fetches every target at
once, at most ``concurrency`` in flight, each under its own timeout, so a slow or dead target costs
one slot for at most ``timeout`` seconds and never delays the others. A target whose previous
scrape is still in flight is skipped by the next cycle rather than queued twice.

Memory does not grow with time: per target one last good body (at most ``max_body_bytes``), the
last error, and one memoised parse. Scrape failures are values (``Scrape.error``); the fetcher
raises from this hierarchy, and any other exception a hand-made fetcher raises is recorded too:

    FleetserveError
    └── ScrapeError           one fetch of one target failed; str() is what Scrape.error shows
        ├── ScrapeTimeout     no complete answer within the timeout
        ├── BadStatus         the target answered with a status other than 200
        ├── BodyTooLarge      the body is over max_body_bytes (declared or read)
        └── FetchFailed       connection refused or reset, malformed HTTP (the cause is chained:
                              a ``fleetserve.httpclient.UpstreamError``)

Freshness is decided by pure functions (``view``, ``staleness``, ``next_tick``) from the stored
state and a ``now``; the ``Scraper`` class only does the I/O and the bookkeeping.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import ssl
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType, TracebackType
from typing import Protocol, TypeVar
from urllib.parse import urlsplit

import httpx
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from fleetserve.errors import FleetserveError
from fleetserve.httpclient import ConnectFailed, HttpClient, Origin, UpstreamError

log = logging.getLogger("fleetserve.metrics")

T = TypeVar("T")

MAX_BODY_BYTES = 1 << 20
"""The largest body kept for one target; a larger one is that target's error (1 MiB)."""

MAX_ERROR_CHARS = 300
"""Error messages are cut to this length, so a hostile target cannot grow memory through them."""

DEFAULT_MAX_ORIGINS = 4096
"""Origins (scheme, host, port) the default fetcher keeps a connection pool for, least recent dropped."""

Clock = Callable[[], float]


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


@dataclass(frozen=True)
class Target:
    """One endpoint to scrape: a stable key, its metrics URL, the labels its samples get, and the
    bearer token the endpoint demands (an engine's API key), if any."""

    key: str
    url: str
    labels: Mapping[str, str] = field(default_factory=dict, hash=False)
    bearer: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        # A read-only copy: the caller's dict may change later; this target must not.
        object.__setattr__(self, "labels", MappingProxyType(dict(self.labels)))


@dataclass(frozen=True)
class Scrape:
    """What is known about one target now: its last good body, how old it is, and the last error.

    ``fetched_at`` and ``age`` are ``None`` (and ``stale`` true) until a scrape has succeeded.
    ``error`` is the error of the latest attempt, ``None`` once an attempt succeeds again.
    """

    key: str
    fetched_at: float | None
    age: float | None
    body: bytes | None
    error: str | None
    stale: bool


@dataclass(frozen=True)
class ScraperStats:
    """The scraper's own figures: scrape counts, the last cycle's duration and the worst staleness."""

    targets: int
    scrapes_ok: int
    scrapes_failed: int
    cycles: int
    last_cycle_seconds: float | None
    max_staleness_seconds: float


class Fetcher(Protocol):
    """Fetches one URL's body, sending ``Authorization: Bearer`` with ``bearer`` when given; raises
    (preferably a ``ScrapeError``) on any failure."""

    async def __call__(self, url: str, timeout: float, bearer: str | None = None) -> bytes: ...


@dataclass(eq=False)
class _TargetState:
    """The mutable record the scraper keeps per target (never exposed: ``view`` makes a ``Scrape``)."""

    target: Target
    added_at: float
    body: bytes | None = None
    fetched_at: float | None = None
    error: str | None = None
    attempted: bool = False
    in_flight: bool = False
    generation: int = 0  # bumped with every new body; keys the memoised parse
    parsed: tuple[int, Callable[[bytes], object], object] | None = None


# ---- pure decisions ------------------------------------------------------------------------


def view(state: _TargetState, now: float, stale_after: float) -> Scrape | None:
    """The ``Scrape`` a reader sees at ``now``; ``None`` before the first attempt has finished."""
    if not state.attempted:
        return None
    age = None if state.fetched_at is None else max(0.0, now - state.fetched_at)
    return Scrape(
        key=state.target.key,
        fetched_at=state.fetched_at,
        age=age,
        body=state.body,
        error=state.error,
        stale=age is None or age > stale_after,
    )


def staleness(state: _TargetState, now: float) -> float:
    """Seconds since the target's last good body, or since it was added when it never had one."""
    since = state.fetched_at if state.fetched_at is not None else state.added_at
    return max(0.0, now - since)


def next_tick(start: float, interval: float, now: float) -> float:
    """The first tick ``start + k * interval`` after ``now``: ticks missed while busy are skipped."""
    k = int((now - start) // interval) + 1
    return start + k * interval


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


# ---- an httpx fetcher -----------------------------------------------------------------------


class OriginPoolTransport(httpx.AsyncBaseTransport):
    """An httpx transport with one small connection pool per origin, least recently used evicted.

    httpcore's pool scans every pooled connection on each request and each response close (and
    polls each idle socket), so one pool over a thousand origins costs O(origins) per request;
    here each origin's pool holds a connection or two. Idle sockets stay bounded at
    ``max_origins * per_origin``.
    """

    def __init__(self, *, max_origins: int = DEFAULT_MAX_ORIGINS, per_origin: int = 2) -> None:
        self._max_origins = max_origins
        self._limits = httpx.Limits(max_connections=per_origin, max_keepalive_connections=per_origin)
        # One TLS context for every origin: building one per pool would load the CA bundle each time.
        self._ssl = httpx.create_ssl_context()
        self._pools: OrderedDict[tuple[bytes, bytes, int | None], httpx.AsyncHTTPTransport] = OrderedDict()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        origin = (url.raw_scheme, url.raw_host, url.port)
        pool = self._pools.get(origin)
        if pool is None:
            pool = httpx.AsyncHTTPTransport(verify=self._ssl, limits=self._limits, trust_env=False)
            self._pools[origin] = pool
            if len(self._pools) > self._max_origins:
                _, evicted = self._pools.popitem(last=False)
                await evicted.aclose()
        else:
            self._pools.move_to_end(origin)
        return await pool.handle_async_request(request)

    async def aclose(self) -> None:
        pools, self._pools = list(self._pools.values()), OrderedDict()
        for pool in pools:
            await pool.aclose()


class HttpxFetcher:
    """A fetcher on one shared ``httpx.AsyncClient``, keep-alive, a small pool per origin."""

    def __init__(
        self,
        *,
        max_body_bytes: int = MAX_BODY_BYTES,
        max_origins: int = DEFAULT_MAX_ORIGINS,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.max_body_bytes = max_body_bytes
        self._client = httpx.AsyncClient(
            transport=transport if transport is not None else OriginPoolTransport(max_origins=max_origins),
            # Compressing 3 KB on loopback or a LAN costs both sides more CPU than it saves.
            headers={"Accept-Encoding": "identity", "Accept": "text/plain"},
            follow_redirects=False,
            trust_env=False,
        )

    async def __call__(self, url: str, timeout: float, bearer: str | None = None) -> bytes:
        headers = {"Authorization": f"Bearer {bearer}"} if bearer else None
        try:
            async with self._client.stream("GET", url, timeout=timeout, headers=headers) as response:
                if response.status_code != 200:
                    raise BadStatus(response.status_code)
                declared = _content_length(response)
                too_large = body_error(0, declared, self.max_body_bytes)
                if too_large is not None:
                    raise too_large
                chunks: list[bytes] = []
                size = 0
                async for chunk in response.aiter_bytes():
                    size += len(chunk)
                    too_large = body_error(size, None, self.max_body_bytes)
                    if too_large is not None:
                        raise too_large
                    chunks.append(chunk)
                return b"".join(chunks)
        except httpx.TimeoutException as exc:
            raise ScrapeTimeout(timeout) from exc
        except (httpx.HTTPError, httpx.InvalidURL) as exc:
            raise FetchFailed(f"fetch failed: {type(exc).__name__}: {exc}") from exc

    async def aclose(self) -> None:
        """Close every pooled connection."""
        await self._client.aclose()


def _content_length(response: httpx.Response) -> int | None:
    value = response.headers.get("content-length")
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


# ---- the scraper ----------------------------------------------------------------------------


class Scraper:
    """Scrapes a changing set of targets once per interval and keeps each one's last raw body."""

    def __init__(
        self,
        fetch: Fetcher | None = None,
        *,
        concurrency: int = 64,
        timeout: float = 2.0,
        interval: float = 1.0,
        stale_after: float | None = None,
        max_body_bytes: int = MAX_BODY_BYTES,
        clock: Clock = time.monotonic,
    ) -> None:
        if concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, not {concurrency}")
        if timeout <= 0 or interval <= 0:
            raise ValueError(f"timeout and interval must be positive, not {timeout} and {interval}")
        self._owned: HttpFetcher | None = None
        if fetch is None:
            self._owned = HttpFetcher(max_body_bytes=max_body_bytes)
            fetch = self._owned
        self._fetch: Fetcher = fetch
        self.concurrency = concurrency
        self.timeout = timeout
        self.interval = interval
        self.stale_after = 3 * interval if stale_after is None else stale_after
        self.max_body_bytes = max_body_bytes
        self._clock = clock
        self._states: dict[str, _TargetState] = {}
        # Shared by every cycle: overlapping cycles (a hung target) still hold `concurrency` at most.
        self._slots = asyncio.Semaphore(concurrency)
        self._ok = 0
        self._failed = 0
        self._cycles = 0
        self._last_cycle: float | None = None

    # -- targets --

    def set_targets(self, targets: Iterable[Target]) -> None:
        """Replace the target set: new ones are scraped from the next cycle, removed ones dropped.

        A target whose key and URL stay keeps its data (and takes the new labels); one whose URL
        changed starts afresh.
        """
        wanted: dict[str, Target] = {}
        for target in targets:
            if target.key in wanted:
                raise ValueError(f"duplicate target key {target.key!r}")
            wanted[target.key] = target
        now = self._clock()
        states: dict[str, _TargetState] = {}
        for key, target in wanted.items():
            old = self._states.get(key)
            if old is not None and old.target.url == target.url:
                old.target = target
                states[key] = old
            else:
                states[key] = _TargetState(target, now)
        # A scrape in flight for a dropped state finds itself replaced and discards its result.
        self._states = states

    def targets(self) -> tuple[Target, ...]:
        """The current targets, in the order they were given."""
        return tuple(s.target for s in self._states.values())

    # -- reading --

    def latest(self, key: str) -> Scrape | None:
        """The target's last good body and freshness; ``None`` if unknown or not yet attempted."""
        state = self._states.get(key)
        return None if state is None else view(state, self._clock(), self.stale_after)

    def snapshot(self) -> dict[str, Scrape]:
        """Every attempted target's ``Scrape``, read at one instant."""
        now = self._clock()
        out: dict[str, Scrape] = {}
        for key, state in self._states.items():
            scrape = view(state, now, self.stale_after)
            if scrape is not None:
                out[key] = scrape
        return out

    def parse_on_demand(self, key: str, parse: Callable[[bytes], T]) -> T | None:
        """``parse`` applied to the target's last good body, memoised until a new body arrives.

        One memo per target (the latest parser's result), so memory stays bounded; ``None`` when
        the target is unknown or has no body. Stale bodies are parsed too: check ``latest``.
        """
        state = self._states.get(key)
        if state is None or state.body is None:
            return None
        memo = state.parsed
        if memo is not None and memo[0] == state.generation and memo[1] is parse:
            return memo[2]  # type: ignore[return-value]  # stored by this same parser
        value = parse(state.body)
        state.parsed = (state.generation, parse, value)
        return value

    def stats(self) -> ScraperStats:
        """The self-metrics: scrapes ok and failed, cycles, last cycle duration, worst staleness."""
        now = self._clock()
        worst = max((staleness(s, now) for s in self._states.values()), default=0.0)
        return ScraperStats(
            targets=len(self._states),
            scrapes_ok=self._ok,
            scrapes_failed=self._failed,
            cycles=self._cycles,
            last_cycle_seconds=self._last_cycle,
            max_staleness_seconds=worst,
        )

    # -- scraping --

    async def scrape_once(self) -> None:
        """One cycle: every target not already in flight, at most ``concurrency`` at a time."""
        pending = deque(s for s in self._states.values() if not s.in_flight)
        for state in pending:
            state.in_flight = True
        start = self._clock()
        try:
            # A few workers draining one queue, not one task per target: cheaper per target.
            async with asyncio.TaskGroup() as group:
                for _ in range(min(self.concurrency, len(pending))):
                    group.create_task(self._drain(pending))
        finally:
            for state in pending:  # left over only when the cycle was cancelled
                state.in_flight = False
        self._cycles += 1
        self._last_cycle = self._clock() - start

    async def _drain(self, pending: deque[_TargetState]) -> None:
        while pending:
            state = pending.popleft()
            async with self._slots:
                await self._scrape(state)

    async def _scrape(self, state: _TargetState) -> None:
        body: bytes | None = None
        error: str | None = None
        try:
            async with asyncio.timeout(self.timeout):
                body = await self._fetch(state.target.url, self.timeout, bearer=state.target.bearer)
            too_large = body_error(len(body), None, self.max_body_bytes)
            if too_large is not None:
                body, error = None, str(too_large)
        except Exception as exc:  # any failure of one target is that target's error, nothing more
            error = describe(exc, self.timeout)
        finally:
            state.in_flight = False
        if self._states.get(state.target.key) is not state:
            return  # removed (or replaced) while in flight: its data is dropped
        state.attempted = True
        if body is not None:
            self._ok += 1
            state.body = body
            state.fetched_at = self._clock()
            state.error = None
            state.generation += 1
            state.parsed = None
        else:
            self._failed += 1
            state.error = error

    async def run(self, stop: asyncio.Event) -> None:
        """Scrape every target once per interval until ``stop`` is set; then cancel what is in flight.

        A cycle that outlasts the interval does not hold up the next one: cycles run as tasks and
        the next tick starts on time, skipping only the targets still in flight.
        """
        cycles: set[asyncio.Task[None]] = set()
        start = self._clock()
        try:
            while not stop.is_set():
                task = asyncio.create_task(self.scrape_once())
                cycles.add(task)
                task.add_done_callback(_finished(cycles))
                delay = next_tick(start, self.interval, self._clock()) - self._clock()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(max(0.0, delay)):
                        await stop.wait()
        finally:
            for task in cycles:
                task.cancel()
            await asyncio.gather(*cycles, return_exceptions=True)

    async def aclose(self) -> None:
        """Close the default fetcher's connections (a fetcher handed in is the caller's to close)."""
        if self._owned is not None:
            await self._owned.aclose()

    async def __aenter__(self) -> Scraper:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()


def _finished(cycles: set[asyncio.Task[None]]) -> Callable[[asyncio.Task[None]], None]:
    def done(task: asyncio.Task[None]) -> None:
        cycles.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("scrape cycle failed", exc_info=task.exception())

    return done


class ScraperCollector(Collector):
    """Exposes a scraper's ``stats()`` to ``prometheus_client`` as ``fleetserve_scraper_*`` metrics."""

    def __init__(self, scraper: Scraper) -> None:
        self._scraper = scraper

    def collect(self) -> Iterator[Metric]:
        stats = self._scraper.stats()
        scrapes = CounterMetricFamily(
            "fleetserve_scraper_scrapes", "Scrapes finished, by result", labels=["result"]
        )
        scrapes.add_metric(["ok"], stats.scrapes_ok)
        scrapes.add_metric(["failed"], stats.scrapes_failed)
        yield scrapes
        yield GaugeMetricFamily("fleetserve_scraper_targets", "Targets scraped", value=stats.targets)
        yield GaugeMetricFamily(
            "fleetserve_scraper_last_cycle_seconds",
            "Duration of the last complete scrape cycle",
            value=stats.last_cycle_seconds if stats.last_cycle_seconds is not None else float("nan"),
        )
        yield GaugeMetricFamily(
            "fleetserve_scraper_max_staleness_seconds",
            "Age of the oldest target's last good scrape",
            value=stats.max_staleness_seconds,
        )


__all__ = [
    "MAX_BODY_BYTES",
    "BadStatus",
    "BodyTooLarge",
    "FetchFailed",
    "Fetcher",
    "HttpFetcher",
    "HttpxFetcher",
    "Scrape",
    "ScrapeError",
    "ScrapeTimeout",
    "Scraper",
    "ScraperCollector",
    "ScraperStats",
    "Target",
    "next_tick",
    "staleness",
    "view",
]
