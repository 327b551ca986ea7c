"""The cache-aware scorer (``picker.pick_cache_aware``) as a table, its balance guard on a hot
prefix, round robin, and the routing policy a deployment's spec gives."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from fleetserve.gateway.picker import Endpoint, Load, pick_cache_aware, pick_round_robin
from fleetserve.gateway.prefixcache import BLOCK_TOKENS, PrefixCaches, block_keys
from fleetserve.spec.policies import RoutingPolicy


def ep(name: str, weight: float = 1.0) -> Endpoint:
    return Endpoint(replica=name, url=f"http://{name}:8080", weight=weight)


THREE = [ep("a"), ep("b"), ep("c")]
P = 2000  # prompt tokens

SCORED = [
    # (sentence, endpoints, loads, cached, exclude, expected replica, expected cached tokens)
    ("the replica holding the prefix wins at equal load", THREE, {}, {"b": 1600}, (), "b", 1600),
    ("the longest cached prefix wins", THREE, {}, {"a": 800, "b": 1600}, (), "b", 1600),
    (
        "a whole-prompt hit outweighs one queued request",
        [ep("a"), ep("b")],
        {"b": Load(1)},
        {"b": P},
        (),
        "b",
        P,
    ),
    (
        "a whole-prompt hit does not outweigh three queued requests",
        THREE,
        {"b": Load(3), "c": Load(3)},
        {"b": P},
        (),
        "a",
        0,
    ),
    (
        "past (1+eps)*mean+1 the balance guard discounts a replica's cache: the next best wins",
        THREE,
        {"a": Load(4), "b": Load(1), "c": Load(2)},
        {"a": P, "c": P},
        (),
        "c",
        P,
    ),
    (
        "with nothing cached it is least outstanding work",
        THREE,
        {"a": Load(2), "b": Load(1), "c": Load(3)},
        {},
        (),
        "b",
        0,
    ),
    (
        "fresh engine-reported waiting requests count as load",
        [ep("a"), ep("b")],
        {"a": Load(0, 4, 0.5)},
        {"a": 1000},
        (),
        "b",
        0,
    ),
    (
        "a fuller KV cache breaks a tie towards the emptier one",
        [ep("a"), ep("b")],
        {"a": Load(0, 0, 0.5, 0.9), "b": Load(0, 0, 0.5, 0.1)},
        {},
        (),
        "b",
        0,
    ),
    (
        "a stale KV usage is ignored",
        [ep("a"), ep("b")],
        {"a": Load(0, 0, 9.0, 0.9), "b": Load(0, 0, 1.0, 0.1)},
        {},
        (),
        "a",
        0,
    ),
    (
        "weight: an H100 replica with the prefix and 3 in flight beats an idle CPU replica",
        [ep("h100", 4.0), ep("cpu", 1.0)],
        {"h100": Load(3)},
        {"h100": P},
        (),
        "h100",
        P,
    ),
    (
        "a cached prefix on an excluded replica is not used",
        THREE,
        {"a": Load(1)},
        {"b": P},
        ("b",),
        "c",
        0,
    ),
    (
        "cached tokens past the prompt count as the whole prompt",
        [ep("a"), ep("b")],
        {},
        {"a": 5 * P},
        (),
        "a",
        P,
    ),
]


@pytest.mark.parametrize(
    ("endpoints", "loads", "cached", "exclude", "expected", "tokens"),
    [c[1:] for c in SCORED],
    ids=[c[0] for c in SCORED],
)
def test_cache_aware_scorer(endpoints, loads, cached, exclude, expected, tokens):
    chosen = pick_cache_aware(endpoints, loads, cached, P, random.Random(7), exclude=frozenset(exclude))
    assert chosen is not None
    assert (chosen.endpoint.replica, chosen.cached_tokens) == (expected, tokens)


def test_a_lone_replica_is_chosen_whatever_its_load_its_cache_counted():
    chosen = pick_cache_aware([ep("a")], {"a": Load(9)}, {"a": P}, P, random.Random(1))
    assert chosen is not None and (chosen.endpoint.replica, chosen.cached_tokens, chosen.outstanding) == (
        "a",
        P,
        9,
    )


def test_all_excluded_gives_none_and_bad_parameters_are_refused():
    assert pick_cache_aware(THREE, {}, {}, P, random.Random(1), exclude=frozenset("abc")) is None
    with pytest.raises(ValueError, match="epsilon"):
        pick_cache_aware(THREE, {}, {}, P, random.Random(1), epsilon=-1)
    with pytest.raises(ValueError, match="load_weight"):
        pick_cache_aware(THREE, {}, {}, P, random.Random(1), load_weight=0)
    with pytest.raises(ValueError, match="repeat"):
        pick_cache_aware([ep("a"), ep("a")], {}, {}, P, random.Random(1))


def test_a_hot_prefix_spills_to_every_replica_which_learns_it_and_load_stays_bounded():
    """One prompt for every request, none finishing: the guard spreads them, each replica that
    takes one learns the prefix, and no replica's work passes the guard's bound by more than one."""
    endpoints = THREE
    caches = PrefixCaches()
    keys = block_keys(b"s" * (P * 4))
    in_flight = {e.replica: 0 for e in endpoints}
    rng = random.Random(3)
    for _ in range(60):
        loads = {name: Load(n) for name, n in in_flight.items()}
        cached = {e.replica: caches.cached_tokens(e.replica, keys) for e in endpoints}
        chosen = pick_cache_aware(endpoints, loads, cached, P, rng)
        assert chosen is not None
        caches.learn(chosen.endpoint.replica, keys)
        in_flight[chosen.endpoint.replica] += 1
        mean = sum(in_flight.values()) / len(in_flight)
        assert max(in_flight.values()) <= 1.25 * mean + 2
    assert all(caches.cached_tokens(e.replica, keys) == len(keys) * BLOCK_TOKENS for e in endpoints)
    assert max(in_flight.values()) - min(in_flight.values()) <= 3


def test_a_hot_prefix_with_requests_finishing_stays_mostly_on_its_replica():
    """At low load (one request at a time) the prefix's replica keeps it: no spill is needed."""
    caches = PrefixCaches()
    keys = block_keys(b"h" * (P * 4))
    picked = []
    for _ in range(20):
        cached = {e.replica: caches.cached_tokens(e.replica, keys) for e in THREE}
        chosen = pick_cache_aware(THREE, {}, cached, P, random.Random(5))
        assert chosen is not None
        caches.learn(chosen.endpoint.replica, keys)
        picked.append(chosen.endpoint.replica)
    assert len(set(picked)) == 1


