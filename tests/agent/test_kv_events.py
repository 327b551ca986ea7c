"""The agent's consumer of vLLM's KV cache events (``agent/kvevents.py``): the tally's table (stored,
removed, cleared, other media, the tracked bound, the rate bound, sequence gaps, a restart), the
decoding of batches as vLLM's msgspec structs encode them, and the listener's real ZMQ socket:
bound on loopback only, fed by a real publisher, deaf to messages over its bound."""

from __future__ import annotations

import socket
import time
from typing import Any

import msgspec
import psutil
import pytest
import zmq

from fleetserve.agent.kvevents import (
    MAX_MESSAGE_BYTES,
    Cleared,
    KvEventsListener,
    KvTally,
    Removed,
    Stored,
    decode_batch,
    read_event,
)

# --- vLLM's event structs, as vllm/distributed/kv_events.py (0.32) declares them -----------------
# (Copied, not imported: importing vLLM takes seconds; the slow test against vLLM itself is
# tests/e2e/test_vllm_kv_events.py.)


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):  # type: ignore[call-arg]
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


def encoded(*events: KVCacheEvent) -> bytes:
    return msgspec.msgpack.encode(EventBatch(ts=time.time(), events=list(events)))


def stored(*hashes: bytes | int, medium: str | None = "GPU") -> BlockStored:
    return BlockStored(list(hashes), None, list(range(16 * len(hashes))), 16, None, medium, None)


# --- decoding --------------------------------------------------------------------------------------


def test_batches_decode_as_vllm_encodes_them():
    payload = encoded(stored(b"a" * 32, 7), BlockRemoved([b"a" * 32], "GPU"), AllBlocksCleared())
    events = decode_batch(payload)
    assert events == [
        Stored((hash(b"a" * 32), hash(7)), 16, "GPU"),
        Removed((hash(b"a" * 32),), "GPU"),
        Cleared(),
    ]
    assert decode_batch(b"\xc1 not msgpack") is None
    assert decode_batch(msgspec.msgpack.encode({"ts": 1})) is None


def test_earlier_vllms_tagged_arrays_are_read_too():
    batch = [1.0, [["BlockStored", [1, 2], None, [0] * 32, 16, None, "GPU"], ["BlockRemoved", [1], "GPU"],
                   ["AllBlocksCleared"]]]  # fmt: skip
    assert decode_batch(msgspec.msgpack.encode(batch)) == [
        Stored((hash(1), hash(2)), 16, "GPU"),
        Removed((hash(1),), "GPU"),
        Cleared(),
    ]


@pytest.mark.parametrize(
    "event",
    [
        {"type": "BlockStored", "block_hashes": ["x"], "block_size": 16},  # a hash neither bytes nor int
        {"type": "BlockStored", "block_hashes": [1]},  # no block size
        {"type": "Mystery"},
        {"block_hashes": [1]},
        ["BlockStored", ["x"], None, [], 16, None, None],
        ["BlockStored", [1], None, [], 0, None, None],  # no block size
        ["BlockStored", [1]],  # too short
        ["BlockRemoved"],
        ["SomethingNew", 1, 2],  # a newer kind: skipped
        "AllBlocksCleared",
        [],
    ],
)
def test_events_not_understood_are_skipped(event):
    assert read_event(event) is None


# --- the tally -------------------------------------------------------------------------------------


def tally_after(*batches: list[Any], **bounds: int) -> KvTally:
    tally = KvTally(**bounds)
    for i, batch in enumerate(batches):
        tally.take([e for e in (read_event(x) for x in batch) if e is not None], now=float(i))
    return tally


S = "BlockStored"
R = "BlockRemoved"
TALLIES = [
    ("stored", [[[S, [1, 2, 3], None, [], 16, None, "GPU"]]], dict(blocks=3, stored=3)),
    (
        "stored twice counts once",
        [[[S, [1, 2], None, [], 16, None, None]], [[S, [2], 1, [], 16, None, None]]],
        dict(blocks=2, stored=2),
    ),
    ("removed", [[[S, [1, 2, 3], None, [], 16, None, None], [R, [1, 3], None]]], dict(blocks=1, removed=2)),
    ("a removal never seen stored is not counted", [[[R, [9], None]]], dict(blocks=0, removed=0)),
    ("cleared", [[[S, [1, 2], None, [], 16, None, None]], [["AllBlocksCleared"]]], dict(blocks=0, clears=1)),
    (
        "an offload tier is not the cache",
        [[[S, [1, 2], None, [], 16, None, "CPU"]]],
        dict(blocks=0, stored=0),
    ),
    ("the block size is the engine's", [[[S, [1], None, [], 32, None, None]]], dict(block_tokens=32)),
]


@pytest.mark.parametrize(("why", "batches", "expected"), TALLIES, ids=[t[0] for t in TALLIES])
def test_tally(why, batches, expected):
    summary = tally_after(*batches).summary().model_dump()
    assert {k: summary[k] for k in expected} == expected


