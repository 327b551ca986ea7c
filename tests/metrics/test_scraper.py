"""The scraper against real HTTP servers on 127.0.0.1, and its pure parts on their own.

Every server here is an ``asyncio.start_server`` speaking just enough HTTP/1.1: keep-alive,
Content-Length or chunked bodies, a delay, a hang, a status, ``Connection: close``. Each scenario
runs in its own ``asyncio.run`` and closes its servers and scraper before returning.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from fleetserve.metrics.fetch import BadStatus, BodyTooLarge, FetchFailed, HttpFetcher, ScrapeTimeout, route
from fleetserve.metrics.httpxfetch import HttpxFetcher
from fleetserve.metrics.scraper import Scraper, ScraperCollector
from fleetserve.metrics.targets import Target, TargetState, next_tick, staleness, view

# ---- a real, minimal HTTP server ------------------------------------------------------------


def counter_body(n: int) -> bytes:
    """A small llama.cpp-like body whose counter is the request number."""
    return (
        "# TYPE llamacpp:tokens_predicted_total counter\n"
        f"llamacpp:tokens_predicted_total {n}\n"
        "# TYPE llamacpp:requests_processing gauge\n"
        "llamacpp:requests_processing 1\n"
    ).encode()


@dataclass
class Behaviour:
    """How a test server answers; tests change it between scrapes."""

    body: Callable[[int], bytes] = counter_body
    status: int = 200
    delay: float = 0.0
    hang: bool = False
    chunked: bool = False
    close: bool = False  # answer with Connection: close and close
    drop_reused: bool = False  # close a reused connection without answering (an expired keep-alive)
    bearer: str | None = None  # answer 401 to a request without "Authorization: Bearer <bearer>"


@dataclass
class Gauge:
    """A count that remembers its highest value."""

    now: int = 0
    peak: int = 0

    def up(self) -> None:
        self.now += 1
        self.peak = max(self.peak, self.now)

    def down(self) -> None:
        self.now -= 1


@dataclass
class EngineServer:
    """One fake engine on its own port of 127.0.0.1."""

    behaviour: Behaviour = field(default_factory=Behaviour)
    in_service: Gauge = field(default_factory=Gauge)
    open_connections: Gauge = field(default_factory=Gauge)
    connections: int = 0
    requests: int = 0
    port: int = 0
    _server: asyncio.Server | None = None
    _writers: set[asyncio.StreamWriter] = field(default_factory=set)
    _closing: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/metrics"

    async def start(self) -> EngineServer:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def aclose(self) -> None:
        """Stop listening and end every connection; handlers return on their own (none cancelled)."""
        assert self._server is not None
        self._server.close()
        self._closing.set()
        for writer in list(self._writers):
            writer.transport.abort()
        while self._writers:
            await asyncio.sleep(0.001)
        await self._server.wait_closed()

    def drop_connections(self) -> None:
        """Close every connection, as a server does when its keep-alive timeout passes."""
        for writer in list(self._writers):
            writer.transport.abort()

    async def _pause(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await self._closing.wait()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        self.connections += 1
        self.open_connections.up()
        on_this_connection = 0
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                on_this_connection += 1
                b = self.behaviour
                if b.drop_reused and on_this_connection > 1:
                    return
                self.requests += 1
                self.in_service.up()
                try:
                    await self._pause(3600 if b.hang else b.delay)
                finally:
                    self.in_service.down()
                if self._closing.is_set():
                    return
                refused = b.bearer is not None and f"\r\nauthorization: bearer {b.bearer}\r\n" not in (
                    head.decode("latin-1").lower()
                )
                writer.write(self._response(replace(b, status=401) if refused else b))
                await writer.drain()
                if b.close:
                    return
        finally:
            self.open_connections.down()  # before any await: the count is exact when the client reacts
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()
            self._writers.discard(writer)

    def _response(self, b: Behaviour) -> bytes:
        body = b.body(self.requests)
        head = f"HTTP/1.1 {b.status} X\r\nContent-Type: text/plain; version=0.0.4\r\n"
        if b.close:
            head += "Connection: close\r\n"
        if not b.chunked:
            return f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body
        chunks = b"".join(
            f"{len(body[i : i + 1000]):x}\r\n".encode() + body[i : i + 1000] + b"\r\n"
            for i in range(0, len(body), 1000)
        )
        return f"{head}Transfer-Encoding: chunked\r\n\r\n".encode() + chunks + b"0\r\n\r\n"


@contextlib.asynccontextmanager
async def engines(*behaviours: Behaviour, shared: bool = False) -> AsyncIterator[list[EngineServer]]:
    """Started servers, one per behaviour (``shared``: one in-service and connection gauge for all)."""
    in_service, connections = Gauge(), Gauge()
    servers = [EngineServer(b, in_service, connections) if shared else EngineServer(b) for b in behaviours]
    try:
        for server in servers:
            await server.start()
        yield servers
    finally:
        for server in servers:
            await server.aclose()


def targets_of(servers: list[EngineServer]) -> list[Target]:
    return [Target(f"engine-{i}", s.url, {"replica": str(i)}) for i, s in enumerate(servers)]


def dead_url() -> str:
    """A URL on a port of 127.0.0.1 where nothing listens."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}/metrics"


