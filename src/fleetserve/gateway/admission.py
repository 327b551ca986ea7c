"""Admission: a bounded FIFO queue in front of each deployment, and holding while no replica is Ready.

A deployment serves ``ready_replicas * max_concurrency_per_replica`` requests at once. A request
beyond that waits in FIFO order, up to ``max_waiting`` of them and each up to
``max_wait_seconds``; with no Ready replica (scaled to zero, or still starting) a request is held
up to a deadline while one starts. Refusals are exceptions the proxy turns into responses:

    FleetserveError
    └── GatewayRejection     the gateway refuses a request; carries .status and .retry_after
        ├── QueueFull        429: max_waiting requests already wait
        ├── QueueTimeout     429: waited max_wait_seconds without a slot
        └── NoReplica        503: no replica became Ready within the hold deadline

Every decision (admit, wait or refuse; how long a waiter may still wait and what it gets at the
end; how many waiters a freed capacity lets in; the Retry-After estimate) is a pure function
below, tested on its own. ``Admission`` is the one stateful coordinator: it keeps the counts and
the queues, and applies those functions on the event loop.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from enum import Enum
from typing import NamedTuple, Protocol

from fleetserve.errors import FleetserveError

DEFAULT_MAX_CONCURRENCY_PER_REPLICA = 8
MIN_RETRY_AFTER = 1.0
"""The least Retry-After the gateway answers with, in seconds."""

DEFAULT_SERVICE_SECONDS = 1.0
"""The service time assumed before any request of a deployment has finished."""

SERVICE_EWMA_ALPHA = 0.2
"""Weight of the newest service time in the running average."""


class GatewayRejection(FleetserveError):
    """The gateway refuses a request: the HTTP status to answer and the seconds to Retry-After."""

    status: int = 503

    def __init__(self, deployment: str, retry_after: float, message: str) -> None:
        self.deployment = deployment
        self.retry_after = retry_after
        super().__init__(f"deployment {deployment!r}: {message}")


class QueueFull(GatewayRejection):
    """As many requests as the policy allows already wait for this deployment."""

    status = 429


class QueueTimeout(GatewayRejection):
    """The request waited ``max_wait_seconds`` in the queue without getting a slot."""

    status = 429


class NoReplica(GatewayRejection):
    """No replica of the deployment became Ready before the hold deadline."""

    status = 503


class QueuePolicy(Protocol):
    """Anything with the queue bounds, such as ``fleetserve.spec.policies.AdmissionPolicy``."""

    @property
    def max_waiting(self) -> int: ...

    @property
    def max_wait_seconds(self) -> float: ...


@dataclass(frozen=True)
class AdmissionPolicy:
    """How many requests a deployment's replicas serve at once, and how many may wait, for how long."""

    max_waiting: int
    max_wait_seconds: float
    max_concurrency_per_replica: int = DEFAULT_MAX_CONCURRENCY_PER_REPLICA

    def __post_init__(self) -> None:
        if self.max_waiting < 0:
            raise ValueError(f"max_waiting must not be negative, got {self.max_waiting}")
        if not self.max_wait_seconds > 0:
            raise ValueError(f"max_wait_seconds must be positive, got {self.max_wait_seconds}")
        if self.max_concurrency_per_replica < 1:
            raise ValueError(
                f"max_concurrency_per_replica must be at least 1, got {self.max_concurrency_per_replica}"
            )

    @classmethod
    def of(cls, policy: QueuePolicy, *, max_concurrency_per_replica: int | None = None) -> AdmissionPolicy:
        """This policy from the spec's (or any object with its fields); the concurrency defaults to 8."""
        if isinstance(policy, AdmissionPolicy) and max_concurrency_per_replica is None:
            return policy
        if max_concurrency_per_replica is None:
            max_concurrency_per_replica = DEFAULT_MAX_CONCURRENCY_PER_REPLICA
        return cls(policy.max_waiting, policy.max_wait_seconds, max_concurrency_per_replica)

    def capacity(self, ready_replicas: int) -> int:
        """How many requests ``ready_replicas`` replicas serve at once."""
        return max(0, ready_replicas) * self.max_concurrency_per_replica


# ---- pure decisions -----------------------------------------------------------------------------


