"""What a request costs and how it is counted: its token reservation, and its accounting.

- Before a request is forwarded, a key with a tokens-per-minute limit reserves what the request
  may use (``reservation``): what its deployment's engines may generate for it, read from
  whichever field carries its cap as each engine reads them (each engine row's ``cap_fields``: ``max_tokens``,
  ``max_completion_tokens``, ``max_output_tokens``, llama.cpp's ``n_predict``; times ``n``), the
  deployment's context when unbounded, plus an estimate of its prompt. When its answer is in, the
  reservation is settled (``settlement``) with the usage the engine reported, or with what was
  held (``held_reserved``) when the answer carried none or, from an engine that reports one
  sequence's usage (llama.cpp), when the request had several sequences (unless a stream's usage
  events count them all).
- Every answered request, refusals included, is accounted once (``Accounting.account``): usage
  per minute, key and model in memory (``gateway.usage``, written to the store by
  ``gateway.usage_flush``), and the gateway's metrics (answer, queue depth, per key, per stream).
- ``Exchange`` is one request's bookkeeping across its tries, written by the proxy as the answer
  comes and read here.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from typing import Any

from fleetserve.engines.registry import ENGINES
from fleetserve.engines.routes import RouteKind
from fleetserve.engines.spec import CapFields, EngineKind
from fleetserve.gateway.admission import Admission
from fleetserve.gateway.endpoints import EndpointTable, Route
from fleetserve.gateway.picker import Endpoint
from fleetserve.gateway.sse import UsageTap
from fleetserve.gateway.usage import UsageCounter
from fleetserve.gateway.windows import Held
from fleetserve.metrics.exposition import FleetMetrics
from fleetserve.store.credentials import ApiKey

# Tokens reserved per choice for a request the engine may answer until its context is full, where
# the deployment's context is not known to the gateway (a profile without ``context``: its engine
# starts with the model's own, read from the weights, which the gateway does not open).
DEFAULT_RESERVE_TOKENS = 256
# Bytes of request body per prompt token, for the reservation's estimate of the prompt.
BYTES_PER_TOKEN = 4
# Route kinds that generate no tokens: a request reserves its input's estimate only.
NOTHING_GENERATED = frozenset({RouteKind.EMBEDDINGS, RouteKind.RERANK})
# The most sequences (choices times prompts) one request is reserved for, and the most tokens per
# sequence where no context bounds them (llama.cpp reads a cap as a 32-bit int): a nonsense ``n``
# or cap cannot make a reservation past 2**47 tokens, which Redis's Lua (doubles) counts exactly.
MAX_SEQUENCES = 1 << 16
MAX_TOKENS_PER_SEQUENCE = (1 << 31) - 1


def _number(value: object, strings: bool) -> int | None:
    """``value`` as an engine reads an integer field, rounded up; None where it reads none."""
    if value is None or isinstance(value, bool):  # a boolean read as 0 or 1 would only shrink
        return None
    if isinstance(value, int):
        return value
    try:
        if isinstance(value, float):
            return math.ceil(value)
        if strings and isinstance(value, str):
            return math.ceil(float(value))
    except (ValueError, OverflowError):  # "nan", "inf", not a number
        return None
    return None


RESPONSES_ONLY = "max_output_tokens"
_KINDS = {k.value: k for k in EngineKind}


def _first(
    data: dict[str, Any], groups: tuple[tuple[str, ...], ...], strings: bool, responses: bool = False
) -> int | None:
    for group in groups:
        values = [
            n
            for name in group
            if (responses or name != RESPONSES_ONLY) and (n := _number(data.get(name), strings)) is not None
        ]
        if values:
            return max(values)
    return None


def _prompts(data: dict[str, Any]) -> int:
    """Prompts one request holds: a completions request's list of prompts is answered prompt by
    prompt (a list of token ids is one prompt)."""
    prompt = data.get("prompt")
    if isinstance(prompt, list):
        return max(1, sum(1 for p in prompt if isinstance(p, str | list | dict)))
    return 1


def completion_budget(
    data: dict[str, Any], fields: CapFields, context: int | None, responses: bool = False
) -> int:
    """Tokens an engine reading ``fields`` may generate for ``data`` (sent to the Responses API when
    ``responses``): its cap per choice (at most the ``context`` its replicas start with; that
    context when unbounded), times choices and prompts."""
    cap = _first(data, fields.cap, fields.strings, responses)
    if cap is None or cap < 0:  # unbounded: until the context is full
        per_sequence = DEFAULT_RESERVE_TOKENS if context is None else context
    else:
        per_sequence = min(max(cap, 1), MAX_TOKENS_PER_SEQUENCE if context is None else context)
    return per_sequence * sequences(data, fields)


def sequences(data: dict[str, Any], fields: CapFields) -> int:
    """Sequences an engine reading ``fields`` generates for ``data``: choices times prompts (never
    fewer than one, never more than ``MAX_SEQUENCES``)."""
    choices = _first(data, fields.choices, fields.strings)
    return min(MAX_SEQUENCES, max(1, choices or 1) * _prompts(data))


def reservation(
    data: dict[str, Any],
    body: bytes,
    engines: Iterable[EngineKind] = (),
    context: int | None = None,
    path: bytes = b"",
    kind: RouteKind = RouteKind.GENERATION,
) -> int:
    """Tokens to reserve for a request to ``path`` before its usage is known: the most any of
    ``engines`` (the deployment's; every known engine when none is named) may generate for it,
    within the deployment's ``context`` (None: not known here), plus an estimate of its prompt.
    Embeddings and reranking (``kind``) generate nothing: their inputs are all they count."""
    if kind in NOTHING_GENERATED:
        return len(body) // BYTES_PER_TOKEN
    rules = [ENGINES[e].cap_fields for e in engines if e in ENGINES] or [
        s.cap_fields for s in ENGINES.values()
    ]
    responses = path.endswith(b"/responses")
    budget = max(completion_budget(data, fields, context, responses) for fields in rules)
    return budget + len(body) // BYTES_PER_TOKEN


def held_reserved(held: Held) -> int:
    """The tokens a reservation holds (settled as used when the answer had no usage)."""
    return held.reserved


def answering_fields(route: Route, ex: Exchange) -> CapFields | None:
    """The cap fields of the engine that answered ``ex`` (None when no replica was tried)."""
    if ex.endpoint is None:
        return None
    kind = _KINDS.get(route.engines.get(ex.endpoint.replica, ""))
    rules = [ENGINES[k].cap_fields for k in ((kind,) if kind else route.engine_kinds) if k in ENGINES]
    # Not known which of several engines answered: the one whose usage says least.
    return next((f for f in rules if f.usage_per_sequence), rules[0] if rules else None)


def settlement(reserved: int, ex: Exchange, fields: CapFields | None, data: dict[str, Any]) -> int:
    """Tokens a request that reserved ``reserved`` is settled at, once answered by an engine
    reading ``fields``: the usage it reported (``ex``), or the reservation when it reported none.

    An engine whose usage is one sequence's (``usage_per_sequence``: llama.cpp) answering a
    request of several sequences (``n``, a list of prompts) would let a key generate past its
    limit if settled from that usage: a stream is settled from the sum of its usage events when
    there is one per sequence (and counted so in ``ex``), anything else at the reservation, which
    holds what every sequence may generate.
    """
    used = ex.usage_total
    if used is None:
        return reserved
    if used == 0 or fields is None or not fields.usage_per_sequence:
        return used
    wanted = sequences(data, fields)
    if wanted <= 1:
        return used
    tap = ex.tap
    if tap is not None and tap.summed is not None and tap.usage_events >= wanted:
        summed = tap.summed
        ex.usage_total, ex.prompt, ex.completion = summed.total, summed.prompt, summed.completion
        return summed.total
    return max(used, reserved)


class Exchange:
    """One request's bookkeeping across its tries: what was sent where, when, and what came back."""

    __slots__ = (
        "broken", "completion", "counts", "endpoint", "first_at", "last_at", "pick_header", "prompt",
        "sent_at", "tap", "usage_total",
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
        # The answer counts its tokens llama.cpp's own way (``UsageBy.COUNTS``), not in a usage object.
        self.counts = False
        # Why the replica was picked, for a client that asked (``x-fleetserve-debug: pick``).
        self.pick_header: bytes | None = None


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
