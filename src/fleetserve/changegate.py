"""Whether a whole-fleet reader must read again: only when the store's change counter moved
since its last read (``SqlReports.fleet_changes``, bumped by the database in the same transaction
as every write that changes replicas, nodes, deployments, models or classes), or when its last
read is ``FULL_READ_SECONDS`` old (a safety net). Heartbeats move nothing, so at thousands of
nodes a quiet fleet costs each reader one tiny read a tick instead of every row.

A reader also rests after each read for ``PACE`` times as long as that read took, counter moved
or not: at 5,000 nodes a whole-fleet read takes a good fraction of a second, and a fleet that
changes every second (a scale-up placing thousands of replicas, agents registering) would
otherwise have every reader read back to back, the server busy re-reading instead of answering
heartbeats. A read of a few milliseconds rests a few milliseconds more: small fleets do not see it.

Pure: the counter is passed in, the clock injected. A reader takes the counter BEFORE it reads,
so a write that commits in between moves the counter past what it recorded and is read next
time; it can cost a read too many, never one too few.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

FULL_READ_SECONDS = 30.0
"""The longest a reader goes without a full read, even when the counter did not move."""
PACE = 3.0
"""After a read, a reader rests this many times as long as the read took (at most a quarter of
its time spent reading)."""


@dataclass
class ChangeGate:
    """One reader's last read: the counter it saw then, and when."""

    full_every: float = FULL_READ_SECONDS
    clock: Callable[[], float] = time.monotonic
    pace: float = PACE
    seen: int | None = field(default=None, init=False)
    at: float = field(default=-math.inf, init=False)
    took: float = field(default=0.0, init=False)

    def due(self, counter: int) -> bool:
        """Whether to read now, the counter being ``counter``."""
        since = self.clock() - self.at
        if since < self.pace * self.took:
            return False  # resting after a long read
        return counter != self.seen or since >= self.full_every

    def read(self, counter: int, began: float | None = None) -> None:
        """A read was made; ``counter`` was taken before it, and the read began at ``began`` (by
        ``clock``; None: it took no time worth resting for)."""
        self.at = self.clock()
        self.seen, self.took = counter, 0.0 if began is None else max(0.0, self.at - began)
