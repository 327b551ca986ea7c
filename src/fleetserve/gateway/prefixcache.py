"""What one gateway believes each replica holds in its prompt (KV) cache, in blocks of tokens.

A prompt becomes comparable blocks without a tokenizer: its chat messages serialised canonically
(``prompt_bytes``: sorted keys, no chat template applied) are cut into blocks of ``BLOCK_BYTES``
bytes, about ``BLOCK_TOKENS`` tokens at ``BYTES_PER_TOKEN`` bytes a token (English text under a
BPE tokenizer runs 3.5-4.5 bytes a token). Each block's key is a chained hash, the hash of the
previous block's key and this block's bytes (``block_keys``), so equal keys mean equal prefixes
and a prompt's longest cached prefix is found by walking its keys until the first miss, as vLLM's
prefix cache finds its blocks. Only whole blocks count; a partial last block is never cached, and
no more than ``MAX_PROMPT_BLOCKS`` are cut from one prompt, so a huge prompt costs a bounded time.
The hash is Python's own 64-bit ``hash`` (SipHash, seeded per process: about 3x cheaper than
blake2b here); keys are never compared across processes, since each gateway models only what it
routed itself.

``ReplicaCache`` is one replica's model: its blocks in LRU order, at most its KV capacity
(``capacity_blocks``: the tokens placement sized the replica's KV cache for, carried on the route
as ``Endpoint.kv_tokens``, else ``DEFAULT_KV_TOKENS``). A prompt's blocks are touched last block
first, so the LRU end evicts a prompt's tail before its head, as vLLM frees a finished request's
blocks in reverse: the shared head of many prompts outlives their suffixes.

An engine that caches per slot holds fewer prompts than its KV's tokens would: llama-server
without its host-memory prompt cache (``--cache-ram 0``) keeps only what each of its slots last
computed, one prompt a slot, however large the KV. Its route then carries the most prompts it
holds (``Endpoint.kv_prompts``, the engine row's ``held_prompts``) and the model keeps whole
prompts as the engine's slots do (``ReplicaCache.prompts``): a prompt takes the place of the held
prompt it shares the longest prefix with, where that is at least ``SLOT_SIMILARITY`` of it (as
llama-server picks the slot for a request), else of the least recently used one once every
place is taken. Modelled as blocks alone, such a replica looked as if it still held prompts its
slots had long since overwritten: the picker sent prompts where they had been, not where they were.

``PrefixCaches`` holds one model per replica, learned only from what this gateway routed: on each
pick the prompt's blocks are inserted for the chosen replica (``learn``). Several gateways each
hold their own models, each knowing only the requests it sent; none sees another's. A replica's
model is corrected where the engine tells cheaply: its engine's epoch (``sync``: bumped by the
observer when the engine restarted, its prompt-token counter reset or its agent reporting a
restart, or its vLLM engine reporting its whole cache dropped) or a new KV capacity clears it,
since a restarted engine has lost its cache.

And a replica's model is corrected by what its engine says it holds (``correct``, once per
``cachereport.CacheReport``, never per request):

- **vLLM**'s KV events, through its agent: the blocks it holds now, in its tokens. The engine's
  blocks are token blocks, chained hashes of token ids, and these are byte blocks: without the
  engine's tokenizer and chat template in the gateway (a ``/tokenize`` round trip per request)
  the two cannot be matched block by block, so the model holds at most as many of its blocks as
  the engine's tokens make (``trim_blocks``), its least recently used going first, as the
  engine's do. Each gateway models only what it routed, a part of what the engine holds, so this
  bound only bites when the engine evicted (or was cleared) past what this gateway believed.
- **llama.cpp**'s slots (``GET /slots``), for a per-slot model: which slots served a request since
  the last answer (their ``id_task`` moved), and which hold a prompt now. Of the slots that
  served one, as many as this gateway sent it requests since are taken for its own, the others
  for another's (another gateway's, or a client of the engine itself), which overwrote what the
  slot held (``slot_correction``); the model holds no more prompts than the slots holding one of
  this gateway's (``trim_prompts``), the least recently used going first, as llama-server gives
  an unrelated prompt its least recently used slot. An emptied slot holds none. The slots'
  count and context are the model's.

Pure apart from the clock-free state it holds: no I/O, no locks (the gateway's event loop owns it).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from fleetserve.cachereport import CacheReport, SlotState

BYTES_PER_TOKEN = 4
"""The byte-level approximation of a token: 4 bytes of serialised prompt."""

BLOCK_TOKENS = 16
"""Tokens in one block, as vLLM's default block size."""

