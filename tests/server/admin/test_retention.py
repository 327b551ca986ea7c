"""Retention: usage and audit events older than their bound are dropped, on both backends; the
flags that set the bounds are checked before anything starts."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

import pytest
from typer.testing import CliRunner

from fleetserve.cli.main import app
from fleetserve.server.admin.retention import RetentionPolicy, prune_forever, prune_once
from fleetserve.store import SqlStore
from fleetserve.store.audit import AuditAction
from fleetserve.store.usage import UsageCounts, UsageRecord

NOW = datetime(2026, 6, 1, 12, 0, tzinfo=UTC)


def seed(store: SqlStore, now: datetime) -> None:
    store.add_usage(
        [UsageRecord(now - timedelta(days=d), 1, "chat", UsageCounts(1)) for d in (1, 29, 31, 90)], now
    )
    for days in (1, 364, 366):
        store.record_event(
            "admin token 1", AuditAction.DELETE, f"Model/m{days}", {}, None, now - timedelta(days=days)
        )


def test_prune_once_drops_what_is_older_than_each_retention(store: SqlStore) -> None:
    seed(store, NOW)
    assert prune_once(store, RetentionPolicy(), NOW) == (2, 1)
    assert [b.start for b in store.usage(NOW - timedelta(days=100), NOW)] == [
        (NOW - timedelta(days=d)) for d in (29, 1)
    ]
    assert [e.target for e in store.events()] == ["Model/m1", "Model/m364"]
    short = RetentionPolicy(usage=timedelta(days=2), audit=timedelta(days=2))
    assert prune_once(store, short, NOW) == (1, 1)


def test_the_pruning_task_prunes_at_once_and_stops_when_told(sqlite_store: SqlStore) -> None:
    now = datetime.now(UTC)
    seed(sqlite_store, now)

    async def scenario() -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(prune_forever(sqlite_store, RetentionPolicy(), stop, interval=3600))
        for _ in range(500):
            if len(sqlite_store.events()) == 2:
                break
            await asyncio.sleep(0.01)
        stop.set()
        await asyncio.wait_for(task, 10)

    asyncio.run(scenario())
    assert len(sqlite_store.usage(now - timedelta(days=100), now)) == 2


@pytest.mark.parametrize("days", [0, -1])
def test_a_retention_must_be_positive(days: int) -> None:
    with pytest.raises(ValueError, match="retention must be positive"):
        RetentionPolicy(usage=timedelta(days=days))


@pytest.mark.parametrize("command", ["server", "up"])
@pytest.mark.parametrize("flag", ["--usage-retention", "--audit-retention"])
def test_a_bad_retention_flag_exits_2_naming_it_before_anything_starts(command: str, flag: str) -> None:
    result = CliRunner().invoke(app, [command, flag, "a fortnight"])
    assert result.exit_code == 2, result.output
    assert flag in result.output


@pytest.mark.parametrize("command", ["server", "up"])
def test_the_retention_flags_are_in_the_help(command: str) -> None:
    result = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    assert "--usage-retention" in result.output and "--audit-retention" in result.output


def test_up_passes_the_retention_flags_on_to_its_server() -> None:
    from fleetserve.cli.local import UpOptions

    args = UpOptions(usage_retention="7d", audit_retention="90d").server_args()
    assert args[:4] == ["--usage-retention", "7d", "--audit-retention", "90d"]
