"""Admission: the pure decisions, then the asyncio coordinator (FIFO, bounds, holding, cancellation)."""

from __future__ import annotations

import asyncio
import time

import pytest

from fleetserve.errors import FleetserveError
from fleetserve.gateway.admission import (
    Admission,
    AdmissionPolicy,
    Depth,
    Expiry,
    GatewayRejection,
    NoReplica,
    QueueFull,
    QueueTimeout,
    Remaining,
    Verdict,
    decide,
    ewma,
    grants,
    remaining,
    retry_after,
)
from fleetserve.spec.policies import AdmissionPolicy as SpecAdmissionPolicy

# ---- pure decisions -----------------------------------------------------------------------------

ONE_SLOT = AdmissionPolicy(max_waiting=2, max_wait_seconds=30, max_concurrency_per_replica=1)
EIGHT = AdmissionPolicy(max_waiting=4, max_wait_seconds=30)
NO_QUEUE = AdmissionPolicy(max_waiting=0, max_wait_seconds=30)

DECIDE = [
    # (sentence, in_flight, waiting, ready, policy, verdict)
    ("a free slot with nobody waiting admits at once", 0, 0, 1, ONE_SLOT, Verdict.ADMIT),
    ("capacity is replicas times concurrency per replica", 15, 0, 2, EIGHT, Verdict.ADMIT),
    ("a full deployment queues the request", 16, 0, 2, EIGHT, Verdict.WAIT),
    ("a free slot does not let a newcomer pass those waiting", 0, 1, 1, ONE_SLOT, Verdict.WAIT),
    ("a full queue refuses", 1, 2, 1, ONE_SLOT, Verdict.QUEUE_FULL),
    ("no replica holds the request while the queue has room", 0, 0, 0, ONE_SLOT, Verdict.WAIT),
    ("no replica and a full queue refuses as full", 0, 2, 0, ONE_SLOT, Verdict.QUEUE_FULL),
    (
        "no replica and a policy that lets nothing wait answers no replica",
        0,
        0,
        0,
        NO_QUEUE,
        Verdict.NO_REPLICA,
    ),
    (
        "a full deployment whose policy lets nothing wait refuses as full",
        8,
        0,
        1,
        NO_QUEUE,
        Verdict.QUEUE_FULL,
    ),
    ("in-flight above capacity after a scale-down queues", 20, 0, 1, EIGHT, Verdict.WAIT),
]


@pytest.mark.parametrize(
    ("in_flight", "waiting", "ready", "policy", "verdict"),
    [c[1:] for c in DECIDE],
    ids=[c[0] for c in DECIDE],
)
def test_decide(in_flight, waiting, ready, policy, verdict):
    assert decide(in_flight, waiting, ready, policy) is verdict


GRANTS = [
    ("every free slot goes to a waiter", 5, 10, 1, 3),
    ("no more grants than waiters", 0, 2, 2, 2),
    ("nothing is granted while full", 8, 3, 1, 0),
    ("nothing is granted above capacity", 20, 3, 1, 0),
    ("nothing is granted without a replica", 0, 3, 0, 0),
]


@pytest.mark.parametrize(
    ("in_flight", "waiting", "ready", "expected"), [c[1:] for c in GRANTS], ids=[c[0] for c in GRANTS]
)
def test_grants(in_flight, waiting, ready, expected):
    assert grants(in_flight, waiting, ready, EIGHT) == expected


REMAINING = [
    # (sentence, now, enqueued_at, queued_since, ready, expected); max_wait 30, hold deadline 60
    (
        "a held request counts down the hold deadline from its arrival",
        110,
        100,
        None,
        0,
        Remaining(50, Expiry.NO_REPLICA),
    ),
    (
        "a queued request counts down max_wait from when it first saw a replica",
        150,
        100,
        140,
        1,
        Remaining(20, Expiry.TIMEOUT),
    ),
    ("time held does not eat into queue time", 165, 100, 159, 2, Remaining(24, Expiry.TIMEOUT)),
    (
        "a replica lost while queued means holding under the first deadline",
        170,
        100,
        140,
        0,
        Remaining(-10, Expiry.NO_REPLICA),
    ),
    (
        "a request that arrived with a replica queues from its arrival",
        131,
        100,
        100,
        1,
        Remaining(-1, Expiry.TIMEOUT),
    ),
]


