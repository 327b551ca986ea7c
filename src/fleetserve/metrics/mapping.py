"""Which engine metric feeds each canonical signal: the ``MetricMapping`` value every engine's row
carries (``fleetserve.engines``) and configuration builds (``fleetserve.metrics.engine``).

It imports nothing of fleetserve's, so the engine rows can hold their mappings without a cycle.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from enum import StrEnum


class Signal(StrEnum):
    """A canonical engine signal; each value is also the ``MetricMapping`` field that feeds it."""

    RUNNING = "running"
    WAITING = "waiting"
    KV_CACHE_USAGE = "kv_cache_usage"
    PROMPT_TOKENS = "prompt_tokens"
    GENERATION_TOKENS = "generation_tokens"
    TTFT = "ttft"


@dataclass(frozen=True)
class MetricMapping:
    """Which engine metric feeds each canonical signal; ``None`` is a blank: the engine has none.

    ``kv_cache_usage_fallbacks`` are older names of the KV metric, tried in order when the current
    one is absent. ``ttft`` names a histogram by its base name (without ``_bucket``).
    """

    running: str | None = None
    waiting: str | None = None
    kv_cache_usage: str | None = None
    kv_cache_usage_fallbacks: tuple[str, ...] = ()
    prompt_tokens: str | None = None
    generation_tokens: str | None = None
    ttft: str | None = None

    @property
    def is_empty(self) -> bool:
        """True when the mapping names nothing at all (which means vLLM's names)."""
        return all(not getattr(self, f.name) for f in fields(self))

    def names(self, signal: Signal) -> tuple[str, ...]:
        """The engine metric names for ``signal``, preferred first; empty when blank."""
        own: str | None = getattr(self, signal.value)
        first = (own,) if own else ()
        return first + self.kv_cache_usage_fallbacks if signal is Signal.KV_CACHE_USAGE else first
