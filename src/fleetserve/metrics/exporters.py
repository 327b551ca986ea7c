"""GPU metrics exporters as scrape targets, and their scrapes mapped onto ``fleetserve_gpu_*``.

An ``ExporterTarget`` is one exporter found on one node: the driver whose stack runs it (the
driver table's ``metrics_exporter`` row says how to find and read it), the fleetserve node whose
GPUs it reports, and its metrics URL. On Kubernetes the node is the exporter pod's
``spec.nodeName``, which is the fleetserve node's name (``kube import`` names nodes as Kubernetes
does): the exporter's own ``Hostname`` label is often the pod's name there, so it is never
trusted when the node is known (design.md, Metrics; ``metrics.gpu``). Each device's class is the
one the fleetserve node gives that ordinal; without one, the exporter's model label.

Pure: ``gpu_series`` maps the scraper's stored bodies; fetching is the scraper's (server) or the
agent's relay (``agent.exporter_relay``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from fleetserve.drivers import Driver, MetricsExporter, metrics_exporters
from fleetserve.metrics.exposition import GPU_METRICS, SeriesValue
from fleetserve.metrics.gpu import GpuContext, GpuSource, normalize_gpu
from fleetserve.metrics.promtext import ExpositionError, Sample, parse
from fleetserve.metrics.targets import Scrape, Target
from fleetserve.tls import url_of

LOOPBACK = "127.0.0.1"
# Kubernetes discovery runs this often (``fleetserve server --kube-exporters``): DaemonSet pods
# come and go with nodes, not with requests.
REFRESH_SECONDS = 30.0
# The control plane scrapes each exporter this often: DCGM's exporter collects every 30 s by
# default, and a Kubernetes-mode scrape (a row per pod) is large.
SCRAPE_SECONDS = 10.0
KEY_PREFIX = "exporter/"

# device ordinal → fleetserve device class, for one node
Classes = Mapping[str, str]


def exporter_source(driver: Driver) -> GpuSource:
    """The output format of ``driver``'s exporter; KeyError when its stack runs none."""
    return GpuSource(metrics_exporters()[driver].source)


@dataclass(frozen=True)
class ExporterTarget:
    """One GPU metrics exporter to scrape: whose it is, which node's GPUs it reports, its URL.

    ``pod`` is ``namespace/name`` of the exporter pod it was found as (empty when not found
    through Kubernetes).
    """

    driver: Driver
    node: str
    url: str
    pod: str = ""

    @property
    def source(self) -> GpuSource:
        return exporter_source(self.driver)

    @property
    def key(self) -> str:
        """The scraper's key: the pod where there is one, else driver and URL."""
        return KEY_PREFIX + (self.pod or f"{self.driver.value}/{self.url}")

    def target(self) -> Target:
        """The scrape target; its labels are the canonical GPU labels this target fixes."""
        return Target(key=self.key, url=self.url, labels={"node": self.node, "driver": self.driver.value})

    def samples(self, body: str | bytes, classes: Classes | None = None) -> tuple[Sample, ...]:
        """The canonical GPU samples of one scrape of this exporter (ExpositionError: unreadable)."""
        text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
        return normalize_gpu(text, self.source, GpuContext(node=self.node or None, classes=classes or {}))


def exporter_url(exporter: MetricsExporter, host: str, port: int | None = None) -> str:
    """The exporter's metrics URL on ``host`` (its default port unless ``port``)."""
    return url_of("http", host, exporter.default_port if port is None else port) + exporter.path


def local_targets(node: str = "", host: str = LOOPBACK) -> list[ExporterTarget]:
    """Every exporter of the table at its default port on ``host``: what an agent probes."""
    return [
        ExporterTarget(driver=driver, node=node, url=exporter_url(exporter, host))
        for driver, exporter in metrics_exporters().items()
    ]


def detect_driver(body: str) -> Driver | None:
    """The driver whose exporter wrote ``body``: the first table row whose mapping finds GPU samples
    in it; None when none does (not an exporter, or one reporting no device)."""
    try:
        samples = parse(body)
    except ExpositionError:
        return None
    for driver in metrics_exporters():
        if normalize_gpu(samples, exporter_source(driver)):
            return driver
    return None


def series_of(samples: Iterable[Sample]) -> list[SeriesValue]:
    """Canonical GPU samples as the ``(name, labels, value)`` values ``FleetMetrics`` takes."""
    return [(s.name, dict(s.labels), s.value) for s in samples if s.name in GPU_METRICS]


def gpu_series(
    targets: Iterable[ExporterTarget],
    scrapes: Mapping[str, Scrape],
    classes_of: Callable[[str], Classes],
) -> tuple[list[SeriesValue], dict[str, str]]:
    """This cycle's ``fleetserve_gpu_*`` values from the exporters' fresh scrapes, and per target key
    why it gave none (no scrape yet, stale, unreadable). ``classes_of(node)`` gives a node's classes."""
    out: list[SeriesValue] = []
    why: dict[str, str] = {}
    for target in targets:
        scrape = scrapes.get(target.key)
        if scrape is None:
            why[target.key] = "not scraped yet"
            continue
        if scrape.body is None or scrape.stale:
            why[target.key] = f"stale: {scrape.error or 'no recent scrape'}"
            continue
        try:
            samples = target.samples(scrape.body, classes_of(target.node))
        except ExpositionError as exc:
            why[target.key] = f"unreadable metrics: {exc}"
            continue
        if not samples:
            why[target.key] = f"no {target.source.value} GPU samples in its metrics"
        out.extend(series_of(samples))
    return out, why


__all__ = [
    "LOOPBACK",
    "REFRESH_SECONDS",
    "SCRAPE_SECONDS",
    "Classes",
    "ExporterTarget",
    "detect_driver",
    "exporter_source",
    "exporter_url",
    "gpu_series",
    "local_targets",
    "series_of",
]