class Verdict(Enum):
    """What to do with a request that arrives."""

    ADMIT = "admit"  # a slot is free and nobody waits ahead
    WAIT = "wait"  # queue (or hold, with no replica) until a slot frees
    QUEUE_FULL = "queue_full"
    NO_REPLICA = "no_replica"  # no replica and a policy that lets nothing wait


def decide(in_flight: int, waiting: int, ready_replicas: int, policy: AdmissionPolicy) -> Verdict:
    """The verdict on an arriving request, given the deployment's counts."""
    # A free slot goes to the head of the queue first: admitting past waiters would break FIFO.
    if waiting == 0 and in_flight < policy.capacity(ready_replicas):
        return Verdict.ADMIT
    if waiting < policy.max_waiting:
        return Verdict.WAIT
    # With no replica and no queue at all, the honest answer is "no replica" (503), not "busy".
    if ready_replicas <= 0 and policy.max_waiting == 0:
        return Verdict.NO_REPLICA
    return Verdict.QUEUE_FULL


def grants(in_flight: int, waiting: int, ready_replicas: int, policy: AdmissionPolicy) -> int:
    """How many waiters, from the head of the queue, get a slot now."""
    return max(0, min(waiting, policy.capacity(ready_replicas) - in_flight))


class Expiry(Enum):
    """What a waiter gets when its time runs out."""

    NO_REPLICA = "no_replica"
    TIMEOUT = "timeout"


class Remaining(NamedTuple):
    """How long a waiter may still wait, and what it gets if the time runs out."""

    seconds: float
    expiry: Expiry


def remaining(
    now: float,
    enqueued_at: float,
    queued_since: float | None,
    ready_replicas: int,
    max_wait_seconds: float,
    deadline_no_replica: float,
) -> Remaining:
    """How long a waiter may still wait.

    While no replica is Ready it is held, up to ``deadline_no_replica`` from when it arrived. Once
    a replica is Ready it queues, up to ``max_wait_seconds`` from ``queued_since`` (when it first
    saw a Ready replica), so time spent held does not eat into its queue time. A replica lost
    while it queues sends it back to being held under the original deadline.
    """
    if ready_replicas <= 0 or queued_since is None:
        return Remaining(enqueued_at + deadline_no_replica - now, Expiry.NO_REPLICA)
    return Remaining(queued_since + max_wait_seconds - now, Expiry.TIMEOUT)


def retry_after(waiting: int, in_flight: int, avg_service_seconds: float | None) -> float:
    """Seconds a refused client should wait: the time for the queue ahead of it to drain, at least 1.

    With ``in_flight`` requests in service, each taking ``avg_service_seconds`` on average, a slot
    frees every ``avg / in_flight`` seconds; the queue plus the client need ``waiting + 1`` slots.
    """
    avg = DEFAULT_SERVICE_SECONDS if avg_service_seconds is None else avg_service_seconds
    return max(MIN_RETRY_AFTER, (waiting + 1) * avg / max(1, in_flight))


def ewma(previous: float | None, sample: float, alpha: float = SERVICE_EWMA_ALPHA) -> float:
    """The running average of service times after one more sample."""
    return sample if previous is None else previous + alpha * (sample - previous)


# ---- the coordinator ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Ticket:
    """An admitted request's slot: its deployment and how long it waited for it."""

    deployment: str
    waited_seconds: float


class Depth(NamedTuple):
    """A deployment's requests in service and waiting (held ones included)."""

    in_flight: int
    waiting: int


@dataclass
class _Lane:
    """One deployment's counts, FIFO queue and the latest way to count its Ready replicas."""

    in_flight: int = 0
    waiters: deque[asyncio.Future[None]] = field(default_factory=deque)
    avg_service: float | None = None
    ready_replicas: Callable[[], int] = lambda: 0
    policy: AdmissionPolicy | None = None


