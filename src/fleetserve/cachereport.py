"""What an engine says it holds in its prompt (KV) cache, as the observer hands it to the gateway's
cache model (``gateway.prefixcache``), whichever engine said it and however it reached the control
plane.

- **llama.cpp** answers ``GET /slots`` (``--slots``, with the replica's key): per slot its id, its
  context, whether it is processing, the task it last served and the tokens its cache holds now.
  The observer reads it beside ``/metrics`` (``engines/llamacpp.py`` reads the body).
- **vLLM** publishes KV cache events (``--kv-events-config``) on a socket of the node's loopback that
  its agent consumes (``agent/kvevents.py``); the agent reports the blocks held, their size and
  how often the whole cache was dropped in its status report (``protocol.KvCacheSummary``).

One ``CacheReport`` is one observation: ``seq`` moves with each, so a gateway corrects its model
once per observation, not once per request. Pure values, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_SLOTS = 256
"""The most slots read from one engine's answer (llama-server's ``--parallel`` is far below)."""


@dataclass(frozen=True)
class SlotState:
    """One llama-server slot: its id, its context in tokens, whether it is processing a request,
    the task it last served (None: none yet) and the tokens its cache holds."""

    id: int
    n_ctx: int
    processing: bool
    task: int | None
    tokens: int

    @property
    def holds(self) -> bool:
        """Whether the slot holds a prompt (one it is processing counts: its prompt is going in)."""
        return self.processing or self.tokens > 0


@dataclass(frozen=True)
class CacheReport:
    """One observation of what a replica's engine holds: the tokens its cache holds (None where it
    did not say), the tokens its KV holds at most where it said (None: placement's sizing stands),
    and for an engine caching per slot, its slots."""

    seq: int
    held_tokens: int | None = None
    capacity_tokens: int | None = None
    slots: tuple[SlotState, ...] | None = None
