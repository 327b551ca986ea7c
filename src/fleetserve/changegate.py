"""Whether a whole-fleet reader must read again: only when the store's change counter moved
since its last read (``SqlReports.fleet_changes``, bumped by the database in the same transaction
as every write that changes replicas, nodes, deployments, models or classes), or when its last
read is ``FULL_READ_SECONDS`` old (a safety net). Heartbeats move nothing, so at thousands of
nodes a quiet fleet costs each reader one tiny read a tick instead of every row.

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


@dataclass
class ChangeGate:
    """One reader's last read: the counter it saw then, and when."""

    full_every: float = FULL_READ_SECONDS
    clock: Callable[[], float] = time.monotonic
    seen: int | None = field(default=None, init=False)
    at: float = field(default=-math.inf, init=False)

    def due(self, counter: int) -> bool:
        """Whether to read now, the counter being ``counter``."""
        return counter != self.seen or self.clock() - self.at >= self.full_every

    def read(self, counter: int) -> None:
        """A read was made; ``counter`` was taken before it."""
        self.seen, self.at = counter, self.clock()
