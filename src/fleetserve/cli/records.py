"""The record commands, which read a running control plane over HTTP: ``usage`` (the gateways'
requests and tokens per API key, model or time step) and ``events`` (the audit log of admin
actions)."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from typing import Annotated, Any

import typer
from rich.console import Console

from fleetserve.adminapi.records import EventView
from fleetserve.cli.admin import FormatOpt, ServerOpt, TokenOpt, call, call_all, parse_duration
from fleetserve.cli.output import Column, Format, emit


class UsageBy(StrEnum):
    """What ``fleetserve usage`` sums over: API keys, models, or time steps."""

    KEY = "key"
    MODEL = "model"
    MINUTE = "minute"
    HOUR = "hour"
    DAY = "day"


def since_param(text: str, now: datetime) -> str:
    """``--since`` as the API's ISO 8601 time: a duration back from ``now`` (``24h``, ``7d``) or
    a time itself (``2026-12-01T00:00:00Z``); ValueError otherwise."""
    try:
        return (now - timedelta(seconds=parse_duration(text))).isoformat()
    except ValueError:
        pass
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(f"{text!r} is neither a duration (24h, 7d) nor an ISO 8601 time") from None
    return (when if when.tzinfo else when.replace(tzinfo=UTC)).isoformat()


COUNTS: tuple[Column, ...] = (
    ("requests", lambda r: r["requests"]), ("errors", lambda r: r["errors"]),
    ("prompt", lambda r: r["promptTokens"]), ("completion", lambda r: r["completionTokens"]),
    ("total", lambda r: r["totalTokens"]),
)  # fmt: skip
KEY: Column = ("key", lambda r: f"{r['keyId']} ({r['key']})" if r.get("key") else str(r["keyId"]))


def usage_table(data: dict[str, Any], by: UsageBy) -> tuple[list[dict[str, Any]], tuple[Column, ...]]:
    """The rows and columns ``fleetserve usage --by BY`` prints from the API's answer."""
    if by is UsageBy.KEY:
        return data["totals"]["keys"], (KEY, *COUNTS)
    if by is UsageBy.MODEL:
        return data["totals"]["models"], (("model", lambda r: r["model"]), *COUNTS)
    return data["rows"], (("start", lambda r: r["start"]), KEY, ("model", lambda r: r["model"]), *COUNTS)


def register(app: typer.Typer) -> None:
    """Add ``usage`` and ``events`` to ``app``."""

    @app.command("usage")
    def usage_command(
        since: Annotated[
            str, typer.Option(help="How far back: a duration (30m, 24h, 7d) or an ISO 8601 time.")
        ] = "24h",
        by: Annotated[
            UsageBy, typer.Option(help="Totals per key or model, or rows per minute, hour or day.")
        ] = UsageBy.KEY,
        key: Annotated[int | None, typer.Option(help="Only this API key's id.", min=0)] = None,
        model: Annotated[str | None, typer.Option(help="Only this model.")] = None,
        server: ServerOpt = None,
        token: TokenOpt = None,
        output: FormatOpt = Format.TABLE,
    ) -> None:
        """The gateways' usage: requests, errors, prompt and completion tokens per API key, per
        model, or per minute, hour or day (written by every gateway every 10 seconds)."""
        console = Console(soft_wrap=True)
        try:
            start = since_param(since, datetime.now(UTC))
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="--since") from None
        totals_only = by in (UsageBy.KEY, UsageBy.MODEL)
        params: dict[str, Any] = {
            "since": start,
            # Totals come with any step: the coarsest and one row keep the answer small.
            "step": "day" if totals_only else by.value,
            "limit": 1 if totals_only else 100_000,
        }
        if key is not None:
            params["key"] = key
        if model is not None:
            params["model"] = model
        data = call(server, token, "GET", "/usage", params=params)
        if output is not Format.TABLE:
            emit(data, output, console)
            return
        rows, columns = usage_table(data, by)
        if not rows:
            console.print(f"no usage between {data['since']} and {data['until']}", markup=False)
            return
        emit(rows, output, console, columns)
        if data.get("truncated") and not totals_only:
            console.print("(more rows than shown: narrow --since or use a coarser --by)", markup=False)

    @app.command("events")
    def events_command(
        since: Annotated[
            str, typer.Option(help="How far back: a duration (1h, 7d) or an ISO 8601 time.")
        ] = "7d",
        action: Annotated[
            str | None,
            typer.Option(
                help="Only this action: apply, delete, cordon, drain, key.create, token.revoke, ..."
            ),
        ] = None,
        limit: Annotated[
            int, typer.Option(help="At most this many events, newest first.", min=1, max=1000)
        ] = 100,
        server: ServerOpt = None,
        token: TokenOpt = None,
        output: FormatOpt = Format.TABLE,
    ) -> None:
        """The audit log: every admin action (apply, delete, cordon, drain, keys, tokens,
        approvals, uploads, rollout undo), who took it, on what, from where, newest first."""
        console = Console(soft_wrap=True)
        try:
            start = since_param(since, datetime.now(UTC))
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="--since") from None
        params: dict[str, Any] = {"since": start, "limit": limit}
        if action is not None:
            params["action"] = action
        data = call_all(EventView, server, token, "GET", "/events", params=params)
        columns: tuple[Column, ...] = (
            ("at", lambda e: e.at.isoformat()), ("actor", lambda e: e.actor), ("action", lambda e: e.action),
            ("target", lambda e: e.target), ("source", lambda e: e.source),
            ("detail", lambda e: json.dumps(e.detail, separators=(",", ":")) if e.detail else ""),
        )  # fmt: skip
        if output is Format.TABLE and not data:
            console.print("no events", markup=False)
            return
        emit(data, output, console, columns)
