"""The autoscaler's pure core: table-driven rules, timelines, and properties over random inputs."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from fleetserve.autoscale import (
    AutoscaleState,
    Decision,
    DecisionLog,
    ScaleReason,
    Signals,
    Timer,
    decide,
    decide_for,
    load_of,
    render_decision,
)
from fleetserve.spec.policies import AutoscalePolicy, ReplicaRange
from fleetserve.spec.resources import Deployment

NAME = "chat"
R1_10 = ReplicaRange(min=1, max=10)
R0_4 = ReplicaRange(min=0, max=4)
R2_3 = ReplicaRange(min=2, max=3)
POLICY = AutoscalePolicy()  # target 4, cooldown 120 s, zero after 300 s, no up stabilization
STABLE_UP = AutoscalePolicy(scale_up_stabilization_seconds=30)


def sig(
    ready: int,
    values: tuple[float, ...] | None = None,
    *,
    held: int = 0,
    last: float | None = None,
    total: int | None = None,
) -> Signals:
    """Signals with every Ready replica reporting ``values`` (default: one 4.0 each)."""
    return Signals(
        deployment=NAME,
        replicas_ready=ready,
        replicas_total=ready if total is None else total,
        outstanding_per_replica=(4.0,) * ready if values is None else values,
        gateway_waiting=held,
        last_request_at=last,
    )


def at(desired: int, **kw: float | int | None) -> AutoscaleState:
    return replace(AutoscaleState(desired=desired, observed_since=0.0), **kw)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Case:
    sentence: str
    bounds: ReplicaRange
    policy: AutoscalePolicy
    signals: Signals
    state: AutoscaleState | None
    now: float
    desired: int
    reason: ScaleReason


CASES = [
    Case("load at target holds steady", R1_10, POLICY, sig(3), at(3), 10, 3, ScaleReason.STEADY),
    Case(
        "load above target scales up at once to ceil(load / target)",
        R1_10,
        POLICY,
        sig(2, (9.0, 8.0)),
        at(2),
        10,
        5,
        ScaleReason.LOAD_ABOVE_TARGET,
    ),
    Case(
        "requests held at the gateway count as load",
        R1_10,
        POLICY,
        sig(2, (4.0, 4.0), held=9),
        at(2),
        10,
        5,
        ScaleReason.LOAD_ABOVE_TARGET,
    ),
    Case(
        "scale-up is capped at max",
        R1_10,
        POLICY,
        sig(2, (100.0, 100.0)),
        at(2),
        10,
        10,
        ScaleReason.ABOVE_MAX,
    ),
    Case(
        "a count below min is raised to min whatever the load",
        R2_3,
        POLICY,
        sig(1, (0.0,)),
        at(1),
        10,
        2,
        ScaleReason.BELOW_MIN,
    ),
    Case(
        "a count above max (max lowered) comes down at once",
        R2_3,
        POLICY,
        sig(5),
        at(5),
        10,
        3,
        ScaleReason.ABOVE_MAX,
    ),
    Case(
        "the first cycle starts from replicas_total",
        R1_10,
        POLICY,
        sig(4),
        None,
        10,
        4,
        ScaleReason.STEADY,
    ),
    Case(
        "low load does not scale down before the cooldown",
        R1_10,
        POLICY,
        sig(4, (0.0,) * 4),
        at(4, below_target_since=0.0, below_target_peak=1),
        119,
        4,
        ScaleReason.STEADY,
    ),
    Case(
        "after the cooldown, down to the most the load needed in the window",
        R1_10,
        POLICY,
        sig(4, (1.0,) * 4),
        at(4, below_target_since=0.0, below_target_peak=2),
        120,
        2,
        ScaleReason.LOAD_BELOW_TARGET_AFTER_COOLDOWN,
    ),
    Case(
        "the load rule keeps one replica even when min is 0",
        R0_4,
        POLICY,
        sig(3, (0.0,) * 3, last=100.0),
        at(3, below_target_since=0.0, below_target_peak=1),
        130,
        1,
        ScaleReason.LOAD_BELOW_TARGET_AFTER_COOLDOWN,
    ),
    Case(
        "Ready replicas with no fresh metrics hold the count",
        R1_10,
        POLICY,
        sig(4, ()),
        at(4, below_target_since=0.0, below_target_peak=1),
        500,
        4,
        ScaleReason.NO_FRESH_METRICS,
    ),
    Case(
        "partial metrics may not scale down",
        R1_10,
        POLICY,
        sig(4, (0.0, 0.0)),
        at(4, below_target_since=0.0, below_target_peak=1),
        500,
        4,
        ScaleReason.NO_FRESH_METRICS,
    ),
    Case(
        "partial metrics may scale up on what was reported; the silent replicas count as idle",
        R1_10,
        POLICY,
        sig(4, (12.0, 12.0)),
        at(4),
        10,
        6,
        ScaleReason.LOAD_ABOVE_TARGET,
    ),
    Case(
        "NaN and negative values count as not reported",
        R1_10,
        POLICY,
        sig(2, (float("nan"), -1.0)),
        at(2),
        500,
        2,
        ScaleReason.NO_FRESH_METRICS,
    ),
    Case(
        "a held request scales from zero to one",
        R0_4,
        POLICY,
        sig(0, held=1, last=99.0),
        at(0),
        100,
        1,
        ScaleReason.HELD_REQUEST,
    ),
    Case(
        "a burst held at zero starts as many as it needs",
        R0_4,
        POLICY,
        sig(0, held=10, last=99.0),
        at(0),
        100,
        3,
        ScaleReason.HELD_REQUEST,
    ),
    Case("zero with nothing held stays at zero", R0_4, POLICY, sig(0), at(0), 100, 0, ScaleReason.STEADY),
    Case(
        "idle past scale_to_zero_after goes to zero",
        R0_4,
        POLICY,
        sig(1, (0.0,), last=0.0),
        at(1, last_scale_up_at=0.0),
        300,
        0,
        ScaleReason.IDLE,
    ),
    Case(
        "idle, but not long enough, stays",
        R0_4,
        POLICY,
        sig(1, (0.0,), last=1.0),
        at(1),
        300,
        1,
        ScaleReason.STEADY,
    ),
    Case(
        "idle never scales to zero when min is above 0",
        R1_10,
        POLICY,
        sig(1, (0.0,), last=0.0),
        at(1),
        10_000,
        1,
        ScaleReason.STEADY,
    ),
    Case(
        "a request still in flight is not idle, however old the last arrival",
        R0_4,
        POLICY,
        sig(1, (1.0,), last=0.0),
        at(1),
        10_000,
        1,
        ScaleReason.STEADY,
    ),
    Case(
        "never heard a request: idle counts from when the autoscaler first saw it",
        R0_4,
        POLICY,
        sig(1, (0.0,)),
        at(1),
        300,
        0,
        ScaleReason.IDLE,
    ),
    Case(
        "up stabilization delays a scale-up",
        R1_10,
        STABLE_UP,
        sig(2, (8.0, 8.0)),
        at(2, above_target_since=0.0),
        29,
        2,
        ScaleReason.STEADY,
    ),
    Case(
        "up stabilization lets it through once elapsed",
        R1_10,
        STABLE_UP,
        sig(2, (8.0, 8.0)),
        at(2, above_target_since=0.0),
        30,
        4,
        ScaleReason.LOAD_ABOVE_TARGET,
    ),
    Case(
        "starting replicas (none Ready) with held requests scale up on the held load",
        R1_10,
        POLICY,
        sig(0, held=12, total=1),
        at(1),
        10,
        3,
        ScaleReason.LOAD_ABOVE_TARGET,
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.sentence for c in CASES])
def test_rules(case: Case) -> None:
    d = decide(NAME, case.bounds, case.policy, case.signals, case.state, case.now)
    assert (d.desired, d.reason) == (case.desired, case.reason)
    assert d.state.desired == d.desired
    assert d.changed == (d.desired != d.previous)
    assert d.detail.startswith(f"{NAME}: ")


def test_every_reason_renders_a_sentence() -> None:
    seen = set()
    for case in CASES:
        d = decide(NAME, case.bounds, case.policy, case.signals, case.state, case.now)
        seen.add(d.reason)
        assert render_decision(d) == d.detail
        assert d.as_dict()["detail"] == d.detail
    assert seen == set(ScaleReason)


@pytest.mark.parametrize(
    ("sentence", "timer"),
    [
        ("low load does not scale down before the cooldown", Timer.DOWN_COOLDOWN),
        ("after the cooldown, down to the most the load needed in the window", Timer.DOWN_COOLDOWN),
        ("idle, but not long enough, stays", Timer.IDLE),
        ("idle past scale_to_zero_after goes to zero", Timer.IDLE),
        ("up stabilization delays a scale-up", Timer.UP_STABILIZATION),
        ("load at target holds steady", None),
    ],
)
def test_timed_rules_say_which_timer_runs(sentence: str, timer: Timer | None) -> None:
    (case,) = [c for c in CASES if c.sentence == sentence]
    d = decide(NAME, case.bounds, case.policy, case.signals, case.state, case.now)
    assert d.timer is timer
    assert (d.waited is None) == (timer is None)


def test_signals_for_another_deployment_are_a_fault() -> None:
    with pytest.raises(ValueError, match="not 'other'"):
        decide("other", R1_10, POLICY, sig(1), None, 0)


@pytest.mark.parametrize(("metric", "expected"), [("in_flight", 3.0), ("waiting", 2.0), ("outstanding", 5.0)])
def test_load_of_counts_the_policy_metric(metric: str, expected: float) -> None:
    assert load_of(metric, running=3.0, waiting=2.0) == expected  # type: ignore[arg-type]


# ---- timelines ------------------------------------------------------------------------------


def run(
    bounds: ReplicaRange,
    policy: AutoscalePolicy,
    steps: list[tuple[float, Signals]],
    state: AutoscaleState | None = None,
) -> list[Decision]:
    out = []
    for now, signals in steps:
        d = decide(NAME, bounds, policy, signals, state, now)
        state = d.state
        out.append(d)
    return out


def test_scale_down_waits_for_a_continuous_cooldown() -> None:
    low = sig(4, (1.0,) * 4)  # needs 1
    high = sig(4)  # needs 4
    steps = [(0.0, high), (10.0, low), (100.0, low), (115.0, high), (120.0, low), (200.0, low), (240.0, low)]
    got = [(d.desired, d.reason) for d in run(R1_10, POLICY, steps)]
    assert got == [
        (4, ScaleReason.STEADY),
        (4, ScaleReason.STEADY),  # window opens at 10
        (4, ScaleReason.STEADY),
        (4, ScaleReason.STEADY),  # load back at target: the window closes
        (4, ScaleReason.STEADY),  # reopens at 120
        (4, ScaleReason.STEADY),
        (1, ScaleReason.LOAD_BELOW_TARGET_AFTER_COOLDOWN),  # 120 s after 120
    ]


def test_scale_down_goes_to_the_busiest_moment_of_the_window() -> None:
    steps = [
        (0.0, sig(6, (0.5,) * 6)),
        (50.0, sig(6, (2.0,) * 6)),
        (100.0, sig(6, (0.5,) * 6)),
        (120.0, sig(6, (0.5,) * 6)),
    ]
    decisions = run(R1_10, POLICY, steps, at(6))
    assert [d.desired for d in decisions] == [6, 6, 6, 3]  # 12 outstanding at t=50 needed 3


def test_a_scale_down_restarts_the_window() -> None:
    low = sig(4, (0.0,) * 4)
    decisions = run(
        R1_10, POLICY, [(0.0, low), (120.0, low), (130.0, sig(1, (0.0,))), (250.0, sig(1, (0.0,)))], at(4)
    )
    assert [d.desired for d in decisions] == [4, 1, 1, 1]
    assert decisions[1].state.last_scale_down_at == 120.0
    assert decisions[2].state.below_target_since is None  # at one replica, min 1: nothing below


def test_zero_to_one_to_zero() -> None:
    timeline = [
        (0.0, sig(0)),
        (10.0, sig(0, held=1, last=10.0)),
        (20.0, sig(0, held=1, last=10.0, total=1)),  # starting: still 1
        (40.0, sig(1, (1.0,), last=10.0)),
        (60.0, sig(1, (0.0,), last=55.0)),
        (354.0, sig(1, (0.0,), last=55.0)),
        (355.0, sig(1, (0.0,), last=55.0)),
        (400.0, sig(0, last=55.0)),
    ]
    decisions = run(R0_4, POLICY, timeline, at(0))
    assert [(d.desired, d.reason) for d in decisions] == [
        (0, ScaleReason.STEADY),
        (1, ScaleReason.HELD_REQUEST),
        (1, ScaleReason.STEADY),
        (1, ScaleReason.STEADY),
        (1, ScaleReason.STEADY),
        (1, ScaleReason.STEADY),
        (0, ScaleReason.IDLE),
        (0, ScaleReason.STEADY),
    ]


def test_scale_to_zero_waits_a_cooldown_after_a_scale_up() -> None:
    # Scaled up at t=1000 for a request that arrived long ago and ended; idle, but just changed.
    state = at(1, last_scale_up_at=1000.0)
    d = decide(NAME, R0_4, POLICY, sig(1, (0.0,), last=0.0), state, 1100.0)
    assert (d.desired, d.reason, d.timer, d.waited) == (1, ScaleReason.STEADY, Timer.DOWN_COOLDOWN, 100.0)
    d = decide(NAME, R0_4, POLICY, sig(1, (0.0,), last=0.0), state, 1120.0)
    assert (d.desired, d.reason) == (0, ScaleReason.IDLE)


def test_missing_metrics_reset_the_cooldown() -> None:
    low = sig(4, (0.0,) * 4)
    decisions = run(
        R1_10, POLICY, [(0.0, low), (100.0, sig(4, ())), (110.0, low), (200.0, low), (230.0, low)], at(4)
    )
    assert [d.desired for d in decisions] == [4, 4, 4, 4, 1]


# ---- properties -----------------------------------------------------------------------------

bounds_st = st.builds(
    lambda lo, span: ReplicaRange(min=lo, max=max(1, lo + span)),
    st.integers(0, 6),
    st.integers(0, 8),
)
policy_st = st.builds(
    AutoscalePolicy,
    target=st.sampled_from([0.5, 1.0, 4.0, 7.5]),
    scale_up_stabilization_seconds=st.sampled_from([0.0, 0.0, 15.0]),
    scale_down_cooldown_seconds=st.sampled_from([0.0, 30.0, 120.0]),
    scale_to_zero_after_seconds=st.sampled_from([0.0, 60.0, 300.0]),
)
value_st = st.one_of(
    st.floats(0, 64, allow_nan=False),
    st.sampled_from([float("nan"), -1.0, float("inf"), 1e300]),
)
signals_st = st.builds(
    Signals,
    deployment=st.just(NAME),
    replicas_ready=st.integers(0, 12),
    replicas_total=st.integers(0, 12),
    outstanding_per_replica=st.lists(value_st, max_size=12).map(tuple),
    gateway_waiting=st.integers(0, 200),
    last_request_at=st.one_of(st.none(), st.floats(0, 1000, allow_nan=False)),
)
state_st = st.one_of(
    st.none(),
    st.builds(
        AutoscaleState,
        desired=st.integers(0, 20),
        last_scale_up_at=st.one_of(st.none(), st.floats(0, 1000, allow_nan=False)),
        last_scale_down_at=st.one_of(st.none(), st.floats(0, 1000, allow_nan=False)),
        below_target_since=st.one_of(st.none(), st.floats(0, 1000, allow_nan=False)),
        below_target_peak=st.integers(0, 20),
        above_target_since=st.one_of(st.none(), st.floats(0, 1000, allow_nan=False)),
    ),
)


@settings(max_examples=400, deadline=None)
@given(bounds_st, policy_st, signals_st, state_st, st.floats(0, 2000, allow_nan=False))
def test_desired_is_always_within_bounds(
    bounds: ReplicaRange, policy: AutoscalePolicy, signals: Signals, state: AutoscaleState | None, now: float
) -> None:
    d = decide(NAME, bounds, policy, signals, state, now)
    assert bounds.min <= d.desired <= bounds.max
    assert d.state.desired == d.desired
    assert d.detail


@settings(max_examples=300, deadline=None)
@given(
    bounds_st,
    policy_st,
    st.integers(1, 12),
    st.integers(0, 11),
    state_st.filter(lambda s: s is not None),
    st.floats(0, 5000, allow_nan=False),
    st.one_of(st.none(), st.floats(0, 5000, allow_nan=False)),
)
def test_never_scales_down_without_fresh_metrics(
    bounds: ReplicaRange,
    policy: AutoscalePolicy,
    ready: int,
    reporting: int,
    state: AutoscaleState,
    now: float,
    last: float | None,
) -> None:
    # Fewer replicas report than are Ready, each reporting zero load: nothing justifies going down.
    reporting = min(reporting, ready - 1)
    signals = sig(ready, (0.0,) * reporting, last=last)
    d = decide(NAME, bounds, policy, signals, state, now)
    assert d.desired >= min(state.desired, bounds.max)


@settings(max_examples=300, deadline=None)
@given(bounds_st, st.integers(1, 12), st.lists(st.floats(0, 64, allow_nan=False), min_size=1, max_size=12))
def test_scale_up_is_immediate(bounds: ReplicaRange, current: int, per_replica: list[float]) -> None:
    current = max(bounds.min, min(bounds.max, current))
    values = tuple(per_replica[:current]) if current else ()
    signals = sig(len(values), values)
    d = decide(NAME, bounds, POLICY, signals, at(current), 0.0)
    wanted = d.wanted
    if current > 0 and wanted > current:
        assert d.desired == min(wanted, bounds.max)


load_step_st = st.tuples(
    st.floats(0.5, 60, allow_nan=False),  # seconds since the previous cycle
    st.floats(0, 40, allow_nan=False),  # total load
    st.integers(0, 3),  # gateway-held requests
    st.booleans(),  # metrics fresh this cycle
)


@settings(max_examples=200, deadline=None)
@given(bounds_st, policy_st, st.lists(load_step_st, min_size=2, max_size=60))
def test_flapping_load_never_scales_down_sooner_than_the_cooldown(
    bounds: ReplicaRange, policy: AutoscalePolicy, steps: list[tuple[float, float, int, bool]]
) -> None:
    now = 0.0
    state: AutoscaleState | None = None
    last_change: float | None = None
    for dt, load, held, fresh in steps:
        now += dt
        ready = state.desired if state is not None else bounds.min
        values = tuple([load / ready] * ready) if fresh and ready else ()
        d = decide(
            NAME, bounds, policy, sig(ready, values, held=held, last=now if held else None), state, now
        )
        if d.desired < d.previous and last_change is not None:
            assert now - last_change >= policy.scale_down_cooldown_seconds
        if d.desired < d.previous:
            assert fresh or ready == 0
        if d.changed and state is not None:
            last_change = now
        state = d.state


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 200), st.floats(0, 1000, allow_nan=False))
def test_a_held_request_always_lifts_zero(held: int, now: float) -> None:
    d = decide(NAME, R0_4, POLICY, sig(0, held=held, last=now), at(0), now)
    assert d.desired >= 1
    assert d.reason in {ScaleReason.HELD_REQUEST, ScaleReason.ABOVE_MAX}


# ---- the policy on the deployment -----------------------------------------------------------

DEPLOYMENT = {"name": "chat", "model": "m", "profiles": [{"name": "cpu", "engine": "llama.cpp"}]}


def test_autoscale_policy_parses_in_camel_case() -> None:
    dep = Deployment.model_validate(
        DEPLOYMENT
        | {
            "replicas": {"min": 0, "max": 3},
            "autoscale": {"target": 2, "metric": "waiting", "scaleDownCooldownSeconds": 60},
        }
    )
    assert dep.autoscale == AutoscalePolicy(target=2, metric="waiting", scale_down_cooldown_seconds=60)


@pytest.mark.parametrize(
    ("sentence", "extra", "match"),
    [
        (
            "autoscale with a fixed count is refused",
            {"replicas": 2, "autoscale": {}},
            "autoscale needs replicas",
        ),
        (
            "a zero target is refused",
            {"replicas": {"min": 1, "max": 2}, "autoscale": {"target": 0}},
            "target",
        ),
        (
            "an unknown metric is refused",
            {"replicas": {"min": 1, "max": 2}, "autoscale": {"metric": "gpu"}},
            "metric",
        ),
        (
            "a negative cooldown is refused",
            {"replicas": {"min": 1, "max": 2}, "autoscale": {"scaleDownCooldownSeconds": -1}},
            "scaleDownCooldownSeconds",
        ),
    ],
)
def test_autoscale_policy_validation(sentence: str, extra: dict[str, object], match: str) -> None:
    with pytest.raises(ValidationError, match=match):
        Deployment.model_validate(DEPLOYMENT | extra)


def test_decide_for_uses_the_deployment_range_and_default_policy() -> None:
    fixed = Deployment.model_validate(DEPLOYMENT | {"replicas": 2})
    assert decide_for(fixed, sig(2), None, 0.0) is None
    ranged = Deployment.model_validate(DEPLOYMENT | {"replicas": {"min": 1, "max": 3}})
    d = decide_for(ranged, sig(1, (40.0,)), None, 0.0)
    assert d is not None
    assert (d.desired, d.reason) == (3, ScaleReason.ABOVE_MAX)


# ---- decision log ---------------------------------------------------------------------------


def test_decision_log_is_bounded_and_folds_repeats() -> None:
    log = DecisionLog(capacity=3)
    timeline = [
        (0.0, sig(1)),  # Steady
        (10.0, sig(1)),  # folded into the Steady entry
        (20.0, sig(1, (40.0,))),  # LoadAboveTarget: 1 → 10
        (30.0, sig(10, (40.0,) * 10)),  # AboveMax: wants 100
        (40.0, sig(10, (40.0,) * 10)),  # folded
        (50.0, sig(10)),  # Steady: pushes the first entry out
    ]
    for decision in run(R1_10, POLICY, timeline):
        log.record(decision)
    entries = log.entries(NAME)
    assert [(e["reason"], e["desired"], e["repeats"]) for e in entries] == [
        ("LoadAboveTarget", 10, 1),
        ("AboveMax", 10, 2),
        ("Steady", 10, 1),
    ]
    assert all(isinstance(e["detail"], str) for e in entries)
    assert log.entries("other") == ()
    assert set(log.snapshot()) == {NAME}
    log.forget(NAME)
    assert log.snapshot() == {}


def test_decision_log_counts_identical_steady_cycles() -> None:
    log = DecisionLog()
    for now in range(5):
        log.record(decide(NAME, R1_10, POLICY, sig(2), at(2), float(now)))
    (entry,) = log.entries(NAME)
    assert (entry["repeats"], entry["last_at"], entry["at"]) == (5, 4.0, 0.0)
    entry["repeats"] = 99
    assert log.entries(NAME)[0]["repeats"] == 5  # callers get copies


def test_decision_log_needs_room() -> None:
    with pytest.raises(ValueError):
        DecisionLog(capacity=0)
