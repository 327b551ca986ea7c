"""``server/collector.py``: the control plane's long-lived heap is frozen out of the collector as
it grows, never before it is large, and not again until it has grown by a quarter."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from fleetserve.server.collector import FREEZE_MIN_BLOCKS, HeapFreezer


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
