"""What to evict when the cache is over its budget: a pure decision, no disk, no clock, no lock.

The input is what the cache holds (``Held``: each model's blobs with their sizes, its last use,
whether running replicas pin it), the budget in bytes and the model just fetched; the output is an
``EvictionPlan``: the models to evict in order and, when the budget cannot be met, an ``OverCap``
saying what holds the bytes. The rules:

- bytes are counted per blob: a blob two models share counts once, and is freed only when the
  last model naming it goes;
- the least recently used model goes first, one at a time, until the held bytes fit the budget;
- never a pinned model, nor the one just fetched; nor a model whose every blob a protected model
  shares (evicting it would free nothing, only lose it);
- when nothing evictable is left and the bytes still exceed the budget, the cache stays over it
  and says why (the pins, the model just fetched) rather than fail the download.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from fleetserve.units import format_bytes


@dataclass(frozen=True)
class Held:
    """One cached model as the eviction decision sees it: its blobs (digest → size), last use, pin."""

    name: str
    blobs: Mapping[str, int]
    last_used: float
    pinned: bool = False


@dataclass(frozen=True)
class OverCap:
    """Why the cache stays over its budget: the bytes held, and which models keep them."""

    total: int
    budget: int
    pinned: tuple[str, ...]
    # The model just fetched, when it is not pinned too (it is never evicted by its own insert).
    just_fetched: str | None = None

    def message(self, root: Path) -> str:
        """The sentence the cache logs and reports for the cache directory ``root``."""
        reasons = []
        if self.pinned:
            reasons.append(f"pinned by running replicas: {', '.join(self.pinned)}")
        if self.just_fetched is not None:
            reasons.append(f"just fetched: {self.just_fetched}")
        return (
            f"model cache {root} holds {format_bytes(self.total)} ({self.total} bytes), over its cap of "
            f"{format_bytes(self.budget)} ({self.budget} bytes); what is left cannot be evicted "
            f"({'; '.join(reasons) or 'shared blobs'})"
        )


@dataclass(frozen=True)
class EvictionPlan:
    """The models to evict, least recently used first, the bytes held after, and any overrun."""

    evict: tuple[str, ...]
    total: int
    over_cap: OverCap | None


def held_bytes(held: Iterable[Held]) -> int:
    """The bytes of the blobs the models name, each blob once."""
    sizes: dict[str, int] = {}
    for h in held:
        sizes.update(h.blobs)
    return sum(sizes.values())


def over_cap(held: Sequence[Held], budget: int | None, keep: str | None = None) -> OverCap | None:
    """Why ``held`` exceeds ``budget`` (``keep``: the model just fetched), or None when it fits."""
    total = held_bytes(held)
    if budget is None or total <= budget:
        return None
    pinned = tuple(sorted(h.name for h in held if h.pinned))
    just_fetched = (
        keep if keep is not None and keep not in pinned and any(h.name == keep for h in held) else None
    )
    return OverCap(total, budget, pinned, just_fetched)


def plan_eviction(held: Sequence[Held], budget: int | None, keep: str | None = None) -> EvictionPlan:
    """Which of ``held`` to evict to fit ``budget`` bytes (None: no budget), never ``keep``."""
    left = list(held)
    evicted: list[str] = []
    while budget is not None and held_bytes(left) > budget:
        protected = {d for h in left if h.name == keep or h.pinned for d in h.blobs}
        candidates = [h for h in left if h.name != keep and not h.pinned and set(h.blobs) - protected]
        if not candidates:
            break
        victim = min(candidates, key=lambda h: h.last_used)
        evicted.append(victim.name)
        left = [h for h in left if h.name != victim.name]
    return EvictionPlan(tuple(evicted), held_bytes(left), over_cap(left, budget, keep))
