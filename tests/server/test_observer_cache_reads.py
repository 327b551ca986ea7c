"""When the observer asks a llama.cpp replica for its slots (``cachereport.read_due``,
``Observer.cache_reads_due``): once when first seen, then only when its metrics show work since
the last ask — at once when it has nothing running or waiting, at most every
``BUSY_READ_SECONDS`` while it works (first, once it did any work) — and never while it stays idle, so the engine's idle timer
runs out and it may sleep (``GET /slots`` restarts it; a metrics scrape does not)."""

from __future__ import annotations

import asyncio

import pytest

from fleetserve.cachereport import BUSY_READ_SECONDS, Activity, read_due
from fleetserve.metrics.exposition import FleetMetrics
from fleetserve.metrics.scraper import Scraper
from fleetserve.metrics.targets import Target
from fleetserve.server.observer import Observer
from fleetserve.store.sql import SqlStore

IDLE = Activity(prompt_tokens=10, generation_tokens=5, running=0, waiting=0)
WORKING = Activity(prompt_tokens=20, generation_tokens=5, running=1, waiting=0)
DONE = Activity(prompt_tokens=20, generation_tokens=40, running=0, waiting=0)


@pytest.mark.parametrize(
    ("activity", "last", "now", "due"),
    [
        (None, None, 0.0, False),  # no metrics yet: nothing to go by
        (IDLE, None, 0.0, True),  # never asked, has worked
        (Activity(0, 0, 0, 0), None, 0.0, False),  # a fresh engine: its slots hold nothing
        (Activity(0, 0, 0, 1), None, 0.0, True),
        (IDLE, (IDLE, 0.0), 3600.0, False),  # idle an hour: never asked again
        (DONE, (IDLE, 0.0), 0.5, True),  # work done and settled: at once
        (WORKING, (IDLE, 0.0), 1.0, False),  # working: not before BUSY_READ_SECONDS
        (WORKING, (IDLE, 0.0), BUSY_READ_SECONDS, True),
        (WORKING, (WORKING, 0.0), 2 * BUSY_READ_SECONDS, False),  # a stuck request: no new work
        (DONE, (WORKING, 4.0), 5.0, True),
    ],
)
def test_read_due(
    activity: Activity | None, last: tuple[Activity, float] | None, now: float, due: bool
) -> None:
    assert read_due(activity, last, now) is due


def test_the_observer_asks_an_idle_replica_once_and_a_worked_one_again(sqlite_store: SqlStore) -> None:
    observer = Observer(sqlite_store, FleetMetrics())
    observer._cache_targets = [Target(key="l-0", url="http://127.0.0.1:1/slots")]
    assert observer.cache_reads_due(0.0) == []  # no metrics scraped yet
    observer._activity = {"l-0": IDLE}
    assert observer.cache_reads_due(1.0) == ["l-0"]
    assert [observer.cache_reads_due(t) for t in (2.0, 30.0, 600.0)] == [[], [], []]
    observer._activity = {"l-0": WORKING}  # working, last asked long ago: asked now
    assert observer.cache_reads_due(601.0) == ["l-0"]
    observer._activity = {"l-0": Activity(prompt_tokens=20, generation_tokens=9, running=1, waiting=0)}
    assert observer.cache_reads_due(605.0) == []  # still working, asked 4 s ago
    observer._activity = {"l-0": DONE}
    assert observer.cache_reads_due(606.0) == ["l-0"]  # settled
    assert observer.cache_reads_due(607.0) == []


def test_scrape_once_of_some_keys_fetches_only_those() -> None:
    fetched: list[str] = []

    async def fetch(url: str, timeout: float, bearer: str | None = None) -> bytes:
        fetched.append(url)
        return b"[]"

    async def main() -> None:
        scraper = Scraper(fetch)
        scraper.set_targets([Target(key=k, url=f"http://{k}/slots") for k in ("a", "b", "c")])
        await scraper.scrape_once(["b"])
        assert fetched == ["http://b/slots"]
        assert scraper.latest("b") is not None and scraper.latest("a") is None
        await scraper.scrape_once()
        assert sorted(fetched) == ["http://a/slots", "http://b/slots", "http://b/slots", "http://c/slots"]

    asyncio.run(main())
