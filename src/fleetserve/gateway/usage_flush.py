"""Writing a gateway's usage counts to the store: every ``interval`` seconds and once more when
the gateway stops. A write that fails puts its counts back into the counter (they go out with the
next one), so a store that is down for a while loses nothing.
"""

from __future__ import annotations

import asyncio
import logging
from datetime import UTC, datetime

from starlette.concurrency import run_in_threadpool

from fleetserve.errors import FleetserveError
from fleetserve.gateway.usage import UsageCounter
from fleetserve.store.protocols import UsageSink

log = logging.getLogger("fleetserve.gateway.usage")

# Seconds between two writes of a gateway's usage counts.
FLUSH_SECONDS = 10.0
# At stop: how often the last write is tried, and the pause between tries.
STOP_TRIES = 3
STOP_RETRY_SECONDS = 1.0


class UsageFlusher:
    """Writes a ``UsageCounter`` into a ``UsageSink`` periodically, and at stop."""

    def __init__(
        self,
        counter: UsageCounter,
        sink: UsageSink,
        interval: float = FLUSH_SECONDS,
        stop_retry_seconds: float = STOP_RETRY_SECONDS,
    ) -> None:
        if not interval > 0:
            raise ValueError(f"the usage flush interval must be positive, got {interval}")
        self.counter = counter
        self.sink = sink
        self.interval = interval
        self.stop_retry_seconds = stop_retry_seconds
        self.failures = 0  # writes that failed in a row
        self._task: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()
        self._lock = asyncio.Lock()

    async def flush(self) -> int:
        """Write what was counted so far; the rows written (0 on failure: the counts are kept)."""
        async with self._lock:  # one write at a time: the loop's and a caller's never interleave
            records = self.counter.take()
            if not records:
                return 0
            try:
                written = await run_in_threadpool(self.sink.add_usage, records, datetime.now(UTC))
            except (FleetserveError, ValueError, OSError) as exc:
                self.counter.restore(records)
                self.failures += 1
                log.warning(
                    "writing %d usage rows failed (%s); kept for the next write (%d failure(s) in a row)",
                    len(records), exc, self.failures,
                )  # fmt: skip
                return 0
            self.failures = 0
            return written

    async def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                await asyncio.wait_for(self._stopping.wait(), self.interval)
            except TimeoutError:
                await self.flush()

    def start(self) -> None:
        """Start writing every ``interval`` seconds."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="usage-flush")

    async def stop(self) -> None:
        """Stop the loop (a write under way finishes; never cancelled half-way, so nothing is
        counted twice) and write what is left, trying ``STOP_TRIES`` times; what still fails is
        logged as lost."""
        self._stopping.set()
        if self._task is not None:
            await self._task
            self._task = None
        for attempt in range(STOP_TRIES):
            if attempt:
                await asyncio.sleep(self.stop_retry_seconds)
            await self.flush()
            if not len(self.counter):
                return
        log.error("usage of %d (minute, key, model) cells could not be written at stop", len(self.counter))
