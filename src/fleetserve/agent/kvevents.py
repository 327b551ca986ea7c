"""The agent consumes its vLLM replicas' KV cache events and reports what they say.

vLLM publishes KV cache events (``--kv-events-config``, the engine row's ``kv_events``) through
ZMQ with no authentication at all, so the socket must never face the node's network: the agent
binds a SUB socket on 127.0.0.1 at a port ZMQ picks (``KvEventsListener``), the engine connects
to it (vLLM's publisher connects to a non-wildcard TCP endpoint), and what the events say leaves
the node only inside the agent's status report (``protocol.KvCacheSummary``), which the server
takes on the node's credential and for the node's own replicas only. Each message is
``[topic, sequence (8 bytes, big-endian), msgpack KVEventBatch]`` (``vllm/distributed/kv_events.py``,
0.32); a batch is ``[ts, [event, ...], data_parallel_rank?]`` (``array_like``) and each event a
map tagged by ``type`` (``tag=True``, ``omit_defaults``): ``{"type": "BlockStored",
"block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", ...}``,
``{"type": "BlockRemoved", "block_hashes", "medium", ...}``, ``{"type": "AllBlocksCleared"}``
(earlier vLLMs encoded events as tagged arrays in that field order: read too).

``KvTally`` folds the events into what is reported, pure and bounded: the hashes of the blocks
held (at most ``MAX_TRACKED_BLOCKS``, the oldest forgotten first), the block size, stored and
removed totals, whole-cache clears, and ``gaps`` (batches missed by sequence, unreadable, or
dropped over ``MAX_BYTES_PER_SECOND`` or ``MAX_BLOCKS_PER_SECOND``: the counts are approximate
after one). A removed block
never seen stored is not counted, so a missed store cannot drive the count below what is held.
Everything the socket takes is bounded: a message over ``MAX_MESSAGE_BYTES`` makes ZMQ drop the
peer, at most ``RECEIVE_HWM`` messages queue, and the hashes of one second past the rate are
dropped unread. Events of another medium than the engine's own KV (an offload tier's) are not
its cache and are skipped.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import msgspec
import zmq

from fleetserve.protocol import KvCacheSummary

log = logging.getLogger("fleetserve.agent")

LOOPBACK = "127.0.0.1"
MAX_TRACKED_BLOCKS = 1 << 17
"""The most block hashes held per replica (131,072 blocks: 2M tokens at 16 a block, under 20 MB)."""
MAX_BLOCKS_PER_SECOND = 50_000
"""The most block hashes (stored and removed) taken per replica per second; past it batches drop."""
MAX_BYTES_PER_SECOND = 16 << 20
"""The most message bytes decoded per replica per second; past it messages drop unread, so a
flood costs the agent a bounded share of a core, whatever it holds."""
MAX_MESSAGE_BYTES = 4 << 20
"""The largest message the socket takes (ZMQ_MAXMSGSIZE: a larger one drops the peer)."""
RECEIVE_HWM = 1000
"""The most messages queued unread (ZMQ_RCVHWM: beyond it ZMQ drops them, seen as a gap)."""
DEFAULT_BLOCK_TOKENS = 16
# The media that are the engine's own KV cache (None: vLLM before it said; "GPU" its own blocks,
# the CPU build's too); another ("CPU": an offloaded tier) is not what the prefix cache serves from.
OWN_MEDIA = frozenset({None, "GPU"})


@dataclass(frozen=True)
class Stored:
    hashes: tuple[int, ...]
    block_tokens: int
    medium: str | None = None


@dataclass(frozen=True)
class Removed:
    hashes: tuple[int, ...]
    medium: str | None = None


@dataclass(frozen=True)
class Cleared:
    pass


KvEvent = Stored | Removed | Cleared


def _key(block_hash: object) -> int | None:
    """A block hash (vLLM's ExternalBlockHash: bytes or int) as a set key."""
    if isinstance(block_hash, bytes | int) and not isinstance(block_hash, bool):
        return hash(block_hash)
    return None


def _hashes(value: object) -> tuple[int, ...] | None:
    if not isinstance(value, list):
        return None
    keys = [_key(h) for h in value]
    return None if any(k is None for k in keys) else tuple(k for k in keys if k is not None)


def _stored(hashes_value: object, size: object, medium: object) -> Stored | None:
    hashes = _hashes(hashes_value)
    if hashes is None or not isinstance(size, int) or isinstance(size, bool) or size < 1:
        return None
    return Stored(hashes, min(size, 1 << 16), medium if isinstance(medium, str) else None)


def _removed(hashes_value: object, medium: object) -> Removed | None:
    hashes = _hashes(hashes_value)
    return None if hashes is None else Removed(hashes, medium if isinstance(medium, str) else None)


def read_event(event: object) -> KvEvent | None:
    """One decoded event, or None for one not understood (a newer kind is skipped, not fatal): a
    map tagged by ``type`` (vLLM 0.32's structs), or a tagged array (earlier ones, ``array_like``)."""
    if isinstance(event, dict):
        tag = event.get("type")
        if tag == "AllBlocksCleared":
            return Cleared()
        if tag == "BlockStored":
            return _stored(event.get("block_hashes"), event.get("block_size"), event.get("medium"))
        if tag == "BlockRemoved":
            return _removed(event.get("block_hashes"), event.get("medium"))
        return None
    if not isinstance(event, list) or not event:
        return None
    tag = event[0]
    if tag == "AllBlocksCleared":
        return Cleared()
    if tag == "BlockStored" and len(event) >= 5:
        return _stored(event[1], event[4], event[6] if len(event) > 6 else None)
    if tag == "BlockRemoved" and len(event) >= 2:
        return _removed(event[1], event[2] if len(event) > 2 else None)
    return None


def decode_batch(payload: bytes) -> list[KvEvent] | None:
    """A KVEventBatch's events (those understood), or None when the payload is not a batch."""
    try:
        batch = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError:
        return None
    if not isinstance(batch, list) or len(batch) < 2 or not isinstance(batch[1], list):
        return None
    return [e for e in (read_event(item) for item in batch[1]) if e is not None]


def batch_size(events: Sequence[KvEvent]) -> int:
    """The block hashes a batch carries: what the rate bound counts."""
    return sum(len(e.hashes) for e in events if not isinstance(e, Cleared))


@dataclass
class KvTally:
    """What one replica's events said, folded (see the module's docstring). Pure: the clock is
    passed to ``take``."""

    held: OrderedDict[int, None] = field(default_factory=OrderedDict)
    block_tokens: int = DEFAULT_BLOCK_TOKENS
    stored: int = 0
    removed: int = 0
    clears: int = 0
    gaps: int = 0
    last_seq: int | None = None
    # The rate bounds: the second they count, and the block hashes and bytes taken in it.
    second: int = -1
    taken: int = 0
    read: int = 0
    max_tracked: int = MAX_TRACKED_BLOCKS
    max_per_second: int = MAX_BLOCKS_PER_SECOND
    max_bytes_per_second: int = MAX_BYTES_PER_SECOND

    def _tick(self, now: float) -> None:
        second = int(now)
        if second != self.second:
            self.second, self.taken, self.read = second, 0, 0

    def admit(self, size: int, now: float) -> bool:
        """Whether a message of ``size`` bytes may be decoded this second (else a gap)."""
        self._tick(now)
        if self.read + size > self.max_bytes_per_second:
            self.gaps += 1
            return False
        self.read += size
        return True

    def sequence(self, seq: int) -> None:
        """A message of sequence number ``seq`` arrived: one after a jump counts a gap."""
        if self.last_seq is not None and seq != self.last_seq + 1:
            self.gaps += 1
        self.last_seq = seq

    def take(self, events: Sequence[KvEvent], now: float) -> bool:
        """Fold a batch in, unless it goes over this second's rate (then a gap); whether taken."""
        self._tick(now)
        size = batch_size(events)
        if self.taken + size > self.max_per_second:
            self.gaps += 1
            return False
        self.taken += size
        for event in events:
            self.apply(event)
        return True

    def apply(self, event: KvEvent) -> None:
        held = self.held
        if isinstance(event, Cleared):
            held.clear()
            self.clears += 1
            return
        if event.medium not in OWN_MEDIA:
            return
        if isinstance(event, Stored):
            self.block_tokens = event.block_tokens
            for key in event.hashes:
                if key not in held:
                    self.stored += 1
                held[key] = None
            while len(held) > self.max_tracked:
                held.popitem(last=False)
            return
        for key in event.hashes:
            if key in held:
                del held[key]
                self.removed += 1

    def restarted(self) -> None:
        """The engine started again: it holds nothing, and its sequence numbers start over."""
        self.held.clear()
        self.last_seq = None

    def summary(self) -> KvCacheSummary:
        return KvCacheSummary(
            blocks=len(self.held),
            blockTokens=self.block_tokens,
            stored=self.stored,
            removed=self.removed,
            clears=self.clears,
            gaps=self.gaps,
        )


class KvEventsListener:
    """One replica's events socket: bound on loopback at a port ZMQ picks (``endpoint``: what the
    engine is told), read on a thread of its own into a ``KvTally``."""

    def __init__(self, replica: str, topic: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.replica = replica
        self.clock = clock
        self.tally = KvTally()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._restarts: int | None = None
        self._socket: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
        self._socket.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        self._socket.setsockopt(zmq.RCVHWM, RECEIVE_HWM)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.SUBSCRIBE, topic.encode())
        port: int = self._socket.bind_to_random_port(f"tcp://{LOOPBACK}")
        self.endpoint = f"tcp://{LOOPBACK}:{port}"
        self.port = port
        self._thread = threading.Thread(target=self._run, name=f"kv-events-{replica}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        socket = self._socket
        try:
            while not self._stop.is_set():
                if not socket.poll(250):
                    continue
                parts = socket.recv_multipart(zmq.NOBLOCK)
                self._received(parts)
        except zmq.ZMQError as exc:
            if not self._stop.is_set():
                log.warning("replica %s: KV events socket failed: %s", self.replica, exc)
        finally:
            socket.close(0)

    def _received(self, parts: list[bytes]) -> None:
        seq = int.from_bytes(parts[1], "big") if len(parts) == 3 and len(parts[1]) == 8 else None
        with self._lock:
            if seq is not None:
                self.tally.sequence(seq)
            if len(parts) < 2 or not self.tally.admit(len(parts[-1]), self.clock()):
                if len(parts) < 2:
                    self.tally.gaps += 1
                return
        events = decode_batch(parts[-1])  # off the lock: the report never waits on a decode
        with self._lock:
            if events is None:
                self.tally.gaps += 1
                return
            self.tally.take(events, self.clock())

    def summary(self, restarts: int) -> KvCacheSummary:
        """What the events said, for the report; ``restarts`` is the engine's restart count now (a
        restart forgets what it held)."""
        with self._lock:
            if self._restarts is not None and restarts != self._restarts:
                self.tally.restarted()
            self._restarts = restarts
            return self.tally.summary()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
