"""What a request costs and how it is counted: its token reservation, and its accounting.

- Before a request is forwarded, a key with a tokens-per-minute limit reserves what the request
  may use (``reservation``: its completion budget and an estimate of its prompt); when its answer
  is in, the reservation is settled with the usage the engine reported, or with what was held
  (``held_reserved``) when the answer carried none.
- Every answered request, refusals included, is accounted once (``Accounting.account``): usage
  per minute, key and model in memory (``gateway.usage``, written to the store by
  ``gateway.usage_flush``), and the gateway's metrics (answer, queue depth, per key, per stream).
- ``Exchange`` is one request's bookkeeping across its tries, written by the proxy as the answer
  comes and read here.
"""

from __future__ import annotations

import time
from typing import Any

from fleetserve.gateway.admission import Admission
from fleetserve.gateway.endpoints import EndpointTable
from fleetserve.gateway.picker import Endpoint
from fleetserve.gateway.sse import UsageTap
from fleetserve.gateway.usage import UsageCounter
from fleetserve.gateway.windows import Held
from fleetserve.metrics.exposition import FleetMetrics
from fleetserve.store.credentials import ApiKey

# Tokens reserved for a request without max_tokens, until its real usage is known.
DEFAULT_RESERVE_TOKENS = 256
# Bytes of request body per prompt token, for the reservation's estimate of the prompt.
BYTES_PER_TOKEN = 4


def reservation(data: dict[str, Any], body: bytes) -> int:
    """Tokens to reserve for a request before its usage is known: its completion budget and prompt."""
    budget = data.get("max_tokens")
    if not isinstance(budget, int) or budget < 0:
        budget = data.get("max_completion_tokens")
    if not isinstance(budget, int) or budget < 0:
        budget = DEFAULT_RESERVE_TOKENS
    return budget + len(body) // BYTES_PER_TOKEN


def held_reserved(held: Held) -> int:
    """The tokens a reservation holds (settled as used when the answer had no usage)."""
    return held.reserved


class Exchange:
    """One request's bookkeeping across its tries: what was sent where, when, and what came back."""

    __slots__ = (
        "broken", "completion", "endpoint", "first_at", "last_at", "prompt", "sent_at", "tap", "usage_total",
    )  # fmt: skip

    def __init__(self) -> None:
        self.endpoint: Endpoint | None = None
        self.sent_at = 0.0
        self.first_at: float | None = None
        self.last_at = 0.0
        self.tap: UsageTap | None = None
        self.usage_total: int | None = None
        self.prompt = 0
        self.completion = 0
        self.broken = False  # a stream whose upstream broke off after its first byte


class Accounting:
    """Counts each answered request: into ``usage`` (none without a sink) and ``metrics`` (none
    without a registry), reading queue depths from ``admission`` and engines from ``table``."""

    def __init__(
        self,
        usage: UsageCounter | None,
        metrics: FleetMetrics | None,
        admission: Admission,
        table: EndpointTable,
    ) -> None:
        self.usage = usage
        self.metrics = metrics
        self.admission = admission
        self.table = table
        self._queue_depth: dict[str, int] = {}

    def account(
        self,
        key: ApiKey,
        model: str,
        deployment: str | None,
        status: int,
        started: float,
        ex: Exchange | None,
    ) -> None:
        """Count one answer with ``status`` to ``key`` for ``model`` (``deployment`` None: the
        model was not found), begun at ``started`` (monotonic), with what ``ex`` saw if forwarded."""
        usage = self.usage
        if usage is not None:  # one dict update; written to the store by the flusher
            usage.add(
                time.time(), key.id, model, ex.prompt if ex else 0, ex.completion if ex else 0,
                status >= 400 or (ex is not None and ex.broken),
            )  # fmt: skip
        metrics = self.metrics
        if metrics is None:
            return
        seconds = time.monotonic() - started
        if deployment is not None:
            metrics.gateway_answer(deployment, status, seconds)
            waiting = self.admission.depth(deployment).waiting
            if self._queue_depth.get(deployment) != waiting:  # a gauge: set only when it moved
                self._queue_depth[deployment] = waiting
                metrics.set_queue_depth(deployment, waiting)
        metrics.gateway_key_request(
            key.name, model, seconds, ex.prompt if ex else 0, ex.completion if ex else 0
        )
        if ex is not None and ex.first_at is not None and ex.endpoint is not None and deployment is not None:
            tap = ex.tap
            itl = None
            if tap is not None and tap.events > 2 and ex.last_at > ex.first_at:
                itl = (ex.last_at - ex.first_at) / (tap.events - 2)  # minus [DONE] and the first
            route = self.table.routes.get(deployment)
            engine = route.engines.get(ex.endpoint.replica, "") if route is not None else ""
            metrics.gateway_stream(deployment, ex.endpoint.replica, engine, ex.first_at - ex.sent_at, itl)
