"""The admin API's records: the gateways' usage (``GET /api/v1/usage``) and the audit log of admin
actions (``GET /api/v1/events``). Both need an admin token.

Usage is read over a bounded window (at most ``MAX_WINDOW``, and at most ``MAX_BUCKETS`` steps of
it) and a bounded number of rows; per step, key and model, with totals per key (names included)
and per model over the same window. One key's usage is ``?key=ID``: there is no separate route.
Times without a zone are taken as UTC.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Annotated

from fastapi import APIRouter, Query
from fastapi.exceptions import RequestValidationError

from fleetserve.adminapi.records import (
    Counts,
    EventView,
    KeyTotal,
    ModelTotal,
    UsageReport,
    UsageRow,
    UsageTotals,
)
from fleetserve.server.auth import admin
from fleetserve.server.params import NameQuery
from fleetserve.store.audit import MAX_EVENTS, AuditAction, AuditEvent
from fleetserve.store.sql import SqlStore
from fleetserve.store.usage import MAX_USAGE_ROWS, Step, UsageCounts

# The longest window one usage request may read, and the most steps it may cut it into.
MAX_WINDOW = timedelta(days=400)
MAX_BUCKETS = 20_000
DEFAULT_WINDOW = timedelta(hours=24)


def _utc(value: datetime, field: str) -> datetime:
    """``value`` in UTC (a time without a zone is taken as UTC); a 422 naming ``field`` if it is
    out of range once moved to UTC."""
    try:
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)
    except (OverflowError, ValueError):
        raise _invalid(field, "out of range once in UTC") from None


def _invalid(field: str, message: str) -> RequestValidationError:
    """A 422 naming the query parameter ``field``."""
    return RequestValidationError([{"loc": ("query", field), "msg": message, "type": "value_error"}])


def usage_window(
    since: datetime | None, until: datetime | None, step: Step, now: datetime
) -> tuple[datetime, datetime]:
    """The window a usage request reads: [since, until), by default the last 24 hours, checked."""
    end = _utc(until, "until") if until is not None else now
    if since is not None:
        start = _utc(since, "since")
    elif end - datetime.min.replace(tzinfo=UTC) > DEFAULT_WINDOW:
        start = end - DEFAULT_WINDOW
    else:
        raise _invalid("until", "too early: nothing was counted then")
    if end <= start:
        raise _invalid("since", f"must be before until ({end.isoformat()})")
    if end - start > MAX_WINDOW:
        raise _invalid("since", f"the window is longer than {MAX_WINDOW.days} days: narrow it")
    buckets = (end - start).total_seconds() / step.seconds
    if buckets > MAX_BUCKETS:
        coarser = "hour" if step is Step.MINUTE else "day"
        raise _invalid(
            "step",
            f"{int(buckets)} {step.value}s in the window, more than {MAX_BUCKETS}: use step={coarser} "
            "or a shorter window",
        )
    return start, end


def _counts(c: UsageCounts) -> dict[str, int]:
    """The counts as ``Counts``' fields, to spread into a row or a total."""
    return {
        "requests": c.requests, "errors": c.errors, "prompt_tokens": c.prompt_tokens,
        "completion_tokens": c.completion_tokens, "total_tokens": c.total_tokens,
    }  # fmt: skip


def event_view(e: AuditEvent) -> EventView:
    """An audit event as the API shows it."""
    return EventView(
        id=e.id, at=e.at, actor=e.actor, action=e.action, target=e.target, detail=dict(e.detail),
        source=e.source,
    )  # fmt: skip


def build_records_router(store: SqlStore) -> APIRouter:
    """``/api/v1/usage`` and ``/api/v1/events``; each needs an admin token."""
    api = APIRouter(prefix="/api/v1", dependencies=[admin])

    @api.get(
        "/usage",
        tags=["usage"],
        summary="Gateway usage per step, API key and model, with totals per key and per model",
    )
    def usage(
        since: Annotated[
            datetime | None, Query(description="Start (ISO 8601; default: 24 hours before until).")
        ] = None,
        until: Annotated[datetime | None, Query(description="End, exclusive (default: now).")] = None,
        key: Annotated[int | None, Query(ge=0, le=2**31 - 1, description="Only this API key's id.")] = None,
        model: NameQuery = None,
        step: Annotated[Step, Query(description="Sum per minute, hour or day.")] = Step.HOUR,
        limit: Annotated[int, Query(ge=1, le=MAX_USAGE_ROWS, description="At most this many rows.")] = 10_000,
    ) -> UsageReport:
        start, end = usage_window(since, until, step, datetime.now(UTC))
        rows = store.usage(start, end, key_id=key, model=model, step=step, limit=limit)
        names = {k.id: k.name for k in store.list_api_keys()}
        per_key = store.usage_totals(start, end, "key", key_id=key, model=model)
        per_model = store.usage_totals(start, end, "model", key_id=key, model=model)
        return UsageReport(
            since=start,
            until=end,
            step=step,
            rows=[
                UsageRow(
                    start=r.start,
                    key_id=r.key_id,
                    key=names.get(r.key_id),
                    model=r.model,
                    **_counts(r.counts),
                )
                for r in rows
            ],
            truncated=len(rows) == limit,
            totals=UsageTotals(
                keys=[KeyTotal(key_id=k, key=names.get(k), **_counts(c)) for k, c in sorted(per_key.items())],
                models=[ModelTotal(model=m, **_counts(c)) for m, c in sorted(per_model.items())],
                all=Counts(**_counts(sum(per_model.values(), UsageCounts()))),
            ),
        )

    @api.get("/events", tags=["events"], summary="The audit log of admin actions, newest first")
    def events(
        since: Annotated[datetime | None, Query(description="Only events at or after this time.")] = None,
        limit: Annotated[int, Query(ge=1, le=MAX_EVENTS, description="At most this many events.")] = 100,
        action: Annotated[AuditAction | None, Query(description="Only events of this action.")] = None,
    ) -> list[EventView]:
        start = _utc(since, "since") if since is not None else None
        return [event_view(e) for e in store.events(start, limit, action)]

    return api
