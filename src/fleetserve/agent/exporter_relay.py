"""The agent relays a GPU metrics exporter's reading instead of its own (``agent --gpu-exporter``).

On a node that already runs NVIDIA's DCGM exporter or AMD's device-metrics-exporter, the agent
reports what the exporter reads, mapped onto ``fleetserve_gpu_*`` by the exporter's row of
``metrics.gpu`` and labelled with this node and its devices' classes, rather than reading NVML or
sysfs beside it. ``--gpu-exporter URL`` names the exporter (which one it is, is told by what it
serves); ``auto`` probes every exporter of the driver table at its default port on 127.0.0.1.

The exporters are fetched on a thread of their own (``run``), never on the report (heartbeat)
path: a hung exporter costs its timeout there and nothing else. The report takes the latest
fresh reading (``read``); where no exporter answers for a driver, that driver's GPUs are read as
before (the agent's own reader of that driver: NVML, sysfs), and only there. Each change of what
is relayed is said once in the log.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import httpx

from fleetserve.agent.gpustats import GpuReader
from fleetserve.drivers import Driver
from fleetserve.metrics.exporters import ExporterTarget, detect_driver, local_targets
from fleetserve.metrics.fetch import MAX_BODY_BYTES
from fleetserve.metrics.promtext import ExpositionError
from fleetserve.protocol import GpuSample
from fleetserve.spec.resources import Node

log = logging.getLogger("fleetserve.agent")

AUTO = "auto"
FETCH_TIMEOUT = 2.0

Clock = Callable[[], float]


@dataclass(frozen=True)
class Candidate:
    """An exporter the agent may relay: its URL, and its driver where known before it answers."""

    url: str
    driver: Driver | None = None


def candidates(spec: str) -> tuple[Candidate, ...]:
    """What ``--gpu-exporter`` names: ``auto`` (every table exporter's default port on loopback)
    or URLs, comma-separated; ValueError for anything else."""
    if spec.strip() == AUTO:
        return tuple(Candidate(t.url, t.driver) for t in local_targets())
    urls = [u.strip() for u in spec.split(",") if u.strip()]
    if not urls or not all(u.startswith(("http://", "https://")) for u in urls):
        raise ValueError(
            f"{spec!r}: give 'auto' or the exporter's metrics URL, e.g. http://127.0.0.1:9400/metrics"
        )
    return tuple(Candidate(u) for u in urls)


@dataclass(frozen=True)
class Reading:
    """One exporter's last good answer: its driver, the body, and when it came (monotonic)."""

    url: str
    driver: Driver
    body: str
    at: float


def relayed_samples(node: Node, readings: Sequence[Reading]) -> tuple[list[GpuSample], set[Driver]]:
    """The canonical samples of ``readings`` for ``node``'s own devices, and the drivers they cover.

    A device the exporter reports that the node does not have (another node's, or one discovery
    left out) is not this node's to report."""
    classes = {str(d.index): d.device_class for d in node.devices}
    out: list[GpuSample] = []
    covered: set[Driver] = set()
    for reading in readings:
        target = ExporterTarget(driver=reading.driver, node=node.name, url=reading.url)
        try:
            samples = target.samples(reading.body, classes)
        except ExpositionError:
            continue
        covered.add(reading.driver)
        out.extend(
            GpuSample(name=s.name, labels=dict(s.labels), value=s.value)
            for s in samples
            if s.labels.get("device") in classes
        )
    return out, covered


class ExporterRelay:
    """Fetches the exporters every ``interval`` seconds; ``read(node)`` is the agent's GPU reader."""

    def __init__(
        self,
        spec: str,
        own: Mapping[Driver, GpuReader],
        interval: float = 5.0,
        timeout: float = FETCH_TIMEOUT,
        clock: Clock = time.monotonic,
    ) -> None:
        self.candidates = candidates(spec)
        # Per driver, the agent's own reading: used only for drivers no exporter answers for.
        self.own = own
        self.interval = interval
        self.stale_after = 3 * interval
        self._clock = clock
        self._http = httpx.Client(timeout=timeout, follow_redirects=False)
        self._lock = threading.Lock()
        self._readings: dict[str, Reading] = {}
        self._said: tuple[str, ...] | None = None  # the URLs relayed, as last logged

    def _fetch(self, url: str) -> str:
        with self._http.stream("GET", url, headers={"Accept": "text/plain"}) as response:
            response.raise_for_status()
            parts: list[bytes] = []
            size = 0
            for piece in response.iter_bytes():
                size += len(piece)
                if size > MAX_BODY_BYTES:
                    raise ValueError(f"more than {MAX_BODY_BYTES} bytes")
                parts.append(piece)
        return b"".join(parts).decode("utf-8", "replace")

    def poll(self) -> None:
        """Fetch every candidate once; keep each one's answer if it is an exporter's."""
        errors: dict[str, str] = {}
        for candidate in self.candidates:
            try:
                body = self._fetch(candidate.url)
            except (httpx.HTTPError, ValueError) as exc:
                errors[candidate.url] = str(exc) or type(exc).__name__
                continue
            driver = detect_driver(body)
            if driver is None or (candidate.driver is not None and driver is not candidate.driver):
                errors[candidate.url] = "its answer holds no GPU metrics exporter's readings"
                continue
            with self._lock:
                self._readings[candidate.url] = Reading(candidate.url, driver, body, self._clock())
        self._say(errors)

    def fresh(self) -> list[Reading]:
        """The readings young enough to report."""
        now = self._clock()
        with self._lock:
            return [r for r in self._readings.values() if now - r.at <= self.stale_after]

    def _say(self, errors: dict[str, str]) -> None:
        live = tuple(r.url for r in self.fresh())
        if live == self._said:
            return
        self._said = live
        if live:
            drivers = {r.url: r.driver.value for r in self.fresh()}
            log.info(
                "GPU metrics: relaying the exporter(s) at %s instead of reading the GPUs itself",
                ", ".join(f"{u} ({drivers.get(u, '?')})" for u in live),
            )
        else:
            log.warning(
                "GPU metrics: no exporter answers (%s); the agent reads its GPUs itself (NVML, sysfs)",
                "; ".join(f"{u}: {why}" for u, why in errors.items()) or "none named",
            )

    def read(self, node: Node) -> list[GpuSample]:
        """The node's GPU samples: relayed where an exporter answers; the other drivers' GPUs read
        by the agent itself, as without an exporter (NVML, sysfs)."""
        relayed, covered = relayed_samples(node, self.fresh())
        for driver, reader in self.own.items():
            if driver not in covered:
                relayed.extend(reader(node))
        return relayed

    def close(self) -> None:
        """Close the connections to the exporters."""
        self._http.close()

    def run(self, stop: threading.Event) -> None:
        """Poll every ``interval`` seconds until ``stop``; then close the connections."""
        try:
            while not stop.is_set():
                self.poll()
                stop.wait(self.interval)
        finally:
            self.close()