@settings(max_examples=200, deadline=None)
@given(
    work=st.lists(st.integers(0, 20), min_size=1, max_size=6),
    hits=st.lists(st.integers(0, 3000), min_size=6, max_size=6),
    excluded=st.sets(st.integers(0, 5)),
    seed=st.integers(0, 1000),
)
def test_never_an_excluded_replica_and_never_one_past_the_guard_for_its_cache(work, hits, excluded, seed):
    endpoints = [ep(f"r{i}") for i in range(len(work))]
    loads = {f"r{i}": Load(w) for i, w in enumerate(work)}
    cached = {f"r{i}": hits[i] for i in range(len(work))}
    exclude = frozenset(f"r{i}" for i in excluded)
    chosen = pick_cache_aware(endpoints, loads, cached, P, random.Random(seed), exclude=exclude)
    live = [e for e in endpoints if e.replica not in exclude]
    if not live:
        assert chosen is None
        return
    assert chosen is not None and chosen.endpoint.replica not in exclude
    mean = sum(loads[e.replica].in_flight for e in live) / len(live)
    if chosen.cached_tokens > 0:
        assert loads[chosen.endpoint.replica].in_flight <= 1.25 * mean + 1


def test_round_robin_goes_in_turn_skipping_the_excluded():
    assert [pick_round_robin(THREE, t).replica for t in range(4)] == ["a", "b", "c", "a"]  # type: ignore[union-attr]
    assert pick_round_robin(THREE, 1, exclude=frozenset({"b"})).replica == "c"  # type: ignore[union-attr]
    assert pick_round_robin(THREE, 0, exclude=frozenset("abc")) is None


@pytest.mark.parametrize(
    ("routing", "expected"),
    [
        ({}, "cache-aware"),
        ({"prefixAffinity": True}, "prefix-hash"),
        ({"policy": "least-load"}, "least-load"),
        ({"policy": "round-robin"}, "round-robin"),
        ({"policy": "prefix-hash", "prefixAffinity": True}, "prefix-hash"),
    ],
)
def test_the_routing_policy_of_a_spec(routing, expected):
    assert RoutingPolicy.model_validate(routing).effective_policy == expected


def test_prefix_affinity_with_another_policy_is_refused():
    with pytest.raises(ValidationError, match="prefixAffinity"):
        RoutingPolicy.model_validate({"prefixAffinity": True, "policy": "cache-aware"})
    with pytest.raises(ValidationError):
        RoutingPolicy.model_validate({"policy": "random"})
