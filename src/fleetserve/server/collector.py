"""The cyclic garbage collector's settings for the control-plane process (``fleetserve server``).

The control plane holds a large, long-lived heap (every node's and replica's parsed document, the
reconciler's kept free capacity) and makes hundreds of thousands of short-lived objects per
reconcile cycle. Under the collector's default thresholds (700, 10, 10) enough of them are alive
at some young collection to be promoted that the whole heap is rescanned every few cycles: at
5,000 nodes and 25,000 replicas, four full passes of about a second in twelve cycles
(``bench/reconcile.py``), each one stalling every thread of the process. A first threshold of
50,000 lets them die by reference counting before a collection sees them; cyclic garbage is still
collected, a little later.
"""

from __future__ import annotations

import gc

CONTROL_PLANE_GC_THRESHOLDS = (50_000, 20, 10)


def tune_collector() -> None:
    """Set the collector's thresholds for the control plane's heap (see the module docstring)."""
    gc.set_threshold(*CONTROL_PLANE_GC_THRESHOLDS)