BLOCK_BYTES = BLOCK_TOKENS * BYTES_PER_TOKEN
"""Bytes of serialised prompt in one block."""

DEFAULT_KV_TOKENS = 4096
"""A replica's KV capacity in tokens when the route does not carry one (``modelfacts.DEFAULT_CONTEXT``)."""

MAX_BLOCKS = 1 << 18
"""The most blocks one replica's model holds (4M tokens), so a huge KV cannot make the model huge."""

SLOT_SIMILARITY = 0.1
"""The share of a prompt a held prompt must share with it to be the one it replaces
(llama-server's default ``--slot-prompt-similarity``)."""

MAX_PROMPT_BLOCKS = 1024
"""The most blocks cut from one prompt (16,384 tokens): a longer prompt's tail is not modelled, so
what routing costs is bounded (about 0.5 ms) however long the prompt."""


def prompt_bytes(data: Mapping[str, Any]) -> bytes:
    """A request body's prompt as bytes to cut into blocks: its ``messages`` (chat), else its
    ``prompt`` or ``input``, serialised canonically (JSON with sorted keys; a string prompt as its
    UTF-8). A follow-up turn's messages start with the bytes of the earlier turns' messages, up to
    the list's closing bracket, so a conversation's blocks extend its earlier ones. b"" when there is none."""
    prompt = data.get("messages")
    if prompt is None:
        prompt = data.get("prompt")
        if prompt is None:
            prompt = data.get("input")
    if prompt is None:
        return b""
    if isinstance(prompt, str):
        return prompt.encode("utf-8", "surrogatepass")
    try:
        return orjson.dumps(prompt, option=orjson.OPT_SORT_KEYS)
    except (TypeError, orjson.JSONEncodeError):
        return b""


