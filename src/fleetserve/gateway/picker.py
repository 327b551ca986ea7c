"""Endpoint picking among a deployment's Ready replicas: least outstanding work, weighted by capacity.

Two ways to choose, both pure functions of (endpoints, loads, rng):

- **Least outstanding work.** A replica's outstanding work is the gateway's own in-flight count to
  it plus the engine's reported waiting requests when that metric is fresh. Its score is that work
  divided by its weight (relative capacity: an H100 replica 4.0, a CPU replica 1.0); the lowest
  score wins and ties are broken by the rng, so equal replicas share the load.
- **Prefix affinity** (``prefix-hash``). With a ``prefix_key`` the request goes to the key's
  replica on a consistent hash ring, so requests sharing a prompt prefix reuse one replica's KV
  cache, unless that replica is over its bounded-load capacity (Mirrokni, Thorup, Zadimoghaddam,
  "Consistent Hashing with Bounded Loads", 2018): then the next replica clockwise that is under
  it. Removing or adding one of n replicas moves only the keys of that replica (about 1/n of them).

- **Cache-aware** (``pick_cache_aware``). Each replica's cost is the share of the prompt it would
  prefill (the tokens not in its cache, as ``gateway.prefixcache`` models it) plus its load
  (outstanding work and KV usage) times ``load_weight``, divided by its weight; the cheapest wins.
  A replica whose outstanding work per weight exceeds ``(1 + epsilon) * mean + 1`` is not chosen
  for its cache (balance guard): it counts as holding nothing, so a hot prefix spills to the
  next-best replica, which then learns it too.
- **Round robin** (``pick_round_robin``): the benchmark's baseline, in turn regardless of load.

The gateway's in-flight count and the engine's waiting count can overlap (a request this gateway
sent may be waiting inside the engine): the overlap counts twice, which errs towards spreading.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import math
import random
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

VNODES_PER_WEIGHT = 100
"""Virtual nodes on the ring per unit of weight: a weight-4.0 replica gets 400 points."""

MAX_VNODES = 10_000
"""Cap on one replica's virtual nodes, so a huge weight cannot make the ring huge."""

FRESH_SECONDS = 5.0
"""Engine figures (a replica's running and waiting requests) older than this are stale: the picker
counts only the gateway's own in-flight requests, the autoscaler counts the replica as unmeasured."""

DEFAULT_BOUNDED_LOAD = 1.25

DEFAULT_EPSILON = 0.25
"""The cache-aware balance guard's slack: a replica may hold 25% more than the mean, plus one."""

DEFAULT_LOAD_WEIGHT = 0.5
"""What one outstanding request costs against a whole prompt's prefill: a full cache hit is worth
two requests' queue on the same replica (an engine batches, so a queued request is not a whole
wait; the prefill of a long prompt is most of a request's time to its first token)."""


@dataclass(frozen=True)
class Endpoint:
    """One Ready replica the gateway can send requests to, with its relative capacity and its
    engine's API key; or an Endpoint (``replica`` is ``endpoint/NAME``), with its API key and the
    name its server calls the model by (``upstream_model``: the request's ``"model"`` is sent as it)."""

    replica: str
    url: str
    weight: float = 1.0
    engine_key: str | None = field(default=None, repr=False)
    upstream_model: str | None = None
    # An Endpoint's key is a secret of someone else's server: an answer held whole that repeats it
    # has it replaced (``upstream.relay_answer``). A replica's engine key is fleetserve's own.
    redact: bool = False
    # The tokens its KV cache was sized for (placement's context for its profile); None: unknown.
    kv_tokens: int | None = None
    # The LoRA adapters its engine loaded, in load order (its agent's report).
    adapters: tuple[str, ...] = ()
    # Body fields the gateway sets in each request sent here: how its engine is told which adapter
    # the request chose, or none (``AdapterSupport.request_fields``). Not part of its hash.
    fields: Mapping[str, Any] | None = field(default=None, hash=False)
    # The most prompts its cache holds at once, where that bounds it (an engine caching per slot).
    kv_prompts: int | None = None

    def __post_init__(self) -> None:
        if not (math.isfinite(self.weight) and self.weight > 0):
            raise ValueError(
                f"endpoint {self.replica!r}: weight must be a positive number, got {self.weight}"
            )


@dataclass(frozen=True)
class Load:
    """What one replica has outstanding: the gateway's in-flight requests and the engine's queue.

    ``engine_waiting`` is the engine-reported number of waiting requests and ``metric_age`` how
    many seconds old that report is; either None means the gateway has no report.
    """

    in_flight: int
    engine_waiting: int | None = None
    metric_age: float | None = None
    # The engine's KV cache in use, 0-1, when it reports it (fresh with ``metric_age``).
    kv_usage: float | None = None

    def __post_init__(self) -> None:
        if self.in_flight < 0:
            raise ValueError(f"in_flight must not be negative, got {self.in_flight}")
        if self.engine_waiting is not None and self.engine_waiting < 0:
            raise ValueError(f"engine_waiting must not be negative, got {self.engine_waiting}")

    def outstanding(self, fresh_seconds: float = FRESH_SECONDS) -> int:
        """In-flight requests, plus the engine's waiting ones if reported at most ``fresh_seconds`` ago."""
        # A NaN age compares False and so counts as stale, like a missing one.
        fresh = self.metric_age is not None and self.metric_age <= fresh_seconds
        if fresh and self.engine_waiting is not None:
            return self.in_flight + self.engine_waiting
        return self.in_flight


