"""bench/routing.py's pure parts, fast: the traces (Poisson arrivals, shared, unique and hot
prefixes, follow-up turns), the statistics and the table with its targets lines. The benchmark
itself (real llama-server replicas behind a real gateway) is not a test."""

from __future__ import annotations

import math
import statistics
import sys
from collections import Counter
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def routing():
    sys.path.insert(0, str(BENCH))
    try:
        import routing as module
    finally:
        sys.path.remove(str(BENCH))
    return module


def test_a_shared_trace_has_groups_follow_ups_and_poisson_arrivals(routing):
    trace = routing.make_trace("shared", 400, 2.0, seed=3, groups=4, users=3, system_bytes=500)
    assert len(trace) == 400
    times = [r.at for r in trace]
    assert times == sorted(times) and times[0] > 0
    gaps = [b - a for a, b in zip([0.0, *times], times, strict=False)]
    assert 0.4 < statistics.mean(gaps) < 0.6  # 1 / rate
    systems = {r.messages[0][1] for r in trace}
    assert len(systems) == 4 and all(len(s) == 500 for s in systems)
    assert {r.group for r in trace} == {"g0", "g1", "g2", "g3"}
    turns = Counter(len(r.messages) for r in trace)
    # first turns (system + user), then follow-ups carrying the conversation, at most MAX_TURNS
    assert set(turns) == {2 * t for t in range(1, routing.MAX_TURNS + 1)}
    follow = next(r for r in trace if len(r.messages) == 4)
    earlier = [r for r in trace if r.at < follow.at and r.messages == follow.messages[:2]]
    assert earlier, "a follow-up extends a conversation sent before it"
    assert [role for role, _ in follow.messages] == ["system", "user", "assistant", "user"]


def test_a_unique_trace_has_the_same_lengths_and_no_shared_prefix(routing):
    shared = routing.make_trace("shared", 60, 1.0, seed=5, system_bytes=300)
    unique = routing.make_trace("unique", 60, 1.0, seed=5, system_bytes=300)
    assert [r.at for r in unique] == [r.at for r in shared]
    assert [[len(c) for _, c in r.messages] for r in unique] == [
        [len(c) for _, c in r.messages] for r in shared
    ]
    assert len({r.messages[0][1] for r in unique}) == 60


def test_a_hot_trace_sends_most_requests_to_one_prefix(routing):
    trace = routing.make_trace("hot", 1000, 1.0, seed=2, groups=5, system_bytes=50, hot_share=0.8)
    share = Counter(r.group for r in trace)["g0"] / len(trace)
    assert 0.75 < share < 0.85
    assert routing.make_trace("hot", 10, 1.0, seed=2) == routing.make_trace("hot", 10, 1.0, seed=2)


def test_unknown_traces_and_rates_are_refused(routing):
    with pytest.raises(ValueError):
        routing.make_trace("bursty", 10, 1.0)
    with pytest.raises(ValueError):
        routing.make_trace("shared", 10, 0.0)


def test_percentiles_interpolate(routing):
    assert routing.percentile([], 0.5) is None
    assert routing.percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert routing.percentile([1.0, 2.0], 0.5) == 1.5
    assert routing.percentile([float(i) for i in range(101)], 0.99) == pytest.approx(99.0)


def result(routing, sent, done, replica, status=200, first=None, **kw):
    return routing.Result(
        sent=sent, status=status, done=done, first=first or sent + 0.1, replica=replica, **kw
    )


def test_a_phase_summarises_into_a_row(routing):
    results = [
        result(
            routing, 0.0, 1.0, "a", first=0.5, tokens=8, cached=900, computed=100, expected=200, prompt=250
        ),
        result(routing, 0.5, 2.5, "b", first=1.5, tokens=8, cached=0, computed=1000, expected=0, prompt=250),
        result(
            routing, 1.0, 2.0, "a", first=1.25, tokens=8, cached=1000, computed=0, expected=250, prompt=250
        ),
        result(routing, 1.5, None, None, status=429),
        result(routing, 1.6, None, None, status=503),
    ]
    row = routing.summarise("shared", "cache-aware", results, ["a", "b", "c"], cpu=0.001)
    assert (row.r429, row.r503, row.other_errors, row.count) == (1, 1, 0, 5)
    assert row.ttft_p50 == pytest.approx(0.5)
    assert row.e2e_p50 == pytest.approx(1.0)
    assert row.rps == pytest.approx(3 / 2.5) and row.tps == pytest.approx(24 / 2.5)
    assert row.engine_hit == pytest.approx(1900 / 3000)
    assert row.gateway_hit == pytest.approx(450 / 750)
    assert row.spread == math.inf  # replica c had nothing
    assert row.cpu_per_1k == pytest.approx(0.2)
    assert routing.spread(results, ["a", "b"]) == pytest.approx(1.0)  # 2 s of in-flight each


def row(routing, trace, policy, **figures):
    base = dict(ttft_p50=1.0, ttft_p99=2.0, e2e_p50=1.2, rps=1.0, tps=8.0, spread=1.2, cpu_per_1k=0.1)
    base.update(figures)
    return routing.Row(trace, policy, **base)


def test_the_table_and_targets_say_met_and_not_met_with_figures(routing):
    rows = [
        row(routing, "shared", "least-load", ttft_p50=0.9, ttft_p99=2.0),
        row(routing, "shared", "cache-aware", ttft_p50=0.2, ttft_p99=0.8, rps=1.1, engine_hit=0.9),
        row(routing, "unique", "least-load"),
        row(routing, "unique", "cache-aware", ttft_p50=1.05, tps=6.0),
        row(routing, "hot", "least-load", ttft_p50=1.0),
        row(routing, "hot", "cache-aware", ttft_p50=0.6, spread=1.5, cpu_per_1k=0.5),
    ]
    text = routing.table(rows)
    lines = text.splitlines()
    assert len(lines) == 2 + len(rows)
    assert "TTFT p50" in lines[0] and "CPU-s/1k" in lines[0]
    assert "0.20s" in lines[3] and "90%" in lines[3]
    verdicts = routing.targets(rows)
    assert verdicts[0].startswith("(a)") and verdicts[0].endswith(": met")
    assert "0.22x" in verdicts[0]
    assert verdicts[1] == "(b) unique: cache-aware within 10% of least-load on every column: not met (tok/s)"
    assert verdicts[2].startswith("(c)") and verdicts[2].endswith("not met") and "0.60x" in verdicts[2]
    assert verdicts[3].endswith("0.500 CPU-s per 1,000 requests <= 0.3: not met")


def test_targets_of_phases_not_run_say_so(routing):
    assert routing.targets([]) == [
        "(a) shared: not measured",
        "(b) unique: not measured",
        "(c) hot: not measured",
    ]


def test_requests_per_second_equal_within_the_tolerance_is_equal(routing):
    def shared(rps):
        return [
            row(routing, "shared", "least-load", ttft_p50=0.9, ttft_p99=2.0, rps=1.0),
            row(routing, "shared", "cache-aware", ttft_p50=0.2, ttft_p99=0.8, rps=rps),
        ]

    assert routing.targets(shared(0.99))[0].endswith(": met")
    assert routing.targets(shared(0.97))[0].endswith(": not met")
