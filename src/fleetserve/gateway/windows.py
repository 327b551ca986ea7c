"""Where a gateway keeps its rate-limit windows: in the process, or shared by every gateway in Redis.

``LocalWindows`` is the exact in-process sliding log of ``ratelimit.RateLimiter``. ``RedisWindows``
keeps each key's requests and tokens per second in two Redis hashes, one field per second of the
window, and checks and counts a request in one server-side Lua script (so two gateways can
never both take the last request of a window); a second script settles a reservation. The time
is Redis's own (``TIME``), the same for every gateway. A second is counted until the end of its
second plus the window, so the shared windows never count less than the exact log would.

A gateway that loses Redis falls back to its own in-process windows at once, logs it once, and
says so in a metric (``on_shared(False)``); it tries Redis again every ``RETRY_SECONDS`` and says
when it is back.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from fleetserve.gateway.ratelimit import WINDOW_SECONDS, Decision, LimitKind, Limits, RateLimiter, Reservation

log = logging.getLogger("fleetserve.gateway")

RETRY_SECONDS = 5.0
"""How long a gateway that lost Redis keeps to its own windows before trying Redis again."""

REDIS_TIMEOUT = 0.5
"""Seconds a Redis call may take before the gateway counts Redis as lost."""


@dataclass(frozen=True)
class SharedReservation:
    """Tokens reserved in Redis: the key, the second they were counted in, how many."""

    key: str
    second: int
    reserved: int


Held = Reservation | SharedReservation


class Windows(Protocol):
    """Rate-limit windows: admit a request (reserving tokens), settle it from its real usage."""

    async def admit(self, key: str, limits: Limits, reserve: int) -> tuple[Decision, Held | None]: ...

    async def settle(self, held: Held, tokens: int) -> None: ...

    async def aclose(self) -> None: ...


class LocalWindows:
    """This process's own windows (``RateLimiter``) on the monotonic clock."""

    def __init__(self) -> None:
        self.limiter = RateLimiter()

    async def admit(self, key: str, limits: Limits, reserve: int) -> tuple[Decision, Held | None]:
        return self.limiter.admit(key, limits, time.monotonic(), reserve)

    async def settle(self, held: Held, tokens: int) -> None:
        if isinstance(held, Reservation):
            self.limiter.settle(held, tokens, time.monotonic())
        else:  # reserved in Redis before it was lost: count here what was used
            self.limiter.record_tokens(held.key, tokens, time.monotonic())

    async def aclose(self) -> None:
        return None


# KEYS: requests hash, tokens hash. ARGV: rpm, tpm (-1: none), tokens to reserve, window seconds.
# Returns {1, second} when admitted, {0, wait in ms, 1 for requests or 2 for tokens} when not.
_ADMIT = """
local clock = redis.call('TIME')
local now = tonumber(clock[1]) + tonumber(clock[2]) / 1e6
local second = tonumber(clock[1])
local rpm, tpm = tonumber(ARGV[1]), tonumber(ARGV[2])
local reserve, window = tonumber(ARGV[3]), tonumber(ARGV[4])
local function load(key)
  local flat = redis.call('HGETALL', key)
  local seconds, stale, total = {}, {}, 0
  for i = 1, #flat, 2 do
    local s, n = tonumber(flat[i]), tonumber(flat[i + 1])
    if s + 1 + window <= now then
      stale[#stale + 1] = flat[i]
    else
      seconds[#seconds + 1] = {s, n}
      total = total + n
    end
  end
  if #stale > 0 then redis.call('HDEL', key, unpack(stale)) end
  table.sort(seconds, function(a, b) return a[1] < b[1] end)
  return seconds, total
end
local function wait(seconds, total, limit)
  if total < limit then return nil end
  if limit == 0 then return window end
  local left = total
  for _, s in ipairs(seconds) do
    left = left - s[2]
    if left < limit then return math.max(s[1] + 1 + window - now, 0.001) end
  end
  return window
end
local worst, which = nil, 0
if rpm >= 0 then
  local seconds, total = load(KEYS[1])
  local w = wait(seconds, total, rpm)
  if w then worst, which = w, 1 end
end
if tpm >= 0 then
  local seconds, total = load(KEYS[2])
  local w = wait(seconds, total, tpm)
  if w and (worst == nil or w > worst) then worst, which = w, 2 end
end
if worst then return {0, math.ceil(worst * 1000), which} end
if rpm >= 0 then
  redis.call('HINCRBY', KEYS[1], second, 1)
  redis.call('EXPIRE', KEYS[1], window + 2)
end
if tpm >= 0 and reserve > 0 then
  redis.call('HINCRBY', KEYS[2], second, reserve)
  redis.call('EXPIRE', KEYS[2], window + 2)
end
return {1, second}
"""

