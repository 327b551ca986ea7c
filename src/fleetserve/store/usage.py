"""The usage aggregate over SQL: the gateways' request and token counts per minute, API key and
model, added into one row per (minute, key, model) however many gateways write it, and read back
summed per minute, hour or day.

A gateway counts in memory and writes its counts every few seconds (``gateway.usage``); the write
is an upsert that ADDS (``INSERT … ON CONFLICT DO UPDATE SET requests = requests + excluded…``),
atomic on both backends, so two gateways adding into the same minute lose nothing. Rows are
written in key order, so two writers on PostgreSQL lock them in the same order (no deadlock).

How a timestamp is cut to the hour or the day differs by database: ``TRUNCATE`` is that table.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Any, Literal

from sqlalchemy import ColumnElement, delete, func, literal_column, select, type_coerce
from sqlalchemy.dialects import postgresql, sqlite

from fleetserve.store.base import SqlBase
from fleetserve.store.tables import UsageMinuteRow, UtcDateTime, stamp

# A flush may carry counts of a minute a little after ``now`` (clocks of one process move on
# between counting and writing); anything later is a mis-set clock and refused.
FUTURE_SLACK = timedelta(minutes=2)
# The most rows one ``usage`` call returns; the caller narrows its window or coarsens its step.
MAX_USAGE_ROWS = 100_000


class Step(StrEnum):
    """How finely usage is summed over time."""

    MINUTE = "minute"
    HOUR = "hour"
    DAY = "day"

    @property
    def seconds(self) -> int:
        return {Step.MINUTE: 60, Step.HOUR: 3600, Step.DAY: 86400}[self]


@dataclass(frozen=True)
class UsageCounts:
    """What was counted for one (minute, key, model): requests, errors, prompt and completion tokens."""

    requests: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def __add__(self, other: UsageCounts) -> UsageCounts:
        return UsageCounts(
            self.requests + other.requests,
            self.errors + other.errors,
            self.prompt_tokens + other.prompt_tokens,
            self.completion_tokens + other.completion_tokens,
        )

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class UsageRecord:
    """Counts of one minute (its start, UTC, seconds zero), API key (0: no key) and model."""

    minute: datetime
    key_id: int
    model: str
    counts: UsageCounts


@dataclass(frozen=True)
class UsageBucket:
    """Counts summed over one step (``start``: the step's first minute) for one key and model."""

    start: datetime
    key_id: int
    model: str
    counts: UsageCounts


def minute_of(when: datetime) -> datetime:
    """The start of ``when``'s minute, in UTC."""
    return stamp(when).replace(second=0, microsecond=0)


def merged(records: Iterable[UsageRecord]) -> dict[tuple[datetime, int, str], UsageCounts]:
    """Records summed per (minute, key, model), minutes cut to their start."""
    out: dict[tuple[datetime, int, str], UsageCounts] = {}
    for r in records:
        key = (minute_of(r.minute), r.key_id, r.model)
        out[key] = out.get(key, UsageCounts()) + r.counts
    return out


# The constants below are literals, not bound parameters: the same expression appears in SELECT and
# GROUP BY, and PostgreSQL only sees them as one when no parameter differs.


def _pg_truncate(step: Step, column: Any) -> ColumnElement[Any]:
    # timezone('UTC', …) first: date_trunc of a timestamptz cuts in the session's time zone.
    unit = {Step.HOUR: "'hour'", Step.DAY: "'day'"}[step]
    return func.date_trunc(literal_column(unit), func.timezone(literal_column("'UTC'"), column))


def _sqlite_truncate(step: Step, column: Any) -> ColumnElement[Any]:
    # SQLite keeps UtcDateTime as naive UTC text: cut it with strftime, read back as a timestamp.
    pattern = {Step.HOUR: "'%Y-%m-%d %H:00:00'", Step.DAY: "'%Y-%m-%d 00:00:00'"}[step]
    return func.strftime(literal_column(pattern), column)


# How each database cuts a timestamp to the start of its hour or day.
TRUNCATE: Mapping[str, Callable[[Step, Any], ColumnElement[Any]]] = {
    "postgresql": _pg_truncate,
    "sqlite": _sqlite_truncate,
}


class SqlUsage(SqlBase):
    """Usage per minute, key and model, over SQL."""

    def add_usage(self, records: Sequence[UsageRecord], now: datetime) -> int:
        """Add ``records`` into the stored rows (one upsert that adds, in one transaction); the
        number of rows written. ``now`` is when they were counted: a minute after it is refused."""
        rows = merged(records)
        latest = stamp(now) + FUTURE_SLACK
        for (minute, key_id, model), counts in rows.items():
            if minute > latest:
                raise ValueError(
                    f"usage of minute {minute.isoformat()} is in the future (now {now.isoformat()})"
                )
            if min(counts.requests, counts.errors, counts.prompt_tokens, counts.completion_tokens) < 0:
                raise ValueError(f"negative usage for key {key_id}, model {model!r}: {counts}")
        if not rows:
            return 0
        values = [
            {
                "minute": minute, "key_id": key_id, "model": model, "requests": c.requests,
                "errors": c.errors, "prompt_tokens": c.prompt_tokens,
                "completion_tokens": c.completion_tokens,
            }
            for (minute, key_id, model), c in sorted(rows.items())
        ]  # fmt: skip
        dialect_insert = postgresql.insert if self._postgres else sqlite.insert
        stmt = dialect_insert(UsageMinuteRow)
        t = UsageMinuteRow.__table__.c
        upsert = stmt.on_conflict_do_update(
            index_elements=["minute", "key_id", "model"],
            set_={
                name: t[name] + stmt.excluded[name]
                for name in ("requests", "errors", "prompt_tokens", "completion_tokens")
            },
        )
        with self._write(f"adding {len(values)} usage rows") as s:
            s.connection().execute(upsert, values)
        return len(values)

    def usage(
        self,
        since: datetime,
        until: datetime,
        key_id: int | None = None,
        model: str | None = None,
        step: Step = Step.MINUTE,
        limit: int = MAX_USAGE_ROWS,
    ) -> list[UsageBucket]:
        """Usage of the minutes in [``since``, ``until``), summed per ``step``, key and model, by
        time then key then model; at most ``limit`` buckets (the earliest)."""
        if not 1 <= limit <= MAX_USAGE_ROWS:
            raise ValueError(f"limit must be 1..{MAX_USAGE_ROWS}, got {limit}")
        step = Step(step)
        t = UsageMinuteRow.__table__.c
        start: ColumnElement[Any] = (
            t.minute
            if step is Step.MINUTE
            else type_coerce(TRUNCATE[self._engine.dialect.name](step, t.minute), UtcDateTime())
        ).label("start")
        query = (
            select(
                start, t.key_id, t.model, func.sum(t.requests), func.sum(t.errors),
                func.sum(t.prompt_tokens), func.sum(t.completion_tokens),
            )
            .where(*self._window(since, until, key_id, model))
            .group_by(start, t.key_id, t.model)
            .order_by(start, t.key_id, t.model)
            .limit(limit)
        )  # fmt: skip
        with self._read("reading usage") as s:
            return [
                UsageBucket(r[0], r[1], r[2], UsageCounts(int(r[3]), int(r[4]), int(r[5]), int(r[6])))
                for r in s.execute(query)
            ]

    def usage_totals(
        self,
        since: datetime,
        until: datetime,
        by: Literal["key", "model"],
        key_id: int | None = None,
        model: str | None = None,
    ) -> dict[Any, UsageCounts]:
        """Usage of the minutes in [``since``, ``until``) summed per key id (``by="key"``) or per
        model (``by="model"``)."""
        t = UsageMinuteRow.__table__.c
        column = {"key": t.key_id, "model": t.model}[by]
        query = (
            select(
                column, func.sum(t.requests), func.sum(t.errors),
                func.sum(t.prompt_tokens), func.sum(t.completion_tokens),
            )
            .where(*self._window(since, until, key_id, model))
            .group_by(column)
        )  # fmt: skip
        with self._read(f"summing usage per {by}") as s:
            return {r[0]: UsageCounts(int(r[1]), int(r[2]), int(r[3]), int(r[4])) for r in s.execute(query)}

    def prune_usage(self, older_than: datetime) -> int:
        """Delete the usage of minutes before ``older_than``; how many rows went."""
        when = stamp(older_than)
        with self._write("pruning usage") as s:
            result = s.connection().execute(delete(UsageMinuteRow).where(UsageMinuteRow.minute < when))
            return int(result.rowcount)

    @staticmethod
    def _window(
        since: datetime, until: datetime, key_id: int | None, model: str | None
    ) -> list[ColumnElement[bool]]:
        if stamp(until) <= stamp(since):
            raise ValueError(f"until ({until.isoformat()}) must be after since ({since.isoformat()})")
        t = UsageMinuteRow.__table__.c
        where = [t.minute >= stamp(since), t.minute < stamp(until)]
        if key_id is not None:
            where.append(t.key_id == key_id)
        if model is not None:
            where.append(t.model == model)
        return where
