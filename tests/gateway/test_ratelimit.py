"""Per-key rate limits over an exact 60 s sliding window: boundaries, Retry-After, tokens, memory."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetserve.gateway.ratelimit import ALLOWED, Decision, LimitKind, Limits, RateLimiter

REQ = LimitKind.REQUESTS
TOK = LimitKind.TOKENS

# Each case: requests recorded at times, tokens recorded as (time, amount), then one check.
CASES = [
    # (sentence, limits, request times, token events, now, expected decision)
    ("a key without limits is always allowed", Limits(), [0, 1, 2] * 50, [(0, 10**9)], 3, ALLOWED),
    ("a key under its request limit is allowed", Limits(rpm=3), [0, 10], [], 20, ALLOWED),
    (
        "a key at its request limit is denied until the oldest request leaves",
        Limits(rpm=2),
        [0, 10],
        [],
        30,
        Decision(False, 30.0, REQ),
    ),
    (
        "a request still counts a moment before 60 s have passed",
        Limits(rpm=1),
        [0],
        [],
        59.75,
        Decision(False, 0.25, REQ),
    ),
    ("a request stops counting exactly 60 s after it was made", Limits(rpm=1), [0], [], 60, ALLOWED),
    (
        "Retry-After waits for as many requests as are over the limit",
        Limits(rpm=2),
        [0, 5, 10, 20],
        [],
        30,
        Decision(False, 40.0, REQ),
    ),
    ("a key under its token limit is allowed", Limits(tpm=101), [], [(0, 100)], 1, ALLOWED),
    (
        "a key whose tokens reached the limit is denied",
        Limits(tpm=100),
        [],
        [(0, 100)],
        1,
        Decision(False, 59.0, TOK),
    ),
    ("tokens stop counting exactly 60 s after they were used", Limits(tpm=100), [], [(0, 100)], 60, ALLOWED),
    (
        "Retry-After waits until the tokens left in the window drop below the limit",
        Limits(tpm=100),
        [],
        [(0, 50), (10, 50), (20, 50)],
        30,
        Decision(False, 40.0, TOK),
    ),
    (
        "one large response can hold a key back for a whole window",
        Limits(tpm=100),
        [],
        [(0, 10), (1, 1000), (2, 10)],
        30,
        Decision(False, 31.0, TOK),
    ),
    (
        "when both limits deny, the one that frees later is named",
        Limits(rpm=1, tpm=10),
        [5],
        [(20, 10)],
        30,
        Decision(False, 50.0, TOK),
    ),
    (
        "when both limits deny, requests can be the later one",
        Limits(rpm=1, tpm=10),
        [20],
        [(5, 10)],
        30,
        Decision(False, 50.0, REQ),
    ),
    ("a request limit of 0 denies for a whole window", Limits(rpm=0), [], [], 0, Decision(False, 60.0, REQ)),
    ("a token limit of 0 denies for a whole window", Limits(tpm=0), [], [], 0, Decision(False, 60.0, TOK)),
]


@pytest.mark.parametrize(
    ("limits", "requests", "tokens", "now", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_check(limits, requests, tokens, now, expected):
    limiter = RateLimiter()
    for t in requests:
        limiter.record_request("k", t)
    for t, amount in tokens:
        limiter.record_tokens("k", amount, t)
    assert limiter.check("k", limits, now) == expected


def test_tokens_are_enforced_on_the_next_request_after_the_response():
    limiter, limits = RateLimiter(), Limits(tpm=500)
    assert limiter.acquire("k", limits, 0).allowed
    # The response's usage arrives after it: 600 tokens, over the limit only now.
    limiter.record_tokens("k", 600, 2)
    assert limiter.check("k", limits, 3) == Decision(False, 59.0, TOK)
    assert limiter.check("k", limits, 62).allowed


def test_keys_are_limited_independently():
    limiter, limits = RateLimiter(), Limits(rpm=1)
    assert limiter.acquire("alice", limits, 0).allowed
    assert not limiter.acquire("alice", limits, 1).allowed
    assert limiter.acquire("bob", limits, 1).allowed


def test_acquire_counts_only_allowed_requests():
    limiter, limits = RateLimiter(), Limits(rpm=2)
    decisions = [limiter.acquire("k", limits, t) for t in (0, 1, 2, 3, 60)]
    assert [d.allowed for d in decisions] == [True, True, False, False, True]
    # The denied ones at 2 and 3 were not counted: at 60.5 the window holds the requests at 1 and 60.
    assert limiter.check("k", limits, 60.5) == Decision(False, 0.5, REQ)


def test_a_check_records_nothing():
    limiter = RateLimiter()
    for t in range(10):
        assert limiter.check("k", Limits(rpm=1), t).allowed
    assert len(limiter) == 0


def test_whole_second_retry_after_rounds_up():
    assert Decision(False, 0.25, REQ).retry_after_header == 1
    assert Decision(False, 30.0, REQ).retry_after_header == 30
    assert ALLOWED.retry_after_header == 0


# ---- memory -------------------------------------------------------------------------------------


def test_an_idle_key_is_dropped_by_prune():
    limiter = RateLimiter()
    limiter.record_request("a", 0)
    limiter.record_tokens("b", 10, 30)
    assert limiter.prune(59.5) == 0
    assert limiter.prune(60) == 1  # "a" went idle at 60; "b" holds tokens until 90
    assert len(limiter) == 1
    assert limiter.prune(90) == 1
    assert len(limiter) == 0


def test_idle_keys_are_dropped_without_calling_prune():
    limiter = RateLimiter()
    for i in range(1000):
        limiter.record_request(f"key-{i}", 0)
    assert len(limiter) == 1000
    limiter.record_request("active", 61)
    assert len(limiter) == 1


def test_a_key_is_dropped_when_touched_after_going_idle():
    limiter = RateLimiter()
    limiter.record_request("k", 0)
    limiter.record_request("other", 30)
    assert limiter.check("k", Limits(rpm=1), 60).allowed
    assert len(limiter) == 1


def test_a_key_holds_only_the_last_window_of_events():
    limiter = RateLimiter()
    for t in range(0, 600):
        limiter.record_request("k", t)
        limiter.record_tokens("k", 1, t)
    assert limiter.check("k", Limits(rpm=60), 599.5) == Decision(False, 0.5, REQ)
    assert limiter.check("k", Limits(rpm=61, tpm=61), 599.5).allowed


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: Limits(rpm=-1), "rpm"),
        (lambda: Limits(tpm=-1), "tpm"),
        (lambda: RateLimiter().record_tokens("k", -5, 0), "tokens"),
        (lambda: Decision(False, 0.0, REQ), "positive"),
        (lambda: Decision(True, 1.0, None), "allowed"),
    ],
    ids=[
        "a negative request limit is refused",
        "a negative token limit is refused",
        "a negative token count is refused",
        "a denial without a wait is refused",
        "an allowance with a wait is refused",
    ],
)
def test_invalid_inputs_are_refused(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_zero_tokens_keep_no_state():
    limiter = RateLimiter()
    limiter.record_tokens("k", 0, 0)
    assert len(limiter) == 0


# ---- properties ---------------------------------------------------------------------------------

# Quarter seconds: every sum and difference is exact in floating point, so boundaries are exact.
times = st.integers(0, 4 * 300).map(lambda q: q / 4)


@settings(max_examples=300, derandomize=True, database=None)
@given(
    st.lists(st.tuples(times, st.integers(1, 40)), max_size=30),
    st.integers(1, 10),
    st.integers(1, 200),
    times,
)
def test_retry_after_is_exactly_when_the_window_frees(events, rpm, tpm, now):
    events = sorted(events)
    now = now + (events[-1][0] if events else 0)
    limiter = RateLimiter()
    for t, amount in events:
        limiter.record_request("k", t)
        limiter.record_tokens("k", amount, t)
    limits = Limits(rpm=rpm, tpm=tpm)
    decision = limiter.check("k", limits, now)
    window = [(t, a) for t, a in events if now - 60 < t]
    over = len(window) >= rpm or sum(a for _, a in window) >= tpm
    assert decision.allowed is not over
    if over:
        assert 0 < decision.retry_after <= 60
        # Still denied a quarter second before now + retry_after, allowed exactly then.
        if decision.retry_after > 0.25:
            assert not limiter.check("k", limits, now + decision.retry_after - 0.25).allowed
        assert limiter.check("k", limits, now + decision.retry_after).allowed


def test_a_reservation_counts_at_once_and_is_settled_in_place() -> None:
    limiter = RateLimiter()
    limits = Limits(tpm=100)
    decision, held = limiter.admit("k", limits, 0.0, reserve=80)
    assert decision.allowed and held is not None
    assert limiter.check("k", limits, 1.0).allowed  # 80 < 100
    _, second = limiter.admit("k", limits, 1.0, reserve=30)  # 110 counted: the next is refused
    refused = limiter.check("k", limits, 2.0)
    assert not refused.allowed and refused.which is LimitKind.TOKENS
    limiter.settle(held, 10, 3.0)  # the first used 10, not 80: 40 counted now
    assert limiter.check("k", limits, 3.0).allowed
    # Settled in place, at the time of the request: the 10 leave the window at 60, not at 63.
    assert second is not None
    limiter.settle(second, 100, 4.0)
    assert not limiter.check("k", limits, 59.0).allowed
    assert not limiter.check("k", limits, 60.5).allowed  # the second's 100 remain until 61
    assert limiter.check("k", limits, 61.0).allowed


def test_a_reservation_settled_after_its_window_counts_the_tokens_then() -> None:
    limiter = RateLimiter()
    limits = Limits(tpm=50)
    _, held = limiter.admit("k", limits, 0.0, reserve=10)
    assert held is not None
    limiter.settle(held, 70, 100.0)  # a request that ran past the window
    assert not limiter.check("k", limits, 100.0).allowed
    assert limiter.check("k", limits, 160.0).allowed


def test_a_key_without_a_token_limit_reserves_nothing() -> None:
    limiter = RateLimiter()
    decision, held = limiter.admit("k", Limits(rpm=5), 0.0, reserve=100)
    assert decision.allowed and held is None