IDLE = Load(in_flight=0)
"""The load of a replica the caller has no entry for."""


def load_bound(total_outstanding: int, weight: float, total_weight: float, bounded_load: float) -> int:
    """The most work a replica of ``weight`` may already hold and still take the next request.

    Mirrokni et al. give each of n bins the capacity ``ceil(c * (m + 1) / n)``, m the balls
    already placed; the weighted variant used here gives each replica its share of that by weight,
    ``ceil(c * (m + 1) * w / W)``, which is the paper's formula when all weights are equal. A
    replica qualifies when its outstanding work is strictly below its capacity, so that taking
    the request leaves it at most at capacity (with "at most" instead, one replica could take
    every request of a hot key and grow without bound). Because the capacities add up to at least
    ``c * (m + 1) > m`` for ``c >= 1``, some replica always qualifies.
    """
    return math.ceil(bounded_load * (total_outstanding + 1) * weight / total_weight)


def pick(
    endpoints: Sequence[Endpoint],
    loads: Mapping[str, Load],
    rng: random.Random,
    *,
    exclude: frozenset[str] = frozenset(),
    prefix_key: str | None = None,
    bounded_load: float = DEFAULT_BOUNDED_LOAD,
    fresh_seconds: float = FRESH_SECONDS,
) -> Endpoint | None:
    """The endpoint to send the next request to, or None when every endpoint is excluded.

    ``loads`` is keyed by replica name (a missing entry means idle); ``exclude`` names replicas
    that already failed this request. With ``prefix_key`` the choice is the consistent-hash
    replica of the key under bounded load (see ``load_bound``), else least outstanding work.
    """
    if bounded_load < 1:
        raise ValueError(f"bounded_load must be at least 1, got {bounded_load}")
    repeated = sorted(name for name, n in Counter(e.replica for e in endpoints).items() if n > 1)
    if repeated:
        raise ValueError(f"endpoints repeat replica names: {repeated}")
    candidates = [e for e in endpoints if e.replica not in exclude]
    if not candidates:
        return None
    work = {e.replica: loads.get(e.replica, IDLE).outstanding(fresh_seconds) for e in candidates}
    if prefix_key is not None:
        chosen = _affine(endpoints, candidates, work, prefix_key, bounded_load)
        if chosen is not None:
            return chosen
    return _least_outstanding(candidates, work, rng)


@dataclass(frozen=True)
class Pick:
    """A cache-aware pick and why: the replica, its expected cached tokens and its load."""

    endpoint: Endpoint
    cached_tokens: int
    outstanding: int


def pick_cache_aware(
    endpoints: Sequence[Endpoint],
    loads: Mapping[str, Load],
    cached: Mapping[str, int],
    prompt_tokens: int,
    rng: random.Random,
    *,
    exclude: frozenset[str] = frozenset(),
    epsilon: float = DEFAULT_EPSILON,
    load_weight: float = DEFAULT_LOAD_WEIGHT,
    fresh_seconds: float = FRESH_SECONDS,
) -> Pick | None:
    """The endpoint with the lowest expected cost for a prompt of ``prompt_tokens`` tokens, of
    which ``cached[replica]`` are believed cached there; None when every endpoint is excluded.

    cost = (prompt - cached) / prompt + load_weight * (outstanding + kv_usage) / weight, a
    guarded replica's cached taken as 0 (see the module's docstring); ties broken by ``rng``.
    The capacity weight divides the load, not the miss: with nothing cached anywhere this is least
    outstanding work per weight (least-load's rule, idle replicas tied whatever their weight),
    the KV usage breaking ties.
    """
    if epsilon < 0 or not math.isfinite(epsilon):
        raise ValueError(f"epsilon must be a non-negative number, got {epsilon}")
    if load_weight <= 0 or not math.isfinite(load_weight):
        raise ValueError(f"load_weight must be a positive number, got {load_weight}")
    repeated = sorted(name for name, n in Counter(e.replica for e in endpoints).items() if n > 1)
    if repeated:
        raise ValueError(f"endpoints repeat replica names: {repeated}")
    candidates = [e for e in endpoints if e.replica not in exclude]
    if not candidates:
        return None
    work = {e.replica: loads.get(e.replica, IDLE).outstanding(fresh_seconds) for e in candidates}
    mean = sum(work.values()) / sum(e.weight for e in candidates)
    bound = (1 + epsilon) * mean + 1
    prompt = max(1, prompt_tokens)
    scored: list[tuple[float, Endpoint, int]] = []
    for e in candidates:
        load = loads.get(e.replica, IDLE)
        guarded = work[e.replica] / e.weight > bound
        hit = 0 if guarded else min(prompt, max(0, cached.get(e.replica, 0)))
        kv = load.kv_usage if _fresh(load, fresh_seconds) and load.kv_usage is not None else 0.0
        kv = min(1.0, max(0.0, kv)) if math.isfinite(kv) else 0.0
        cost = (prompt - hit) / prompt + load_weight * (work[e.replica] + kv) / e.weight
        scored.append((cost, e, hit))
    best = min(s[0] for s in scored)
    # Ties keep the endpoints' order, so one seeded rng gives one answer.
    tied = [s for s in scored if s[0] == best]
    chosen = tied[0] if len(tied) == 1 else rng.choice(tied)
    _, endpoint, hit = chosen
    return Pick(endpoint, hit, work[endpoint.replica])


