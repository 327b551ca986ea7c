"""Usage counted in memory, per minute, API key and model: what a gateway writes to the store every
few seconds (``gateway.usage_flush``), never a row per request.

Counting is one dict update on the request path: the key is (epoch minute, key id, model) and the
value a list of four counters. ``take`` hands the counts over and starts afresh; ``restore`` adds
counts back after a write that failed, so nothing is lost. Pure: the caller passes the time.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import UTC, datetime

from fleetserve.store.usage import UsageCounts, UsageRecord

# (minute since the epoch, API key id, model)
CounterKey = tuple[int, int, str]
# A bound on the distinct (minute, key, model) cells held between writes: a store that stays
# down for long keeps the newest this many, and says how many it dropped.
MAX_CELLS = 200_000


class UsageCounter:
    """Requests, errors, prompt and completion tokens per (minute, key, model), in memory."""

    __slots__ = ("_cells", "dropped", "max_cells")

    def __init__(self, max_cells: int = MAX_CELLS) -> None:
        self._cells: dict[CounterKey, list[int]] = {}
        self.max_cells = max_cells
        # Cells discarded because MAX_CELLS was reached (a store down for a long time).
        self.dropped = 0

    def add(self, now: float, key_id: int, model: str, prompt: int, completion: int, error: bool) -> None:
        """Count one answered request at ``now`` (seconds since the epoch)."""
        cell = (int(now // 60), key_id, model)
        counts = self._cells.get(cell)
        if counts is None:
            if len(self._cells) >= self.max_cells:
                self._evict()
            counts = self._cells[cell] = [0, 0, 0, 0]
        counts[0] += 1
        counts[1] += error
        counts[2] += prompt
        counts[3] += completion

    def __len__(self) -> int:
        return len(self._cells)

    def take(self) -> list[UsageRecord]:
        """Every count so far, as records; the counter starts afresh."""
        cells, self._cells = self._cells, {}
        return [
            UsageRecord(datetime.fromtimestamp(m * 60, UTC), key_id, model, UsageCounts(*counts))
            for (m, key_id, model), counts in cells.items()
        ]

    def restore(self, records: Iterable[UsageRecord]) -> None:
        """Add taken ``records`` back (their write failed): they go out with the next write."""
        for r in records:
            cell = (int(r.minute.timestamp() // 60), r.key_id, r.model)
            counts = self._cells.get(cell)
            if counts is None:
                if len(self._cells) >= self.max_cells:
                    self._evict()
                counts = self._cells[cell] = [0, 0, 0, 0]
            c = r.counts
            counts[0] += c.requests
            counts[1] += c.errors
            counts[2] += c.prompt_tokens
            counts[3] += c.completion_tokens

    def _evict(self) -> None:
        oldest = min(self._cells)
        del self._cells[oldest]
        self.dropped += 1
