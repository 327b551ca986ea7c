"""The control plane's view of its engines: scrape every Running replica's ``/metrics``, map it
onto the canonical names (one mapping per engine), publish it on ``/metrics``, and keep each
replica's running and waiting requests for the gateway's picking and the autoscaler.

It also tells each replica's engine epoch (``epochs``), a count that moves when the engine lost
its caches: its agent reported a restart, or its prompt-token counter went backwards (a counter
resets only when its process starts again). The gateway's cache model of a replica is cleared
when its epoch moves (``gateway.prefixcache``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass

from starlette.concurrency import run_in_threadpool

from fleetserve.changegate import ChangeGate
from fleetserve.engines.registry import ENGINES
from fleetserve.engines.spec import EngineKind
from fleetserve.errors import FleetserveError
from fleetserve.metrics.engine import EngineLabels, effective_mapping, normalize
from fleetserve.metrics.exposition import ENGINE_METRICS, GPU_METRICS, FleetMetrics, SeriesValue
from fleetserve.metrics.promtext import ExpositionError
from fleetserve.metrics.scraper import Scraper
from fleetserve.metrics.targets import Target
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
        endpoints = self.store.replica_endpoints()
        self.restarts([(e.replica.deployment, e.replica.name, e.status.restarts) for e in endpoints])
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
        try:
            self.metrics.set_engine_samples(samples)
        except ValueError as exc:
            log.warning("engine metrics refused: %s", exc)

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
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), timeout=self.interval)
        finally:
            stop.set()
            await scraping
            if exporting is not None:
                await exporting
            await self.scraper.aclose()