def pick_round_robin(
    endpoints: Sequence[Endpoint], turn: int, *, exclude: frozenset[str] = frozenset()
) -> Endpoint | None:
    """The ``turn``-th endpoint in turn among those not excluded, or None when all are."""
    candidates = [e for e in endpoints if e.replica not in exclude]
    return candidates[turn % len(candidates)] if candidates else None


def _fresh(load: Load, fresh_seconds: float) -> bool:
    return load.metric_age is not None and load.metric_age <= fresh_seconds


def _least_outstanding(
    candidates: Sequence[Endpoint], work: Mapping[str, int], rng: random.Random
) -> Endpoint:
    scores = [work[e.replica] / e.weight for e in candidates]
    best = min(scores)
    # Ties keep the endpoints' order, so one seeded rng gives one answer.
    tied = [e for e, s in zip(candidates, scores, strict=True) if s == best]
    return tied[0] if len(tied) == 1 else rng.choice(tied)


def _affine(
    endpoints: Sequence[Endpoint],
    candidates: Sequence[Endpoint],
    work: Mapping[str, int],
    prefix_key: str,
    bounded_load: float,
) -> Endpoint | None:
    # The ring holds every endpoint, excluded ones too: skipping an excluded replica while walking
    # gives the same answer as a ring without it, and one ring per endpoint set can be cached.
    ring = _ring(tuple(sorted((e.replica, e.weight) for e in endpoints)))
    by_name = {e.replica: e for e in candidates}
    total = sum(work.values())
    total_weight = sum(e.weight for e in candidates)
    for name in ring.walk(prefix_key):
        endpoint = by_name.get(name)
        if endpoint is None:
            continue
        if work[name] < load_bound(total, endpoint.weight, total_weight, bounded_load):
            return endpoint
    # Only reachable with float rounding at the bound: least outstanding work is the safe answer.
    return None


def stable_hash(text: str) -> int:
    """A 64-bit hash of ``text`` that is the same in every process and run (unlike ``hash()``)."""
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "big")


@dataclass(frozen=True)
class HashRing:
    """A consistent hash ring: sorted points, each owned by one replica."""

    points: tuple[int, ...]
    owners: tuple[str, ...]
    members: int

    def walk(self, key: str) -> Iterator[str]:
        """Each replica once, in the order met going clockwise from the key's point."""
        if not self.points:
            return
        start = bisect.bisect_left(self.points, stable_hash(key))
        seen: set[str] = set()
        for i in range(len(self.points)):
            owner = self.owners[(start + i) % len(self.points)]
            if owner not in seen:
                seen.add(owner)
                yield owner
                if len(seen) == self.members:
                    return


def vnodes(weight: float) -> int:
    """How many points a replica of ``weight`` gets on the ring: proportional, at least 1."""
    return max(1, min(MAX_VNODES, round(VNODES_PER_WEIGHT * weight)))


@functools.lru_cache(maxsize=256)
def _ring(members: tuple[tuple[str, float], ...]) -> HashRing:
    # A pure function of the endpoint set, cached because the set changes far less often than
    # requests arrive. A replica's points depend on its own name and weight only, which is what
    # keeps keys in place when other replicas come and go.
    points = sorted(
        (stable_hash(f"{name}#{i}"), name) for name, weight in members for i in range(vnodes(weight))
    )
    return HashRing(tuple(p for p, _ in points), tuple(n for _, n in points), len(members))


def prefix_key_for(messages_or_prompt: str | Sequence[Mapping[str, Any]], length: int = 256) -> str:
    """The first ``length`` characters of a prompt, or of chat messages flattened to text.

    Messages flatten to ``role\\ncontent\\n`` each; a content given as a list of parts contributes
    its text parts. Requests that share this key share a prompt prefix, and with it a KV cache.
    """
    if isinstance(messages_or_prompt, str):
        return messages_or_prompt[:length]
    pieces: list[str] = []
    size = 0
    for message in messages_or_prompt:
        piece = f"{message.get('role', '')}\n{_content_text(message.get('content'))}\n"
        pieces.append(piece)
        size += len(piece)
        if size >= length:
            break
    return "".join(pieces)[:length]


def _content_text(content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):
        return "".join(
            str(part.get("text", ""))
            for part in content
            if isinstance(part, Mapping) and part.get("type") == "text"
        )
    return ""
