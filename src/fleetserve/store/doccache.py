"""Parsed documents kept between reads, so a large fleet's unchanged rows are not parsed again.

Every second the gateway's routes and the observer's targets read every replica, and every cycle
the reconciler's snapshot reads every node and replica. Parsing thousands of stored JSON
documents into frozen pydantic values each time dominated the control plane's CPU at 5,000 nodes
(``bench/controlplane.py``). A ``ParseCache`` keeps, per key, the raw value it last parsed and
the result: a read whose raw value is equal (a C-level dict comparison) gets the same frozen
object back. Each full read replaces the kept set with the keys it saw, so the cache never holds
more than one read's rows.

Replica documents never change once allocated (only their state column does, which is not in the
document), and an allocation is told apart by its engine key, made anew by every allocation:
``ReplicaDocs`` keeps them by (name, engine key), so a read need not even fetch their JSON.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Iterable, Mapping
from typing import Any, Generic, TypeVar

from fleetserve.spec.resources import Replica, ReplicaState

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")

ReplicaKey = tuple[str, str | None]  # (name, engine key): one allocation


class ParseCache(Generic[K, T]):
    """Results of ``parse`` per key, reused while the raw value they came from is unchanged."""

    def __init__(self, parse: Callable[[Any], T]) -> None:
        self._parse = parse
        self._kept: dict[K, tuple[Any, T]] = {}
        self._lock = threading.Lock()

    def parse_all(self, rows: Iterable[tuple[K, Any]]) -> dict[K, T]:
        """Every row parsed (the kept result where its raw value is unchanged); the kept set
        becomes exactly these rows."""
        kept = self._kept
        fresh: dict[K, tuple[Any, T]] = {}
        for key, raw in rows:
            hit = kept.get(key)
            if hit is not None and hit[0] == raw:
                fresh[key] = hit
            else:
                fresh[key] = (raw, self._parse(raw))
        with self._lock:
            self._kept = fresh
        return {key: value for key, (_, value) in fresh.items()}

    def parse_one(self, key: K, raw: Any) -> T:
        """One row parsed, reusing a kept result; nothing is added to or removed from the set."""
        hit = self._kept.get(key)
        if hit is not None and hit[0] == raw:
            return hit[1]
        return self._parse(raw)

    def __len__(self) -> int:
        return len(self._kept)


class ReplicaDocs:
    """Replica documents by allocation, parsed once: a read names the allocations it saw and
    hands over the JSON of only those not kept (``missing``).

    Kept by name, with the engine key of the allocation: an unchanged replica's entry is reused
    as it is, so a read of tens of thousands of replicas makes no new object per replica (each
    one made and kept a cycle long is work for the cyclic garbage collector's full passes)."""

    def __init__(self) -> None:
        self._kept: dict[str, tuple[str | None, Replica]] = {}
        self._lock = threading.Lock()

    def missing(self, keys: Iterable[ReplicaKey]) -> list[ReplicaKey]:
        """The allocations whose document must be fetched."""
        kept = self._kept
        out = []
        for key in keys:
            hit = kept.get(key[0])
            if hit is None or hit[0] != key[1]:
                out.append(key)
        return out

    def resolve(
        self, rows: Iterable[tuple[ReplicaKey, str]], fetched: Mapping[ReplicaKey, dict[str, Any]]
    ) -> dict[str, Replica]:
        """Per replica name, its document with the row's state: kept ones reused, ``fetched``
        ones parsed; the kept set becomes exactly these allocations."""
        kept = self._kept
        fresh: dict[str, tuple[str | None, Replica]] = {}
        out: dict[str, Replica] = {}
        for key, state in rows:
            name, engine_key = key
            hit = kept.get(name)
            if hit is None or hit[0] != engine_key:
                hit = (engine_key, Replica.model_validate({**fetched[key], "state": state}))
            elif hit[1].state.value != state:
                hit = (engine_key, hit[1].model_copy(update={"state": ReplicaState(state)}))
            fresh[name] = hit
            out[name] = hit[1]
        with self._lock:
            self._kept = fresh
        return out

    def forget(self, names: Iterable[str]) -> None:
        """Drop the kept documents of ``names`` (their spec was rewritten): the next read fetches them."""
        with self._lock:
            gone = set(names)
            self._kept = {n: hit for n, hit in self._kept.items() if n not in gone}

    def __len__(self) -> int:
        return len(self._kept)
