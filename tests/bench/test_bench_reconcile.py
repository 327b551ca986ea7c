"""A smoke run of bench/reconcile.py: a tiny fleet on SQLite and on PostgreSQL, every phase once,
the table printed. It checks the run completes and reports every figure, never the figures
themselves (speed belongs to the benchmark)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.mark.slow
def test_a_tiny_run_prints_every_figure_for_both_stores(
    postgres_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(BENCH))
    monkeypatch.setenv("FLEETSERVE_BENCH_POSTGRES", postgres_url)  # the columns' child processes
    import reconcile

    code = reconcile.main(["--nodes", "16", "--replicas", "60", "--cycles", "2"])

    out = capsys.readouterr().out
    assert code == 0, out
    header = next(line for line in out.splitlines() if line.strip().startswith("sqlite"))
    assert header.split() == ["sqlite", "postgres"]
    rows = {re.split(r"\s{2,}", line.strip())[0]: line for line in out.splitlines() if line.strip()}
    for row in (
        "fill: cycles, s",
        "replicas placed",
        "steady cycle p50 / p99 s",
        "snapshot p50 / p99 s",
        "plan p50 / p99 s",
        "commit p50 / p99 s",
        "RSS MiB first / last cycle",
        "quiet cycles: of steady, p50 / p99 ms",
        "scale -10 (drain): s",
        "drain deadline passed: s",
        "scale +10: s",
        "one node NotReady: s",
        "one node Lost: s",
    ):
        assert row in rows, out
    assert "failed" not in out, out
    # The fleet filled, and a steady cycle changed nothing.
    assert rows["changes in steady cycles"].split()[-2:] == ["0", "0"], out
    # Once settled, the cycles the server runs read nothing: every one of them quiet.
    assert rows["quiet cycles: of steady, p50 / p99 ms"].count("2 of 2") == 2, out
    # The silent nodes were judged: one transition each.
    assert rows["one node NotReady: split"].split()[-1] == "t1", out
