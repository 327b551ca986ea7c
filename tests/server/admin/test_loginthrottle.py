"""The dashboard login's bound on failed attempts: per address, overall, in a sliding window,
with bounded memory."""

from __future__ import annotations

from fleetserve.server.admin.loginthrottle import LoginThrottle, ThrottlePolicy

POLICY = ThrottlePolicy(per_address=3, overall=5, window=60.0, max_addresses=4)


def test_an_address_is_held_off_after_its_failures_until_the_first_leaves_the_window() -> None:
    throttle = LoginThrottle(POLICY)
    for t in (0.0, 10.0, 20.0):
        assert throttle.retry_after("a", t) is None
        throttle.failed("a", t)
    assert throttle.retry_after("a", 30.0) == 30.0  # the failure at 0 leaves the window at 60
    assert throttle.retry_after("b", 30.0) is None  # another address is not held off
    assert throttle.retry_after("a", 60.0) is None


def test_a_success_forgets_the_address_failures() -> None:
    throttle = LoginThrottle(POLICY)
    throttle.failed("a", 0.0)
    throttle.failed("a", 1.0)
    throttle.succeeded("a")
    throttle.failed("a", 2.0)
    throttle.failed("a", 3.0)
    assert throttle.retry_after("a", 4.0) is None


def test_failures_from_many_addresses_hold_off_every_address_that_failed_but_not_a_new_one() -> None:
    throttle = LoginThrottle(POLICY)
    for i in range(5):
        throttle.failed(f"10.0.0.{i}", float(i))
    assert throttle.retry_after("10.0.0.4", 10.0) == 50.0
    assert throttle.retry_after("10.0.0.4", 60.0) is None
    assert throttle.retry_after("10.9.9.9", 10.0) is None  # it has not failed: it is heard


def test_at_most_max_addresses_are_remembered_the_oldest_forgotten() -> None:
    throttle = LoginThrottle(ThrottlePolicy(per_address=1, overall=1000, window=60.0, max_addresses=4))
    for i in range(6):
        throttle.failed(f"a{i}", float(i))
    assert throttle.retry_after("a0", 10.0) is None  # forgotten
    assert throttle.retry_after("a5", 10.0) is not None
    assert len(throttle._failures) == 4
