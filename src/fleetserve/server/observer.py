"""The control plane's view of its engines: scrape every Running replica's ``/metrics``, map it
onto the canonical names (one mapping per engine), publish it on ``/metrics``, and keep each
replica's running and waiting requests for the gateway's picking and the autoscaler.

It also tells each replica's engine epoch (``epochs``), a count that moves when the engine lost
its caches: its agent reported a restart, or its prompt-token counter went backwards (a counter
resets only when its process starts again). The gateway's cache model of a replica is cleared
when its epoch moves (``gateway.prefixcache``). A vLLM replica's epoch moves too when its agent
reports its engine dropped its whole KV cache (``kvCache.clears``, from its KV events).

And it tells what each replica's engine says it holds (``reports``, a ``cachereport.CacheReport``
each, which the gateway corrects its model of the replica by): a llama.cpp replica's slots, read
from the route its engine row names (``cache_state``: ``GET /slots``), with the same key, each
answer bounded (``CacheState.max_bytes``) and timed out like a scrape, but only when the replica's
metrics show work since the last answer (``cachereport.read_due``: an idle engine is never asked,
so it may sleep); a vLLM
replica's blocks held, as its agent reported them from its engine's KV events. Each new answer or
report is a new ``seq``, handed to ``on_report`` (the gateway's) on the event loop as it comes, so
the gateway corrects its model between requests, not only at its next pick of the replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from starlette.concurrency import run_in_threadpool

from fleetserve.cachereport import Activity, CacheReport, read_due
from fleetserve.changegate import ChangeGate
from fleetserve.engines.registry import ENGINES
from fleetserve.engines.spec import EngineKind
from fleetserve.errors import FleetserveError
from fleetserve.metrics.engine import EngineLabels, effective_mapping, normalize
from fleetserve.metrics.exposition import ENGINE_METRICS, GPU_METRICS, FleetMetrics, SeriesValue
from fleetserve.metrics.promtext import ExpositionError
from fleetserve.metrics.scraper import Scraper
from fleetserve.metrics.targets import Target
from fleetserve.protocol import KvCacheSummary
from fleetserve.routing import routable
from fleetserve.server.gpu_exporters import ExporterScrape
from fleetserve.store.protocols import AgentReports

log = logging.getLogger("fleetserve.observer")


@dataclass(frozen=True)
class ReplicaLoad:
    """A replica's engine-reported work, and when it was scraped (monotonic seconds)."""

    deployment: str
    running: float
    waiting: float
    at: float
    # The engine's KV cache in use, 0-1, when it reports it.
    kv_usage: float | None = None


