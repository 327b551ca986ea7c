"""Per-API-key limits on requests per minute and tokens per minute, over an exact sliding window.

The window is a log of ``(time, amount)`` events per key, not GCRA or fixed buckets: token usage
arrives in lumps of any size after each response, and a log answers "how long until the last 60 s
hold less than the limit" exactly, which is what ``Retry-After`` should say. An event at ``t``
counts while ``now < t + 60``; at ``t + 60`` exactly it no longer does.

- A request is denied while the requests admitted in the last 60 s are ``>= rpm``.
- A request is denied while the tokens counted in the last 60 s are ``>= tpm``. An admitted request
  reserves its expected tokens at once (``admit(..., reserve=N)``: ``accounting.reservation``,
  its completion cap and an estimate of its prompt), so parallel requests see each other's
  reservations; when the answer's ``usage`` arrives, ``settle`` replaces the reservation with the
  real count, in place (at the time of the request). A reservation already out of the window
  when it is settled counts the real tokens at the time of settling.

Memory is bounded: a key's log holds only the last 60 s of events, and a key with none is
dropped; a sweep over every key runs at most once per 60 s of the passed-in clock, and
``prune(now)`` runs one on demand. Nothing here reads a clock: ``now`` is passed in, in seconds
of a monotonic clock that never goes backwards (pruning trusts it).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from enum import StrEnum

WINDOW_SECONDS = 60.0
"""The sliding window both limits are counted over."""


@dataclass(frozen=True)
class Limits:
    """One API key's limits; None means unlimited. A limit of 0 denies everything."""

    rpm: int | None = None
    tpm: int | None = None

    def __post_init__(self) -> None:
        for name, value in (("rpm", self.rpm), ("tpm", self.tpm)):
            if value is not None and value < 0:
                raise ValueError(f"{name} must not be negative, got {value}")


class LimitKind(StrEnum):
    """Which limit denied a request."""

    REQUESTS = "requests"
    TOKENS = "tokens"


@dataclass(frozen=True)
class Decision:
    """Whether a request may go ahead; if not, which limit denied it and for how many seconds."""

    allowed: bool
    retry_after: float = 0.0
    which: LimitKind | None = None

    def __post_init__(self) -> None:
        if self.allowed and (self.retry_after != 0.0 or self.which is not None):
            raise ValueError("an allowed decision has no retry_after and no limit")
        if not self.allowed and (not self.retry_after > 0 or self.which is None):
            raise ValueError("a denial names its limit and a positive retry_after")

    @property
    def retry_after_header(self) -> int:
        """``retry_after`` rounded up to whole seconds, as the ``Retry-After`` header wants (0 if allowed)."""
        return math.ceil(self.retry_after)


ALLOWED = Decision(allowed=True)

# A denial's retry_after is t + 60 - now for an event still in the window, so positive; this floor
# only guards against float rounding making it 0.
_MIN_RETRY_AFTER = 1e-6


class _Event:
    """One counted amount at one time; ``live`` until it leaves the window."""

    __slots__ = ("amount", "at", "live")

    def __init__(self, at: float, amount: int) -> None:
        self.at = at
        self.amount = amount
        self.live = True


class _Log:
    """The events of one kind for one key within the window, oldest first, with their sum."""

    __slots__ = ("events", "total")

    def __init__(self) -> None:
        self.events: deque[_Event] = deque()
        self.total = 0

    def prune(self, now: float) -> None:
        while self.events and self.events[0].at + WINDOW_SECONDS <= now:
            gone = self.events.popleft()
            gone.live = False
            self.total -= gone.amount

    def add(self, now: float, amount: int) -> _Event:
        event = _Event(now, amount)
        self.events.append(event)
        self.total += amount
        return event

    def adjust(self, event: _Event, amount: int) -> None:
        """Set a live event's amount (settling a reservation)."""
        self.total += amount - event.amount
        event.amount = amount

    def wait(self, limit: int, now: float) -> float | None:
        """Seconds until the window's sum drops below ``limit``; None if it already is."""
        if self.total < limit:
            return None
        if limit == 0:
            # Nothing ever frees: tell the client to come back after a whole window.
            return WINDOW_SECONDS
        remaining = self.total
        for event in self.events:
            remaining -= event.amount
            if remaining < limit:
                return max(event.at + WINDOW_SECONDS - now, _MIN_RETRY_AFTER)
        raise AssertionError("an empty window sums to 0, below any positive limit")  # pragma: no cover


