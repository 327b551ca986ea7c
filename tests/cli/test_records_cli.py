"""``fleetserve usage`` and ``fleetserve events`` against the real control-plane app served by
uvicorn on 127.0.0.1 in a thread of this process, over a SQLite store."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from fleetserve.cli.main import app
from fleetserve.cli.records import UsageBy, since_param, usage_table
from fleetserve.store import SqlStore, TokenKind
from fleetserve.store.audit import AuditAction
from fleetserve.store.usage import UsageCounts, UsageRecord

NOW = datetime(2026, 6, 1, 12, 0, tzinfo=UTC)


@dataclass
class Served:
    url: str
    token: str
    store: SqlStore
    alice: int
    bob: int


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    import uvicorn

    from fleetserve.server.app import create_app

    tmp = tmp_path_factory.mktemp("records")
    with SqlStore.open(tmp / "state.db") as store:
        token = store.create_token(TokenKind.ADMIN, NOW).plaintext
        now = datetime.now(UTC)
        alice, _ = store.create_api_key("alice", ["*"], None, None, now)
        bob, _ = store.create_api_key("bob", ["*"], None, None, now)
        hour = now.replace(minute=0, second=0, microsecond=0)
        store.add_usage(
            [
                UsageRecord(hour - timedelta(hours=2), alice.id, "chat", UsageCounts(3, 1, 30, 60)),
                UsageRecord(hour - timedelta(hours=1), alice.id, "embed", UsageCounts(5, 0, 50, 0)),
                UsageRecord(hour - timedelta(hours=1), bob.id, "chat", UsageCounts(2, 0, 4, 8)),
                UsageRecord(hour - timedelta(days=3), bob.id, "chat", UsageCounts(100, 0, 1, 1)),  # too old
            ],
            now,
        )
        store.record_event("admin token 1", AuditAction.CORDON, "Node/n1", {"reason": "fan"}, "10.0.0.9", now)
        store.record_event("admin token 2", AuditAction.KEY_REVOKE, "ApiKey/7", {}, None, now)
        store.record_event(
            "admin token 1", AuditAction.DELETE, "Model/old", {}, None, now - timedelta(days=30)
        )
        config = uvicorn.Config(
            create_app(store, models_dir=tmp / "models"), host="127.0.0.1", port=0, log_level="warning"
        )
        server = uvicorn.Server(config)
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
            time.sleep(0.02)
        port = server.servers[0].sockets[0].getsockname()[1]
        try:
            yield Served(f"http://127.0.0.1:{port}", token, store, alice.id, bob.id)
        finally:
            server.should_exit = True
            thread.join(20)


def run(served: Served, tmp_path: Path, *args: str) -> Any:
    env = {
        "FLEETSERVE_SERVER": served.url, "FLEETSERVE_TOKEN": served.token, "HOME": str(tmp_path),
        "XDG_CONFIG_HOME": str(tmp_path / "xdg"), "COLUMNS": "250",
    }  # fmt: skip
    return CliRunner().invoke(app, list(args), env=env)


def table(output: str) -> list[list[str]]:
    return [line.split() for line in output.strip().splitlines()]


def test_usage_by_key_prints_each_keys_totals_over_the_last_day(served: Served, tmp_path: Path) -> None:
    result = run(served, tmp_path, "usage")
    assert result.exit_code == 0, result.output
    rows = table(result.output)
    assert rows[0] == ["KEY", "REQUESTS", "ERRORS", "PROMPT", "COMPLETION", "TOTAL"]
    assert rows[1:] == [
        [str(served.alice), "(alice)", "8", "1", "80", "60", "140"],
        [str(served.bob), "(bob)", "2", "0", "4", "8", "12"],
    ]


def test_usage_by_model_and_by_hour_with_filters(served: Served, tmp_path: Path) -> None:
    by_model = run(served, tmp_path, "usage", "--by", "model")
    assert by_model.exit_code == 0, by_model.output
    assert [r[:2] for r in table(by_model.output)[1:]] == [["chat", "5"], ["embed", "5"]]
    by_hour = run(served, tmp_path, "usage", "--by", "hour", "--key", str(served.alice), "-o", "json")
    assert by_hour.exit_code == 0, by_hour.output
    data = json.loads(by_hour.output)
    assert [(r["model"], r["requests"]) for r in data["rows"]] == [("chat", 3), ("embed", 5)]
    assert data["step"] == "hour"
    week = run(served, tmp_path, "usage", "--since", "7d", "--model", "chat", "--by", "day", "-o", "json")
    assert sum(r["requests"] for r in json.loads(week.output)["rows"]) == 105


def test_usage_with_a_bad_since_or_a_refused_window_exits_2_naming_the_option(
    served: Served, tmp_path: Path
) -> None:
    bad = run(served, tmp_path, "usage", "--since", "yesterday")
    assert bad.exit_code == 2 and "--since" in bad.output
    refused = run(served, tmp_path, "usage", "--since", "60d", "--by", "minute")
    assert refused.exit_code == 2, refused.output
    assert "step" in refused.output and "use step=hour" in refused.output


def test_events_prints_the_last_week_newest_first_and_filters_by_action(
    served: Served, tmp_path: Path
) -> None:
    result = run(served, tmp_path, "events")
    assert result.exit_code == 0, result.output
    rows = table(result.output)
    assert rows[0] == ["AT", "ACTOR", "ACTION", "TARGET", "SOURCE", "DETAIL"]
    assert [r[4] for r in rows[1:]] == ["key.revoke", "cordon"]  # the 30-day-old delete is out
    assert rows[2][-2:] == ["10.0.0.9", '{"reason":"fan"}']
    only = run(served, tmp_path, "events", "--since", "60d", "--action", "delete", "-o", "json")
    assert [e["target"] for e in json.loads(only.output)] == ["Model/old"]
    unknown = run(served, tmp_path, "events", "--action", "reboot")
    assert unknown.exit_code == 2 and "action" in unknown.output


def test_since_is_a_duration_back_from_now_or_a_time() -> None:
    assert since_param("24h", NOW) == (NOW - timedelta(hours=1 * 24)).isoformat()
    assert since_param("2026-05-01T00:00:00", NOW) == "2026-05-01T00:00:00+00:00"
    with pytest.raises(ValueError, match="neither a duration"):
        since_param("soon", NOW)


def test_usage_table_picks_totals_or_rows() -> None:
    data = {"rows": [{"start": "t"}], "totals": {"keys": [{"keyId": 1}], "models": [{"model": "m"}]}}
    assert usage_table(data, UsageBy.KEY)[0] == [{"keyId": 1}]
    assert usage_table(data, UsageBy.MODEL)[0] == [{"model": "m"}]
    assert usage_table(data, UsageBy.DAY)[0] == [{"start": "t"}]
