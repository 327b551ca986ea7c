"""The indexed search: free capacity bucketed per device class, so a decision never scans the fleet.

Per class, eligible nodes (Ready, not cordoned, tolerating the class's driver taint) sit in
buckets by how many devices of the class they have free — and again per fabric for multi-node
replicas, and again per cached model, so "among equals, a node holding the model" is a lookup,
not a scan. Bin packing is "the lowest non-empty bucket at or above k"; the emptiest machines are
the highest buckets. CPU nodes sit in one list sorted by free cores (and again per cached model).
Explanations are computed from counters kept beside the buckets, so a "does not fit" costs no
scan either; they agree exactly with the full scan in ``naive.py`` (a property the tests check).

A report depends only on the nodes of its demand's class index (or on the CPU list), so it is
kept per demand until a commit or release touches one of those nodes: when a deployment's
replicas do not fit, the first one is explained and the rest reuse that explanation.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from sortedcontainers import SortedList

from fleetserve.drivers import RuntimeVariant, host_driver, parse_driver
from fleetserve.engines.spec import EngineKind
from fleetserve.placement.choose import Found, found_group, found_single, group_score
from fleetserve.placement.demand import Demand
from fleetserve.placement.filters import free_cores, free_memory
from fleetserve.placement.report import ProfileReport, Reason, report_for
from fleetserve.placement.state import ENGINE_VARIANTS, NodeWork, WorkingState
from fleetserve.spec.resources import Replica

Counts = dict[tuple[Reason, int | None], int]
Build = tuple[EngineKind, RuntimeVariant]
# (engine, variant) → names of indexed nodes that reported their engines without that build.
Lacking = dict[Build, set[str]]


def _lack(lacking: Lacking, node: NodeWork, add: bool) -> None:
    """Count ``node`` in (or out of) the lacking set of every build it reported it has not."""
    if node.runs is None:
        return
    for build in ENGINE_VARIANTS:
        if build not in node.runs:
            members = lacking.setdefault(build, set())
            if add:
                members.add(node.name)
            else:
                members.discard(node.name)


def _build(demand: Demand) -> Build:
    return (demand.engine, demand.variant)


Buckets = list[SortedList]  # index j: names of nodes with j free devices of the class, sorted


def _buckets(max_devices: int) -> Buckets:
    return [SortedList() for _ in range(max_devices + 1)]


class _ClassIndex:
    """Buckets of eligible nodes by free-device count for one device class."""

    def __init__(self, max_devices: int) -> None:
        self.size = max_devices
        self.all: Buckets = _buckets(max_devices)
        self.attached: Buckets = _buckets(max_devices)  # nodes on at least one fabric
        self.fabric: dict[str, Buckets] = {}
        self.held: dict[str, Buckets] = {}  # model → nodes whose cache holds it
        self.present = 0  # Ready, uncordoned nodes with this class, before the taint check
        self.eligible = 0
        self.no_fabric = 0
        # Eligible nodes without a build (filtered before any capacity check): skipped in searches.
        self.lacking: Lacking = {}
        # Bumped whenever a member node's free devices, cores or memory may have changed: a
        # memoised report for this class is current while the version it was made at is.
        self.version = 0

    def buckets_for(self, fabric: str) -> Buckets:
        if fabric not in self.fabric:
            self.fabric[fabric] = _buckets(self.size)
        return self.fabric[fabric]

    def place(self, node: NodeWork, j: int, add: bool) -> None:
        """Add ``node`` to (or remove it from) every bucket list it belongs in at count ``j``."""
        op = SortedList.add if add else SortedList.remove
        name = node.name
        op(self.all[j], name)
        if node.fabrics:
            op(self.attached[j], name)
            for fabric in node.fabrics:
                op(self.buckets_for(fabric)[j], name)
        for model in node.cache:
            held = self.held.get(model)
            if held is None:
                held = self.held[model] = _buckets(self.size)
            op(held[j], name)


class IndexedSearch:
    """Finds a place for a demand from per-class free-capacity indexes."""

    def __init__(self, state: WorkingState) -> None:
        self.state = state
        self.not_ready = 0
        self.cordoned = 0
        self.classes: dict[str, _ClassIndex] = {}
        self.cpu = SortedList()  # (-free cores, name) of nodes a CPU replica may use
        self.cpu_held: dict[str, SortedList] = {}  # model → the same, for nodes caching it
        self.cpu_taint = 0  # Ready, uncordoned nodes in a GPU pool
        self.cpu_version = 0  # as _ClassIndex.version, for the CPU list
        self.cpu_lacking: Lacking = {}  # as _ClassIndex.lacking, for the CPU list
        self._count: dict[tuple[str, str], int] = {}  # (class, node) → indexed free count
        self._cores: dict[str, int] = {}
        self._reports: dict[Demand, tuple[int, ProfileReport]] = {}  # demand → (version, report)
        # Nodes whose replicas hold more cores or memory than they have (one that re-registered
        # smaller): they take no new replica, even one that claims no host CPU.
        self._overcommitted: set[str] = {n.name for n in state.nodes if n.free_cores < 0 or n.free_memory < 0}
        self._drivers = {c: parse_driver(d.driver) for c, d in state.snapshot.classes.items()}
        for node in state.nodes:
            self._add_node(node)

    def _add_node(self, node: NodeWork) -> bool:
        """Count ``node`` in and index its free capacity; False when a class index would have to
        grow (a node with more devices of a class than any before it): build the search anew."""
        if not node.ready:
            self.not_ready += 1
            return True
        if node.cordoned:
            self.cordoned += 1
            return True
        for cls in node.devices_of:
            index = self.classes.get(cls)
            if index is not None and len(node.devices_of[cls]) > index.size:
                return False
        if node.tolerates(host_driver()):
            self._cores[node.name] = node.free_cores
            self._cpu_place(node, node.free_cores, add=True)
            _lack(self.cpu_lacking, node, add=True)
        else:
            self.cpu_taint += 1
        for cls in node.devices_of:
            index = self.classes.get(cls)
            if index is None:
                size = max(len(n.devices_of.get(cls, ())) for n in self.state.nodes)
                index = self.classes[cls] = _ClassIndex(size)
            index.present += 1
            driver = self._drivers.get(cls)
            if driver is None or not node.tolerates(driver):
                continue
            index.eligible += 1
            index.no_fabric += 0 if node.fabrics else 1
            _lack(index.lacking, node, add=True)
            j = node.free_count(cls)
            self._count[(cls, node.name)] = j
            index.place(node, j, add=True)
        return True

    def _remove_node(self, node: NodeWork) -> None:
        """Undo ``_add_node`` for ``node`` as it is indexed now."""
        self._overcommitted.discard(node.name)
        if not node.ready:
            self.not_ready -= 1
            return
        if node.cordoned:
            self.cordoned -= 1
            return
        cores = self._cores.pop(node.name, None)
        if cores is not None:
            self._cpu_place(node, cores, add=False)
            _lack(self.cpu_lacking, node, add=False)
        else:
            self.cpu_taint -= 1
        for cls in node.devices_of:
            index = self.classes[cls]
            index.present -= 1
            j = self._count.pop((cls, node.name), None)
            if j is None:
                continue
            index.eligible -= 1
            index.no_fabric -= 0 if node.fabrics else 1
            _lack(index.lacking, node, add=False)
            index.place(node, j, add=False)

    def replace_node(self, old: NodeWork, new: NodeWork) -> bool:
        """Index ``new`` (the same node's new facts, its replicas held) in place of ``old``;
        False when the search must be built anew instead. Every kept explanation is dropped: the
        counts of not-Ready and cordoned nodes, which every explanation carries, may have moved."""
        self._remove_node(old)
        self._reports.clear()
        self.cpu_version += 1
        for index in self.classes.values():
            index.version += 1
        if new.free_cores < 0 or new.free_memory < 0:
            self._overcommitted.add(new.name)
        return self._add_node(new)

    # --- changes -------------------------------------------------------------------------

    def _cpu_place(self, node: NodeWork, cores: int, add: bool) -> None:
        op = SortedList.add if add else SortedList.remove
        entry = (-cores, node.name)
        op(self.cpu, entry)
        for model in node.cache:
            held = self.cpu_held.get(model)
            if held is None:
                held = self.cpu_held[model] = SortedList()
            op(held, entry)

    def _refresh(self, nodes: list[NodeWork]) -> None:
        for node in nodes:
            if node.free_cores < 0 or node.free_memory < 0:
                self._overcommitted.add(node.name)
            else:
                self._overcommitted.discard(node.name)
            for cls in node.devices_of:
                old = self._count.get((cls, node.name))
                if old is None:
                    continue
                index = self.classes[cls]
                index.version += 1  # host cores or memory may have changed even if devices did not
                new = node.free_count(cls)
                if new != old:
                    index.place(node, old, add=False)
                    index.place(node, new, add=True)
                    self._count[(cls, node.name)] = new
            old_cores = self._cores.get(node.name)
            if old_cores is not None:
                self.cpu_version += 1  # free memory may have changed even if cores did not
                if old_cores != node.free_cores:
                    self._cpu_place(node, old_cores, add=False)
                    self._cpu_place(node, node.free_cores, add=True)
                    self._cores[node.name] = node.free_cores

    def commit(self, replica: Replica) -> None:
        """Allocate a replica found by ``find`` and update the indexes."""
        self._refresh(self.state.allocate(replica))

    def release(self, name: str) -> None:
        """Give back a replica's every shard and update the indexes."""
        self._refresh(self.state.release(name))

    def hold(self, replica: Replica) -> None:
        """Count what an existing replica holds (see ``WorkingState.hold``) and update the indexes."""
        self._refresh(self.state.hold(replica))

    # --- search ----------------------------------------------------------------------------

    def find(self, demand: Demand) -> Found | ProfileReport:
        """Where ``demand`` fits, or a report of why no node does."""
        if demand.device_class is None:
            index = None
            version = self.cpu_version
        else:
            index = self.classes.get(demand.device_class)
            version = index.version if index is not None else 0
        memo = self._reports.get(demand)
        if memo is not None and memo[0] == version:
            return memo[1]
        found = self._find(demand, index)
        if isinstance(found, ProfileReport):
            self._reports[demand] = (version, found)
        return found

    def _find(self, demand: Demand, index: _ClassIndex | None) -> Found | ProfileReport:
        if demand.device_class is None:
            return self._find_cpu(demand)
        if index is None or demand.device_memory > demand.class_memory:
            return self._gpu_report(demand, index, {}, 0, {})
        if demand.nodes == 1:
            return self._find_single(demand, index)
        return self._find_group(demand, index)

    def _fits_host(self, node: NodeWork, demand: Demand, counts: Counts | None) -> bool:
        """Whether ``node`` has the cores and memory ``demand`` claims; count the rejection if not."""
        rejection = free_cores(node, demand) or free_memory(node, demand)
        if rejection is None:
            return True
        if counts is not None:
            counts[rejection] = counts.get(rejection, 0) + 1
        return False

    def _first_fit(
        self, names: Iterable[str], demand: Demand, counts: Counts | None, lacking: set[str]
    ) -> NodeWork | None:
        """The first of ``names`` with the build whose host fits ``demand``, counting every host
        rejection before it (a node without the build is counted as such, from ``lacking``)."""
        by_name = self.state.by_name
        for name in names:
            if name in lacking:
                continue
            node = by_name[name]
            if self._fits_host(node, demand, counts):
                return node
        return None

    def _find_single(self, demand: Demand, index: _ClassIndex) -> Found | ProfileReport:
        by_name = self.state.by_name
        k = demand.devices_per_node
        # Without a host claim every node of a bucket fits, unless some node is overcommitted.
        claims_host = demand.cpu_cores > 0 or demand.host_memory > 0 or bool(self._overcommitted)
        held = index.held.get(demand.model)
        lacking = index.lacking.get(_build(demand), set())
        counts: Counts = {}
        for j in range(k, len(index.all)):
            bucket = index.all[j]
            if not bucket:
                continue
            holders = held[j] if held is not None else None  # of this bucket, by name
            if not claims_host:
                # Every node in the bucket with the build fits: among equals, the first holding
                # the model.
                name = next((n for n in holders or () if n not in lacking), None)
                name = name or next((n for n in bucket if n not in lacking), None)
                if name is not None:
                    return found_single(by_name[name], demand)
                continue
            # A holder that fits, else the first node that fits. Only the scan of the whole
            # bucket counts rejections (the holders are in it too); they matter only when no
            # bucket has a fit, and then every bucket was scanned whole.
            node = self._first_fit(holders, demand, None, lacking) if holders else None
            if node is None:
                node = self._first_fit(bucket, demand, counts, lacking)
            if node is not None:
                return found_single(node, demand)
        return self._gpu_report(demand, index, counts, 0, {})

    def _members(self, buckets: Buckets, demand: Demand, counts: Counts) -> Iterator[NodeWork]:
        """Nodes of a fabric with the build that fit alone, emptiest first."""
        by_name = self.state.by_name
        index = self.classes[demand.device_class] if demand.device_class else None
        lacking = index.lacking.get(_build(demand), set()) if index else set()
        for j in range(len(buckets) - 1, demand.devices_per_node - 1, -1):
            for name in buckets[j]:
                if name in lacking:
                    continue
                node = by_name[name]
                if self._fits_host(node, demand, counts):
                    yield node

    def _find_group(self, demand: Demand, index: _ClassIndex) -> Found | ProfileReport:
        best: tuple[tuple[int, str], list[NodeWork], str] | None = None
        for fabric, buckets in index.fabric.items():
            chosen: list[NodeWork] = []
            for node in self._members(buckets, demand, {}):
                chosen.append(node)
                if len(chosen) == demand.nodes:
                    break
            if len(chosen) == demand.nodes:
                score = group_score(chosen, demand, fabric)
                if best is None or score < best[0]:
                    best = (score, chosen, fabric)
        if best is not None:
            return found_group(best[1], demand, best[2])
        counts: Counts = {}
        n_fit = sum(1 for _ in self._members(index.attached, demand, counts))
        fabric_fit = {
            f: n for f, b in index.fabric.items() if (n := sum(1 for _ in self._members(b, demand, {})))
        }
        return self._gpu_report(demand, index, counts, n_fit, fabric_fit)

    def _find_cpu(self, demand: Demand) -> Found | ProfileReport:
        by_name = self.state.by_name
        best: NodeWork | None = None
        memory_short = 0
        lacking = self.cpu_lacking.get(_build(demand), set())
        # Most free cores first; the first node with the build whose memory also fits sets the
        # best core count.
        for neg_cores, name in self.cpu:
            if -neg_cores < demand.cpu_cores:
                break
            if name in lacking:
                continue
            node = by_name[name]
            if node.free_memory < demand.host_memory:
                memory_short += 1
                continue
            best = node
            break
        if best is not None:
            # Among equals (the same free cores), the first node by name holding the model.
            held = self.cpu_held.get(demand.model)
            if held:
                top = -best.free_cores
                for neg_cores, name in held.islice(held.bisect_left((top, ""))):
                    if neg_cores != top:
                        break
                    if name in lacking:
                        continue
                    node = by_name[name]
                    if node.free_memory >= demand.host_memory:
                        return found_single(node, demand)
            return found_single(best, demand)
        cpu_short = len(self.cpu) - self.cpu.bisect_left((-demand.cpu_cores + 1, ""))
        # Of those short of cores, the nodes without the build are counted as such.
        lacking_short = sum(1 for name in lacking if self._cores[name] < demand.cpu_cores)
        counts: Counts = self._base_counts()
        rest = len(self.state.nodes) - self.not_ready - self.cordoned
        counts[(Reason.TAINT_NOT_TOLERATED, None)] = rest - len(self.cpu)
        counts[(Reason.ENGINE_NOT_INSTALLED, None)] = len(lacking)
        counts[(Reason.INSUFFICIENT_CPU, None)] = cpu_short - lacking_short
        counts[(Reason.INSUFFICIENT_MEMORY, None)] = memory_short
        return self._report(demand, counts, 0, {})

    # --- explanations from counters ------------------------------------------------------------

    def _base_counts(self) -> Counts:
        return {(Reason.NOT_READY, None): self.not_ready, (Reason.CORDONED, None): self.cordoned}

    def _gpu_report(
        self,
        demand: Demand,
        index: _ClassIndex | None,
        host_counts: Counts,
        n_fit: int,
        fabric_fit: dict[str, int],
    ) -> ProfileReport:
        counts = self._base_counts()
        rest = len(self.state.nodes) - self.not_ready - self.cordoned
        present = index.present if index else 0
        counts[(Reason.NO_DEVICE_OF_CLASS, None)] = rest - present
        if index is not None:
            counts[(Reason.TAINT_NOT_TOLERATED, None)] = present - index.eligible
            # Eligible nodes without the build, before any capacity check; the rest, below, are
            # counted without them.
            lacking = index.lacking.get(_build(demand), set())
            counts[(Reason.ENGINE_NOT_INSTALLED, None)] = len(lacking)
            if demand.device_memory > demand.class_memory:
                counts[(Reason.DEVICE_MEMORY_TOO_SMALL, None)] = index.eligible - len(lacking)
            else:
                buckets = index.all
                by_name = self.state.by_name
                index_class = demand.device_class or ""
                if demand.nodes > 1:
                    lacking = {n for n in lacking if by_name[n].fabrics}
                    counts[(Reason.NO_FABRIC, None)] = index.no_fabric - (
                        len(index.lacking.get(_build(demand), set())) - len(lacking)
                    )
                    buckets = index.attached
                short: dict[int, int] = {}
                for name in lacking:
                    j = self._count[(index_class, name)]
                    short[j] = short.get(j, 0) + 1
                for j in range(min(demand.devices_per_node, len(buckets))):
                    counts[(Reason.INSUFFICIENT_FREE_DEVICES, j)] = len(buckets[j]) - short.get(j, 0)
                for key, n in host_counts.items():
                    counts[key] = counts.get(key, 0) + n
                if n_fit:
                    counts[(Reason.FABRIC_TOO_SMALL, None)] = n_fit
        return self._report(demand, counts, n_fit, fabric_fit)

    def _report(
        self, demand: Demand, counts: Counts, n_fit: int, fabric_fit: dict[str, int]
    ) -> ProfileReport:
        return report_for(demand, len(self.state.nodes), counts, n_fit, fabric_fit)
