"""Waking held assignment long-polls: one store read per tick for all of them, not one per poll.

An agent holds ``GET /assignments?since=REVISION&wait=…`` open until its assignments change.
Building a node's assignments (documents parsed, a digest of them) to find out whether they
changed is far too dear to do for every held poll every half second at thousands of nodes. So
each server process keeps one ``AssignmentWatch``: while any poll is held it reads, once per tick
when the store's change counter moved (``changegate``; heartbeats do not move it), what every
node's assignments are built from (``store.assignment_inputs``: plain rows, nothing
parsed), folds it into one fingerprint per node (``fingerprints``, pure), and wakes only the polls
of nodes whose fingerprint moved. A woken poll builds its assignments again and answers if the
revision differs; a spurious wake costs one build, a missed change cannot happen (the poll takes
the fingerprint *before* it builds, so a change in between shows as a moved fingerprint).

Each process reads the shared database itself, so a poll held by one server sees allocations
another server's reconciler committed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from starlette.concurrency import run_in_threadpool

from fleetserve.changegate import ChangeGate
from fleetserve.errors import FleetserveError
from fleetserve.protocol import AssignmentSet
from fleetserve.store.protocols import AssignmentSource
from fleetserve.store.reports import AssignmentInputs

log = logging.getLogger("fleetserve.assignwatch")

# How often the held polls' nodes are checked: the delay an agent sees before a new assignment.
# A held poll waits once for all of its wait: its node moving wakes it, and so do its agent going
# away (``wake``) and the server stopping (at the next tick).
TICK_SECONDS = 0.5

Fingerprint = int


@dataclass(frozen=True)
class Fingerprints:
    """One tick's fingerprint of every node's assignment inputs."""

    per_node: Mapping[str, Fingerprint]
    empty: Fingerprint  # a node not registered

    def of(self, node: str) -> Fingerprint:
        return self.per_node.get(node, self.empty)


def fingerprints(inputs: AssignmentInputs) -> Fingerprints:
    """Per registered node, a digest of everything its assignments are built from: its epoch, its
    replicas, their deployments' specs, the epochs of every node they span, the models and classes.

    Python's ``hash`` suffices: fingerprints are only compared within one process."""
    shard_nodes: dict[str, list[str]] = {}
    for replica, node, _ in inputs.shards:
        shard_nodes.setdefault(replica, []).append(node)
    per_node: dict[str, set[tuple[str, str, tuple[tuple[str, int], ...]]]] = {}
    for replica, node, deployment in inputs.shards:
        peers = tuple((n, inputs.epochs.get(n, 0)) for n in sorted(shard_nodes[replica]))
        per_node.setdefault(node, set()).add((replica, inputs.deployments.get(deployment, ""), peers))
    shared = hash(inputs.shared)
    none: frozenset[tuple[str, str, tuple[tuple[str, int], ...]]] = frozenset()
    return Fingerprints(
        {
            # The node's own epoch too: a poll of an older registration must answer (and be refused).
            node: hash((shared, epoch, frozenset(per_node.get(node, none))))
            for node, epoch in inputs.epochs.items()
        },
        hash((shared, 0, none)),
    )


