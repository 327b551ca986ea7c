"""The gateway's usage counter (pure) and its flusher, over an in-memory sink that can fail."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from datetime import UTC, datetime

from fleetserve.errors import StoreError
from fleetserve.gateway.usage import UsageCounter
from fleetserve.gateway.usage_flush import UsageFlusher
from fleetserve.store.usage import UsageCounts, UsageRecord

T = datetime(2026, 6, 1, 12, 0, tzinfo=UTC).timestamp()


def test_requests_of_one_minute_key_and_model_are_one_cell() -> None:
    counter = UsageCounter()
    counter.add(T + 1, 1, "chat", 10, 5, False)
    counter.add(T + 59.9, 1, "chat", 3, 0, True)
    counter.add(T + 60, 1, "chat", 1, 1, False)  # the next minute
    counter.add(T + 2, 2, "chat", 1, 1, False)  # another key
    counter.add(T + 3, 1, "embed", 7, 0, False)  # another model
    records = sorted(counter.take(), key=lambda r: (r.minute, r.key_id, r.model))
    minute = datetime.fromtimestamp(T, UTC)
    assert [(r.minute.timestamp() - T, r.key_id, r.model, r.counts) for r in records] == [
        (0, 1, "chat", UsageCounts(2, 1, 13, 5)),
        (0, 1, "embed", UsageCounts(1, 0, 7, 0)),
        (0, 2, "chat", UsageCounts(1, 0, 1, 1)),
        (60, 1, "chat", UsageCounts(1, 0, 1, 1)),
    ]
    assert records[0].minute == minute and len(counter) == 0 and counter.take() == []


def test_restored_counts_add_to_those_counted_since() -> None:
    counter = UsageCounter()
    counter.add(T, 1, "chat", 10, 5, False)
    taken = counter.take()
    counter.add(T + 5, 1, "chat", 1, 1, True)
    counter.restore(taken)
    [record] = counter.take()
    assert record.counts == UsageCounts(2, 1, 11, 6)


def test_past_the_bound_the_oldest_cell_is_dropped_and_counted() -> None:
    counter = UsageCounter(max_cells=2)
    for minute in range(3):
        counter.add(T + 60 * minute, 1, "chat", 1, 1, False)
    assert counter.dropped == 1
    assert sorted(r.minute.timestamp() - T for r in counter.take()) == [60, 120]


class FlakySink:
    """A UsageSink that fails its first ``failures`` writes, then keeps what it is given."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.written: list[UsageRecord] = []

    def add_usage(self, records: Sequence[UsageRecord], now: datetime) -> int:
        if self.failures:
            self.failures -= 1
            raise StoreError("state store: adding usage rows failed: the database is down")
        self.written += records
        return len(records)


def test_a_failed_write_keeps_the_counts_for_the_next_one() -> None:
    async def scenario() -> None:
        counter = UsageCounter()
        sink = FlakySink(failures=1)
        flusher = UsageFlusher(counter, sink, interval=3600)
        counter.add(T, 1, "chat", 10, 5, False)
        assert await flusher.flush() == 0 and flusher.failures == 1
        counter.add(T + 1, 1, "chat", 1, 1, False)
        assert await flusher.flush() == 1 and flusher.failures == 0
        assert [r.counts for r in sink.written] == [UsageCounts(2, 0, 11, 6)]

    asyncio.run(scenario())


def test_the_loop_writes_every_interval_and_stop_writes_the_rest() -> None:
    async def scenario() -> None:
        counter = UsageCounter()
        sink = FlakySink(failures=0)
        flusher = UsageFlusher(counter, sink, interval=0.01)
        flusher.start()
        counter.add(T, 1, "chat", 1, 1, False)
        for _ in range(500):
            if sink.written:
                break
            await asyncio.sleep(0.01)
        assert [r.counts.requests for r in sink.written] == [1]
        counter.add(T, 1, "chat", 1, 1, False)
        await flusher.stop()
        assert [r.counts.requests for r in sink.written] == [1, 1] and len(counter) == 0

    asyncio.run(scenario())


def test_stop_retries_a_failed_last_write() -> None:
    async def scenario() -> None:
        counter = UsageCounter()
        sink = FlakySink(failures=2)
        flusher = UsageFlusher(counter, sink, interval=3600, stop_retry_seconds=0)
        counter.add(T, 1, "chat", 4, 2, False)
        await flusher.stop()
        assert [r.counts for r in sink.written] == [UsageCounts(1, 0, 4, 2)]

    asyncio.run(scenario())