def test_the_tally_holds_a_bounded_number_of_blocks_oldest_forgotten():
    tally = tally_after([[S, list(range(10)), None, [], 16, None, None]], max_tracked=4)
    assert list(tally.held) == [hash(h) for h in (6, 7, 8, 9)]
    assert tally.summary().stored == 10


def test_batches_over_the_rate_are_dropped_as_gaps_and_the_next_second_takes_again():
    tally = KvTally(max_per_second=5)
    batch = [Stored((1, 2, 3), 16)]
    assert tally.take(batch, now=10.1)
    assert not tally.take([Stored((4, 5, 6), 16)], now=10.5)
    assert tally.gaps == 1 and len(tally.held) == 3
    assert tally.take([Stored((4, 5, 6), 16)], now=11.0)
    assert len(tally.held) == 6


def test_bytes_over_the_rate_are_not_decoded():
    tally = KvTally(max_bytes_per_second=1000)
    assert tally.admit(600, now=3.0)
    assert not tally.admit(600, now=3.9)
    assert tally.gaps == 1
    assert tally.admit(600, now=4.0)


def test_sequence_jumps_are_gaps_and_a_restart_forgets_what_was_held():
    tally = KvTally()
    for seq in (0, 1, 2, 5, 6):
        tally.sequence(seq)
    assert tally.gaps == 1
    tally.take([Stored((1, 2), 16)], now=0)
    tally.restarted()
    tally.sequence(0)  # the new engine counts from 0 again
    assert tally.gaps == 1 and tally.summary().blocks == 0


# --- the listener's socket -------------------------------------------------------------------------


@pytest.fixture
def listener():
    events = KvEventsListener("r-0", "kv-events")
    try:
        yield events
    finally:
        events.close()


def publisher(endpoint: str) -> zmq.Socket[bytes]:
    """A publisher as vLLM's ZmqEventPublisher is to a non-wildcard TCP endpoint: it connects."""
    pub = zmq.Context.instance().socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.connect(endpoint)
    return pub


def publish_until(
    pub: zmq.Socket[bytes], listener: KvEventsListener, parts: list[bytes], blocks: int
) -> None:
    """Publish until the listener holds ``blocks`` (a PUB drops what it sends before the
    subscription reaches it: ZMQ's slow joiner)."""
    deadline = time.monotonic() + 10
    seq = 0
    while listener.summary(0).blocks != blocks:
        assert time.monotonic() < deadline, listener.summary(0)
        pub.send_multipart([b"kv-events", seq.to_bytes(8, "big"), *parts])
        seq += 1
        time.sleep(0.05)


def test_a_real_publisher_s_events_are_tallied(listener):
    assert listener.endpoint.startswith("tcp://127.0.0.1:")
    pub = publisher(listener.endpoint)
    try:
        publish_until(pub, listener, [encoded(stored(b"h1", b"h2"))], 2)
        pub.send_multipart([b"kv-events", (999).to_bytes(8, "big"), encoded(AllBlocksCleared())])
        deadline = time.monotonic() + 10
        while listener.summary(0).clears == 0:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        summary = listener.summary(0)
        assert summary.blocks == 0 and summary.stored == 2 and summary.gaps >= 1  # 999 jumped
        # Another topic is not subscribed to; a restart forgets what was held.
        publish_until(pub, listener, [encoded(stored(b"h3"))], 1)
        pub.send_multipart([b"other", (0).to_bytes(8, "big"), encoded(stored(b"h4", b"h5"))])
        time.sleep(0.3)
        assert listener.summary(0).blocks == 1
        assert listener.summary(1).blocks == 0
    finally:
        pub.close(0)


def test_a_message_over_the_bound_is_never_taken(listener):
    pub = publisher(listener.endpoint)
    try:
        publish_until(pub, listener, [encoded(stored(b"small"))], 1)
        huge = encoded(stored(*[i.to_bytes(32, "big") for i in range(MAX_MESSAGE_BYTES // 32)]))
        assert len(huge) > MAX_MESSAGE_BYTES
        pub.send_multipart([b"kv-events", (10**6).to_bytes(8, "big"), huge])
        time.sleep(1.0)
        assert listener.summary(0).blocks == 1  # ZMQ dropped the peer, not a block taken
    finally:
        pub.close(0)


def non_loopback_addresses() -> list[str]:
    return [
        a.address
        for addresses in psutil.net_if_addrs().values()
        for a in addresses
        if a.family == socket.AF_INET and not a.address.startswith("127.")
    ]


def test_the_events_port_is_not_reachable_from_the_node_network(listener):
    """The attacker on the node's network: the unauthenticated events socket does not face it."""
    addresses = non_loopback_addresses()
    if not addresses:
        pytest.skip("this machine has no non-loopback IPv4 address to try")  # no real thing to try
    for address in addresses:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as attacker:
            attacker.settimeout(2)
            with pytest.raises(OSError):
                attacker.connect((address, listener.port))
    # From loopback it is there (the engine's way in).
    with socket.create_connection(("127.0.0.1", listener.port), timeout=2):
        pass
