"""Free capacity kept between reconcile cycles, brought up to date from what changed.

A cycle's ``WorkingState`` and ``IndexedSearch`` built from scratch cost a pass over every node,
device and replica of the fleet — at 5,000 nodes and 40,000 GPUs, most of a cycle's plan
(``bench/reconcile.py``). ``KeptCapacity`` keeps them from one cycle to the next and, for each new
snapshot, changes only what differs from what it holds:

- a replica it holds that the snapshot lacks (released, or placed last cycle and refused at
  commit) is released; a replica of the snapshot it does not hold (placed and committed, or
  allocated by another server) is held; one whose shards differ is released and held again;
- a node whose document differs (state, cordon, device health, model cache, hardware) gets its
  working state built anew, with what its replicas hold on it, and is indexed again.

What the last cycle's plan took and gave back in memory is undone by the same comparison: the
snapshot, not the plan, is what the state ends up equal to. Anything the patching does not cover
— device classes changed, a node added or removed, a class index that would have to grow — builds
the state from the snapshot, as a fresh ``Placer`` does. The search it hands over decides exactly
as a fresh one would (``tests/reconcile/test_incremental.py`` runs both over random changes).
"""

from __future__ import annotations

from fleetserve.drivers import Driver
from fleetserve.placement.index import IndexedSearch
from fleetserve.placement.placer import Placer
from fleetserve.placement.state import WorkingState
from fleetserve.snapshot import ClusterSnapshot
from fleetserve.spec.resources import DeviceClass, Node


class KeptCapacity:
    """One working state and its index, kept across cycles; a ``Placer`` over them per snapshot."""

    def __init__(self) -> None:
        self._state: WorkingState | None = None
        self._search: IndexedSearch | None = None
        self._nodes: dict[str, Node] = {}
        self._classes: dict[str, DeviceClass] = {}
        self._served: frozenset[Driver] = frozenset()
        self.rebuilds = 0  # how often the state was built from a whole snapshot
        self.patched_nodes = 0
        self._nodes_changed = False  # nodes re-indexed in place, over the kept state's life

    def placer(self, snapshot: ClusterSnapshot) -> Placer:
        """A Placer whose free capacity is exactly ``snapshot``'s; it changes the kept state."""
        try:
            patched = self._update(snapshot)
        except BaseException:
            self._state = self._search = None  # half patched: never trusted again
            raise
        if not patched or self._state is None or self._search is None:
            self._state = WorkingState(snapshot)
            self._search = IndexedSearch(self._state)
            self.rebuilds += 1
            patched = False
        if not patched or self._nodes_changed:
            self._served = snapshot.served_drivers()  # a function of the nodes and classes only
        self._nodes = {n.name: n for n in snapshot.nodes}
        self._classes = dict(snapshot.classes)
        return Placer(snapshot, kept=(self._state, self._search), served=self._served)

    def _update(self, snapshot: ClusterSnapshot) -> bool:
        """Patch the kept state to ``snapshot``; False when it must be built anew instead."""
        state, search = self._state, self._search
        if state is None or search is None or dict(snapshot.classes) != self._classes:
            return False
        kept_nodes = self._nodes
        if len(snapshot.nodes) != len(kept_nodes) or any(n.name not in kept_nodes for n in snapshot.nodes):
            return False
        state.snapshot = snapshot
        self._nodes_changed = False
        wanted = {r.name: r for r in snapshot.replicas}
        for name in [n for n in state.replicas if n not in wanted]:
            search.release(name)
        for replica in snapshot.replicas:
            held = state.replicas.get(replica.name)
            if held is replica:
                continue
            if held is None:
                search.hold(replica)
            elif held.shards != replica.shards:
                search.release(replica.name)
                search.hold(replica)
            else:
                state.replicas[replica.name] = replica  # the same allocation: compare by identity next
        for node in snapshot.nodes:
            old = kept_nodes[node.name]
            if old is node or old == node:
                continue
            self._nodes_changed = True
            before, after = state.replace_node(node, snapshot)
            self.patched_nodes += 1
            if not search.replace_node(before, after):
                return False
        return True
