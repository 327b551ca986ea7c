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
"""

from __future__ import annotations

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


def tune_collector() -> None:
    """Set the collector's thresholds for the control plane's heap and start freezing its
    long-lived part as it grows (see the module docstring)."""
    gc.set_threshold(*CONTROL_PLANE_GC_THRESHOLDS)
    threading.Thread(target=HeapFreezer().run_forever, name="heap-freezer", daemon=True).start()
