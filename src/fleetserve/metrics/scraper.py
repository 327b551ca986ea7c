"""The metrics scraper: every engine's ``/metrics`` fetched once per interval, the last raw body kept.

The scraper stores bytes, never parsed samples: a caller parses on demand (``parse_on_demand``
memoises one parse per target until the next body arrives). Each cycle fetches every target at
once, at most ``concurrency`` in flight, each under its own timeout, so a slow or dead target costs
one slot for at most ``timeout`` seconds and never delays the others. A target whose previous
scrape is still in flight is skipped by the next cycle rather than queued twice.

Memory does not grow with time: per target one last good body (at most ``max_body_bytes``), the
last error, and one memoised parse. Scrape failures are values (``Scrape.error``); the fetcher
raises from the ``ScrapeError`` hierarchy (``metrics.fetch``), and any other exception a
hand-made fetcher raises is recorded too.

Freshness is decided by pure functions (``metrics.targets``: ``view``, ``staleness``,
``next_tick``) from the stored state and a ``now``; the ``Scraper`` class only does the I/O and
the bookkeeping.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Collection, Iterable, Iterator
from types import TracebackType
from typing import TypeVar

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from fleetserve.metrics.fetch import MAX_BODY_BYTES, Fetcher, HttpFetcher, body_error, describe
from fleetserve.metrics.targets import Scrape, ScraperStats, Target, TargetState, next_tick, staleness, view

log = logging.getLogger("fleetserve.metrics")

T = TypeVar("T")

Clock = Callable[[], float]


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
        self._states: dict[str, TargetState] = {}
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
        states: dict[str, TargetState] = {}
        for key, target in wanted.items():
            old = self._states.get(key)
            if old is not None and old.target.url == target.url:
                old.target = target
                states[key] = old
            else:
                states[key] = TargetState(target, now)
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

    async def scrape_once(self, keys: Collection[str] | None = None) -> None:
        """One cycle: every target not already in flight (of ``keys`` only, when given), at most
        ``concurrency`` at a time."""
        pending = deque(
            s for key, s in self._states.items() if not s.in_flight and (keys is None or key in keys)
        )
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

    async def _drain(self, pending: deque[TargetState]) -> None:
        while pending:
            state = pending.popleft()
            async with self._slots:
                await self._scrape(state)

    async def _scrape(self, state: TargetState) -> None:
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


__all__ = ["Scraper", "ScraperCollector"]
