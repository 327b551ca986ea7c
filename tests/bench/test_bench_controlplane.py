"""A smoke run of bench/controlplane.py: a real server on PostgreSQL and on SQLite under a dozen
simulated agents, every phase once, the table printed. It checks the run completes and reports
every figure, never the figures themselves (speed belongs to the benchmark)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
SMALL = ["--quick", "--nodes", "12", "--replicas", "40", "--apply", "10", "--heartbeat", "1"]


def run_bench(postgres_url: str, monkeypatch: pytest.MonkeyPatch, *args: str) -> int:
    """bench/controlplane.py's main on a dozen agents against the tests' PostgreSQL."""
    monkeypatch.syspath_prepend(str(BENCH))
    import controlplane

    monkeypatch.setattr(controlplane, "POSTGRES", postgres_url)
    code: int = controlplane.main([*SMALL, *args])
    assert sys.modules["controlplane"] is controlplane
    return code


@pytest.mark.slow
def test_a_small_run_prints_every_figure_for_both_databases(
    postgres_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    code = run_bench(
        postgres_url, monkeypatch, "--steady", "4", "--quiet", "4", "--skip", "pair", "--trace", str(tmp_path)
    )

    out = capsys.readouterr().out
    assert code == 0, out
    header = next(line for line in out.splitlines() if line.strip().startswith("postgres"))
    assert header.split() == ["postgres", "sqlite"]
    rows = {re.split(r"\s{2,}", line.strip())[0]: line for line in out.splitlines() if line.strip()}
    for row in (
        "apply 10 -> all assigned s",
        "heartbeat p50 / p99 ms",
        "report p50 / p99 ms",
        "requests/s sustained",
        "reconcile cycle p50 / p99 s (mean)",
        "snapshot p50 / p99 s (mean)",
        "server RSS MiB start/end",
        "server CPU ms per request answered",
        "CPU ms per heartbeat: charged / +rest",
        "CPU ms per status report: charged / +rest",
        "server CPU charged to no call",
        "load process loop lag p99 / max ms",
        "database rows",
    ):
        assert row in rows, out
    # --trace: each column's steady-phase requests, one line each, sent in the phase.
    for column in ("postgres", "sqlite"):
        lines = (tmp_path / f"{column}.csv").read_text().splitlines()
        assert lines[0] == "sent_unix_s,kind,ms"
        kinds = {line.split(",")[1] for line in lines[1:]}
        assert "heartbeat" in kinds, lines
    # The servers charged CPU to the steady phase's heartbeats (ms per call, then how many).
    charged = re.findall(r"([\d.]+) / ([\d.]+) \(([\d,]+)\)", rows["CPU ms per heartbeat: charged / +rest"])
    assert len(charged) == 2, out
    for ms, with_rest, calls in charged:
        assert 0 < float(ms) <= float(with_rest) and int(calls.replace(",", "")) > 0, out
    # Every agent enrolled and was heard from; none of their requests failed.
    assert rows["failed requests"].split()[-2:] == ["0", "0"], out
    assert "placed)" in rows["apply 10 -> all assigned s"], out


@pytest.mark.slow
def test_a_run_past_its_deadline_prints_the_phases_it_finished_and_exits_1(
    postgres_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Long enough to enrol a dozen agents, far too short for the 60 s steady phase.
    code = run_bench(
        postgres_url,
        monkeypatch,
        "--steady",
        "60",
        "--quiet",
        "2",
        "--skip",
        "pair,sqlite",
        "--deadline",
        "25",
    )

    captured = capsys.readouterr()
    assert code == 1, captured.out
    assert "stopped before the end" in captured.err
    rows = {re.split(r"\s{2,}", line.strip())[0] for line in captured.out.splitlines() if line.strip()}
    assert "enrolment: nodes/s" in rows, captured.out
    assert "heartbeat p50 / p99 ms" not in rows, captured.out  # the steady phase never ended