# KEYS: tokens hash. ARGV: the reservation's second, tokens reserved, tokens used, window seconds.
_SETTLE = """
local clock = redis.call('TIME')
local now = tonumber(clock[1]) + tonumber(clock[2]) / 1e6
local second, reserved, used = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local window = tonumber(ARGV[4])
if second + 1 + window > now and redis.call('HEXISTS', KEYS[1], second) == 1 then
  redis.call('HINCRBY', KEYS[1], second, used - reserved)
elseif used > 0 then
  redis.call('HINCRBY', KEYS[1], tonumber(clock[1]), used)
end
redis.call('EXPIRE', KEYS[1], window + 2)
return 1
"""


class RedisWindows:
    """Windows shared by every gateway in one Redis, falling back to this process's own."""

    def __init__(
        self,
        url: str,
        *,
        namespace: str = "fleetserve",
        on_shared: Callable[[bool], None] | None = None,
        client: aioredis.Redis | None = None,
    ) -> None:
        self.url = url
        self._redis = client or aioredis.Redis.from_url(
            url, socket_timeout=REDIS_TIMEOUT, socket_connect_timeout=REDIS_TIMEOUT
        )
        self._admit = self._redis.register_script(_ADMIT)
        self._settle = self._redis.register_script(_SETTLE)
        self._prefix = f"{namespace}:ratelimit:"
        self.local = LocalWindows()
        self._on_shared = on_shared
        self._lost_until: float | None = None
        if on_shared is not None:
            on_shared(True)

    @property
    def shared(self) -> bool:
        """Whether the windows are in Redis now (False while fallen back to this process's own)."""
        return self._lost_until is None

    def _usable(self) -> bool:
        return self._lost_until is None or time.monotonic() >= self._lost_until

    def _lost(self, exc: BaseException) -> None:
        if self._lost_until is None:
            log.warning(
                "lost Redis at %s (%s): rate limits fall back to this gateway's own windows",
                _safe(self.url),
                exc,
            )
            if self._on_shared is not None:
                self._on_shared(False)
        self._lost_until = time.monotonic() + RETRY_SECONDS

    def _back(self) -> None:
        if self._lost_until is not None:
            self._lost_until = None
            log.warning("Redis at %s answers again: rate limits are shared again", _safe(self.url))
            if self._on_shared is not None:
                self._on_shared(True)

    async def admit(self, key: str, limits: Limits, reserve: int) -> tuple[Decision, Held | None]:
        if not self._usable():
            return await self.local.admit(key, limits, reserve)
        rpm = -1 if limits.rpm is None else limits.rpm
        tpm = -1 if limits.tpm is None else limits.tpm
        keys = [f"{self._prefix}{key}:requests", f"{self._prefix}{key}:tokens"]
        try:
            answer = await self._admit(keys=keys, args=[rpm, tpm, reserve, int(WINDOW_SECONDS)])
        except (RedisError, OSError) as exc:
            self._lost(exc)
            return await self.local.admit(key, limits, reserve)
        self._back()
        if int(answer[0]) == 1:
            held = SharedReservation(key, int(answer[1]), reserve) if limits.tpm is not None else None
            return Decision(True), held
        which = LimitKind.REQUESTS if int(answer[2]) == 1 else LimitKind.TOKENS
        return Decision(False, max(int(answer[1]) / 1000, 0.001), which), None

    async def settle(self, held: Held, tokens: int) -> None:
        if isinstance(held, Reservation) or not self._usable():
            await self.local.settle(held, tokens)
            return
        try:
            await self._settle(
                keys=[f"{self._prefix}{held.key}:tokens"],
                args=[held.second, held.reserved, tokens, int(WINDOW_SECONDS)],
            )
        except (RedisError, OSError) as exc:
            self._lost(exc)
            await self.local.settle(held, tokens)
            return
        self._back()

    async def aclose(self) -> None:
        await self._redis.aclose()


def _safe(url: str) -> str:
    """A Redis URL without its password, for logs."""
    scheme, sep, rest = url.partition("://")
    if not sep or "@" not in rest:
        return url
    return f"{scheme}://***@{rest.rpartition('@')[2]}"
