"""The gateway's model of each replica's prompt cache (``gateway.prefixcache``): chained block
keys, longest cached prefix, LRU eviction at the KV capacity, resets on an engine's restart, and
what cutting a 2,000-token prompt into blocks costs."""

from __future__ import annotations

import orjson
import pytest

from fleetserve.gateway.prefixcache import (
    BLOCK_BYTES,
    BLOCK_TOKENS,
    DEFAULT_KV_TOKENS,
    MAX_BLOCKS,
    MAX_PROMPT_BLOCKS,
    PrefixCaches,
    ReplicaCache,
    block_keys,
    capacity_blocks,
    prompt_bytes,
)

SYSTEM = "You are the fleet's assistant. " * 200  # about 6,000 bytes


def chat(*turns: str) -> dict[str, object]:
    roles = ["user", "assistant"]
    return {
        "model": "m",
        "messages": [{"role": "system", "content": SYSTEM}]
        + [{"role": roles[i % 2], "content": t} for i, t in enumerate(turns)],
    }


def test_keys_are_chained_so_equal_keys_mean_equal_prefixes():
    a = block_keys(b"x" * BLOCK_BYTES * 3)
    assert len(a) == 3 and len(set(a)) == 3  # the same bytes in every block, yet three keys
    b = block_keys(b"y" + b"x" * (BLOCK_BYTES * 3 - 1))
    assert not set(a) & set(b)  # one byte differs in the first block: nothing after it matches
    c = block_keys(b"x" * BLOCK_BYTES * 2 + b"z" * BLOCK_BYTES)
    assert c[:2] == a[:2] and c[2] != a[2]
    assert block_keys(b"x" * (BLOCK_BYTES - 1)) == []  # no whole block, nothing to cache
    # a huge prompt is cut into MAX_PROMPT_BLOCKS at most, the same first ones
    huge = bytes(range(256)) * (BLOCK_BYTES * MAX_PROMPT_BLOCKS // 128)
    assert block_keys(huge) == block_keys(huge[: BLOCK_BYTES * MAX_PROMPT_BLOCKS])
    assert len(block_keys(huge)) == MAX_PROMPT_BLOCKS
    with pytest.raises(ValueError):
        block_keys(b"x", 0)


def test_a_follow_up_turn_extends_the_conversation_s_blocks():
    first = block_keys(prompt_bytes(chat("hello there")))
    follow = block_keys(prompt_bytes(chat("hello there", "hi! how can I help", "tell me more")))
    other = block_keys(prompt_bytes({"messages": [{"role": "system", "content": "Another prompt. " * 400}]}))
    assert len(first) >= SYSTEM.__len__() // BLOCK_BYTES
    assert follow[: len(first) - 1] == first[:-1]  # all but the block holding the list's end
    assert first[0] != other[0]


def test_prompt_bytes_reads_messages_prompt_or_input_canonically():
    assert prompt_bytes({"prompt": "abc"}) == b"abc"
    assert prompt_bytes({"input": ["a", "b"]}) == b'["a","b"]'
    assert prompt_bytes({"model": "m"}) == b""
    # key order in the client's JSON does not matter
    one = {"messages": [{"role": "user", "content": "x"}]}
    two = orjson.loads(b'{"messages": [{"content": "x", "role": "user"}]}')
    assert prompt_bytes(one) == prompt_bytes(two)


def test_the_longest_cached_prefix_is_walked_to_the_first_miss():
    cache = ReplicaCache(capacity=100)
    keys = block_keys(b"p" * BLOCK_BYTES * 10)
    cache.insert(keys[:6])
    assert cache.matched(keys) == 6
    assert cache.matched(block_keys(b"q" * BLOCK_BYTES * 10)) == 0


def test_eviction_at_capacity_takes_the_least_recent_prompt_s_tail_first():
    cache = ReplicaCache(capacity=8)
    old = block_keys(b"o" * BLOCK_BYTES * 5)
    new = block_keys(b"n" * BLOCK_BYTES * 5)
    cache.insert(old)
    cache.insert(new)  # 10 blocks into 8: two of the old prompt go, its last two
    assert len(cache.blocks) == 8
    assert cache.matched(new) == 5 and cache.matched(old) == 3
    cache.insert(old[:3])  # using the old head again keeps it past the next prompt
    cache.insert(block_keys(b"m" * BLOCK_BYTES * 3))
    assert cache.matched(old) == 3 and cache.matched(new) == 2


def test_a_prompt_longer_than_the_cache_keeps_its_head():
    cache = ReplicaCache(capacity=4)
    keys = block_keys(b"L" * BLOCK_BYTES * 10)
    cache.insert(keys)
    assert cache.matched(keys) == 4


def test_capacity_comes_from_the_replica_s_kv_tokens_else_a_default():
    assert capacity_blocks(512) == 512 // BLOCK_TOKENS
    assert capacity_blocks(None) == DEFAULT_KV_TOKENS // BLOCK_TOKENS
    assert capacity_blocks(0) == DEFAULT_KV_TOKENS // BLOCK_TOKENS
    assert capacity_blocks(10**12) == MAX_BLOCKS
    with pytest.raises(ValueError):
        ReplicaCache(capacity=0)


def test_an_engine_restart_or_a_new_capacity_clears_its_model_and_no_other():
    caches = PrefixCaches()
    keys = block_keys(b"s" * BLOCK_BYTES * 4)
    for name in ("a", "b"):
        caches.sync(name, 4096, 0)
        caches.learn(name, keys)
    assert caches.cached_tokens("a", keys) == 4 * BLOCK_TOKENS
    caches.sync("a", 4096, 0)  # same epoch: kept
    assert caches.cached_tokens("a", keys) == 4 * BLOCK_TOKENS
    caches.sync("a", 4096, 1)  # the observer saw its engine start again
    assert caches.cached_tokens("a", keys) == 0 and caches.resets == 1
    assert caches.cached_tokens("b", keys) == 4 * BLOCK_TOKENS
    caches.sync("b", 8192, 0)
    assert caches.cached_tokens("b", keys) == 0
    assert caches.replicas["b"].capacity == 8192 // BLOCK_TOKENS
    caches.keep_only(["b"])
    assert set(caches.replicas) == {"b"} and caches.cached_tokens("a", keys) == 0


def test_a_2000_token_chat_is_125_blocks_and_a_model_holding_it_finds_them_all():
    """The prompt bench/prefixcache.py times (its cost is a figure there, not a bound here): about
    2,000 tokens (8,000 bytes) of chat cut into 125 chained blocks, found whole where learned."""
    body = {"messages": [{"role": "system", "content": "w" * 7950}, {"role": "user", "content": "hi"}]}
    caches = PrefixCaches()
    keys = block_keys(prompt_bytes(body))
    assert len(keys) == 125
    for name in ("a", "b", "c"):
        caches.learn(name, keys)
    assert [caches.cached_tokens(name, keys) for name in ("a", "b", "c")] == [125 * BLOCK_TOKENS] * 3
    assert caches.cached_tokens("d", keys) == 0


def _prompt(letter: bytes, blocks: int = 6) -> list[int]:
    return block_keys(letter * BLOCK_BYTES * blocks)


@pytest.mark.parametrize(
    ("sent", "held"),
    [
        # Fewer prompts than places: every one held.
        (["a", "b"], {"a", "b"}),
        # One prompt too many: the least recently sent goes, whatever room the tokens leave.
        (["a", "b", "c"], {"b", "c"}),
        # Sending a held prompt again keeps it: it is the most recent now.
        (["a", "b", "a", "c"], {"a", "c"}),
        # A follow-up of a held prompt takes its place (its slot), not another's: b goes for c
        # (a's head is held as a+'s).
        (["a", "b", "a+", "c"], {"a", "a+", "c"}),
    ],
)
def test_an_engine_caching_per_slot_holds_whole_prompts_in_its_places(sent, held):
    prompts = {
        "a": _prompt(b"a"),
        "b": _prompt(b"b"),
        "c": _prompt(b"c"),
        "a+": block_keys(b"a" * BLOCK_BYTES * 6 + b"+" * BLOCK_BYTES * 2),
    }
    cache = ReplicaCache(capacity=1000, prompts=2)
    for name in sent:
        cache.insert(prompts[name])
    got = {name for name, keys in prompts.items() if cache.matched(keys) == len(keys)}
    assert got == held
    assert set(cache.blocks) == {k for name in held for k in prompts[name]}


def test_prompts_held_per_slot_still_fit_the_kv_tokens():
    cache = ReplicaCache(capacity=10, prompts=4)
    cache.insert(_prompt(b"a"))
    cache.insert(_prompt(b"b"))  # 12 blocks in 10: the older prompt goes whole
    assert cache.matched(_prompt(b"a")) == 0 and cache.matched(_prompt(b"b")) == 6
    with pytest.raises(ValueError):
        ReplicaCache(capacity=10, prompts=0)


def test_a_replica_s_prompt_bound_comes_with_its_sync_and_a_new_one_clears_it():
    caches = PrefixCaches()
    caches.sync("a", 4096, 0, kv_prompts=1)
    caches.learn("a", _prompt(b"x"))
    caches.learn("a", _prompt(b"y"))
    assert caches.cached_tokens("a", _prompt(b"x")) == 0
    assert caches.cached_tokens("a", _prompt(b"y")) == 6 * BLOCK_TOKENS
    caches.sync("a", 4096, 0, kv_prompts=None)  # the engine's args changed: its cache is new
    assert caches.cached_tokens("a", _prompt(b"y")) == 0
    caches.learn("a", _prompt(b"x"))
    caches.learn("a", _prompt(b"y"))
    assert caches.cached_tokens("a", _prompt(b"x")) == 6 * BLOCK_TOKENS  # tokens alone bound it


@pytest.mark.parametrize(
    ("args", "held"),
    [
        ((), None),
        (("--cache-ram", "0"), 4),
        (("--cache-ram=0",), 4),
        (("-cram", "0"), 4),
        (("--cache-ram", "0", "--cache-ram", "2048"), None),  # the last one wins
        (("--cache-ram", "512"), None),
    ],
)
def test_llama_cpp_holds_a_prompt_a_slot_without_its_host_cache(args, held):
    from fleetserve.engines.llamacpp import DEFAULT_SLOTS, LLAMACPP
    from fleetserve.engines.vllm import VLLM

    assert LLAMACPP.held_prompts(list(args)) == (None if held is None else DEFAULT_SLOTS)
    assert VLLM.held_prompts(list(args)) is None
