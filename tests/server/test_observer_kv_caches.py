"""The observer's reading of what agents reported of their vLLM replicas' KV events
(``Observer.kv_caches``): a clear seen after a first look moves the replica's engine epoch (the
gateway clears its model), a new count of blocks held is a new report (a new ``seq``), the same
count is none, and each new report is told to the gateway once (``on_report``)."""

from __future__ import annotations

from fleetserve.cachereport import CacheReport
from fleetserve.metrics.exposition import FleetMetrics
from fleetserve.protocol import KvCacheSummary
from fleetserve.server.observer import Observer
from fleetserve.store.sql import SqlStore


def summary(blocks: int, clears: int = 0, block_tokens: int = 16) -> KvCacheSummary:
    return KvCacheSummary(blocks=blocks, blockTokens=block_tokens, clears=clears)


def test_clears_move_the_epoch_and_held_blocks_are_reports(sqlite_store: SqlStore) -> None:
    observer = Observer(sqlite_store, FleetMetrics())
    told: list[tuple[str, CacheReport]] = []
    observer.on_report = lambda replica, report: told.append((replica, report))

    observer.kv_caches([("v-0", summary(10, clears=3)), ("l-0", None)])
    # First seen with 3 clears: nothing to clear yet.
    assert observer.epochs.get("v-0", 0) == 0 and "l-0" not in observer.reports
    first = observer.reports["v-0"]
    assert first.held_tokens == 160 and first.slots is None

    observer.kv_caches([("v-0", summary(10, clears=3))])
    assert observer.reports["v-0"] is first  # the same count: no new report

    observer.kv_caches([("v-0", summary(0, clears=4, block_tokens=32))])
    assert observer.epochs["v-0"] == 1
    second = observer.reports["v-0"]
    assert second.seq > first.seq and second.held_tokens == 0

    observer._tell_reports()
    observer._tell_reports()
    assert told == [("v-0", second)]