@pytest.mark.parametrize(
    ("now", "enqueued_at", "queued_since", "ready", "expected"),
    [c[1:] for c in REMAINING],
    ids=[c[0] for c in REMAINING],
)
def test_remaining(now, enqueued_at, queued_since, ready, expected):
    assert remaining(now, enqueued_at, queued_since, ready, 30.0, 60.0) == expected


RETRY = [
    ("the queue ahead drains at in-flight slots per service time", 9, 4, 2.0, 5.0),
    ("an empty queue waits for one slot", 0, 1, 3.0, 3.0),
    ("never less than one second", 0, 8, 0.5, 1.0),
    ("no in-flight requests count as one", 3, 0, 2.0, 8.0),
    ("an unknown service time counts as one second", 9, 2, None, 5.0),
]


@pytest.mark.parametrize(
    ("waiting", "in_flight", "avg", "expected"), [c[1:] for c in RETRY], ids=[c[0] for c in RETRY]
)
def test_retry_after(waiting, in_flight, avg, expected):
    assert retry_after(waiting, in_flight, avg) == pytest.approx(expected)


def test_the_service_time_average_starts_at_the_first_sample_and_moves_a_fifth():
    assert ewma(None, 4.0) == 4.0
    assert ewma(4.0, 9.0) == pytest.approx(5.0)


def test_a_policy_is_built_from_the_deployment_spec():
    spec = SpecAdmissionPolicy(max_waiting=5, max_wait_seconds=2.5)
    assert AdmissionPolicy.of(spec) == AdmissionPolicy(5, 2.5, 8)
    assert AdmissionPolicy.of(spec, max_concurrency_per_replica=2) == AdmissionPolicy(5, 2.5, 2)
    assert AdmissionPolicy.of(ONE_SLOT) is ONE_SLOT
    assert EIGHT.capacity(3) == 24


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_waiting": -1, "max_wait_seconds": 1},
        {"max_waiting": 1, "max_wait_seconds": 0},
        {"max_waiting": 1, "max_wait_seconds": 1, "max_concurrency_per_replica": 0},
    ],
    ids=["a negative queue bound is refused", "a zero wait is refused", "a zero concurrency is refused"],
)
def test_invalid_policies_are_refused(kwargs):
    with pytest.raises(ValueError):
        AdmissionPolicy(**kwargs)


@pytest.mark.parametrize(
    ("error", "status"),
    [(QueueFull, 429), (QueueTimeout, 429), (NoReplica, 503)],
    ids=["a full queue is 429", "a queue timeout is 429", "no replica is 503"],
)
def test_rejections_carry_status_and_retry_after(error, status):
    exc = error("d", 3.0, "why")
    assert isinstance(exc, GatewayRejection)
    assert isinstance(exc, FleetserveError)
    assert (exc.status, exc.retry_after, exc.deployment) == (status, 3.0, "d")


# ---- the coordinator ----------------------------------------------------------------------------


