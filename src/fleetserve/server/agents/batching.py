"""Concurrent calls gathered into one: at most one worker-thread call at a time per kind.

Thousands of agents each send a heartbeat every few seconds. Each alone is tiny work — one
indexed statement — but a trip to a worker thread and a database round trip each cost more than
the work, and under load the event loop, the worker threads and the reconciler fight over the
GIL for every one. A ``Gather`` hands a many-at-once function (``store.beats``,
``store.nodes_for_credentials``) every call that arrived while the previous one ran: one thread
trip and one or two statements for all of them.

A ``Gather`` runs its batches on a thread of its own, not in the shared worker pool: when the pool
is taken (thousands of agents registering, long-polls building their answers), heartbeats do not
queue behind that work for a thread.

A batch starts ``tick`` seconds after the first call of a quiet moment (0: at once, alone), so
that the calls of one tick share a thread trip and a statement: a batch's cost is mostly fixed
(a statement through SQLAlchemy and the driver, a hand-off), and 1,000 agents send only about 70
heartbeats a second, one or two per batch without a tick. Calls that arrive while a batch is in
flight wait for it to end (they would have waited for the database anyway) and go in the next
at once; a batch holds at most ``limit`` calls. A heartbeat is judged by when it arrived (the
door stamps it before it queues), so a tick delays its answer, never its judgement. Each
caller gets its own result, in order; an error of the batch is each caller's error. A caller
that goes away (its task cancelled) takes nothing with it: the batch still runs for the others.

The batch's CPU (its thread's own clock around ``many``) is split evenly over the bills of the
calls it held (``callcpu``: what each agent call costs, per kind).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Generic, TypeVar

from fleetserve.server.agents.callcpu import Bill, current_bill

T = TypeVar("T")
R = TypeVar("R")

DEFAULT_LIMIT = 512
MAX_TICK = 1.0  # a call waits at most this long for company


class Gather(Generic[T, R]):
    """Calls of ``many`` (a function of a list of arguments to the list of their results, run on
    this gather's own thread, ``name``) gathered over ``tick`` seconds and while one is in flight."""

    def __init__(
        self,
        many: Callable[[Sequence[T]], Sequence[R]],
        limit: int = DEFAULT_LIMIT,
        name: str = "gather",
        tick: float = 0.0,
    ) -> None:
        if limit < 1:
            raise ValueError(f"a batch holds at least one call, not limit={limit}")
        if not 0 <= tick <= MAX_TICK:
            raise ValueError(f"a batch's tick is 0 to {MAX_TICK:g} s, not tick={tick}")
        self.many = many
        self.limit = limit
        self.tick = tick
        self.name = name
        self._thread: ThreadPoolExecutor | None = None  # started at the first batch
        self._waiting: list[tuple[T, asyncio.Future[R], Bill | None]] = []
        self._running: asyncio.Task[None] | None = None
        self.batches = 0  # calls of ``many`` made, for tests and the curious
        self.calls = 0

    async def __call__(self, argument: T) -> R:
        future: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        self._waiting.append((argument, future, current_bill()))
        if self._running is None:
            self._running = asyncio.create_task(self._drain())
        return await future

    async def _drain(self) -> None:
        batch: list[tuple[T, asyncio.Future[R], Bill | None]] = []
        try:
            if self.tick and len(self._waiting) < self.limit:
                await asyncio.sleep(self.tick)  # the calls of this tick go together
            while self._waiting:
                batch, self._waiting = self._waiting[: self.limit], self._waiting[self.limit :]
                self.batches += 1
                self.calls += len(batch)
                try:
                    if self._thread is None:
                        self._thread = ThreadPoolExecutor(1, thread_name_prefix=self.name)
                    arguments = [argument for argument, _, _ in batch]
                    loop = asyncio.get_running_loop()
                    results, spent = await loop.run_in_executor(self._thread, self._timed, arguments)
                    share = spent / len(batch)
                    for _, _, bill in batch:
                        if bill is not None:
                            bill.seconds += share
                    if len(results) != len(batch):
                        raise RuntimeError(f"{len(results)} results for a batch of {len(batch)} calls")
                except Exception as exc:  # every caller's error: each judges it as its own
                    for _, future, _ in batch:
                        if not future.done():
                            future.set_exception(exc)
                else:
                    for (_, future, _), result in zip(batch, results, strict=True):
                        if not future.done():
                            future.set_result(result)
                batch = []
        finally:
            self._running = None
            # Only when the drain itself was cancelled (the loop shutting down): nobody hangs.
            for _, future, _ in batch + self._waiting:
                if not future.done():
                    future.cancel()
            self._waiting = []

    def _timed(self, arguments: Sequence[T]) -> tuple[Sequence[R], float]:
        """``many`` of ``arguments``, and the CPU seconds its thread spent on it."""
        began = time.thread_time()
        results = self.many(arguments)
        return results, time.thread_time() - began