class _KeyState:
    """One key's request log and token log."""

    __slots__ = ("requests", "tokens")

    def __init__(self) -> None:
        self.requests = _Log()
        self.tokens = _Log()

    def prune(self, now: float) -> bool:
        """Drop expired events; True when nothing is left."""
        self.requests.prune(now)
        self.tokens.prune(now)
        return not self.requests.events and not self.tokens.events


class RateLimiter:
    """The request and token windows of every API key seen in the last minute."""

    def __init__(self) -> None:
        self._keys: dict[str, _KeyState] = {}
        self._swept_at: float | None = None

    def __len__(self) -> int:
        """How many keys hold state."""
        return len(self._keys)

    def check(self, key: str, limits: Limits, now: float) -> Decision:
        """Whether ``key`` may send a request now; records nothing.

        When both limits deny, the decision names the one that frees later, with its wait: the
        client has to wait for both.
        """
        self._sweep(now)
        # A key without state has used nothing; an empty log answers for it without storing one.
        state = self._existing(key, now) or _KeyState()
        waits = [
            (wait, kind)
            for log, limit, kind in (
                (state.requests, limits.rpm, LimitKind.REQUESTS),
                (state.tokens, limits.tpm, LimitKind.TOKENS),
            )
            if limit is not None and (wait := log.wait(limit, now)) is not None
        ]
        if not waits:
            return ALLOWED
        wait, kind = max(waits)
        return Decision(False, wait, kind)

    def record_request(self, key: str, now: float) -> None:
        """Count one request of ``key`` at ``now``."""
        self._sweep(now)
        self._existing_or_new(key, now).requests.add(now, 1)

    def record_tokens(self, key: str, tokens: int, now: float) -> None:
        """Count ``tokens`` (from a response's usage) against ``key`` at ``now``."""
        if tokens < 0:
            raise ValueError(f"tokens must not be negative, got {tokens}")
        self._sweep(now)
        if tokens:
            self._existing_or_new(key, now).tokens.add(now, tokens)

    def acquire(self, key: str, limits: Limits, now: float) -> Decision:
        """``check``, and when allowed, count the request at once (no await can come between).

        A key without a request limit has nothing to count, so nothing is recorded for it.
        """
        decision = self.check(key, limits, now)
        if decision.allowed and limits.rpm is not None:
            self.record_request(key, now)
        return decision

    def admit(
        self, key: str, limits: Limits, now: float, reserve: int = 0
    ) -> tuple[Decision, Reservation | None]:
        """``acquire``, and when allowed and the key has a token limit, reserve ``reserve`` tokens.

        The reservation is settled with ``settle`` once the real count is known.
        """
        decision = self.acquire(key, limits, now)
        if not decision.allowed or limits.tpm is None:
            return decision, None
        state = self._existing_or_new(key, now)
        return decision, Reservation(key, reserve, state.tokens, state.tokens.add(now, reserve))

    def settle(self, reservation: Reservation, tokens: int, now: float) -> None:
        """Replace a reservation with the ``tokens`` really used."""
        if tokens < 0:
            raise ValueError(f"tokens must not be negative, got {tokens}")
        event = reservation.event
        if event.live and now < event.at + WINDOW_SECONDS:
            reservation.log.adjust(event, tokens)
            return
        if event.live:  # out of the window but not pruned yet: it no longer counts either way
            reservation.log.adjust(event, 0)
        self.record_tokens(reservation.key, tokens, now)

    def prune(self, now: float) -> int:
        """Drop expired events of every key and the keys left with none; how many keys went."""
        self._swept_at = now
        idle = [key for key, state in self._keys.items() if state.prune(now)]
        for key in idle:
            del self._keys[key]
        return len(idle)

    def _sweep(self, now: float) -> None:
        # Amortized: one pass over all keys per window of the caller's clock keeps idle keys
        # from piling up even if nobody calls prune().
        if self._swept_at is None:
            self._swept_at = now
        elif now - self._swept_at >= WINDOW_SECONDS:
            self.prune(now)

    def _existing(self, key: str, now: float) -> _KeyState | None:
        state = self._keys.get(key)
        if state is not None and state.prune(now):
            del self._keys[key]
            return None
        return state

    def _existing_or_new(self, key: str, now: float) -> _KeyState:
        state = self._existing(key, now)
        if state is None:
            state = self._keys[key] = _KeyState()
        return state


@dataclass(frozen=True)
class Reservation:
    """Tokens counted for an admitted request before its answer, settled from its real usage."""

    key: str
    reserved: int
    log: _Log
    event: _Event
