"""The stopper's threads with stops that only wait (no process): every stop runs at once, a stop in
flight is never started twice, and ``done`` comes after the replica no longer counts as stopping."""

from __future__ import annotations

import threading
import time

import pytest

from fleetserve.agent.stopper import Stopper


class Stops:
    """Stops that wait until released: counts each call, notes what ``done`` saw."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}
        self.release = threading.Event()
        self.lock = threading.Lock()
        self.done_seen: dict[str, frozenset[str]] = {}
        self.stopper = Stopper(self.stop, self.done)

    def stop(self, name: str) -> None:
        with self.lock:
            self.calls[name] = self.calls.get(name, 0) + 1
        if name.startswith("broken"):
            raise RuntimeError("a stop that fails")
        assert self.release.wait(10)

    def done(self, name: str) -> None:
        with self.lock:
            self.done_seen[name] = self.stopper.stopping()


def test_eight_stops_at_once_all_proceed_together() -> None:
    names = [f"r-{i}" for i in range(8)]
    barrier = threading.Barrier(len(names) + 1, timeout=5)

    def stop(name: str) -> None:
        barrier.wait()  # only passes when all eight are in flight at once

    stopper = Stopper(stop, lambda name: None)
    started = [stopper.stop(name) for name in names]
    assert started == [True] * 8
    barrier.wait()  # broken (BrokenBarrierError) if the stops ran one after another
    assert stopper.wait(5)
    assert stopper.stopping() == frozenset()


def test_a_stop_asked_for_again_while_in_flight_starts_nothing() -> None:
    stops = Stops()
    assert stops.stopper.stop("r-0")
    assert not stops.stopper.stop("r-0")
    assert not stops.stopper.stop("r-0")
    assert stops.stopper.stopping() == frozenset({"r-0"})
    stops.release.set()
    assert stops.stopper.wait(5)
    assert stops.calls == {"r-0": 1}
    # Once done, a new stop of the name (a later engine under it) runs again.
    assert stops.stopper.stop("r-0")
    assert stops.stopper.wait(5)
    assert stops.calls == {"r-0": 2}


def test_done_comes_after_the_replica_no_longer_counts_as_stopping() -> None:
    stops = Stops()
    stops.stopper.stop("r-0")
    stops.stopper.stop("r-1")
    stops.release.set()
    assert stops.stopper.wait(5)
    assert "r-0" not in stops.done_seen["r-0"] and "r-1" not in stops.done_seen["r-1"]


def test_a_stop_that_fails_neither_ends_the_others_nor_stays_in_flight(
    caplog: pytest.LogCaptureFixture,
) -> None:
    stops = Stops()
    stops.stopper.stop("broken-0")
    stops.stopper.stop("r-0")
    stops.release.set()
    assert stops.stopper.wait(5)
    assert set(stops.done_seen) == {"broken-0", "r-0"}
    assert stops.stopper.stopping() == frozenset()
    assert "stopping broken-0 failed" in caplog.text


def test_wait_returns_false_while_a_stop_is_still_in_flight() -> None:
    stops = Stops()
    stops.stopper.stop("r-0")
    started = time.monotonic()
    assert not stops.stopper.wait(0.2)
    assert time.monotonic() - started < 2
    stops.release.set()
    assert stops.stopper.wait(5)
