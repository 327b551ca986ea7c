"""What an engine says it holds corrects the gateway's model of it (``PrefixCaches.correct``):
vLLM's held blocks (its KV events, through its agent) bound the blocks modelled, least recently
used first; llama.cpp's slots drop the prompts of emptied slots and of slots that served requests
this gateway did not send; each report is applied once."""

from __future__ import annotations

import pytest

from fleetserve.cachereport import CacheReport, SlotState
from fleetserve.gateway.prefixcache import BLOCK_TOKENS, PrefixCaches, ReplicaCache, slot_correction


def prompt(tag: int, blocks: int = 4) -> list[int]:
    """A prompt's chained keys: ``blocks`` keys no other tag shares."""
    return [tag * 1000 + i for i in range(blocks)]


def slot(
    id: int, task: int | None, tokens: int = 100, processing: bool = False, n_ctx: int = 4096
) -> SlotState:
    return SlotState(id=id, n_ctx=n_ctx, processing=processing, task=task, tokens=tokens)


# --- slot_correction: which slots hold this gateway's prompts, and its requests not seen served ----

T, F = True, False
CASES = [
    # no earlier answer: every slot holding a prompt is taken for this gateway's
    ("first answer", None, {}, [slot(0, 5), slot(1, None, 0)], 3, ({0: T, 1: F}, 0)),
    ("nothing served", [slot(0, 5), slot(1, 6)], {0: T, 1: F}, [slot(0, 5), slot(1, 6)], 0, ({0: T, 1: F}, 0)),
    ("ours served into a slot", [slot(0, 5), slot(1, 6)], {0: F, 1: F}, [slot(0, 9), slot(1, 6)], 1,
     ({0: T, 1: F}, 0)),
    ("another's overwrote ours", [slot(0, 5), slot(1, 6)], {0: T, 1: T}, [slot(0, 9), slot(1, 6)], 0,
     ({0: F, 1: T}, 0)),
    ("another's into an empty slot leaves ours", [slot(0, 5), slot(1, None, 0)], {0: T},
     [slot(0, 5), slot(1, 7)], 0, ({0: T, 1: F}, 0)),
    ("two served, one ours", [slot(0, 5), slot(1, 6)], {0: T, 1: F}, [slot(0, 9), slot(1, 10)], 1,
     ({0: T, 1: F}, 0)),
    ("ours still queued", [slot(0, 5)], {0: T}, [slot(0, 5)], 2, ({0: T}, 1)),
    ("an emptied slot holds nothing", [slot(0, 5), slot(1, 6)], {0: T, 1: T},
     [slot(0, 5), slot(1, 6, tokens=0)], 0, ({0: T, 1: F}, 0)),
    ("processing holds", [slot(0, 5)], {0: F}, [slot(0, 8, tokens=0, processing=True)], 1, ({0: T}, 0)),
]  # fmt: skip


@pytest.mark.parametrize(
    ("why", "previous", "mine", "current", "routed", "expected"), CASES, ids=[c[0] for c in CASES]
)
def test_slot_correction(why, previous, mine, current, routed, expected):
    assert slot_correction(previous, current, mine, routed) == expected


# --- ReplicaCache trims ---------------------------------------------------------------------------


def test_trim_blocks_evicts_least_recently_used_first():
    cache = ReplicaCache(capacity=100)
    cache.insert(prompt(1))
    cache.insert(prompt(2))  # the most recent: kept
    assert cache.trim_blocks(6) == 2
    assert cache.matched(prompt(2)) == 4
    # prompt 1's tail went first (touched last block first), its head stays
    assert cache.matched(prompt(1)) == 2
    assert cache.trim_blocks(100) == 0
    assert cache.trim_blocks(0) == 6 and not cache.blocks


def test_trim_per_slot_drops_whole_prompts_oldest_first():
    cache = ReplicaCache(capacity=100, prompts=4)
    for tag in (1, 2, 3):
        cache.insert(prompt(tag))
    assert cache.trim_blocks(9) == 4  # one whole prompt: the oldest
    assert [cache.matched(prompt(t)) for t in (1, 2, 3)] == [0, 4, 4]
    assert cache.trim_prompts(1) == 1
    assert [cache.matched(prompt(t)) for t in (1, 2, 3)] == [0, 0, 4]
    assert cache.trim_prompts(-3) == 1 and not cache.blocks and not cache.holders


def test_resize_shrinks_and_keeps_what_fits():
    cache = ReplicaCache(capacity=100)
    cache.insert(prompt(1, 10))
    cache.resize(4)
    assert cache.capacity == 4 and cache.matched(prompt(1, 10)) == 4


# --- PrefixCaches.correct -------------------------------------------------------------------------


