"""The cyclic garbage collector's settings for the control-plane process (``fleetserve server``).

The control plane holds a large, long-lived heap (every node's and replica's parsed document, the
reconciler's kept free capacity) and makes hundreds of thousands of short-lived objects per
reconcile cycle. Under the collector's default thresholds (700, 10, 10) enough of them are alive
at some young collection to be promoted that the whole heap is rescanned every few cycles: at
5,000 nodes and 25,000 replicas, four full passes of about a second in twelve cycles
(``bench/reconcile.py``), each one stalling every thread of the process. A first threshold of
50,000 lets them die by reference counting before a collection sees them; cyclic garbage is still
collected, a little later.

Even so, a young collection of the second generation scanned up to a million survivors (150 to
370 ms at 5,000 agents) and a full one the whole heap (1.5 s), stalling heartbeats with it. So
the heap's long-lived part is frozen out of the collector (``gc.freeze``) whenever it has grown
by a quarter since the last freeze (checked every ``FREEZE_CHECK_SECONDS``, by the interpreter's
allocated-block count): one full collection first, so nothing that is garbage then is kept,
then every object alive is moved where no collection scans it again. It grows in steps (nodes
enrolling, a scale-up), so the full passes come with those steps and not in a steady fleet.
Frozen objects are still freed by reference counting when dropped; only a reference cycle among
them that is dropped later is never collected (the control plane's long-lived documents hold
none).

The server process (``fleetserve server``: the API, its held long-polls, the gateway) has a heap
of another kind: thousands of requests a second, and at 5,000 agents 5,000 assignment long-polls
held open about 20 s each, some 60 tracked objects apiece (a connection, its task, coroutines,
futures, contexts), dying as fast as new ones are made. CPython 3.11 starts a young collection
when allocations *minus deallocations* of tracked objects pass the first threshold, so in that
steady churn one seldom comes, and when it does it scans every object born since the last one
that is still alive: 100,000 to 350,000 objects, 60 to 220 ms, every heartbeat in flight
waiting behind it (heartbeat p99 320 to 680 ms at 5,000 agents, ``bench/controlplane.py``). So
there the young generations are collected on a clock instead (``PacedCollector``: every
``YOUNG_SECONDS``, a collection of the two young generations, which then hold only what was born
since the last tick: a few milliseconds), the automatic full pass is switched off (a held poll's
objects outlive a tick, are promoted, and would set off a full pass of the whole held set every
second or two), and a full pass runs when the heap has grown by ``FULL_GROWTH`` since the last one
(what it frees is cyclic garbage that died old; most cycles die young and go at the next tick),
beside the freezing above.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import sys
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

CONTROL_PLANE_GC_THRESHOLDS = (50_000, 20, 10)
FREEZE_CHECK_SECONDS = 10.0
FREEZE_GROWTH = 1.25  # the heap has grown by a quarter since the last freeze
FREEZE_MIN_BLOCKS = 1_000_000  # below this a full collection is cheap: nothing frozen

# The server process (see the module docstring): young collections on a clock. Each tick scans
# what is alive of the objects born since the last one: a held poll's once whatever the tick, but
# every request in flight at each tick. At 0.1 s the ticks were 13% of the server's CPU at 5,000
# agents (``bench/controlplane.py --profile``), most of it requests scanned in flight; at 0.5 s a
# tick scans a few thousand more objects (a few milliseconds) and five times fewer ticks run.
YOUNG_SECONDS = 0.5
# Automatic collections stay as a backstop for a tick that does not come (young only: the third
# threshold is never reached, so the automatic full pass never runs).
SERVER_GC_THRESHOLDS = (50_000, 20, 2**30)
FULL_GROWTH = 1.10  # a full pass when the heap has grown by a tenth since the last one


class HeapFreezer:
    """Freezes the long-lived heap out of the collector as it grows (module docstring)."""

    def __init__(self, blocks: Callable[[], int] = sys.getallocatedblocks) -> None:
        self.blocks = blocks
        self.frozen_at = 0  # allocated blocks at the last freeze
        self.freezes = 0

    def check(self) -> bool:
        """Freeze now if the heap grew enough since the last freeze; whether it froze."""
        now = self.blocks()
        if now < FREEZE_MIN_BLOCKS or now < self.frozen_at * FREEZE_GROWTH:
            return False
        began = time.perf_counter()
        gc.collect()
        gc.freeze()
        self.frozen_at, self.freezes = self.blocks(), self.freezes + 1
        log.info(
            "froze %d long-lived objects out of the collector (%.0f ms)",
            gc.get_freeze_count(),
            (time.perf_counter() - began) * 1000,
        )
        return True

    def run_forever(self, every: float = FREEZE_CHECK_SECONDS) -> None:
        while True:
            time.sleep(every)
            self.check()


class PacedCollector:
    """The server process's collector: young generations on a clock, a full pass when the heap has
    grown, the long-lived heap frozen as it grows (module docstring)."""

    def __init__(self, blocks: Callable[[], int] = sys.getallocatedblocks) -> None:
        self.blocks = blocks
        self.freezer = HeapFreezer(blocks)
        self.full_at = blocks()  # allocated blocks after the last full pass
        self.young = 0
        self.full = 0

    def tick(self) -> None:
        """Collect the two young generations."""
        gc.collect(1)
        self.young += 1

    def check(self) -> bool:
        """Freeze or run a full pass if the heap has grown enough; whether either ran."""
        if self.freezer.check():
            self.full_at = self.blocks()
            return True
        if self.blocks() < self.full_at * FULL_GROWTH:
            return False
        gc.collect()
        self.full_at, self.full = self.blocks(), self.full + 1
        return True


async def collect_paced(
    collector: PacedCollector | None = None,
    every: float = YOUNG_SECONDS,
    check_every: float = FREEZE_CHECK_SECONDS,
) -> None:
    """The server process's collections, until cancelled (see the module docstring). On the event
    loop, not a thread of its own: what a collection frees is finalised on the thread that
    collects, and a held poll's coroutines, futures and the loop's own handles must be finalised
    on the loop's thread (from another thread a ``finally`` would touch the loop unsafely)."""
    gc.set_threshold(*SERVER_GC_THRESHOLDS)
    collector = collector or PacedCollector()
    checked = time.monotonic()
    while True:
        await asyncio.sleep(every)
        collector.tick()
        if time.monotonic() - checked >= check_every:
            checked = time.monotonic()
            collector.check()


def tune_collector() -> None:
    """Set the collector's thresholds for the control plane's heap and start freezing its
    long-lived part as it grows (see the module docstring)."""
    gc.set_threshold(*CONTROL_PLANE_GC_THRESHOLDS)
    threading.Thread(target=HeapFreezer().run_forever, name="heap-freezer", daemon=True).start()