class Admission:
    """The admission queues of every deployment, on one event loop.

    ``poll_seconds``: how often a waiter re-counts Ready replicas on its own, for when nobody
    calls ``notify``. ``no_replica_retry_after``: the Retry-After of ``NoReplica``. ``clock``:
    seconds, monotonic; by default the running loop's clock (the one its timeouts use).
    """

    def __init__(
        self,
        *,
        poll_seconds: float = 0.5,
        no_replica_retry_after: float = 5.0,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self._lanes: dict[str, _Lane] = {}
        self._poll = poll_seconds
        self._no_replica_retry_after = max(MIN_RETRY_AFTER, no_replica_retry_after)
        self._clock = clock

    def depth(self, deployment: str) -> Depth:
        """Requests of ``deployment`` in service and waiting, for metrics."""
        lane = self._lanes.get(deployment)
        return Depth(0, 0) if lane is None else Depth(lane.in_flight, len(lane.waiters))

    def notify(self, deployment: str) -> None:
        """The deployment's Ready replicas changed: let in as many waiters as the capacity now allows."""
        lane = self._lanes.get(deployment)
        if lane is not None:
            self._dispatch(lane)

    @asynccontextmanager
    async def slot(
        self,
        deployment: str,
        policy: QueuePolicy,
        ready_replicas: Callable[[], int],
        deadline_no_replica: float,
    ) -> AsyncIterator[Ticket]:
        """Hold a slot of ``deployment`` for the body, waiting for one if needed; always released.

        Raises ``QueueFull``, ``QueueTimeout`` or ``NoReplica``. A waiter cancelled (its client
        went away) leaves the queue; one cancelled just as it was granted a slot gives it back.
        """
        rules = AdmissionPolicy.of(policy)
        lane = self._lanes.setdefault(deployment, _Lane())
        lane.ready_replicas = ready_replicas
        lane.policy = rules
        start = self._now()
        verdict = decide(lane.in_flight, len(lane.waiters), ready_replicas(), rules)
        if verdict is Verdict.QUEUE_FULL:
            raise QueueFull(
                deployment,
                retry_after(len(lane.waiters), lane.in_flight, lane.avg_service),
                f"{len(lane.waiters)} requests already wait (max_waiting {rules.max_waiting})",
            )
        if verdict is Verdict.NO_REPLICA:
            raise NoReplica(deployment, self._no_replica_retry_after, "no replica is Ready and none may wait")
        if verdict is Verdict.ADMIT:
            lane.in_flight += 1
            admitted = start
        else:
            await self._wait(deployment, lane, rules, deadline_no_replica, start)
            admitted = self._now()
        try:
            yield Ticket(deployment, admitted - start)
        finally:
            lane.avg_service = ewma(lane.avg_service, self._now() - admitted)
            self._release(lane)

    async def _wait(
        self, deployment: str, lane: _Lane, rules: AdmissionPolicy, deadline_no_replica: float, start: float
    ) -> None:
        """Queue on ``lane`` until granted a slot (the slot is then counted), or raise."""
        granted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        lane.waiters.append(granted)
        queued_since: float | None = None
        try:
            while True:
                # A replica may be Ready without anyone having called notify(): look for ourselves.
                self._dispatch(lane)
                if granted.done():
                    return
                now = self._now()
                ready = lane.ready_replicas()
                if ready > 0 and queued_since is None:
                    queued_since = now
                left = remaining(now, start, queued_since, ready, rules.max_wait_seconds, deadline_no_replica)
                if left.seconds <= 0:
                    raise self._expired(deployment, lane, rules, left.expiry)
                await asyncio.wait((granted,), timeout=min(self._poll, left.seconds))
        except BaseException:
            if granted.done() and not granted.cancelled():
                # Granted in the same tick as the cancellation or timeout: the slot is ours to give back.
                self._release(lane)
            else:
                granted.cancel()
                lane.waiters.remove(granted)
            raise

    def _expired(
        self, deployment: str, lane: _Lane, rules: AdmissionPolicy, expiry: Expiry
    ) -> GatewayRejection:
        if expiry is Expiry.NO_REPLICA:
            return NoReplica(deployment, self._no_replica_retry_after, "no replica became Ready in time")
        return QueueTimeout(
            deployment,
            retry_after(len(lane.waiters) - 1, lane.in_flight, lane.avg_service),
            f"waited {rules.max_wait_seconds:g} s without a free slot",
        )

    def _release(self, lane: _Lane) -> None:
        lane.in_flight -= 1
        self._dispatch(lane)

    def _dispatch(self, lane: _Lane) -> None:
        """Grant free slots to the head of the queue; the slot is counted at grant time."""
        if lane.policy is None:
            return
        for _ in range(grants(lane.in_flight, len(lane.waiters), lane.ready_replicas(), lane.policy)):
            lane.waiters.popleft().set_result(None)
            lane.in_flight += 1

    def _now(self) -> float:
        return self._clock() if self._clock is not None else asyncio.get_running_loop().time()
