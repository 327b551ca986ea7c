"""Endpoint picking: least outstanding work by weight, exclusions, and prefix affinity under bounded load."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetserve.gateway.picker import (
    Endpoint,
    Load,
    _ring,
    load_bound,
    pick,
    prefix_key_for,
    stable_hash,
    vnodes,
)


def ep(name: str, weight: float = 1.0) -> Endpoint:
    return Endpoint(replica=name, url=f"http://{name}:8080", weight=weight)


def rng() -> random.Random:
    return random.Random(7)


def ring_of(endpoints: list[Endpoint]):  # the same cached ring pick() walks
    return _ring(tuple(sorted((e.replica, e.weight) for e in endpoints)))


THREE = [ep("a"), ep("b"), ep("c")]
KEYS = [f"prompt number {i}: tell me about the fleet" for i in range(2000)]


# ---- least outstanding work ---------------------------------------------------------------------

LEAST = [
    # (sentence, endpoints, loads, exclude, expected)
    (
        "the replica with the fewest in-flight requests wins",
        THREE,
        {"a": Load(3), "b": Load(1), "c": Load(2)},
        (),
        "b",
    ),
    ("a replica without a load entry counts as idle", THREE, {"a": Load(3), "b": Load(1)}, (), "c"),
    (
        "fresh engine-reported waiting requests count as outstanding work",
        THREE,
        {"a": Load(1, 5, 0.5), "b": Load(2, 0, 0.5), "c": Load(3)},
        (),
        "b",
    ),
    (
        "a waiting count reported exactly fresh_seconds ago still counts",
        [ep("a"), ep("b")],
        {"a": Load(0, 9, 5.0), "b": Load(1)},
        (),
        "b",
    ),
    (
        "a stale waiting count is ignored",
        [ep("a"), ep("b")],
        {"a": Load(0, 9, 5.01), "b": Load(1)},
        (),
        "a",
    ),
    (
        "a waiting count without an age is ignored",
        [ep("a"), ep("b")],
        {"a": Load(0, 9, None), "b": Load(1)},
        (),
        "a",
    ),
    (
        "work is divided by weight: an H100 replica with 3 beats a CPU replica with 1",
        [ep("h100", 4.0), ep("cpu", 1.0)],
        {"h100": Load(3), "cpu": Load(1)},
        (),
        "h100",
    ),
    (
        "a heavier replica still loses once its share is larger",
        [ep("h100", 4.0), ep("cpu", 1.0)],
        {"h100": Load(5), "cpu": Load(1)},
        (),
        "cpu",
    ),
    (
        "an excluded replica is never returned, however idle",
        THREE,
        {"a": Load(0), "b": Load(4), "c": Load(9)},
        ("a",),
        "b",
    ),
    ("loads of unknown replicas are ignored", [ep("a")], {"zzz": Load(0), "a": Load(50)}, (), "a"),
]


@pytest.mark.parametrize(
    ("endpoints", "loads", "exclude", "expected"), [c[1:] for c in LEAST], ids=[c[0] for c in LEAST]
)
def test_least_outstanding_work(endpoints, loads, exclude, expected):
    chosen = pick(endpoints, loads, rng(), exclude=frozenset(exclude))
    assert chosen is not None
    assert chosen.replica == expected


@pytest.mark.parametrize(
    ("endpoints", "exclude"),
    [([], ()), (THREE, ("a", "b", "c")), (THREE, ("a", "b", "c", "unknown"))],
    ids=["no endpoints at all", "every endpoint excluded", "every endpoint and more excluded"],
)
def test_nothing_left_gives_none(endpoints, exclude):
    assert pick(endpoints, {}, rng(), exclude=frozenset(exclude)) is None
    assert pick(endpoints, {}, rng(), exclude=frozenset(exclude), prefix_key="k") is None


def test_equal_replicas_share_the_load_through_the_rng():
    r = random.Random(1)
    counts = Counter(pick(THREE, {}, r).replica for _ in range(3000))  # type: ignore[union-attr]
    assert set(counts) == {"a", "b", "c"}
    assert all(800 < n < 1200 for n in counts.values())


def test_the_same_seed_gives_the_same_choice():
    assert [pick(THREE, {}, random.Random(s)) for s in range(20)] == [
        pick(THREE, {}, random.Random(s)) for s in range(20)
    ]


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: pick([ep("a"), ep("a")], {}, rng()), "repeat replica names"),
        (lambda: pick(THREE, {}, rng(), bounded_load=0.9), "bounded_load"),
        (lambda: ep("a", 0.0), "weight"),
        (lambda: ep("a", math.nan), "weight"),
        (lambda: Load(-1), "in_flight"),
        (lambda: Load(0, -1, 0.0), "engine_waiting"),
    ],
    ids=[
        "two endpoints with one replica name are refused",
        "a load bound below 1 is refused",
        "a zero weight is refused",
        "a NaN weight is refused",
        "a negative in-flight count is refused",
        "a negative waiting count is refused",
    ],
)
def test_invalid_inputs_are_refused(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# ---- prefix affinity ----------------------------------------------------------------------------


def affine(endpoints, loads, key, **kw) -> str:
    chosen = pick(endpoints, loads, rng(), prefix_key=key, **kw)
    assert chosen is not None
    return chosen.replica


def test_the_same_key_maps_to_the_same_replica_while_loads_are_even():
    for loads in ({}, {"a": Load(2), "b": Load(2), "c": Load(2)}):
        homes = [affine(THREE, loads, k) for k in KEYS[:200]]
        assert homes == [affine(THREE, loads, k) for k in KEYS[:200]]
        assert homes == [ring_of(THREE).walk(k).__next__() for k in KEYS[:200]]
    # Different keys spread over every replica.
    assert set(homes) == {"a", "b", "c"}


def test_an_overloaded_home_sends_the_key_to_the_next_replica_clockwise():
    key = KEYS[0]
    order = list(ring_of(THREE).walk(key))
    loads = {order[0]: Load(10)}
    # total 10, three replicas: bound ceil(1.25 * 11 / 3) = 5; the home holds 10.
    assert load_bound(10, 1.0, 3.0, 1.25) == 5
    assert affine(THREE, loads, key) == order[1]


def test_an_excluded_home_sends_the_key_where_a_ring_without_it_would():
    for key in KEYS[:200]:
        home = next(ring_of(THREE).walk(key))
        rest = [e for e in THREE if e.replica != home]
        assert affine(THREE, {}, key, exclude=frozenset({home})) == next(ring_of(rest).walk(key))


@pytest.mark.parametrize("removed", ["r0", "r4", "r9"])
def test_removing_one_of_n_replicas_moves_only_its_keys(removed):
    endpoints = [ep(f"r{i}") for i in range(10)]
    before = {k: affine(endpoints, {}, k) for k in KEYS}
    after = {k: affine([e for e in endpoints if e.replica != removed], {}, k) for k in KEYS}
    moved = {k for k in KEYS if before[k] != after[k]}
    assert moved == {k for k in KEYS if before[k] == removed}
    assert len(moved) <= 2 * len(KEYS) / 10


def test_adding_a_replica_moves_only_the_keys_it_takes():
    endpoints = [ep(f"r{i}") for i in range(9)]
    before = {k: affine(endpoints, {}, k) for k in KEYS}
    after = {k: affine([*endpoints, ep("new")], {}, k) for k in KEYS}
    moved = {k for k in KEYS if before[k] != after[k]}
    assert all(after[k] == "new" for k in moved)
    assert len(moved) <= 2 * len(KEYS) / 10


def test_a_heavier_replica_owns_a_proportional_share_of_the_ring():
    endpoints = [ep("h100", 4.0), ep("cpu", 1.0)]
    assert (vnodes(4.0), vnodes(1.0), vnodes(0.001), vnodes(1e9)) == (400, 100, 1, 10_000)
    share = Counter(affine(endpoints, {}, k) for k in KEYS)["h100"] / len(KEYS)
    assert 0.7 < share < 0.9


def test_a_hot_key_spreads_without_any_replica_passing_the_bound():
    endpoints = [ep("a"), ep("b"), ep("c"), ep("d")]
    held = Counter[str]()
    for placed in range(200):
        chosen = affine(endpoints, {n: Load(c) for n, c in held.items()}, "one hot system prompt")
        # The chosen replica was below its capacity before taking this request.
        assert held[chosen] < load_bound(placed, 1.0, 4.0, 1.25)
        held[chosen] += 1
        assert max(held.values()) <= math.ceil(1.25 * (placed + 1) / 4)
    assert set(held) == {"a", "b", "c", "d"}


def test_the_ring_hash_is_stable_across_processes():
    assert stable_hash("fleetserve") == 17104234474175711921


# ---- properties ---------------------------------------------------------------------------------

NAMES = [f"r{i}" for i in range(8)]


@st.composite
def scenarios(draw):
    names = draw(st.lists(st.sampled_from(NAMES), unique=True, max_size=len(NAMES)))
    endpoints = [ep(n, draw(st.sampled_from([0.5, 1.0, 2.0, 4.0]))) for n in names]
    loads = {
        n: Load(
            draw(st.integers(0, 50)),
            draw(st.none() | st.integers(0, 50)),
            draw(st.none() | st.floats(0, 20)),
        )
        for n in draw(st.lists(st.sampled_from([*NAMES, "ghost"]), unique=True))
    }
    exclude = frozenset(draw(st.lists(st.sampled_from([*NAMES, "ghost"]), unique=True)))
    key = draw(st.none() | st.text(max_size=20))
    return endpoints, loads, exclude, key


@settings(max_examples=300, derandomize=True, database=None)
@given(scenarios(), st.integers(0, 2**32))
def test_pick_never_returns_an_excluded_or_unknown_endpoint(scenario, seed):
    endpoints, loads, exclude, key = scenario
    chosen = pick(endpoints, loads, random.Random(seed), exclude=exclude, prefix_key=key)
    candidates = [e for e in endpoints if e.replica not in exclude]
    if not candidates:
        assert chosen is None
        return
    assert chosen in candidates
    work = {e.replica: loads.get(e.replica, Load(0)).outstanding() for e in candidates}
    if key is None:
        # Least outstanding work: nothing scores strictly lower than the choice.
        assert all(work[chosen.replica] / chosen.weight <= work[e.replica] / e.weight for e in candidates)
    else:
        # Bounded load: the choice was under its capacity (one always is).
        total, weight = sum(work.values()), sum(e.weight for e in candidates)
        assert work[chosen.replica] < load_bound(total, chosen.weight, weight, 1.25)


@settings(max_examples=200, derandomize=True, database=None)
@given(st.lists(st.integers(0, 30), min_size=2, max_size=8, unique=True), st.integers(0, 2**32))
def test_without_ties_the_least_loaded_replica_always_wins(in_flight, seed):
    endpoints = [ep(f"r{i}") for i in range(len(in_flight))]
    loads = {f"r{i}": Load(n) for i, n in enumerate(in_flight)}
    chosen = pick(endpoints, loads, random.Random(seed))
    assert chosen == endpoints[in_flight.index(min(in_flight))]


# ---- prefix keys --------------------------------------------------------------------------------

PREFIXES = [
    ("a prompt is cut to its first N characters", "x" * 300, 256, "x" * 256),
    ("a short prompt is kept whole", "hello", 256, "hello"),
    (
        "chat messages flatten to role and content lines",
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        256,
        "system\nbe brief\nuser\nhi\n",
    ),
    (
        "content parts contribute their text parts only",
        [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "look "},
                    {"type": "image_url"},
                    {"type": "text", "text": "here"},
                ],
            }
        ],
        256,
        "user\nlook here\n",
    ),
    (
        "flattened messages are cut to N characters too",
        [{"role": "user", "content": "abcdef"}] * 100,
        10,
        "user\nabcde",
    ),
    (
        "a message without content contributes its role",
        [{"role": "assistant", "content": None}],
        256,
        "assistant\n\n",
    ),
]


@pytest.mark.parametrize(
    ("given_", "length", "expected"), [c[1:] for c in PREFIXES], ids=[c[0] for c in PREFIXES]
)
def test_prefix_keys(given_, length, expected):
    assert prefix_key_for(given_, length) == expected


def test_a_shared_system_prompt_gives_a_shared_prefix_key():
    system = {"role": "system", "content": "You are a helpful assistant. " * 20}
    one = prefix_key_for([system, {"role": "user", "content": "first question"}])
    two = prefix_key_for([system, {"role": "user", "content": "another question"}])
    assert one == two
    assert affine(THREE, {}, one) == affine(THREE, {}, two)