class Replicas:
    """A settable count of Ready replicas."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __call__(self) -> int:
        return self.n


async def settle() -> None:
    """Let every runnable task run until it blocks."""
    for _ in range(5):
        await asyncio.sleep(0)


async def until(condition) -> None:
    """Return once ``condition()`` holds, checking every few milliseconds."""
    while not condition():
        await asyncio.sleep(0.005)


async def holder(
    admission: Admission, policy, replicas, release: asyncio.Event, deadline: float = 5.0
) -> None:
    async with admission.slot("d", policy, replicas, deadline):
        await release.wait()


def test_a_request_with_a_free_slot_is_admitted_and_released():
    async def scenario():
        admission = Admission()
        async with admission.slot("d", EIGHT, Replicas(1), 5.0) as ticket:
            assert admission.depth("d") == Depth(1, 0)
            assert ticket.deployment == "d"
            assert ticket.waited_seconds == 0
        assert admission.depth("d") == (0, 0)
        assert admission.depth("never-seen") == (0, 0)

    asyncio.run(scenario())


def test_waiters_are_served_in_arrival_order():
    async def scenario():
        admission, replicas, release = Admission(poll_seconds=0.01), Replicas(1), asyncio.Event()
        policy = AdmissionPolicy(max_waiting=10, max_wait_seconds=5, max_concurrency_per_replica=1)
        first = asyncio.create_task(holder(admission, policy, replicas, release))
        await settle()
        served: list[int] = []

        async def waiter(i: int) -> None:
            async with admission.slot("d", policy, replicas, 5.0):
                served.append(i)
                await asyncio.sleep(0.005)

        tasks = []
        for i in range(6):
            tasks.append(asyncio.create_task(waiter(i)))
            await settle()
        assert admission.depth("d") == (1, 6)
        release.set()
        await asyncio.gather(first, *tasks)
        assert served == list(range(6))
        assert admission.depth("d") == (0, 0)

    asyncio.run(scenario())


def test_a_newcomer_does_not_overtake_a_waiter_when_capacity_grows():
    async def scenario():
        admission, replicas = Admission(poll_seconds=10), Replicas(1)
        release = asyncio.Event()
        policy = AdmissionPolicy(max_waiting=10, max_wait_seconds=5, max_concurrency_per_replica=1)
        served: list[str] = []

        async def request(name: str) -> None:
            async with admission.slot("d", policy, replicas, 5.0):
                served.append(name)
                await release.wait()

        tasks = [asyncio.create_task(request("first"))]
        await settle()
        tasks.append(asyncio.create_task(request("waiter")))
        await settle()
        replicas.n = 2  # a second replica is Ready, but nobody has called notify() yet
        tasks.append(asyncio.create_task(request("newcomer")))
        await settle()
        assert served == ["first", "waiter"]
        assert admission.depth("d") == (2, 1)
        release.set()
        await asyncio.gather(*tasks)
        assert served == ["first", "waiter", "newcomer"]

    asyncio.run(scenario())


def test_a_full_queue_refuses_with_429_and_a_retry_after():
    async def scenario():
        admission, replicas, release = Admission(), Replicas(1), asyncio.Event()
        tasks = [asyncio.create_task(holder(admission, ONE_SLOT, replicas, release)) for _ in range(3)]
        await settle()
        assert admission.depth("d") == (1, 2)
        with pytest.raises(QueueFull) as caught:
            async with admission.slot("d", ONE_SLOT, replicas, 5.0):
                pytest.fail("admitted past a full queue")
        assert caught.value.status == 429
        assert caught.value.retry_after >= 1
        assert admission.depth("d") == (1, 2)
        release.set()
        await asyncio.gather(*tasks)

    asyncio.run(scenario())


def test_a_waiter_gives_up_after_max_wait_with_429():
    async def scenario():
        admission, replicas, release = Admission(poll_seconds=0.01), Replicas(1), asyncio.Event()
        policy = AdmissionPolicy(max_waiting=5, max_wait_seconds=0.05, max_concurrency_per_replica=1)
        first = asyncio.create_task(holder(admission, policy, replicas, release))
        await settle()
        started = time.monotonic()
        with pytest.raises(QueueTimeout) as caught:
            async with admission.slot("d", policy, replicas, 5.0):
                pytest.fail("admitted while the slot was held")
        assert 0.04 <= time.monotonic() - started < 1.0
        assert (caught.value.status, caught.value.retry_after >= 1) == (429, True)
        assert admission.depth("d") == (1, 0)
        release.set()
        await first

    asyncio.run(scenario())


def test_a_held_request_is_served_when_a_replica_appears_and_notify_is_called():
    async def scenario():
        # A poll far longer than the test: only notify() can wake the held request in time.
        admission, replicas = Admission(poll_seconds=30), Replicas(0)
        waited: list[float] = []

        async def request() -> None:
            async with admission.slot("d", EIGHT, replicas, 10.0) as ticket:
                waited.append(ticket.waited_seconds)

        task = asyncio.create_task(request())
        await asyncio.sleep(0.02)
        assert admission.depth("d") == (0, 1)
        replicas.n = 1
        started = time.monotonic()
        admission.notify("d")
        await task
        assert time.monotonic() - started < 0.5
        assert waited[0] >= 0.02
        assert admission.depth("d") == (0, 0)

    asyncio.run(scenario())


def test_a_held_request_notices_a_replica_on_its_own_without_notify():
    async def scenario():
        admission, replicas = Admission(poll_seconds=0.01), Replicas(0)
        task = asyncio.create_task(holder(admission, EIGHT, replicas, asyncio.Event(), deadline=10.0))
        await asyncio.sleep(0.02)
        replicas.n = 1
        await asyncio.wait_for(until(lambda: admission.depth("d") == (1, 0)), timeout=2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert admission.depth("d") == (0, 0)

    asyncio.run(scenario())


def test_no_replica_by_the_deadline_answers_503():
    async def scenario():
        admission = Admission(poll_seconds=0.01, no_replica_retry_after=7)
        started = time.monotonic()
        with pytest.raises(NoReplica) as caught:
            async with admission.slot("d", EIGHT, Replicas(0), 0.05):
                pytest.fail("admitted without a replica")
        assert 0.04 <= time.monotonic() - started < 1.0
        assert (caught.value.status, caught.value.retry_after) == (503, 7)
        assert admission.depth("d") == (0, 0)

    asyncio.run(scenario())


def test_no_replica_and_no_queue_answers_503_at_once():
    async def scenario():
        admission = Admission()
        with pytest.raises(NoReplica):
            async with admission.slot(
                "d", SpecAdmissionPolicy(max_waiting=0, max_wait_seconds=5), Replicas(0), 30
            ):
                pytest.fail("admitted without a replica")

    asyncio.run(scenario())


def test_a_cancelled_waiter_leaves_the_queue_and_the_next_is_served():
    async def scenario():
        admission, replicas, release = Admission(poll_seconds=0.01), Replicas(1), asyncio.Event()
        policy = AdmissionPolicy(max_waiting=5, max_wait_seconds=5, max_concurrency_per_replica=1)
        tasks = [asyncio.create_task(holder(admission, policy, replicas, release)) for _ in range(3)]
        await settle()
        assert admission.depth("d") == (1, 2)
        tasks[1].cancel()  # the client of the first waiter went away
        await settle()
        assert admission.depth("d") == (1, 1)
        release.set()
        await asyncio.gather(tasks[0], tasks[2])
        assert tasks[1].cancelled()
        assert admission.depth("d") == (0, 0)

    asyncio.run(scenario())


def test_a_waiter_cancelled_just_as_it_is_granted_gives_the_slot_back():
    async def scenario():
        admission, replicas = Admission(poll_seconds=30), Replicas(0)
        task = asyncio.create_task(holder(admission, ONE_SLOT, replicas, asyncio.Event()))
        await settle()
        replicas.n = 1
        admission.notify("d")  # grants the slot ...
        assert admission.depth("d") == (1, 0)
        task.cancel()  # ... and the client leaves before the waiter runs again
        with pytest.raises(asyncio.CancelledError):
            await task
        assert admission.depth("d") == (0, 0)
        async with admission.slot("d", ONE_SLOT, replicas, 5.0):
            assert admission.depth("d") == (1, 0)

    asyncio.run(scenario())


@pytest.mark.parametrize(
    "failure",
    [RuntimeError("upstream broke"), asyncio.CancelledError()],
    ids=["an exception in the body releases the slot", "a cancelled body releases the slot"],
)
def test_the_slot_is_always_released(failure):
    async def scenario():
        admission = Admission()
        with pytest.raises(type(failure)):
            async with admission.slot("d", ONE_SLOT, Replicas(1), 5.0):
                raise failure
        assert admission.depth("d") == (0, 0)

    asyncio.run(scenario())


def test_retry_after_follows_the_measured_service_time():
    async def scenario():
        now = [0.0]
        admission = Admission(clock=lambda: now[0])
        policy = AdmissionPolicy(max_waiting=0, max_wait_seconds=5, max_concurrency_per_replica=1)
        async with admission.slot("d", policy, Replicas(1), 5.0):
            now[0] += 10.0  # a ten-second request
        async with admission.slot("d", policy, Replicas(1), 5.0):
            with pytest.raises(QueueFull) as caught:
                async with admission.slot("d", policy, Replicas(1), 5.0):
                    pytest.fail("admitted past a full deployment")
        assert caught.value.retry_after == pytest.approx(10.0)

    asyncio.run(scenario())
