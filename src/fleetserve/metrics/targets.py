"""Scrape targets and what is known of each: the values readers see, and the pure freshness rules.

The scraper keeps one ``TargetState`` per target (its last good body, the last error, one memoised
parse); readers get a ``Scrape`` made from it by ``view``. Freshness is decided by pure functions
(``view``, ``staleness``, ``next_tick``) from the stored state and a ``now``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType


@dataclass(frozen=True)
class Target:
    """One endpoint to scrape: a stable key, its metrics URL, the labels its samples get, and the
    bearer token the endpoint demands (an engine's API key), if any."""

    key: str
    url: str
    labels: Mapping[str, str] = field(default_factory=dict, hash=False)
    bearer: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        # A read-only copy: the caller's dict may change later; this target must not.
        object.__setattr__(self, "labels", MappingProxyType(dict(self.labels)))


@dataclass(frozen=True)
class Scrape:
    """What is known about one target now: its last good body, how old it is, and the last error.

    ``fetched_at`` and ``age`` are ``None`` (and ``stale`` true) until a scrape has succeeded.
    ``error`` is the error of the latest attempt, ``None`` once an attempt succeeds again.
    """

    key: str
    fetched_at: float | None
    age: float | None
    body: bytes | None
    error: str | None
    stale: bool


@dataclass(frozen=True)
class ScraperStats:
    """The scraper's own figures: scrape counts, the last cycle's duration and the worst staleness."""

    targets: int
    scrapes_ok: int
    scrapes_failed: int
    cycles: int
    last_cycle_seconds: float | None
    max_staleness_seconds: float


@dataclass(eq=False)
class TargetState:
    """The mutable record the scraper keeps per target (never handed to readers: ``view`` makes a
    ``Scrape``)."""

    target: Target
    added_at: float
    body: bytes | None = None
    fetched_at: float | None = None
    error: str | None = None
    attempted: bool = False
    in_flight: bool = False
    generation: int = 0  # bumped with every new body; keys the memoised parse
    parsed: tuple[int, Callable[[bytes], object], object] | None = None


def view(state: TargetState, now: float, stale_after: float) -> Scrape | None:
    """The ``Scrape`` a reader sees at ``now``; ``None`` before the first attempt has finished."""
    if not state.attempted:
        return None
    age = None if state.fetched_at is None else max(0.0, now - state.fetched_at)
    return Scrape(
        key=state.target.key,
        fetched_at=state.fetched_at,
        age=age,
        body=state.body,
        error=state.error,
        stale=age is None or age > stale_after,
    )


def staleness(state: TargetState, now: float) -> float:
    """Seconds since the target's last good body, or since it was added when it never had one."""
    since = state.fetched_at if state.fetched_at is not None else state.added_at
    return max(0.0, now - since)


def next_tick(start: float, interval: float, now: float) -> float:
    """The first tick ``start + k * interval`` after ``now``: ticks missed while busy are skipped."""
    k = int((now - start) // interval) + 1
    return start + k * interval


__all__ = ["Scrape", "ScraperStats", "Target", "TargetState", "next_tick", "staleness", "view"]
