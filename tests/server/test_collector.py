"""``server/collector.py``: the control plane's long-lived heap is frozen out of the collector as
it grows, never before it is large, and not again until it has grown by a quarter; the server
process's young generations are collected on a clock, and cyclic garbage that died old waits for a
full pass, which comes when the heap has grown by a tenth."""

from __future__ import annotations

import asyncio
import gc
import threading
import weakref
from collections.abc import Iterator

import pytest

from fleetserve.server.collector import (
    FREEZE_MIN_BLOCKS,
    SERVER_GC_THRESHOLDS,
    HeapFreezer,
    PacedCollector,
    collect_paced,
)


class Cycle:
    me: object = None


@pytest.fixture
def unfrozen() -> Iterator[None]:
    gc.unfreeze()
    try:
        yield
    finally:
        gc.unfreeze()  # the rest of the suite runs with every object collectable


def test_the_heap_is_frozen_when_large_and_again_only_after_growing_by_a_quarter(unfrozen: None) -> None:
    blocks = [FREEZE_MIN_BLOCKS - 1]
    freezer = HeapFreezer(lambda: blocks[0])
    assert not freezer.check() and gc.get_freeze_count() == 0  # small: a full pass is cheap

    garbage = Cycle()
    garbage.me = garbage  # a reference cycle, dropped: collected before the freeze, not frozen
    dropped = weakref.ref(garbage)
    del garbage
    blocks[0] = FREEZE_MIN_BLOCKS
    assert freezer.check() and freezer.frozen_at == FREEZE_MIN_BLOCKS
    frozen = gc.get_freeze_count()
    assert frozen > 0
    assert dropped() is None

    blocks[0] = int(FREEZE_MIN_BLOCKS * 1.2)
    assert not freezer.check()  # grown by less than a quarter
    blocks[0] = int(FREEZE_MIN_BLOCKS * 1.25)
    assert freezer.check() and freezer.freezes == 2


def dropped_cycle() -> weakref.ref[Cycle]:
    garbage = Cycle()
    garbage.me = garbage
    return weakref.ref(garbage)


@pytest.fixture
def server_thresholds() -> Iterator[None]:
    before = gc.get_threshold()
    gc.set_threshold(*SERVER_GC_THRESHOLDS)
    try:
        yield
    finally:
        gc.set_threshold(*before)


def test_a_tick_collects_young_cycles_and_an_old_one_waits_for_the_heap_to_grow(
    unfrozen: None, server_thresholds: None
) -> None:
    blocks = [100_000]  # small: nothing is frozen
    collector = PacedCollector(lambda: blocks[0])

    young = dropped_cycle()
    collector.tick()
    assert young() is None and collector.young == 1

    kept = Cycle()
    kept.me = kept
    old = weakref.ref(kept)
    collector.tick()  # alive at this tick: promoted to the oldest generation
    collector.tick()
    del kept  # now garbage, in a generation no tick scans
    for _ in range(3):
        collector.tick()
    assert old() is not None

    blocks[0] = 109_999
    assert not collector.check() and old() is not None  # grown by less than a tenth
    blocks[0] = 111_000
    assert collector.check() and collector.full == 1 and old() is None
    assert collector.full_at == 111_000
    assert gc.get_freeze_count() == 0


def test_the_server_process_freezes_its_long_lived_heap_too(unfrozen: None) -> None:
    blocks = [FREEZE_MIN_BLOCKS]
    collector = PacedCollector(lambda: blocks[0])
    assert collector.check() and collector.freezer.freezes == 1 and collector.full == 0
    assert gc.get_freeze_count() > 0
    assert not collector.check()  # neither grown by a quarter since the freeze nor a tenth


def test_paced_collections_run_on_the_event_loops_thread(unfrozen: None, server_thresholds: None) -> None:
    """What a collection frees is finalised on the collecting thread: a held poll's coroutines
    must be finalised on the loop's, so the clock is the loop's, not a thread's."""
    ticks: list[int] = []

    class Recording(PacedCollector):
        def tick(self) -> None:
            ticks.append(threading.get_ident())
            super().tick()

    async def run() -> int:
        gc.set_threshold(700, 10, 10)
        collector = Recording(lambda: 100_000)
        task = asyncio.create_task(collect_paced(collector, every=0.01, check_every=0.05))
        await asyncio.sleep(0.3)
        task.cancel()
        assert gc.get_threshold() == SERVER_GC_THRESHOLDS  # the automatic full pass is off
        return threading.get_ident()

    loop_thread = asyncio.run(run())
    assert len(ticks) >= 3 and set(ticks) == {loop_thread}