class AssignmentWatch:
    """One per server process: ticks while polls are held, and wakes those whose node changed."""

    def __init__(
        self,
        store: AssignmentSource,
        tick: float = TICK_SECONDS,
        stopping: Callable[[], bool] = lambda: False,
    ) -> None:
        self.store = store
        self.tick = tick
        self.stopping = stopping  # once true, every held poll wakes at the next tick
        self._prints: Fingerprints | None = None
        self._inputs: AssignmentInputs | None = None  # what ``_prints`` was computed from
        self._waiters: dict[str, list[tuple[Fingerprint | None, asyncio.Future[None]]]] = {}
        # Per node, the last answer built and the fingerprint taken before building it.
        self._answers: dict[str, tuple[Fingerprint, AssignmentSet]] = {}
        self._task: asyncio.Task[None] | None = None
        self.reads = 0  # store reads made, for tests and the curious
        # The inputs are read again only when the fleet changed (``changegate``).
        self.gate = ChangeGate()

    def current(self, node: str) -> Fingerprint | None:
        """The node's fingerprint as of the last tick (None before the first): take it BEFORE
        building the assignments it stands for."""
        return None if self._prints is None else self._prints.of(node)

    def remember(self, node: str, seen: Fingerprint | None, answer: AssignmentSet) -> None:
        """Keep the answer built after taking ``seen``, for ``answered``."""
        if seen is not None:
            self._answers[node] = (seen, answer)

    def answered(self, node: str, epoch: int, since: str | None) -> AssignmentSet | None:
        """The answer last built for the node, if the agent holds it already (``since``, for
        ``epoch``) and nothing it was built from has moved since: a re-issued poll then waits at
        once instead of building the same set again (thousands of agents re-poll every 20 s)."""
        kept = self._answers.get(node)
        now = self.current(node)
        if kept is None or now is None or kept[0] != now:
            return None
        answer = kept[1]
        return answer if answer.epoch == epoch and answer.revision == since else None

    async def changed(self, node: str, seen: Fingerprint | None, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the node's fingerprint to move from ``seen``;
        whether it did (or may have: ``seen`` None moves at the first tick)."""
        if seen is not None and self.current(node) not in (None, seen):
            return True
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (seen, future)
        self._waiters.setdefault(node, []).append(entry)
        self._ensure_ticking()
        try:
            await asyncio.wait_for(future, timeout)
            return True
        except TimeoutError:
            return False
        finally:
            waiting = self._waiters.get(node, [])
            if entry in waiting:
                waiting.remove(entry)
            if not waiting:
                self._waiters.pop(node, None)

    def _ensure_ticking(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while self._waiters:
            began = time.monotonic()
            try:
                inputs = await run_in_threadpool(self.inputs_if_changed)
                moved = False
                if inputs is not None and (inputs != self._inputs or self._prints is None):
                    # Most ticks nothing moved: comparing the rows is far cheaper than hashing
                    # every node's inputs again.
                    self._prints = await run_in_threadpool(fingerprints, inputs)
                    self._inputs = inputs
                    moved = True
                    known = self._prints.per_node
                    for node in [n for n in self._answers if n not in known]:
                        del self._answers[node]  # deleted nodes
                # A tick where no fingerprint moved wakes nobody: a poll's fingerprint is taken
                # from the last tick's, and one that differs already never waits (``changed``).
                # With thousands of polls held, looking at each every tick was most of its cost.
                if moved or self.stopping():
                    self._wake()
            except FleetserveError as exc:
                log.warning("checking the held assignment polls failed: %s", exc)
                if self.stopping():
                    self._wake()
            await asyncio.sleep(max(0.0, self.tick - (time.monotonic() - began)))

    def inputs_if_changed(self) -> AssignmentInputs | None:
        """The inputs read now, or None when the store's change counter has not moved since the
        last read and no full read is due (blocking)."""
        counter = self.store.fleet_changes()
        if not self.gate.due(counter):
            return None
        began = self.gate.clock()
        inputs = self.store.assignment_inputs()
        self.gate.read(counter, began)
        self.reads += 1
        return inputs

    def _wake(self) -> None:
        stopping = self.stopping()
        for node, waiting in list(self._waiters.items()):
            now = self.current(node)
            for seen, future in waiting:
                if (stopping or seen is None or seen != now) and not future.done():
                    future.set_result(None)

    def wake(self, node: str) -> None:
        """Wake the node's held polls now, moved or not (one of them has lost its agent): each
        looks at its own request, and a poll whose node has not moved waits again."""
        for _, future in self._waiters.get(node, ()):
            if not future.done():
                future.set_result(None)

    async def aclose(self) -> None:
        """Stop ticking (the app is shutting down)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
