"""The control plane's GPU metrics exporters: discovered every 30 s, scraped every 10 s (an
exporter found anew at once), mapped onto ``fleetserve_gpu_*`` (``metrics.exporters``) for the
observer to publish.

``discover`` is blocking (on Kubernetes: ``kube.exporters.discover_exporters`` over the API) and
runs on a worker thread; a failed discovery (a ``KubeError``, or anything else the client raises)
keeps the targets found before and is logged once until it succeeds again. The exporters have a
scraper of their own, so their keys never meet the replicas'.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping, Sequence

from starlette.concurrency import run_in_threadpool

from fleetserve.metrics.exporters import (
    REFRESH_SECONDS,
    SCRAPE_SECONDS,
    Classes,
    ExporterTarget,
    gpu_series,
)
from fleetserve.metrics.exposition import SeriesValue
from fleetserve.metrics.scraper import Scraper

log = logging.getLogger("fleetserve.exporters")

Discover = Callable[[], list[ExporterTarget]]
# The named fleetserve nodes' device classes by ordinal (blocking: reads the store); a node the
# store does not hold is left out, and its devices are classed by the exporter's model label.
NodeClasses = Callable[[Sequence[str]], Mapping[str, Classes]]


def _no_classes(nodes: Sequence[str]) -> Mapping[str, Classes]:
    return {}


class ExporterScrape:
    """Finds the GPU exporters again every ``refresh`` seconds and scrapes them every ``interval``."""

    def __init__(
        self,
        discover: Discover,
        node_classes: NodeClasses = _no_classes,
        interval: float = SCRAPE_SECONDS,
        refresh: float = REFRESH_SECONDS,
    ) -> None:
        self.discover = discover
        self.node_classes = node_classes
        self.classes: Mapping[str, Classes] = {}
        self.refresh = refresh
        self.scraper = Scraper(interval=interval, timeout=min(2.0, interval * 2))
        self.found: list[ExporterTarget] = []
        self.discoveries = 0  # successful discoveries, for tests and the curious
        self._failing = False
        self._silent: dict[str, str] = {}  # target key → why it gave no samples, as last logged

    async def refresh_once(self) -> None:
        """Discover the exporters once and scrape what was found; keep the old set on failure."""
        try:
            found = await run_in_threadpool(self.discover)
            classes = await run_in_threadpool(self.node_classes, sorted({t.node for t in found}))
        except Exception as exc:  # a background loop: any failure is said, and tried again next refresh
            if not self._failing:
                log.warning("finding the GPU metrics exporters failed (keeping %d): %s", len(self.found), exc)
            self._failing = True
            return
        if self._failing or {t.key for t in found} != {t.key for t in self.found}:
            log.info(
                "GPU metrics exporters: %d found%s",
                len(found),
                "".join(f"; {t.driver.value} {t.pod or t.url} on {t.node} at {t.url}" for t in found),
            )
        self._failing = False
        new = {t.key for t in found} - {t.key for t in self.found}
        self.found, self.classes = found, classes
        self.discoveries += 1
        self.scraper.set_targets(t.target() for t in found)
        if new:  # an exporter found now is read now, not at the next tick
            await self.scraper.scrape_once()

    def gpu_samples(self) -> list[SeriesValue]:
        """This cycle's ``fleetserve_gpu_*`` values from the exporters' fresh scrapes."""
        values, why = gpu_series(self.found, self.scraper.snapshot(), lambda node: self.classes.get(node, {}))
        for key, reason in why.items():
            if self._silent.get(key) != reason and not reason.startswith("not scraped"):
                log.warning("GPU metrics exporter %s gives no samples: %s", key, reason)
        self._silent = why
        return values

    async def run(self, stop: asyncio.Event) -> None:
        """Discover every ``refresh`` seconds and scrape until ``stop``."""
        scraping = asyncio.create_task(self.scraper.run(stop))
        try:
            while not stop.is_set():
                await self.refresh_once()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), timeout=self.refresh)
        finally:
            stop.set()
            await scraping
            await self.scraper.aclose()
