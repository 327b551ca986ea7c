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
        "CPU ms per heartbeat: charged / even / prop.",
        "CPU ms per status report: charged / even / prop.",
        "heartbeat: whole-process CPU <= 0.3 ms",
        "status report: whole-process CPU <= 1 ms",
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
    # Then with every CPU-second of the server put on some call (evenly, in proportion), each at
    # least the call's own charge, and the target judged on the larger.
    charged = re.findall(
        r"([\d.]+) / ([\d.]+) / ([\d.]+) \(([\d,]+)\)", rows["CPU ms per heartbeat: charged / even / prop."]
    )
    assert len(charged) == 2, out
    for ms, even, proportional, calls in charged:
        assert 0 < float(ms) <= min(float(even), float(proportional)), out
        assert int(calls.replace(",", "")) > 0, out
    verdicts = re.findall(r"(met|NOT met) \(([\d.]+) ms\)", rows["heartbeat: whole-process CPU <= 0.3 ms"])
    assert len(verdicts) == 2, out
    for (verdict, whole), (_, even, proportional, _) in zip(verdicts, charged, strict=True):
        assert float(whole) == max(float(even), float(proportional)), out
        assert (verdict == "met") == (float(whole) <= 0.3), out
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


def test_whole_process_puts_every_cpu_second_of_the_server_on_some_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.syspath_prepend(str(BENCH))
    import controlplane

    # 100 heartbeats charged 0.01 s, 50 reports 0.04 s: 0.05 s charged of the server's 0.1 s.
    per_call = controlplane.whole_process(
        {"heartbeat": (0.01, 100), "status": (0.04, 50), "register": (0, 0)}, 0.1
    )
    assert set(per_call) == {"heartbeat", "status"}
    for kind in ("heartbeat", "status"):
        own, even, proportional = per_call[kind]
        assert own < even and own < proportional
    # Evenly: 0.05 s over 150 calls each; in proportion: each call's charge doubled.
    assert per_call["heartbeat"] == pytest.approx((1e-4, 1e-4 + 0.05 / 150, 2e-4))
    assert per_call["status"] == pytest.approx((8e-4, 8e-4 + 0.05 / 150, 16e-4))
    # Either way the server's whole CPU is accounted for.
    assert sum(per_call[k][1] * c for k, c in (("heartbeat", 100), ("status", 50))) == pytest.approx(0.1)
    assert sum(per_call[k][2] * c for k, c in (("heartbeat", 100), ("status", 50))) == pytest.approx(0.1)