def block_keys(data: bytes, block_bytes: int = BLOCK_BYTES, limit: int = MAX_PROMPT_BLOCKS) -> list[int]:
    """The chained keys of ``data``'s whole blocks, at most ``limit``: key i hashes key i-1 and
    block i's bytes."""
    if block_bytes < 1:
        raise ValueError(f"block_bytes must be at least 1, got {block_bytes}")
    keys: list[int] = []
    append = keys.append
    previous = 0
    end = min(len(data) // block_bytes, limit) * block_bytes
    for start in range(0, end, block_bytes):
        previous = hash((previous, data[start : start + block_bytes]))
        append(previous)
    return keys


def capacity_blocks(kv_tokens: int | None, block_tokens: int = BLOCK_TOKENS) -> int:
    """How many blocks a replica whose KV holds ``kv_tokens`` tokens keeps (the default when unknown)."""
    tokens = kv_tokens if kv_tokens is not None and kv_tokens > 0 else DEFAULT_KV_TOKENS
    return max(1, min(MAX_BLOCKS, tokens // block_tokens))


@dataclass
class ReplicaCache:
    """One replica's cached blocks, least recently used first, at most ``capacity`` of them; with
    ``prompts``, held as at most that many whole prompts (an engine caching per slot)."""

    capacity: int
    prompts: int | None = None
    blocks: OrderedDict[int, None] = field(default_factory=OrderedDict)
    # With ``prompts``: the prompts held, least recently used first, and how many hold each block.
    held: list[tuple[int, ...]] = field(default_factory=list)
    holders: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.capacity < 1:
            raise ValueError(f"capacity must be at least 1 block, got {self.capacity}")
        if self.prompts is not None and self.prompts < 1:
            raise ValueError(f"prompts must be at least 1 or None, got {self.prompts}")

    def matched(self, keys: Sequence[int]) -> int:
        """How many of ``keys``' leading blocks are held: the prompt's cached prefix, in blocks."""
        blocks = self.blocks
        n = 0
        for key in keys:
            if key not in blocks:
                break
            n += 1
        return n

    def insert(self, keys: Sequence[int]) -> None:
        """Hold ``keys`` as most recently used, the head most recent of all; evict past capacity."""
        if self.prompts is not None:
            self._hold(tuple(keys[: self.capacity]))
            return
        blocks = self.blocks
        # Beyond capacity only the head can stay: the engine keeps the latest tokens it computed
        # only while they fit, and a prefix is useful only from its first block.
        for key in reversed(keys[: self.capacity]):
            blocks[key] = None
            blocks.move_to_end(key)
        while len(blocks) > self.capacity:
            blocks.popitem(last=False)

    def clear(self) -> None:
        self.blocks.clear()
        self.held.clear()
        self.holders.clear()

    def trim_blocks(self, limit: int) -> int:
        """Hold at most ``limit`` blocks, the least recently used going first (per slot: whole
        prompts, the least recently used first); how many blocks went."""
        before = len(self.blocks)
        if self.prompts is not None:
            while self.held and len(self.blocks) > max(0, limit):
                self._drop(0)
        else:
            blocks = self.blocks
            while len(blocks) > max(0, limit):
                blocks.popitem(last=False)
        return before - len(self.blocks)

    def trim_prompts(self, limit: int) -> int:
        """Hold at most ``limit`` prompts (per slot), the least recently used going first; how
        many went."""
        gone = 0
        while len(self.held) > max(0, limit):
            self._drop(0)
            gone += 1
        return gone

    def resize(self, capacity: int) -> None:
        """Hold at most ``capacity`` blocks from now on (the engine said its size)."""
        self.capacity = max(1, capacity)
        self.trim_blocks(self.capacity)

    def _hold(self, keys: tuple[int, ...]) -> None:
        """Hold the prompt ``keys`` in the place the engine would give it (see the module's docstring)."""
        if not keys:
            return
        best, shared = -1, 0
        for i, prompt in enumerate(self.held):
            n = _common(prompt, keys)
            if n > shared:
                best, shared = i, n
        if best >= 0 and shared >= SLOT_SIMILARITY * len(keys):
            self._drop(best)
        elif self.prompts is not None and len(self.held) >= self.prompts:
            self._drop(0)
        self.held.append(keys)
        for key in keys:
            count = self.holders.get(key, 0)
            self.holders[key] = count + 1
            if not count:
                self.blocks[key] = None
        # Each slot's tokens take their own room in the KV: past capacity the oldest prompts go.
        while len(self.held) > 1 and sum(len(p) for p in self.held) > self.capacity:
            self._drop(0)

    def _drop(self, index: int) -> None:
        for key in self.held.pop(index):
            count = self.holders[key] - 1
            if count:
                self.holders[key] = count
            else:
                del self.holders[key]
                del self.blocks[key]


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading keys ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def slot_correction(
    previous: Sequence[SlotState] | None,
    current: Sequence[SlotState],
    mine: Mapping[int, bool],
    routed: int,
) -> tuple[dict[int, bool], int]:
    """Which of an engine's slots last served a request of this gateway's, from two answers of its
    slots, which slots were this gateway's after the earlier one (``mine``), and the requests
    this gateway sent it since then not yet seen served (``routed``): (each slot's id → whether it
    holds a prompt this gateway sent, this gateway's requests still not seen served, at most one a
    slot). A slot served a request when the task it last served changed; as many of those as
    ``routed`` are this gateway's (which ones cannot be told, nor does it matter to a count), the
    others another's, which overwrote what the slot held. With no earlier answer each slot that
    holds a prompt is taken for this gateway's: nothing is known to the contrary."""
    if previous is None:
        return {s.id: s.holds for s in current}, 0
    before = {s.id: s.task for s in previous}
    now: dict[int, bool] = {}
    ours = routed
    for s in current:
        if s.task is not None and s.task != before.get(s.id):
            now[s.id] = ours > 0 and s.holds
            ours -= 1
        else:
            now[s.id] = mine.get(s.id, False) and s.holds
    return now, min(len(current), max(0, ours))


@dataclass
class PrefixCaches:
    """One gateway's model of every replica's prompt cache, learned from what it routed."""

    replicas: dict[str, ReplicaCache] = field(default_factory=dict)
    # replica → (engine epoch, capacity in blocks, prompts held) the model was last synced at
    synced: dict[str, tuple[int | None, int, int | None]] = field(default_factory=dict)
    # Cache resets by cause, for tests and the curious.
    resets: int = 0
    # replica → the last engine report applied (its seq), its slots then, which of them hold a
    # prompt this gateway sent, and its requests to it not yet seen in a slot (``correct``).
    applied: dict[str, int] = field(default_factory=dict)
    slots_seen: dict[str, tuple[SlotState, ...]] = field(default_factory=dict)
    mine: dict[str, dict[int, bool]] = field(default_factory=dict)
    routed: dict[str, int] = field(default_factory=dict)
    # Blocks and prompts dropped by engine reports, for tests and the curious.
    corrected_blocks: int = 0
    corrected_prompts: int = 0

    def sync(
        self, replica: str, kv_tokens: int | None, epoch: int | None, kv_prompts: int | None = None
    ) -> ReplicaCache:
        """``replica``'s model, cleared when its engine's ``epoch`` changed (a restart lost the
        engine's cache) or its capacity did (``kv_tokens``, or ``kv_prompts``: the most prompts it
        holds, None where only its tokens bound it); created empty for a replica not seen before."""
        capacity = capacity_blocks(kv_tokens)
        prompts = kv_prompts if kv_prompts is not None and kv_prompts > 0 else None
        state = (epoch, capacity, prompts)
        cache = self.replicas.get(replica)
        if cache is None:
            cache = self.replicas[replica] = ReplicaCache(capacity, prompts)
            self.synced[replica] = state
            return cache
        if self.synced.get(replica) != state:
            if cache.blocks:
                self.resets += 1
            cache.clear()
            cache.capacity = capacity
            cache.prompts = prompts
            self.synced[replica] = state
        return cache

    def cached_tokens(self, replica: str, keys: Sequence[int]) -> int:
        """Tokens of the prompt ``keys`` cut that ``replica`` is believed to hold (0 if unknown)."""
        cache = self.replicas.get(replica)
        return 0 if cache is None else cache.matched(keys) * BLOCK_TOKENS

    def learn(self, replica: str, keys: Sequence[int]) -> None:
        """``replica`` was sent the prompt ``keys`` cut: it holds its blocks now."""
        cache = self.replicas.get(replica)
        if cache is None:
            cache = self.sync(replica, None, None)
        cache.insert(keys)
        if cache.prompts is not None:
            self.routed[replica] = self.routed.get(replica, 0) + 1

    def correct(self, replica: str, report: CacheReport | None) -> None:
        """Correct ``replica``'s model by what its engine said (see the module's docstring), once
        per report: a report already applied, or none, changes nothing."""
        if report is None or self.applied.get(replica) == report.seq:
            return
        cache = self.replicas.get(replica)
        if cache is None:
            return
        self.applied[replica] = report.seq
        if report.held_tokens is not None:
            self.corrected_blocks += cache.trim_blocks(report.held_tokens // BLOCK_TOKENS)
        if report.slots is None or cache.prompts is None:
            return
        if report.slots:
            cache.prompts = len(report.slots)
        if report.capacity_tokens is not None:
            cache.resize(capacity_blocks(report.capacity_tokens))
        previous = self.slots_seen.get(replica)
        self.slots_seen[replica] = report.slots
        mine, unseen = slot_correction(
            previous, report.slots, self.mine.get(replica, {}), self.routed.get(replica, 0)
        )
        self.mine[replica], self.routed[replica] = mine, unseen
        self.corrected_prompts += cache.trim_prompts(sum(mine.values()) + unseen)

    def keep_only(self, replicas: Iterable[str]) -> None:
        """Forget the replicas no longer routed (replica names are never reused)."""
        live = set(replicas)
        for name in [n for n in self.replicas if n not in live]:
            del self.replicas[name]
            self.synced.pop(name, None)
            self.applied.pop(name, None)
            self.slots_seen.pop(name, None)
            self.mine.pop(name, None)
            self.routed.pop(name, None)
