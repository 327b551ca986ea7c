"""The eviction decision as a pure function: what the cache holds and a budget in, what to evict out.

No disk and no cache: each case is a table row of models (blobs with sizes, last use, pin), the
budget and the model just fetched, and the plan expected.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from fleetserve.agent.cache.eviction import EvictionPlan, Held, OverCap, held_bytes, over_cap, plan_eviction


def model(name: str, last_used: float, *blobs: tuple[str, int], pinned: bool = False) -> Held:
    """A held model; without blobs, one blob of 50 bytes named after the model."""
    return Held(name, dict(blobs or ((f"blob-{name}", 50),)), last_used, pinned)


@dataclass(frozen=True)
class Case:
    name: str
    held: tuple[Held, ...]
    budget: int | None
    keep: str | None
    plan: EvictionPlan


A, B, C, D = model("a", 1), model("b", 2), model("c", 3), model("d", 4)

CASES = [
    Case("without a budget nothing is evicted", (A, B, C), None, "c", EvictionPlan((), 150, None)),
    Case("a cache within its budget evicts nothing", (A, B, C), 150, "c", EvictionPlan((), 150, None)),
    Case(
        "the least recently used model goes first",
        (A, B, C),
        120,
        "c",
        EvictionPlan(("a",), 100, None),
    ),
    Case(
        "models go one at a time, least recent first, until the bytes fit",
        (C, A, D, B),
        60,
        "d",
        EvictionPlan(("a", "b", "c"), 50, None),
    ),
    Case(
        "equal last uses: the first one held goes first",
        (model("x", 1), model("y", 1), model("z", 2)),
        100,
        "z",
        EvictionPlan(("x",), 100, None),
    ),
    Case(
        "a pinned model survives though least recently used; the next one goes",
        (model("a", 1, pinned=True), B, C),
        120,
        "c",
        EvictionPlan(("b",), 100, None),
    ),
    Case(
        "the model just fetched is never evicted by its own insert, however old its last use",
        (model("a", 1), model("b", 2)),
        60,
        "a",
        EvictionPlan(("b",), 50, None),
    ),
    Case(
        "when pins keep the cache over its budget it stays over and names the pins and the new model",
        (model("a", 1, pinned=True), model("b", 2, pinned=True), C),
        120,
        "c",
        EvictionPlan((), 150, OverCap(150, 120, ("a", "b"), "c")),
    ),
    Case(
        "a pinned model just fetched is named once, as pinned",
        (model("a", 1, pinned=True),),
        10,
        "a",
        EvictionPlan((), 50, OverCap(50, 10, ("a",), None)),
    ),
    Case(
        "a blob two models share counts once",
        (model("a", 1, ("x", 50)), model("twin", 2, ("x", 50))),
        60,
        "twin",
        EvictionPlan((), 50, None),
    ),
    Case(
        "a shared blob is freed only when the last model naming it goes",
        (model("a", 1, ("x", 50)), model("b", 2, ("x", 50)), model("c", 3, ("y", 50))),
        60,
        "c",
        EvictionPlan(("a", "b"), 50, None),
    ),
    Case(
        "a model whose every blob a pinned model shares frees nothing and is kept",
        (model("a", 1, ("x", 50)), model("b", 2, ("x", 50), pinned=True), model("c", 3, ("y", 50))),
        60,
        "c",
        EvictionPlan((), 100, OverCap(100, 60, ("b",), "c")),
    ),
    Case(
        "a whole repository counts every file and goes as one",
        (model("repo", 1, ("p", 30), ("q", 30)), model("c", 2)),
        60,
        "c",
        EvictionPlan(("repo",), 50, None),
    ),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_the_eviction_plan(case: Case) -> None:
    assert plan_eviction(case.held, case.budget, keep=case.keep) == case.plan


@pytest.mark.parametrize(
    ("held", "budget", "keep", "expected"),
    [
        ((A, B), 100, None, None),
        ((A, B), None, None, None),
        ((A, model("b", 2, pinned=True)), 60, None, OverCap(100, 60, ("b",), None)),
        ((A, B), 60, "b", OverCap(100, 60, (), "b")),
        ((A, B), 60, "gone", OverCap(100, 60, (), None)),
    ],
    ids=[
        "a cache at its budget is not over it",
        "a cache without a budget is never over it",
        "over the budget: the pinned models are named",
        "over the budget: the model just fetched is named",
        "a model just fetched that is no longer held is not named",
    ],
)
def test_whether_and_why_the_cache_is_over_its_budget(
    held: tuple[Held, ...], budget: int | None, keep: str | None, expected: OverCap | None
) -> None:
    assert over_cap(held, budget, keep) == expected


def test_the_bytes_held_count_each_blob_once() -> None:
    assert held_bytes([model("a", 1, ("x", 10), ("y", 20)), model("b", 2, ("y", 20), ("z", 5))]) == 35
    assert held_bytes([]) == 0


@pytest.mark.parametrize(
    ("over", "fragments"),
    [
        (
            OverCap(150, 120, ("a", "b"), "c"),
            ["(150 bytes)", "(120 bytes)", "pinned by running replicas: a, b; just fetched: c"],
        ),
        (OverCap(100, 60, (), None), ["(100 bytes)", "(shared blobs)"]),
    ],
    ids=["pins and the model just fetched", "neither: shared blobs"],
)
def test_the_overrun_names_the_cache_its_bytes_and_what_holds_them(
    over: OverCap, fragments: list[str]
) -> None:
    message = over.message(Path("/var/cache/models"))
    assert message.startswith("model cache /var/cache/models holds ")
    for fragment in fragments:
        assert fragment in message