def test_vllm_held_blocks_bound_the_model_once_per_report():
    caches = PrefixCaches()
    caches.sync("r", kv_tokens=1 << 16, epoch=0)
    for tag in range(1, 5):
        caches.learn("r", prompt(tag))  # 16 blocks modelled
    # The engine holds 8 of the gateway's blocks' worth of tokens: the oldest go.
    caches.correct("r", CacheReport(seq=1, held_tokens=8 * BLOCK_TOKENS))
    assert len(caches.replicas["r"].blocks) == 8
    assert caches.cached_tokens("r", prompt(4)) == 4 * BLOCK_TOKENS
    assert caches.cached_tokens("r", prompt(1)) == 0
    assert caches.corrected_blocks == 8
    # learned again after the report; the same report again changes nothing
    caches.learn("r", prompt(1))
    caches.correct("r", CacheReport(seq=1, held_tokens=8 * BLOCK_TOKENS))
    assert caches.cached_tokens("r", prompt(1)) == 4 * BLOCK_TOKENS
    # holding more than modelled bounds nothing; none, or an unknown replica, neither
    caches.correct("r", CacheReport(seq=2, held_tokens=10_000))
    caches.correct("r", None)
    caches.correct("other", CacheReport(seq=3, held_tokens=0))
    assert len(caches.replicas["r"].blocks) == 12 and "other" not in caches.replicas


def test_vllm_cleared_cache_reported_as_nothing_held_empties_the_model():
    caches = PrefixCaches()
    caches.sync("r", kv_tokens=4096, epoch=0)
    caches.learn("r", prompt(1))
    caches.correct("r", CacheReport(seq=7, held_tokens=0))
    assert caches.cached_tokens("r", prompt(1)) == 0


def test_llama_slots_drop_prompts_overwritten_by_others_and_emptied_slots():
    caches = PrefixCaches()
    caches.sync("r", kv_tokens=4096, epoch=0, kv_prompts=4)
    empty = tuple(slot(i, None, 0) for i in range(4))
    caches.correct("r", CacheReport(seq=1, capacity_tokens=4096, slots=empty))
    for tag in (1, 2, 3):  # this gateway's three requests, served into slots 0-2
        caches.learn("r", prompt(tag))
    after = (slot(0, 11), slot(1, 12), slot(2, 13), slot(3, None, 0))
    caches.correct("r", CacheReport(seq=2, capacity_tokens=4096, slots=after))
    assert [caches.cached_tokens("r", prompt(t)) > 0 for t in (1, 2, 3)] == [True, True, True]
    assert caches.mine["r"] == {0: True, 1: True, 2: True, 3: False}
    # Two requests from elsewhere: llama-server gives the first the empty slot, the second the
    # least recently used (prompt 1's): the model drops its least recently used prompt.
    others = (slot(0, 21), slot(1, 12), slot(2, 13), slot(3, 22))
    caches.correct("r", CacheReport(seq=3, capacity_tokens=4096, slots=others))
    assert [caches.cached_tokens("r", prompt(t)) > 0 for t in (1, 2, 3)] == [False, True, True]
    assert caches.corrected_prompts == 1
    # Every slot emptied (an erase, or the engine's own clear): nothing is held.
    cleared = tuple(slot(i, s.task, tokens=0) for i, s in enumerate(others))
    caches.correct("r", CacheReport(seq=4, capacity_tokens=4096, slots=cleared))
    assert not caches.replicas["r"].held and caches.corrected_prompts == 3


def test_llama_slots_say_the_slot_count_and_context():
    caches = PrefixCaches()
    cache = caches.sync("r", kv_tokens=None, epoch=0, kv_prompts=4)
    caches.correct("r", CacheReport(seq=1, capacity_tokens=512, slots=(slot(0, None, 0), slot(1, None, 0))))
    assert cache.prompts == 2 and cache.capacity == 512 // BLOCK_TOKENS


def test_slots_do_not_touch_a_model_of_tokens_alone():
    """llama-server with its host prompt cache holds more than its slots: they bound nothing."""
    caches = PrefixCaches()
    caches.sync("r", kv_tokens=4096, epoch=0)
    caches.learn("r", prompt(1))
    caches.correct("r", CacheReport(seq=1, capacity_tokens=64, slots=(slot(0, 9, tokens=0),)))
    assert caches.cached_tokens("r", prompt(1)) == 4 * BLOCK_TOKENS


def test_forgotten_replicas_forget_their_reports():
    caches = PrefixCaches()
    caches.sync("r", kv_tokens=4096, epoch=0, kv_prompts=4)
    caches.learn("r", prompt(1))
    caches.correct("r", CacheReport(seq=1, slots=(slot(0, 1),)))
    caches.keep_only([])
    assert not caches.applied and not caches.slots_seen and not caches.routed and not caches.mine
