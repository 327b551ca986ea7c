"""What a JSON body to ``/v1`` may hold before the gateway forwards it, per kind of route, and how
large a non-streamed engine answer it holds.

An engine's JSON parser may cost far more than the bytes it reads: llama-server's object parsing
is quadratic in the number of keys (one object of 80k keys: 20 s of CPU). The gateway parses the
body once (orjson, linear) and ``exceeded`` walks the parsed value, iteratively and stopping at
the first limit passed, checking:

- ``bytes``: the body's size (413);
- ``depth``: how deeply objects and arrays nest (400);
- ``keys``: the keys of any one object (400);
- ``total_keys``: the keys of all objects together, each object and array counting one more
  (400) — with ``keys`` it bounds the engine's quadratic cost, which grows with the sum of each
  object's keys squared, and the walk's own (a million empty objects are refused after 65,536).

Limits are per kind of route (``BodyKind``): embeddings and rerank carry large arrays of inputs,
shallow; every other route carries generation requests. Each refusal names the limit and the
``--body-limit KIND.LIMIT=VALUE`` flag that raises it. Pure: no I/O.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any

from fleetserve.engines.routes import RouteKind
from fleetserve.units import parse_bytes

# The largest body any route kind may be given (the gateway reads no more than this).
MAX_BODY_BYTES = 64 << 20
# A non-streamed engine answer larger than this is not relayed (502): the gateway holds it whole.
ANSWER_LIMIT = 64 << 20


class BodyKind(StrEnum):
    """Which limits a relayed route's bodies get: the route table's kinds (``engines/routes.py``)
    ``embeddings`` and ``rerank`` are EMBEDDINGS, every other GENERATION."""

    GENERATION = "generation"  # chat, completions, responses, messages, tokenize, templates
    EMBEDDINGS = "embeddings"  # embeddings, rerank: many inputs, shallow


def kind_of(route: RouteKind) -> BodyKind:
    """The body kind of a route of the engines' tables (anything not embeddings or rerank is held
    to generation's)."""
    return BodyKind.EMBEDDINGS if route in (RouteKind.EMBEDDINGS, RouteKind.RERANK) else BodyKind.GENERATION


@dataclass(frozen=True)
class BodyLimits:
    """The limits of one route kind's bodies."""

    bytes: int
    depth: int
    keys: int
    total_keys: int


DEFAULT_BODY_LIMITS: dict[BodyKind, BodyLimits] = {
    BodyKind.GENERATION: BodyLimits(bytes=8 << 20, depth=64, keys=1024, total_keys=65536),
    BodyKind.EMBEDDINGS: BodyLimits(bytes=8 << 20, depth=16, keys=256, total_keys=65536),
}


@dataclass(frozen=True)
class Exceeded:
    """A body past one of its limits: the status to answer and a message naming the limit."""

    status: int
    message: str
    code: str


def exceeded(value: Any, size: int, kind: BodyKind, limits: BodyLimits) -> Exceeded | None:
    """The first limit of ``kind`` the parsed body ``value`` (``size`` bytes) passes, or None."""

    def past(what: str, limit: str, bound: int, status: int = 400) -> Exceeded:
        return Exceeded(
            status,
            f"{what} {bound}, the limit of the gateway for {kind.value} requests "
            f"(an operator raises it with --body-limit {kind.value}.{limit}=N).",
            "request_too_large",
        )

    if size > limits.bytes:
        return past("Request body larger than", "bytes", limits.bytes, 413)
    container = type(value) is dict or type(value) is list
    total = 1 if container else 0  # each object and array counts one: a million empty ones are not free
    stack: list[tuple[Any, int]] = [(value, 1)] if container else []
    while stack:
        node, depth = stack.pop()
        if depth > limits.depth:
            return past("JSON nested deeper than", "depth", limits.depth)
        if type(node) is dict:
            count = len(node)
            if count > limits.keys:
                return past("A JSON object with more keys than", "keys", limits.keys)
            total += count
            children = node.values()
        else:
            children = node
        # The children's types tallied in C (Counter over map): an array of a million numbers
        # is not walked, and one of a million objects is refused before any is looked at.
        kinds = Counter(map(type, children))
        inner = kinds[dict] + kinds[list]
        total += inner
        if total > limits.total_keys:
            return past("More JSON objects, arrays and keys in all than", "total_keys", limits.total_keys)
        if inner:
            stack.extend((c, depth + 1) for c in children if type(c) is dict or type(c) is list)
    return None


def body_limits(
    settings: list[str], base: dict[BodyKind, BodyLimits] | None = None
) -> dict[BodyKind, BodyLimits]:
    """The limits per kind with ``settings`` (``KIND.LIMIT=VALUE``, e.g. ``generation.keys=4096``,
    ``embeddings.bytes=16MiB``) applied over ``base`` (the defaults); ValueError on a bad one."""
    table = dict(base if base is not None else DEFAULT_BODY_LIMITS)
    for setting in settings:
        name, eq, text = setting.partition("=")
        kind_name, dot, limit = name.strip().partition(".")
        kinds = {k.value: k for k in BodyKind}
        fields = ("bytes", "depth", "keys", "total_keys")
        if not eq or not dot or kind_name not in kinds or limit not in fields:
            raise ValueError(
                f"{setting!r}: write KIND.LIMIT=VALUE, KIND one of {', '.join(kinds)}, "
                f"LIMIT one of {', '.join(fields)} (e.g. generation.keys=4096)"
            )
        number = parse_bytes(text.strip()) if limit == "bytes" else int(text)
        if number < 1 or (limit == "bytes" and number > MAX_BODY_BYTES):
            raise ValueError(f"{setting!r}: from 1 to {MAX_BODY_BYTES} for bytes, at least 1 otherwise")
        kind = kinds[kind_name]
        table[kind] = replace(table[kind], **{limit: number})
    return table


@dataclass(frozen=True)
class GatewayLimits:
    """What the gateway accepts from a client and holds from an engine."""

    bodies: dict[BodyKind, BodyLimits]
    answer_bytes: int = ANSWER_LIMIT  # --max-answer-bytes: a non-streamed answer held whole

    @property
    def read_cap(self) -> int:
        """The most body bytes read from any client: the largest kind's ``bytes``."""
        return max(limits.bytes for limits in self.bodies.values())

    def check(self, value: Any, size: int, route: RouteKind) -> Exceeded | None:
        """The first limit the parsed body for a route of kind ``route`` passes, or None."""
        kind = kind_of(route)
        return exceeded(value, size, kind, self.bodies[kind])


DEFAULT_GATEWAY_LIMITS = GatewayLimits(DEFAULT_BODY_LIMITS)
