"""The admin API's records: the gateways' usage (per step, key and model, with totals) and the
audit log of admin actions."""

from __future__ import annotations

from typing import Any

from fleetserve.adminapi.values import IsoTime, View
from fleetserve.store.usage import Step


class Counts(View):
    """Requests, failed requests and tokens counted over some window."""

    requests: int
    errors: int
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class UsageRow(Counts):
    """One step of one key's use of one model (``key``: the key's name, None once it is gone)."""

    start: IsoTime
    key_id: int
    key: str | None
    model: str


class KeyTotal(Counts):
    """One key's use over the whole window."""

    key_id: int
    key: str | None


class ModelTotal(Counts):
    """One model's use over the whole window."""

    model: str


class UsageTotals(View):
    """The window's totals per key, per model, and in all."""

    keys: list[KeyTotal]
    models: list[ModelTotal]
    all: Counts


class UsageReport(View):
    """``GET /usage``: the window [since, until), its rows (``truncated``: the limit cut them) and
    its totals."""

    since: IsoTime
    until: IsoTime
    step: Step
    rows: list[UsageRow]
    truncated: bool
    totals: UsageTotals


class EventView(View):
    """One admin action of the audit log: when, who, what, on what, with what detail, from where."""

    id: int
    at: IsoTime
    actor: str
    action: str
    target: str
    detail: dict[str, Any]
    source: str | None