class Observer:
    """Follows the replicas' engine metrics."""

    def __init__(
        self,
        store: AgentReports,
        metrics: FleetMetrics,
        interval: float = 1.0,
        exporters: ExporterScrape | None = None,
    ) -> None:
        self.store = store
        # The GPU metrics exporters the control plane scrapes itself (``--kube-exporters``).
        self.exporters = exporters
        self.metrics = metrics
        self.interval = interval
        self.scraper = Scraper(interval=interval, timeout=min(2.0, interval * 2))
        # The engines' own word on their caches (llama.cpp's /slots), scraped like their metrics.
        self.cache_scraper = Scraper(
            interval=interval,
            timeout=min(2.0, interval * 2),
            max_body_bytes=max(
                (e.cache_state.max_bytes for e in ENGINES.values() if e.cache_state), default=1
            ),
        )
        # Per replica, what its engine last said it holds (see the module's docstring).
        self.reports: dict[str, CacheReport] = {}
        self._seq = 0
        self._clears: dict[str, int] = {}
        self._cache_seen: dict[str, float] = {}
        self._unreadable: set[str] = set()
        self._cache_targets: list[Target] = []
        # Per replica with a cache state to read: its latest metrics' work, and the work and time
        # (monotonic) when its cache state was last asked for (``read_due``).
        self._activity: dict[str, Activity] = {}
        self._cache_asked: dict[str, tuple[Activity, float]] = {}
        self._cache_reads: set[asyncio.Task[None]] = set()
        # Told each new report, on the event loop (``collect``): the gateway's correction.
        self.on_report: Callable[[str, CacheReport], None] | None = None
        self._told: dict[str, int] = {}
        self.loads: dict[str, ReplicaLoad] = {}
        # Per replica, its latest canonical engine samples without labels (the dashboard's view).
        self.engine_values: dict[str, dict[str, float]] = {}
        self._engines: dict[str, EngineKind] = {}
        self._restarts: dict[str, int] = {}
        # Per replica, its engine's epoch (see the module's docstring) and last prompt-token count.
        self.epochs: dict[str, int] = {}
        self._prompt_tokens: dict[str, float] = {}
        # The targets are read again only when the fleet changed (``changegate``).
        self.gate = ChangeGate()
        self._targets: list[Target] = []
        self.reads = 0  # whole-fleet reads of the targets made, for tests and the curious

    def gpu_samples(self) -> list[SeriesValue]:
        """The GPU samples agents reported, read by them or relayed from an exporter beside them
        (blocking: reads the store)."""
        out: list[SeriesValue] = []
        for status in self.store.agent_statuses().values():
            for sample in status.gpu_metrics:
                if sample.name in GPU_METRICS:
                    out.append((sample.name, dict(sample.labels), sample.value))
        return out

    def restarts(self, statuses: list[tuple[str, str, int]]) -> None:
        """Count engine restarts the agents reported since the last look."""
        for deployment, replica, restarts in statuses:
            seen = self._restarts.get(replica)
            if seen is not None and restarts > seen:
                for _ in range(restarts - seen):
                    self.metrics.engine_restart(deployment, replica)
                self.epochs[replica] = self.epochs.get(replica, 0) + 1
            self._restarts[replica] = restarts

    def kv_caches(self, reported: list[tuple[str, KvCacheSummary | None]]) -> None:
        """Take what agents reported of their replicas' KV events: a whole cache dropped since the
        last look moves the replica's epoch; a new count of blocks held is a new report."""
        for replica, summary in reported:
            if summary is None:
                continue
            seen = self._clears.get(replica)
            if seen is not None and summary.clears > seen:
                self.epochs[replica] = self.epochs.get(replica, 0) + 1
            self._clears[replica] = summary.clears
            held = summary.blocks * summary.block_tokens
            old = self.reports.get(replica)
            if old is None or old.held_tokens != held:
                self._seq += 1
                self.reports[replica] = CacheReport(self._seq, held_tokens=held)

    def targets(self) -> list[Target]:
        """The metrics URL of every Running replica that reported a port (blocking: reads the
        store's change counter, and the replicas only when it moved or a full read is due)."""
        counter = self.store.fleet_changes()
        if self.gate.due(counter):
            began = self.gate.clock()
            self._targets = self._read_targets()
            self.gate.read(counter, began)
            self.reads += 1
        return self._targets

    def _read_targets(self) -> list[Target]:
        deployments = {d.deployment.name: d.deployment for d in self.store.list_deployments()}
        out = []
        cache_targets = []
        endpoints = self.store.replica_endpoints()
        self.restarts([(e.replica.deployment, e.replica.name, e.status.restarts) for e in endpoints])
        self.kv_caches([(e.replica.name, e.status.kv_cache) for e in endpoints])
        for served in routable(endpoints):
            replica = served.replica
            dep = deployments.get(replica.deployment)
            if dep is None:
                continue
            profile = next((p for p in dep.profiles if p.name == replica.profile), None)
            if profile is None:
                continue
            self._engines[replica.name] = profile.engine
            labels = {
                "deployment": dep.name, "replica": replica.name, "node": replica.shards[0].node,
                "engine": profile.engine.value, "model": dep.model,
            }  # fmt: skip
            url = served.url + ENGINES[profile.engine].metrics_path
            out.append(Target(key=replica.name, url=url, labels=labels, bearer=served.engine_key))
            cache_state = ENGINES[profile.engine].cache_state
            if cache_state is not None:
                cache_url = served.url + cache_state.path
                cache_targets.append(Target(key=replica.name, url=cache_url, bearer=served.engine_key))
        self._cache_targets = cache_targets
        live = {e.replica.name for e in endpoints}
        for name in [n for n in self.reports if n not in live]:
            del self.reports[name]
        for name in [n for n in self._clears if n not in live]:
            del self._clears[name]
        for name in [n for n in self._cache_seen if n not in live]:
            del self._cache_seen[name]
        for name in [n for n in self._cache_asked if n not in live]:
            del self._cache_asked[name]
        self._unreadable &= live
        return out

    def collect(self) -> None:
        """Map every fresh scrape onto the canonical names; publish them; keep the loads."""
        samples: list[SeriesValue] = []
        loads: dict[str, ReplicaLoad] = {}
        values_of: dict[str, dict[str, float]] = {}
        targets = {t.key: t for t in self.scraper.targets()}
        for key, scrape in self.scraper.snapshot().items():
            target = targets.get(key)
            engine = self._engines.get(key)
            if target is None or engine is None or scrape.body is None or scrape.stale:
                continue
            labels = EngineLabels(**dict(target.labels))
            try:
                mapped = normalize(
                    scrape.body.decode("utf-8", "replace"), effective_mapping(ENGINES[engine].metrics), labels
                )
            except ExpositionError as exc:
                log.warning("replica %s: unreadable metrics: %s", key, exc)
                continue
            # Only the series the surface defines (the TTFT histogram is mapped but not yet exposed).
            samples.extend((s.name, dict(s.labels), s.value) for s in mapped if s.name in ENGINE_METRICS)
            values = {s.name: s.value for s in mapped}
            self._count_prompt_tokens(key, values.get("fleetserve_prompt_tokens_total"))
            values_of[key] = {n: v for n, v in values.items() if n in ENGINE_METRICS}
            loads[key] = ReplicaLoad(
                deployment=labels.deployment,
                running=values.get("fleetserve_requests_running", 0.0),
                waiting=values.get("fleetserve_requests_waiting", 0.0),
                at=time.monotonic() - (scrape.age or 0.0),
                kv_usage=values.get("fleetserve_kv_cache_usage_ratio"),
            )
        self.loads = loads
        self.engine_values = values_of
        self._activity = {
            key: Activity(
                prompt_tokens=values_of[key].get("fleetserve_prompt_tokens_total", 0.0),
                generation_tokens=values_of[key].get("fleetserve_generation_tokens_total", 0.0),
                running=load.running,
                waiting=load.waiting,
            )
            for key, load in loads.items()
        }
        self._collect_cache_states()
        self._tell_reports()
        try:
            self.metrics.set_engine_samples(samples)
        except ValueError as exc:
            log.warning("engine metrics refused: %s", exc)

    def cache_reads_due(self, now: float) -> list[str]:
        """The replicas whose cache state to ask for now (``read_due``), marked as asked."""
        due = []
        for target in self._cache_targets:
            activity = self._activity.get(target.key)
            if read_due(activity, self._cache_asked.get(target.key), now) and activity is not None:
                self._cache_asked[target.key] = (activity, now)
                due.append(target.key)
        return due

    def _read_cache_states(self) -> None:
        """Ask the due replicas for their cache state, in the background (collected next tick)."""
        due = self.cache_reads_due(time.monotonic())
        if due:
            task = asyncio.create_task(self.cache_scraper.scrape_once(due))
            self._cache_reads.add(task)
            task.add_done_callback(self._cache_reads.discard)

    def _collect_cache_states(self) -> None:
        """Each new fresh answer of an engine's cache state, read by its row, is a new report."""
        for key, scrape in self.cache_scraper.snapshot().items():
            engine = self._engines.get(key)
            cache_state = ENGINES[engine].cache_state if engine is not None else None
            if cache_state is None or scrape.body is None or scrape.stale or scrape.fetched_at is None:
                continue
            if self._cache_seen.get(key) == scrape.fetched_at:
                continue
            self._cache_seen[key] = scrape.fetched_at
            slots = self.cache_scraper.parse_on_demand(key, cache_state.read)
            if slots is None:
                if key not in self._unreadable:  # said once, not every second
                    self._unreadable.add(key)
                    log.warning("replica %s: unreadable answer from %s", key, cache_state.path)
                continue
            self._unreadable.discard(key)
            self._seq += 1
            capacity = max((s.n_ctx for s in slots), default=0) or None
            self.reports[key] = CacheReport(self._seq, capacity_tokens=capacity, slots=slots)

    def _tell_reports(self) -> None:
        if self.on_report is None:
            return
        for replica, report in list(self.reports.items()):
            if self._told.get(replica) != report.seq:
                self._told[replica] = report.seq
                self.on_report(replica, report)
        for name in [n for n in self._told if n not in self.reports]:
            del self._told[name]

    def _count_prompt_tokens(self, replica: str, count: float | None) -> None:
        """A prompt-token counter lower than its last value: the engine started again."""
        if count is None:
            return
        seen = self._prompt_tokens.get(replica)
        if seen is not None and count < seen:
            self.epochs[replica] = self.epochs.get(replica, 0) + 1
        self._prompt_tokens[replica] = count

    async def run(self, stop: asyncio.Event) -> None:
        """Scrape in the background; refresh targets and the published values every interval."""
        scraping = asyncio.create_task(self.scraper.run(stop))
        exporting = None if self.exporters is None else asyncio.create_task(self.exporters.run(stop))
        try:
            while not stop.is_set():
                try:
                    self.scraper.set_targets(await run_in_threadpool(self.targets))
                    self.cache_scraper.set_targets(self._cache_targets)
                    gpus = await run_in_threadpool(self.gpu_samples)
                    if self.exporters is not None:  # on the loop: the scraper is the loop's
                        gpus += self.exporters.gpu_samples()
                    try:
                        self.metrics.set_gpu_samples(gpus)
                    except ValueError as exc:
                        log.warning("GPU metrics refused: %s", exc)
                except FleetserveError as exc:
                    log.warning("listing the replicas to scrape failed: %s", exc)
                self.collect()
                self._read_cache_states()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), timeout=self.interval)
        finally:
            stop.set()
            await scraping
            for task in self._cache_reads:
                task.cancel()
            await asyncio.gather(*self._cache_reads, return_exceptions=True)
            if exporting is not None:
                await exporting
            await self.scraper.aclose()
            await self.cache_scraper.aclose()
