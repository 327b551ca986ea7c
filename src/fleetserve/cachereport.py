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

**When llama.cpp is asked** (``read_due``). ``GET /slots`` is a task on llama-server's queue like a
request (b11434, ``tools/server/server-queue.cpp``): it restarts the engine's idle timer (only a
metrics task does not), so an engine asked every second never sleeps (``--sleep-idle-seconds``),
and one sleeping is woken to answer. Each answer also restarts the one-second wait in which the
engine notices that a non-streamed request's client left. So the slots are read only when the
engine's own metrics (its ``/metrics``, a metrics task, answered from its cache while it sleeps)
show work since the last read (or, first, any work at all: a fresh engine's slots hold nothing):
at once when it has nothing running or waiting (its slots settled), at most every
``BUSY_READ_SECONDS`` while it works, and never while it stays idle.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_SLOTS = 256
"""The most slots read from one engine's answer (llama-server's ``--parallel`` is far below)."""

BUSY_READ_SECONDS = 10.0
"""How often at most a working engine's slots are read (see the module's docstring)."""


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


@dataclass(frozen=True)
class Activity:
    """What an engine's metrics say of its work at one scrape: its prompt and generated tokens so
    far (counters) and its requests running and waiting now."""

    prompt_tokens: float
    generation_tokens: float
    running: float
    waiting: float

    @property
    def busy(self) -> bool:
        return self.running > 0 or self.waiting > 0


def read_due(
    activity: Activity | None,
    last_read: tuple[Activity, float] | None,
    now: float,
    busy_every: float = BUSY_READ_SECONDS,
) -> bool:
    """Whether to ask the engine for its cache state now (module docstring): ``activity`` its
    latest metrics (None: none yet, so nothing to go by), ``last_read`` the activity when it was
    last asked and when (monotonic seconds; None: never)."""
    if activity is None:
        return False
    if last_read is None:  # never asked: worth asking once it has done any work at all
        return activity.busy or activity.prompt_tokens > 0 or activity.generation_tokens > 0
    seen, at = last_read
    if activity == seen:
        return False
    return not activity.busy or now - at >= busy_every
