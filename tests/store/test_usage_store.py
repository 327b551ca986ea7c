"""The usage aggregate on SQLite and PostgreSQL: counts added into one row per (minute, key,
model) however many writers add at once, read back summed per minute, hour or day, pruned."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import Engine, func, select

from fleetserve.store import SqlStore, make_engine, migrate
from fleetserve.store.tables import UsageMinuteRow
from fleetserve.store.usage import MAX_USAGE_ROWS, Step, UsageCounts, UsageRecord

T0 = datetime(2026, 6, 1, 12, 0, tzinfo=UTC)
NOW = T0 + timedelta(days=3)


def rec(minute: datetime, key_id: int, model: str, requests: int = 1, errors: int = 0, prompt: int = 0,
        completion: int = 0) -> UsageRecord:  # fmt: skip
    return UsageRecord(minute, key_id, model, UsageCounts(requests, errors, prompt, completion))


def row_count(store: SqlStore) -> int:
    with store.engine.connect() as conn:
        return int(conn.scalar(select(func.count()).select_from(UsageMinuteRow)) or 0)


def test_adding_twice_into_one_minute_adds_the_counts_in_one_row(store: SqlStore) -> None:
    store.add_usage([rec(T0, 1, "chat", 2, 1, 10, 20)], NOW)
    store.add_usage([rec(T0 + timedelta(seconds=30), 1, "chat", 3, 0, 5, 7)], NOW)
    assert row_count(store) == 1
    [bucket] = store.usage(T0, T0 + timedelta(minutes=1))
    assert (bucket.start, bucket.key_id, bucket.model) == (T0, 1, "chat")
    assert bucket.counts == UsageCounts(5, 1, 15, 27)


def test_records_of_one_cell_in_one_call_are_merged_before_the_write(store: SqlStore) -> None:
    # PostgreSQL refuses an upsert that touches one row twice in a statement: merged first.
    assert store.add_usage([rec(T0, 1, "chat"), rec(T0, 1, "chat"), rec(T0, 2, "chat")], NOW) == 2
    assert {(b.key_id, b.counts.requests) for b in store.usage(T0, NOW)} == {(1, 2), (2, 1)}


@pytest.fixture(params=["sqlite", "postgres"])
def two_writers(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[SqlStore, SqlStore]]:
    """Two stores, each with its own engine, over one database: two gateways writing usage."""
    engines: list[Engine] = []
    try:
        if request.param == "sqlite":
            engines += [make_engine(tmp_path / "shared.db"), make_engine(tmp_path / "shared.db")]
            migrate(engines[0])
            yield SqlStore(engines[0]), SqlStore(engines[1])
        else:
            url: str = request.getfixturevalue("postgres_url")
            schema: str = request.getfixturevalue("postgres_schema")
            first: SqlStore = request.getfixturevalue("postgres_store")
            engines.append(make_engine(url, connect_args={"options": f"-csearch_path={schema}"}))
            yield first, SqlStore(engines[0])
    finally:
        for engine in engines:
            engine.dispose()


def test_two_writers_adding_into_the_same_rows_at_once_lose_no_count(
    two_writers: tuple[SqlStore, SqlStore],
) -> None:
    rounds = 40
    cells = [(T0 + timedelta(minutes=m), k, "chat") for m in range(3) for k in (1, 2)]
    start = threading.Barrier(2)
    errors: list[BaseException] = []

    def write(store: SqlStore, order: int) -> None:
        try:
            start.wait()
            for _ in range(rounds):
                # The second writer lists the cells backwards: the store orders the rows it locks.
                batch = cells if order == 0 else cells[::-1]
                store.add_usage([rec(m, k, model, 1, 1, 3, 5) for m, k, model in batch], NOW)
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(s, i)) for i, s in enumerate(two_writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    buckets = two_writers[0].usage(T0, T0 + timedelta(hours=1))
    assert len(buckets) == len(cells)
    assert {b.counts for b in buckets} == {UsageCounts(2 * rounds, 2 * rounds, 6 * rounds, 10 * rounds)}


def test_usage_is_summed_per_hour_and_per_day_in_utc(store: SqlStore) -> None:
    store.add_usage(
        [
            rec(T0, 1, "chat", 1, 0, 1, 1),
            rec(T0 + timedelta(minutes=59), 1, "chat", 2, 0, 2, 2),
            rec(T0 + timedelta(minutes=61), 1, "chat", 4, 1, 4, 4),
            rec(T0 + timedelta(hours=13), 1, "chat", 8, 0, 8, 8),  # the next day, 01:00 UTC
            rec(T0, 2, "embed", 16, 0, 16, 0),
        ],
        NOW,
    )
    hours = store.usage(T0, T0 + timedelta(days=1), step=Step.HOUR)
    assert [(b.start, b.key_id, b.model, b.counts.requests) for b in hours] == [
        (T0, 1, "chat", 3),
        (T0, 2, "embed", 16),
        (T0 + timedelta(hours=1), 1, "chat", 4),
        (T0 + timedelta(hours=13), 1, "chat", 8),
    ]
    days = store.usage(T0 - timedelta(hours=12), NOW, key_id=1, step=Step.DAY)
    midnight = T0.replace(hour=0)
    assert [(b.start, b.counts) for b in days] == [
        (midnight, UsageCounts(7, 1, 7, 7)),
        (midnight + timedelta(days=1), UsageCounts(8, 0, 8, 8)),
    ]
    assert all(b.start.tzinfo is not None for b in hours + days)


def test_usage_filters_by_key_and_model_and_reads_only_its_window(store: SqlStore) -> None:
    store.add_usage(
        [rec(T0 - timedelta(minutes=1), 1, "chat"), rec(T0, 1, "chat"), rec(T0, 1, "embed"),
         rec(T0, 2, "chat"), rec(T0 + timedelta(minutes=5), 1, "chat")],
        NOW,
    )  # fmt: skip
    window = (T0, T0 + timedelta(minutes=5))  # until is exclusive
    assert [(b.key_id, b.model) for b in store.usage(*window)] == [(1, "chat"), (1, "embed"), (2, "chat")]
    assert [(b.key_id, b.model) for b in store.usage(*window, key_id=1, model="chat")] == [(1, "chat")]
    assert store.usage_totals(*window, "key") == {1: UsageCounts(2), 2: UsageCounts(1)}
    assert store.usage_totals(*window, "model", key_id=1) == {"chat": UsageCounts(1), "embed": UsageCounts(1)}


def test_usage_returns_at_most_its_limit_of_rows(store: SqlStore) -> None:
    store.add_usage([rec(T0 + timedelta(minutes=m), 1, "chat") for m in range(10)], NOW)
    assert [b.start for b in store.usage(T0, NOW, limit=3)] == [T0 + timedelta(minutes=m) for m in range(3)]


@pytest.mark.parametrize(
    ("case", "call"),
    [
        ("a window that ends before it starts", lambda s: s.usage(NOW, T0)),
        ("a limit of zero", lambda s: s.usage(T0, NOW, limit=0)),
        ("a limit past the most rows", lambda s: s.usage(T0, NOW, limit=MAX_USAGE_ROWS + 1)),
        (
            "usage of a minute in the future",
            lambda s: s.add_usage([rec(NOW + timedelta(hours=1), 1, "m")], NOW),
        ),
        ("negative counts", lambda s: s.add_usage([rec(T0, 1, "m", -1)], NOW)),
        ("a naive time", lambda s: s.usage(T0.replace(tzinfo=None), NOW)),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_out_of_bounds_arguments_are_refused_and_write_nothing(store: SqlStore, case: str, call) -> None:
    with pytest.raises(ValueError):
        call(store)
    assert row_count(store) == 0


def test_prune_drops_the_minutes_before_the_bound_only(store: SqlStore) -> None:
    store.add_usage([rec(T0 + timedelta(minutes=m), 1, "chat") for m in range(5)], NOW)
    assert store.prune_usage(T0 + timedelta(minutes=2)) == 2
    assert [b.start for b in store.usage(T0, NOW)] == [T0 + timedelta(minutes=m) for m in (2, 3, 4)]
    assert store.prune_usage(T0) == 0
