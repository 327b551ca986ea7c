"""The server CPU each agent call costs, per kind, always on: ``fleetserve_agent_call_cpu_seconds_total``
and ``fleetserve_agent_calls_total`` by ``kind`` (``CallKind``: heartbeat, status, assignments,
register — a bounded label). A kind's CPU over its calls is what one call of it costs the server.

A call is charged the CPU of the threads that worked for it, read from each thread's own CPU
clock (``time.thread_time``), so the CPU other work took meanwhile is never its own:

- on the event loop, each step of the call's coroutine (``CallCpu.timed``: the clock read before
  and after every resume; what other tasks do between two steps is theirs);
- on a worker thread, the function handed to it (``charged``);
- in a batch of calls (``batching.Gather``), the batch's thread time, split evenly over the
  calls it held.

A call carries its bill in a context variable, which follows it into worker threads (anyio copies
the context). What no call is charged for: the HTTP server's own parsing and writing around the
handler (uvicorn's protocol, the event loop's selector), the thread hand-offs themselves, the
collector, and background work (the assignment watch, the observer, the gateway's routes).
``bench/controlplane.py`` prints the server's whole CPU (from /proc) beside these figures, and
what is left over.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Generator
from contextvars import ContextVar
from enum import Enum
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

from fleetserve.rawasgi.types import App, Receive, Scope, Send

if TYPE_CHECKING:
    from fleetserve.metrics.exposition import FleetMetrics

T = TypeVar("T")
P = ParamSpec("P")


class CallKind(Enum):
    """The agent calls accounted, by the label value they are exposed under."""

    HEARTBEAT = "heartbeat"
    STATUS = "status"
    ASSIGNMENTS = "assignments"  # the long-poll, held or answered at once
    REGISTER = "register"  # enrolment and registering again (FastAPI's route)


class Bill:
    """The CPU seconds one call has used so far."""

    __slots__ = ("seconds",)

    def __init__(self) -> None:
        self.seconds = 0.0


_BILL: ContextVar[Bill | None] = ContextVar("fleetserve_agent_call_bill", default=None)


def current_bill() -> Bill | None:
    """The bill of the call being handled here (None: no accounted call)."""
    return _BILL.get()


def charged(fn: Callable[P, T]) -> Callable[P, T]:
    """``fn``, charging its thread's CPU to the bill of the call that runs it (if any): for
    functions handed to a worker thread."""

    def run(*args: P.args, **kwargs: P.kwargs) -> T:
        bill = _BILL.get()
        if bill is None:
            return fn(*args, **kwargs)
        began = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            bill.seconds += time.thread_time() - began

    return run


class _Timed:
    """Awaits ``call`` step by step, charging each step's CPU on this thread to ``bill``."""

    __slots__ = ("bill", "call", "done")

    def __init__(self, call: Awaitable[Any], bill: Bill, done: Callable[[], None]) -> None:
        self.call = call
        self.bill = bill
        self.done = done

    def __await__(self) -> Generator[Any, Any, Any]:
        inner = self.call.__await__()
        bill, clock = self.bill, time.thread_time
        token = _BILL.set(bill)
        sent: Any = None
        thrown: BaseException | None = None
        try:
            while True:
                began = clock()
                try:
                    yielded = inner.send(sent) if thrown is None else inner.throw(thrown)
                except StopIteration as stop:
                    return stop.value
                finally:
                    bill.seconds += clock() - began
                try:
                    sent, thrown = (yield yielded), None
                except GeneratorExit:
                    inner.close()
                    raise
                except BaseException as exc:  # a cancellation, delivered into the call
                    sent, thrown = None, exc
        finally:
            _BILL.reset(token)
            self.done()


class CallCpu:
    """Per kind, the CPU seconds and the number of calls answered; exposed on ``metrics`` (when
    given) and kept here (``totals``)."""

    def __init__(self, metrics: FleetMetrics | None = None) -> None:
        self._totals = {kind: [0.0, 0] for kind in CallKind}
        self._exposed = (
            None
            if metrics is None
            else {
                kind: (
                    metrics.agent_call_cpu_seconds.labels(kind=kind.value),
                    metrics.agent_calls.labels(kind=kind.value),
                )
                for kind in CallKind
            }
        )

    def timed(self, kind: CallKind, call: Awaitable[T]) -> Awaitable[T]:
        """``call``, its CPU (and what it hands to threads and batches) charged to one ``kind`` call."""
        bill = Bill()
        return _Timed(call, bill, lambda: self.add(kind, bill.seconds))

    def app(self, kind: CallKind, app: App) -> App:
        """An ASGI app whose every call is a ``kind`` call, timed."""

        async def timed_app(scope: Scope, receive: Receive, send: Send) -> None:
            await self.timed(kind, app(scope, receive, send))

        return timed_app

    def add(self, kind: CallKind, seconds: float, calls: int = 1) -> None:
        total = self._totals[kind]
        total[0] += seconds
        total[1] += calls
        if self._exposed is not None:
            cpu, count = self._exposed[kind]
            cpu.inc(seconds)
            count.inc(calls)

    def totals(self) -> dict[CallKind, tuple[float, int]]:
        """Per kind, (CPU seconds, calls) so far."""
        return {kind: (seconds, int(calls)) for kind, (seconds, calls) in self._totals.items()}