class FakeClock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# ---- pure parts -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("now", "expected"),
    [
        (10.0, 11.0),  # at a tick: the next one
        (10.4, 11.0),  # between ticks
        (13.7, 14.0),  # ticks 11, 12 and 13 were missed while busy: skipped, not run in a burst
    ],
)
def test_next_tick_is_the_first_tick_after_now_skipping_missed_ones(now: float, expected: float) -> None:
    assert next_tick(10.0, 1.0, now) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("fetched_at", "now", "age", "stale"),
    [
        (100.0, 100.5, 0.5, False),
        (100.0, 103.0, 3.0, False),  # exactly stale_after: still fresh
        (100.0, 103.5, 3.5, True),
        (None, 200.0, None, True),  # never a good body: stale
    ],
)
def test_a_body_is_stale_once_older_than_stale_after(
    fetched_at: float | None, now: float, age: float | None, stale: bool
) -> None:
    state = TargetState(Target("a", "http://x/metrics"), added_at=50.0, attempted=True)
    state.fetched_at = fetched_at
    state.body = None if fetched_at is None else b"x 1\n"
    scrape = view(state, now, stale_after=3.0)
    assert scrape is not None
    assert (scrape.age, scrape.stale) == (pytest.approx(age) if age is not None else None, stale)


def test_a_target_never_attempted_has_no_view_and_is_stale_since_it_was_added() -> None:
    state = TargetState(Target("a", "http://x/metrics"), added_at=50.0)
    assert view(state, 60.0, 3.0) is None
    assert staleness(state, 60.0) == pytest.approx(10.0)


CHUNKED = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5;ext=1\r\nhello\r\n6\r\n world\r\n0\r\nX-Trailer: 1\r\n\r\n"


@contextlib.asynccontextmanager
async def answering(*responses: bytes, piecewise: bool = False) -> AsyncIterator[tuple[str, list[int]]]:
    """A server on 127.0.0.1 answering its n-th request with ``responses[n]`` (the last one again
    after that), byte by byte if ``piecewise``; yields its URL and the connections it accepted."""
    served = 0
    connections: list[int] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal served
        connections.append(1)
        try:
            while await reader.readuntil(b"\r\n\r\n"):
                answer = responses[min(served, len(responses) - 1)]
                served += 1
                for piece in [answer[i : i + 1] for i in range(len(answer))] if piecewise else [answer]:
                    writer.write(piece)
                    await writer.drain()
                if b"Connection: close" in answer or (b"HTTP/1.0" in answer and b"keep-alive" not in answer):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}/metrics", connections
    finally:
        server.close()


@pytest.mark.parametrize(
    ("response", "body", "reused"),
    [
        (b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello", b"hello", True),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n", b"", True),
        (b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 5\r\n\r\nhello", b"hello", False),
        (b"HTTP/1.0 200 OK\r\nContent-Length: 5\r\n\r\nhello", b"hello", False),
        (b"HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nContent-Length: 5\r\n\r\nhello", b"hello", True),
        (CHUNKED, b"hello world", True),
    ],
)
@pytest.mark.parametrize("piecewise", [False, True], ids=["whole", "byte-by-byte"])
def test_the_fetcher_reads_each_framing_and_reuses_what_may_be(
    response: bytes, body: bytes, reused: bool, piecewise: bool
) -> None:
    async def scenario() -> None:
        fetch = HttpFetcher()
        async with answering(response, piecewise=piecewise) as (url, connections):
            assert await fetch(url, 5) == body
            assert await fetch(url, 5) == body
            assert len(connections) == (1 if reused else 2)
        await fetch.aclose()

    asyncio.run(scenario())


def test_the_fetcher_reads_a_close_delimited_body() -> None:
    async def scenario() -> None:
        fetch = HttpFetcher()
        async with answering(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nhello") as (url, _):
            assert await fetch(url, 5) == b"hello"
        await fetch.aclose()

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("response", "error", "text"),
    [
        (b"HTTP/1.1 503 Busy\r\nContent-Length: 0\r\n\r\n", BadStatus, "bad status: HTTP 503"),
        (b"SPDY/9 200 OK\r\n\r\n", FetchFailed, "malformed"),
        (b"HTTP/1.1 200 OK\r\nno colon\r\n\r\n", FetchFailed, "malformed"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 65\r\n\r\n", BodyTooLarge, "body too large: 65 bytes"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n", FetchFailed, "malformed"),
        (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n41\r\n" + b"x" * 65,
            BodyTooLarge,
            "65 bytes",
        ),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", FetchFailed, "malformed"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n", FetchFailed, "Transfer-Encoding"),
        (
            b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nContent-Length: 1\r\n\r\nx",
            FetchFailed,
            "Content-Encoding",
        ),
        (b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n" + b"x" * 65, BodyTooLarge, "65 bytes"),
    ],
)
def test_the_fetcher_refuses_what_it_cannot_keep(response: bytes, error: type[Exception], text: str) -> None:
    async def scenario() -> None:
        fetch = HttpFetcher(max_body_bytes=64)
        async with answering(response) as (url, _):
            with pytest.raises(error, match=text):
                await fetch(url, 5)
        await fetch.aclose()

    asyncio.run(scenario())


def test_route_splits_a_url_into_origin_and_request() -> None:
    where = route("http://[::1]:9400/metrics?x=1")
    assert where.origin == ("http", "::1", 9400)
    assert where.request.startswith(b"GET /metrics?x=1 HTTP/1.1\r\nHost: [::1]:9400\r\n")
    assert route("https://node-3/metrics").port == 443
    with pytest.raises(FetchFailed, match="bad URL"):
        route("ftp://node-3/metrics")


@pytest.mark.parametrize("fetcher", ["lean", "httpx"])
def test_a_target_with_a_bearer_token_is_scraped_with_it_and_others_without(fetcher: str) -> None:
    async def scenario() -> None:
        fetch = HttpFetcher() if fetcher == "lean" else HttpxFetcher()
        key = "k" * 43
        async with (
            engines(Behaviour(bearer=key), Behaviour(bearer=key)) as servers,
            Scraper(fetch) as scraper,
        ):
            scraper.set_targets(
                [Target("keyed", servers[0].url, bearer=key), Target("keyless", servers[1].url)]
            )
            await scraper.scrape_once()
            snap = scraper.snapshot()
            assert snap["keyed"].error is None and snap["keyed"].body == counter_body(1)
            assert snap["keyless"].error == "bad status: HTTP 401" and snap["keyless"].body is None
            assert "k" * 43 not in repr(scraper.targets())
        await fetch.aclose()

    asyncio.run(scenario())


def test_a_bearer_token_with_a_line_break_is_refused_before_any_request() -> None:
    with pytest.raises(FetchFailed, match="line break"):
        route("http://node-3/metrics", "k\r\nX-Injected: 1")


def test_a_target_keeps_a_read_only_copy_of_its_labels() -> None:
    labels = {"replica": "r1"}
    target = Target("a", "http://x/metrics", labels)
    labels["replica"] = "changed"
    assert target.labels == {"replica": "r1"}
    assert target == Target("a", "http://x/metrics", {"replica": "r1"})
    with pytest.raises(TypeError):
        target.labels["replica"] = "x"  # type: ignore[index]


def test_duplicate_target_keys_are_refused() -> None:
    scraper = Scraper(fetch=_never)
    with pytest.raises(ValueError, match="duplicate target key 'a'"):
        scraper.set_targets([Target("a", "http://x/1"), Target("a", "http://x/2")])


async def _never(url: str, timeout: float, bearer: str | None = None) -> bytes:
    raise AssertionError("not called")


# ---- against real servers --------------------------------------------------------------------


def test_every_target_has_a_fresh_body_after_a_cycle_over_one_reused_connection() -> None:
    async def scenario() -> None:
        async with engines(Behaviour(), Behaviour(chunked=True)) as servers, Scraper() as scraper:
            scraper.set_targets(targets_of(servers))
            await scraper.scrape_once()
            first = scraper.snapshot()
            await scraper.scrape_once()
            second = scraper.snapshot()
            assert set(second) == {"engine-0", "engine-1"}
            for scrape in second.values():
                assert (scrape.error, scrape.stale) == (None, False)
                assert scrape.age is not None and scrape.age < 1.0
            assert first["engine-0"].body == counter_body(1)
            assert second["engine-0"].body == counter_body(2)  # the counter advanced
            assert second["engine-1"].body == counter_body(2)  # chunked, decoded
            assert [s.connections for s in servers] == [1, 1]  # keep-alive: one connection each
            latest = scraper.latest("engine-0")
            assert latest is not None and latest.fetched_at == second["engine-0"].fetched_at
            assert scraper.latest("nobody") is None

    asyncio.run(scenario())


def test_a_slow_target_times_out_without_delaying_the_others() -> None:
    async def scenario() -> None:
        slow = Behaviour(delay=5.0)
        async with (
            engines(Behaviour(), slow, Behaviour(), Behaviour()) as servers,
            Scraper(timeout=0.5) as scraper,
        ):
            scraper.set_targets(targets_of(servers))
            start = time.monotonic()
            await scraper.scrape_once()
            elapsed = time.monotonic() - start
            assert 0.45 <= elapsed < 1.5  # near the timeout, nowhere near the 5 s
            snap = scraper.snapshot()
            for key in ("engine-0", "engine-2", "engine-3"):
                fetched_at = snap[key].fetched_at
                assert fetched_at is not None and fetched_at - start < 0.45  # did not wait
                assert snap[key].error is None
            late = snap["engine-1"]
            assert (late.body, late.stale) == (None, True)
            assert late.error is not None and late.error.startswith("timeout")
            stats = scraper.stats()
            assert (stats.scrapes_ok, stats.scrapes_failed) == (3, 1)
            assert stats.last_cycle_seconds == pytest.approx(elapsed, abs=0.05)

    asyncio.run(scenario())


def test_run_keeps_to_its_interval_while_a_hung_target_is_in_flight() -> None:
    async def scenario() -> None:
        async with engines(Behaviour(), Behaviour(hang=True)) as servers:
            async with Scraper(timeout=1.5, interval=0.2) as scraper:
                scraper.set_targets(targets_of(servers))
                stop = asyncio.Event()
                runner = asyncio.create_task(scraper.run(stop))
                await asyncio.sleep(0.9)
                stop.set()
                start = time.monotonic()
                await runner
                assert time.monotonic() - start < 0.5  # stopping cancels the hung scrape at once
            fast, hung = servers
            assert fast.requests >= 3  # ticks at 0, 0.2, 0.4, 0.6, 0.8 (a noisy machine may miss some)
            assert hung.requests == 1  # still in flight at every later tick: skipped, not queued again

    asyncio.run(scenario())


def test_a_target_that_fails_keeps_its_last_body_goes_stale_and_is_fresh_again_when_back() -> None:
    async def scenario() -> None:
        clock = FakeClock()
        behaviour = Behaviour()
        async with engines(behaviour) as servers, Scraper(timeout=0.3, clock=clock) as scraper:
            scraper.set_targets(targets_of(servers))
            await scraper.scrape_once()
            good = scraper.latest("engine-0")
            assert good is not None and (good.body, good.stale) == (counter_body(1), False)

            behaviour.status = 503
            clock.now += 1.0
            await scraper.scrape_once()
            failing = scraper.latest("engine-0")
            assert failing is not None
            assert (failing.body, failing.error, failing.stale) == (good.body, "bad status: HTTP 503", False)

            behaviour.status, behaviour.hang = 200, True
            clock.now += 2.5  # 3.5 s since the good body: past stale_after (3 x interval)
            await scraper.scrape_once()
            hung = scraper.latest("engine-0")
            assert hung is not None and hung.error is not None and hung.error.startswith("timeout")
            assert (hung.body, hung.stale) == (good.body, True)
            assert hung.age == pytest.approx(3.5)
            assert scraper.stats().max_staleness_seconds == pytest.approx(3.5)

            behaviour.hang = False
            await scraper.scrape_once()
            back = scraper.latest("engine-0")
            assert back is not None
            assert (back.error, back.stale, back.age) == (None, False, 0.0)
            assert back.body is not None and back.body != good.body

    asyncio.run(scenario())


def test_a_dead_target_is_an_error_and_the_others_are_unaffected() -> None:
    async def scenario() -> None:
        async with engines(Behaviour()) as servers, Scraper() as scraper:
            scraper.set_targets([*targets_of(servers), Target("dead", dead_url())])
            await scraper.scrape_once()
            dead = scraper.latest("dead")
            assert dead is not None and dead.error is not None
            assert dead.error.startswith("connect failed")
            assert scraper.latest("engine-0") is not None
            assert scraper.snapshot()["engine-0"].error is None

    asyncio.run(scenario())


def test_removed_targets_are_dropped_even_while_in_flight() -> None:
    async def scenario() -> None:
        async with (
            engines(Behaviour(), Behaviour(), Behaviour(delay=0.3)) as servers,
            Scraper() as scraper,
        ):
            a, b, slow = targets_of(servers)
            scraper.set_targets([a, b])
            await scraper.scrape_once()
            kept = scraper.snapshot()[a.key]

            scraper.set_targets([a, slow])
            assert scraper.latest(b.key) is None
            assert set(scraper.snapshot()) == {a.key}  # slow: added, not attempted yet
            assert scraper.snapshot()[a.key].fetched_at == kept.fetched_at  # unchanged: data kept

            cycle = asyncio.create_task(scraper.scrape_once())
            await asyncio.sleep(0.1)
            scraper.set_targets([a])  # slow is removed while its scrape is in flight
            await cycle
            assert scraper.latest(slow.key) is None
            assert set(scraper.snapshot()) == {a.key}
            assert scraper.stats().targets == 1

            before = scraper.snapshot()[a.key]
            relabelled = Target(a.key, a.url, {"replica": "r9"})  # same URL: data kept, new labels
            scraper.set_targets([relabelled])
            assert scraper.snapshot()[a.key].fetched_at == before.fetched_at
            assert scraper.targets() == (relabelled,)

            moved = Target(a.key, servers[1].url, a.labels)  # same key, new URL: starts afresh
            scraper.set_targets([moved])
            assert scraper.latest(a.key) is None

    asyncio.run(scenario())


def test_oversized_bodies_are_that_targets_error() -> None:
    async def scenario() -> None:
        limit = 1 << 20
        behaviours = [
            Behaviour(body=lambda n: b"x" * (limit + 1)),
            Behaviour(body=lambda n: b"x" * (limit + 1), chunked=True),
            Behaviour(body=lambda n: b"x" * limit),
        ]
        async with engines(*behaviours) as servers, Scraper() as scraper:
            scraper.set_targets(targets_of(servers))
            await scraper.scrape_once()
            snap = scraper.snapshot()
            for key in ("engine-0", "engine-1"):
                error = snap[key].error
                assert snap[key].body is None
                assert error is not None and error.startswith("body too large")
            exact = snap["engine-2"]
            assert exact.body is not None and len(exact.body) == limit and exact.error is None

    asyncio.run(scenario())


def test_a_fetcher_handed_in_is_held_to_the_size_limit_and_any_exception_is_recorded() -> None:
    async def fetch(url: str, timeout: float, bearer: str | None = None) -> bytes:
        if url.endswith("/big"):
            return b"x" * 101
        raise RuntimeError("boom")

    async def scenario() -> None:
        scraper = Scraper(fetch, max_body_bytes=100)
        scraper.set_targets([Target("big", "http://x/big"), Target("boom", "http://x/boom")])
        await scraper.scrape_once()
        snap = scraper.snapshot()
        assert snap["big"].error == "body too large: 101 bytes, the limit is 100 bytes"
        assert snap["boom"].error == "fetch failed: RuntimeError: boom"
        await scraper.aclose()

    asyncio.run(scenario())


def test_concurrency_bound_holds_at_the_servers() -> None:
    async def scenario() -> None:
        behaviours = [Behaviour(delay=0.15, close=True) for _ in range(12)]
        async with engines(*behaviours, shared=True) as servers, Scraper(concurrency=3) as scraper:
            scraper.set_targets(targets_of(servers))
            start = time.monotonic()
            await scraper.scrape_once()
            elapsed = time.monotonic() - start
            assert servers[0].open_connections.peak == 3  # simultaneous connections, all servers
            assert servers[0].in_service.peak == 3  # simultaneous requests, all servers
            assert elapsed >= 4 * 0.15 * 0.95  # 12 targets, 3 at a time
            assert scraper.stats().scrapes_ok == 12

    asyncio.run(scenario())


def test_a_reused_connection_the_server_dropped_is_retried_once_on_a_new_one() -> None:
    async def scenario() -> None:
        async with engines(Behaviour(drop_reused=True)) as servers, Scraper() as scraper:
            scraper.set_targets(targets_of(servers))
            await scraper.scrape_once()
            await scraper.scrape_once()
            scrape = scraper.latest("engine-0")
            assert scrape is not None and scrape.error is None and scrape.body == counter_body(2)
            assert servers[0].connections == 2

    asyncio.run(scenario())


def test_connections_the_server_closed_while_idle_leave_the_pool() -> None:
    async def scenario() -> None:
        fetch = HttpFetcher()
        async with engines(Behaviour(), Behaviour()) as servers, Scraper(fetch) as scraper:
            scraper.set_targets(targets_of(servers))
            await scraper.scrape_once()
            assert fetch.idle_connections == 2
            servers[0].drop_connections()
            await asyncio.sleep(0.05)
            assert fetch.idle_connections == 1
            await scraper.scrape_once()
            assert [s.connections for s in servers] == [2, 1]
            assert all(s.error is None for s in scraper.snapshot().values())
        await fetch.aclose()  # handed in: the scraper leaves it open
        assert fetch.idle_connections == 0

    asyncio.run(scenario())


def test_parse_on_demand_parses_each_body_once() -> None:
    calls: list[bytes] = []

    def parse(body: bytes) -> int:
        calls.append(body)
        return len(body)

    async def scenario() -> None:
        async with engines(Behaviour()) as servers, Scraper() as scraper:
            scraper.set_targets(targets_of(servers))
            assert scraper.parse_on_demand("engine-0", parse) is None  # no body yet
            await scraper.scrape_once()
            first = scraper.parse_on_demand("engine-0", parse)
            assert scraper.parse_on_demand("engine-0", parse) == first
            assert len(calls) == 1
            await scraper.scrape_once()
            scraper.parse_on_demand("engine-0", parse)
            assert calls == [counter_body(1), counter_body(2)]
            assert scraper.parse_on_demand("engine-0", bytes.upper) == counter_body(2).upper()
            assert scraper.parse_on_demand("nobody", parse) is None

    asyncio.run(scenario())


def test_self_metrics_count_scrapes_and_export_to_prometheus() -> None:
    async def scenario() -> None:
        clock = FakeClock()
        async with engines(Behaviour()) as servers, Scraper(clock=clock) as scraper:
            scraper.set_targets([*targets_of(servers), Target("dead", dead_url())])
            await scraper.scrape_once()
            clock.now += 2.0
            stats = scraper.stats()
            assert (stats.targets, stats.scrapes_ok, stats.scrapes_failed, stats.cycles) == (2, 1, 1, 1)
            assert stats.max_staleness_seconds == pytest.approx(2.0)  # dead: since it was added
            registry = CollectorRegistry()
            registry.register(ScraperCollector(scraper))
            text = generate_latest(registry).decode()
            assert 'fleetserve_scraper_scrapes_total{result="ok"} 1.0' in text
            assert 'fleetserve_scraper_scrapes_total{result="failed"} 1.0' in text
            assert "fleetserve_scraper_max_staleness_seconds 2.0" in text
            assert "fleetserve_scraper_targets 2.0" in text

    asyncio.run(scenario())


def test_httpx_fetcher_reads_bodies_and_converts_failures() -> None:
    async def scenario() -> None:
        behaviours = [Behaviour(), Behaviour(body=lambda n: b"x" * 5000), Behaviour(status=503)]
        async with engines(*behaviours) as (ok, big, busy):
            fetch = HttpxFetcher(max_body_bytes=4096)
            try:
                assert await fetch(ok.url, 2.0) == counter_body(1)
                with pytest.raises(BodyTooLarge):
                    await fetch(big.url, 2.0)
                with pytest.raises(BadStatus, match="503"):
                    await fetch(busy.url, 2.0)
                with pytest.raises(FetchFailed):
                    await fetch(dead_url(), 2.0)
                ok.behaviour.delay = 1.0
                with pytest.raises(ScrapeTimeout):
                    await fetch(ok.url, 0.2)
            finally:
                await fetch.aclose()

    asyncio.run(scenario())
