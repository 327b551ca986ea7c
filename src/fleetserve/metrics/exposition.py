"""The control plane's Prometheus ``/metrics``: canonical engine and GPU series, and fleetserve's own.

``FleetMetrics`` owns a private ``CollectorRegistry`` (never the process-global one, so two servers
in one process — or two tests — never share series). It exposes three groups:

- **Engine series** (labels deployment, replica, node, engine, model) and **GPU series** (labels
  node, device, driver, class), under the canonical names of design.md "Metrics". The scraper hands
  over each cycle's samples as plain ``(name, labels, value)`` tuples and they replace the previous
  cycle's wholesale: a replica or GPU that is gone has no series left. A custom collector yields
  them, so this module depends on no other module's types.
- **fleetserve's own** metrics (placement and reconcile time, the gateway's requests, latency,
  queue depth and rejections, engine restarts), kept by ``prometheus_client`` metric objects and
  updated through the methods below.
- **The autoscaler's desired count** per deployment, also replaced wholesale each cycle.

Every exposed name is in ``METRICS`` (one table keyed by name); ``exposed_series_names`` derives
the sample names a query may use (``_bucket``/``_sum``/``_count`` for histograms).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from types import MappingProxyType

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

from fleetserve.reconcile.disruption import Disruption

SeriesValue = tuple[str, Mapping[str, str], float]
"""One series value handed over by the scraper: canonical name, labels, value."""


class Kind(StrEnum):
    """The Prometheus type of a metric."""

    GAUGE = "gauge"
    COUNTER = "counter"
    HISTOGRAM = "histogram"


class Group(StrEnum):
    """Who sets a metric: the scraper (engine, GPU), the autoscaler, or fleetserve's own code."""

    ENGINE = "engine"
    GPU = "gpu"
    AUTOSCALER = "autoscaler"
    OWN = "own"


ENGINE_LABELS = ("deployment", "replica", "node", "engine", "model")
GPU_LABELS = ("node", "device", "driver", "class")

# Placement and reconcile cycles: sub-millisecond on a homelab, seconds on a large fleet (finer
# around the 1 s a cycle at 5,000 nodes should stay under).
CYCLE_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip
# Whole gateway requests: generation runs for seconds to minutes.
# Time to an engine's first token: a loaded GPU answers in tens of milliseconds, a queue in seconds.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# Time between tokens of one stream: a fast GPU 5-20 ms, a CPU replica 50 ms and more.
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0, 2.5)
UNKNOWN_MODEL = "unknown"
"""The model label of a request for a model no deployment serves: never the client's string."""
REQUEST_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)


@dataclass(frozen=True)
class MetricDef:
    """One exposed metric: its name as it appears (counters end in ``_total``), type, labels, help."""

    name: str
    kind: Kind
    group: Group
    labels: tuple[str, ...]
    help: str


def _engine(name: str, kind: Kind, help: str) -> MetricDef:
    return MetricDef(name, kind, Group.ENGINE, ENGINE_LABELS, help)


def _gpu(name: str, kind: Kind, help: str) -> MetricDef:
    return MetricDef(name, kind, Group.GPU, GPU_LABELS, help)


def _own(name: str, kind: Kind, labels: tuple[str, ...], help: str) -> MetricDef:
    return MetricDef(name, kind, Group.OWN, labels, help)


_DEFS = (
    _engine("fleetserve_requests_running", Kind.GAUGE, "Requests the engine is running."),
    _engine("fleetserve_requests_waiting", Kind.GAUGE, "Requests queued in the engine."),
    _engine("fleetserve_kv_cache_usage_ratio", Kind.GAUGE, "Fraction of the KV cache in use, 0-1."),
    _engine("fleetserve_prompt_tokens_total", Kind.COUNTER, "Prompt tokens the engine processed."),
    _engine("fleetserve_generation_tokens_total", Kind.COUNTER, "Tokens the engine generated."),
    _gpu("fleetserve_gpu_utilization_ratio", Kind.GAUGE, "GPU busy fraction, 0-1."),
    _gpu("fleetserve_gpu_memory_used_bytes", Kind.GAUGE, "GPU memory in use, bytes."),
    _gpu("fleetserve_gpu_power_watts", Kind.GAUGE, "GPU power draw, watts."),
    _gpu("fleetserve_gpu_energy_joules_total", Kind.COUNTER, "GPU energy consumed, joules."),
    _gpu("fleetserve_gpu_temperature_celsius", Kind.GAUGE, "GPU temperature, Celsius."),
    _gpu(
        "fleetserve_gpu_tensor_active_ratio",
        Kind.GAUGE,
        "Fraction of cycles the tensor pipes were active, 0-1 (NVIDIA only).",
    ),
    MetricDef(
        "fleetserve_autoscaler_desired_replicas",
        Kind.GAUGE,
        Group.AUTOSCALER,
        ("deployment",),
        "Replicas the autoscaler wants for the deployment.",
    ),
    _own("fleetserve_placement_seconds", Kind.HISTOGRAM, (), "Time to place one deployment's replicas."),
    _own("fleetserve_reconcile_seconds", Kind.HISTOGRAM, (), "Time of one reconcile cycle."),
    _own(
        "fleetserve_reconcile_phase_seconds",
        Kind.HISTOGRAM,
        ("phase",),
        "Time of one phase of a reconcile cycle: snapshot (read), plan (decide) or commit (write).",
    ),
    _own(
        "fleetserve_reconcile_quiet_total",
        Kind.COUNTER,
        (),
        "Reconcile cycles that found nothing changed since a cycle that changed nothing, and read"
        " and planned nothing again (not in fleetserve_reconcile_seconds).",
    ),
    _own(
        "fleetserve_disruption_mode",
        Kind.GAUGE,
        (),
        "1 while so large a share of the fleet is silent that the control plane suspects itself or"
        " the network: nodes are marked NotReady, none is judged Lost, no replica is re-placed.",
    ),
    _own(
        "fleetserve_gateway_requests_total",
        Kind.COUNTER,
        ("deployment", "code"),
        "Requests the gateway answered, by HTTP status code.",
    ),
    _own(
        "fleetserve_gateway_request_seconds",
        Kind.HISTOGRAM,
        ("deployment",),
        "Gateway request duration, from arrival to the last byte.",
    ),
    _own(
        "fleetserve_gateway_queue_depth",
        Kind.GAUGE,
        ("deployment",),
        "Requests waiting in the gateway's admission queue.",
    ),
    _own(
        "fleetserve_gateway_rejections_total",
        Kind.COUNTER,
        ("deployment", "reason"),
        "Requests the gateway refused, by reason.",
    ),
    _own(
        "fleetserve_gateway_ttft_seconds",
        Kind.HISTOGRAM,
        ("deployment", "replica", "engine"),
        "Time from sending a streamed request to the engine to its first token, as the gateway saw it.",
    ),
    _own(
        "fleetserve_gateway_inter_token_seconds",
        Kind.HISTOGRAM,
        ("deployment", "replica", "engine"),
        "Mean time between the tokens of one stream after the first, one sample per stream.",
    ),
    _own(
        "fleetserve_gateway_key_request_seconds",
        Kind.HISTOGRAM,
        ("key", "model"),
        "Gateway request duration by API key name and model (unknown models as 'unknown').",
    ),
    _own(
        "fleetserve_gateway_tokens_total",
        Kind.COUNTER,
        ("key", "model", "kind"),
        "Tokens of answered requests by API key name, model and kind (prompt or completion).",
    ),
    _own(
        "fleetserve_gateway_prompt_tokens_routed_total",
        Kind.COUNTER,
        ("deployment",),
        "Prompt tokens (estimated, about 4 bytes a token) of requests a cache-aware pick routed.",
    ),
    _own(
        "fleetserve_gateway_prompt_tokens_cached_expected_total",
        Kind.COUNTER,
        ("deployment",),
        "Of those, the tokens the picked replica was expected to hold cached: over the routed "
        "tokens, the deployment's expected prefix-cache hit ratio.",
    ),
    _own(
        "fleetserve_ratelimit_shared",
        Kind.GAUGE,
        (),
        "1 while the rate-limit windows are shared in Redis, 0 while this gateway keeps its own.",
    ),
    _own(
        "fleetserve_ratelimit_fallbacks_total",
        Kind.COUNTER,
        (),
        "Times this gateway lost Redis and fell back to its own rate-limit windows.",
    ),
    _own(
        "fleetserve_agent_call_cpu_seconds_total",
        Kind.COUNTER,
        ("kind",),
        "Server CPU seconds spent answering agents' calls, by kind (heartbeat, status, assignments,"
        " register): the CPU of the threads that worked for each call (server/agents/callcpu.py).",
    ),
    _own(
        "fleetserve_agent_calls_total",
        Kind.COUNTER,
        ("kind",),
        "Agents' calls answered, by kind (heartbeat, status, assignments, register).",
    ),
    _own(
        "fleetserve_engine_restarts_total",
        Kind.COUNTER,
        ("deployment", "replica"),
        "Times a replica's engine was restarted.",
    ),
)
METRICS: Mapping[str, MetricDef] = MappingProxyType({d.name: d for d in _DEFS})
"""Every metric ``FleetMetrics`` exposes, keyed by the name it appears under."""

ENGINE_METRICS = frozenset(n for n, d in METRICS.items() if d.group is Group.ENGINE)
GPU_METRICS = frozenset(n for n, d in METRICS.items() if d.group is Group.GPU)


def exposed_series_names() -> frozenset[str]:
    """Every sample name ``render`` can produce: what a PromQL query over it may reference."""
    names: set[str] = set()
    for d in METRICS.values():
        if d.kind is Kind.HISTOGRAM:
            names |= {f"{d.name}_bucket", f"{d.name}_sum", f"{d.name}_count"}
        else:
            names.add(d.name)
    return frozenset(names)


def _base(name: str) -> str:
    """The name ``prometheus_client`` takes for a counter: without ``_total`` (it adds it back)."""
    return name.removesuffix("_total")


@dataclass(frozen=True)
class _Series:
    labels: tuple[str, ...]
    value: float


def _validate(
    samples: Iterable[SeriesValue], allowed: frozenset[str], group: str
) -> dict[str, list[_Series]]:
    """Samples grouped by name, labels in the metric's order; duplicates keep the last value."""
    by_name: dict[str, dict[tuple[str, ...], float]] = {}
    for name, labels, value in samples:
        if name not in allowed:
            raise ValueError(f"{name!r} is not a canonical {group} metric; known: {sorted(allowed)}")
        keys = METRICS[name].labels
        extra = sorted(set(labels) - set(keys))
        if extra:
            raise ValueError(f"{name}: unknown labels {extra}; allowed: {list(keys)}")
        if math.isnan(value):
            continue  # an engine that reports NaN has no value this cycle
        by_name.setdefault(name, {})[tuple(str(labels.get(k, "")) for k in keys)] = float(value)
    return {n: [_Series(k, v) for k, v in series.items()] for n, series in by_name.items()}


class _SnapshotCollector:
    """Yields the latest cycle's engine, GPU and autoscaler series; replaced wholesale, never merged."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._series: dict[Group, dict[str, list[_Series]]] = {}

    def replace(self, group: Group, series: dict[str, list[_Series]]) -> None:
        with self._lock:
            self._series[group] = series

    def describe(self) -> Iterator[Metric]:
        # Registered with every name up front, so a clash with another collector fails at once.
        for d in METRICS.values():
            if d.group is not Group.OWN:
                yield self._family(d)

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            current = {g: dict(s) for g, s in self._series.items()}
        for d in METRICS.values():
            if d.group is Group.OWN:
                continue
            series = current.get(d.group, {}).get(d.name, [])
            if not series:
                continue
            family = self._family(d)
            for s in series:
                family.add_metric(list(s.labels), s.value)
            yield family

    @staticmethod
    def _family(d: MetricDef) -> GaugeMetricFamily | CounterMetricFamily:
        if d.kind is Kind.COUNTER:
            return CounterMetricFamily(_base(d.name), d.help, labels=list(d.labels))
        return GaugeMetricFamily(d.name, d.help, labels=list(d.labels))


class _WithoutCreated:
    """The registry's families minus ``_created`` samples.

    ``prometheus_client`` adds a ``<name>_created`` timestamp to every counter and histogram; in
    the text format each becomes one more gauge series per label set, doubling the series count for
    a value no dashboard reads. Filtering here keeps the process-global switch
    (``disable_created_metrics``) untouched.
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry

    def collect(self) -> Iterator[Metric]:
        for family in self._registry.collect():
            kept = Metric(family.name, family.documentation, family.type, family.unit)
            kept.samples = [s for s in family.samples if s.name != f"{family.name}_created"]
            yield kept


class FleetMetrics:
    """The metrics one control plane exposes, in a registry of its own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._snapshots = _SnapshotCollector()
        self.registry.register(self._snapshots)
        reg = self.registry

        def counter(name: str) -> Counter:
            spec = METRICS[name]
            return Counter(_base(name), spec.help, spec.labels, registry=reg)

        def gauge(name: str) -> Gauge:
            spec = METRICS[name]
            return Gauge(name, spec.help, spec.labels, registry=reg)

        def histogram(name: str, buckets: Sequence[float]) -> Histogram:
            spec = METRICS[name]
            return Histogram(name, spec.help, spec.labels, buckets=buckets, registry=reg)

        self.placement_seconds = histogram("fleetserve_placement_seconds", CYCLE_BUCKETS)
        self.reconcile_seconds = histogram("fleetserve_reconcile_seconds", CYCLE_BUCKETS)
        self.reconcile_phase_seconds = histogram("fleetserve_reconcile_phase_seconds", CYCLE_BUCKETS)
        self.reconcile_quiet = counter("fleetserve_reconcile_quiet_total")
        self.disruption_mode = gauge("fleetserve_disruption_mode")
        # Disruption mode as the reconciler last judged it (None: off), for the fleet's condition.
        self.disruption: Disruption | None = None
        self.gateway_requests = counter("fleetserve_gateway_requests_total")
        self.gateway_request_seconds = histogram("fleetserve_gateway_request_seconds", REQUEST_BUCKETS)
        self.gateway_queue_depth = gauge("fleetserve_gateway_queue_depth")
        self.gateway_rejections = counter("fleetserve_gateway_rejections_total")
        self.engine_restarts = counter("fleetserve_engine_restarts_total")
        self.agent_call_cpu_seconds = counter("fleetserve_agent_call_cpu_seconds_total")
        self.agent_calls = counter("fleetserve_agent_calls_total")
        self.gateway_ttft = histogram("fleetserve_gateway_ttft_seconds", TTFT_BUCKETS)
        self.gateway_itl = histogram("fleetserve_gateway_inter_token_seconds", ITL_BUCKETS)
        self.gateway_key_seconds = histogram("fleetserve_gateway_key_request_seconds", REQUEST_BUCKETS)
        self.gateway_tokens = counter("fleetserve_gateway_tokens_total")
        self.prompt_routed = counter("fleetserve_gateway_prompt_tokens_routed_total")
        self.prompt_cached = counter("fleetserve_gateway_prompt_tokens_cached_expected_total")
        self._hot_cache: dict[str, tuple[Counter, Counter]] = {}
        self.ratelimit_shared = gauge("fleetserve_ratelimit_shared")
        self.ratelimit_fallbacks = counter("fleetserve_ratelimit_fallbacks_total")
        # The gateway's labelled children, looked up once per label set (its hot path).
        self._hot: dict[tuple[str, ...], tuple[Counter, Histogram]] = {}
        self._hot_keys: dict[tuple[str, str], tuple[Histogram, Counter, Counter]] = {}
        # Label values this object created, per labelled metric, so a deleted deployment's series
        # can be removed without reaching into prometheus_client's internals.
        self._children_lock = threading.Lock()
        self._children: dict[str, set[tuple[str, ...]]] = {}

    # --- replaced each cycle ------------------------------------------------------------------

    def set_engine_samples(self, samples: Iterable[SeriesValue]) -> None:
        """Replace every engine series with this cycle's samples (names from ``ENGINE_METRICS``)."""
        self._snapshots.replace(Group.ENGINE, _validate(samples, ENGINE_METRICS, "engine"))

    def set_gpu_samples(self, samples: Iterable[SeriesValue]) -> None:
        """Replace every GPU series with this cycle's samples (names from ``GPU_METRICS``)."""
        self._snapshots.replace(Group.GPU, _validate(samples, GPU_METRICS, "GPU"))

    def set_desired_replicas(self, desired: Mapping[str, int]) -> None:
        """Replace the autoscaler's desired count of every deployment (absent ones disappear)."""
        name = "fleetserve_autoscaler_desired_replicas"
        samples = [(name, {"deployment": dep}, float(n)) for dep, n in desired.items()]
        self._snapshots.replace(Group.AUTOSCALER, _validate(samples, frozenset({name}), "autoscaler"))

    # --- fleetserve's own ---------------------------------------------------------------------

    def observe_placement(self, seconds: float) -> None:
        self.placement_seconds.observe(seconds)

    def observe_reconcile(self, seconds: float) -> None:
        self.reconcile_seconds.observe(seconds)

    def count_quiet_cycle(self) -> None:
        """A reconcile cycle that found nothing changed (``server.reconciler``: it read nothing)."""
        self.reconcile_quiet.inc()

    def set_disruption(self, disruption: Disruption | None) -> None:
        """Disruption mode as a leader's cycle judged it (None: off): the gauge, and what the
        fleet's condition says (``GET /api/v1/fleet``)."""
        self.disruption = disruption
        self.disruption_mode.set(0 if disruption is None else 1)

    def observe_reconcile_phase(self, phase: str, seconds: float) -> None:
        """One phase of a reconcile cycle (``server.reconciler.CyclePhase``: a closed set of labels)."""
        self.reconcile_phase_seconds.labels(phase).observe(seconds)

    def gateway_request(self, deployment: str, code: int, seconds: float) -> None:
        """Count one answered request and its duration."""
        self._child("fleetserve_gateway_requests_total", deployment, str(code))
        self.gateway_requests.labels(deployment, str(code)).inc()
        self._child("fleetserve_gateway_request_seconds", deployment)
        self.gateway_request_seconds.labels(deployment).observe(seconds)

    def gateway_answer(self, deployment: str, code: int, seconds: float) -> None:
        """``gateway_request`` for the data path: the label children looked up once."""
        hot = self._hot.get((deployment, str(code)))
        if hot is None:
            self._child("fleetserve_gateway_requests_total", deployment, str(code))
            self._child("fleetserve_gateway_request_seconds", deployment)
            hot = (
                self.gateway_requests.labels(deployment, str(code)),
                self.gateway_request_seconds.labels(deployment),
            )
            self._hot[(deployment, str(code))] = hot
        hot[0].inc()
        hot[1].observe(seconds)

    def gateway_key_request(self, key: str, model: str, seconds: float, prompt: int, completion: int) -> None:
        """One answered request of API key ``key`` (its stored name) for ``model``: duration, tokens."""
        hot = self._hot_keys.get((key, model))
        if hot is None:
            for labels in ((key, model, "prompt"), (key, model, "completion")):
                self._child("fleetserve_gateway_tokens_total", *labels)
            self._child("fleetserve_gateway_key_request_seconds", key, model)
            hot = (
                self.gateway_key_seconds.labels(key, model),
                self.gateway_tokens.labels(key, model, "prompt"),
                self.gateway_tokens.labels(key, model, "completion"),
            )
            self._hot_keys[(key, model)] = hot
        hot[0].observe(seconds)
        if prompt:
            hot[1].inc(prompt)
        if completion:
            hot[2].inc(completion)

    def gateway_stream(
        self, deployment: str, replica: str, engine: str, ttft: float, itl: float | None
    ) -> None:
        """One stream's time to first token and (with two tokens or more) mean inter-token time."""
        self._child("fleetserve_gateway_ttft_seconds", deployment, replica, engine)
        self.gateway_ttft.labels(deployment, replica, engine).observe(ttft)
        if itl is not None:
            self._child("fleetserve_gateway_inter_token_seconds", deployment, replica, engine)
            self.gateway_itl.labels(deployment, replica, engine).observe(itl)

    def set_ratelimit_shared(self, shared: bool) -> None:
        """Whether the rate-limit windows are in Redis now; a change to False counts a fallback."""
        if not shared:
            self.ratelimit_fallbacks.inc()
        self.ratelimit_shared.set(1 if shared else 0)

    def set_queue_depth(self, deployment: str, depth: int) -> None:
        self._child("fleetserve_gateway_queue_depth", deployment)
        self.gateway_queue_depth.labels(deployment).set(depth)

    def gateway_rejection(self, deployment: str, reason: str) -> None:
        """Count one refused request; ``reason`` is a code such as ``QueueFull``, never prose."""
        self._child("fleetserve_gateway_rejections_total", deployment, reason)
        self.gateway_rejections.labels(deployment, reason).inc()

    def gateway_cache_pick(self, deployment: str, prompt_tokens: int, cached_tokens: int) -> None:
        """Count one cache-aware pick's prompt tokens and those expected cached where it went."""
        hot = self._hot_cache.get(deployment)
        if hot is None:
            self._child("fleetserve_gateway_prompt_tokens_routed_total", deployment)
            self._child("fleetserve_gateway_prompt_tokens_cached_expected_total", deployment)
            hot = self._hot_cache[deployment] = (
                self.prompt_routed.labels(deployment),
                self.prompt_cached.labels(deployment),
            )
        hot[0].inc(prompt_tokens)
        hot[1].inc(cached_tokens)

    def engine_restart(self, deployment: str, replica: str) -> None:
        self._child("fleetserve_engine_restarts_total", deployment, replica)
        self.engine_restarts.labels(deployment, replica).inc()

    def forget_deployment(self, deployment: str) -> None:
        """Remove every own series of a deleted deployment (the snapshot series go next cycle)."""
        metrics = {
            "fleetserve_gateway_requests_total": self.gateway_requests,
            "fleetserve_gateway_request_seconds": self.gateway_request_seconds,
            "fleetserve_gateway_queue_depth": self.gateway_queue_depth,
            "fleetserve_gateway_rejections_total": self.gateway_rejections,
            "fleetserve_engine_restarts_total": self.engine_restarts,
            "fleetserve_gateway_ttft_seconds": self.gateway_ttft,
            "fleetserve_gateway_inter_token_seconds": self.gateway_itl,
            "fleetserve_gateway_prompt_tokens_routed_total": self.prompt_routed,
            "fleetserve_gateway_prompt_tokens_cached_expected_total": self.prompt_cached,
        }
        by_model = {
            "fleetserve_gateway_key_request_seconds": self.gateway_key_seconds,
            "fleetserve_gateway_tokens_total": self.gateway_tokens,
        }
        self._hot.clear()
        self._hot_keys.clear()
        self._hot_cache.clear()
        with self._children_lock:
            for name, metric in by_model.items():
                children = self._children.get(name, set())
                gone = {labels for labels in children if labels[1] == deployment}
                for labels in gone:
                    metric.remove(*labels)
                children -= gone
            for name, metric in metrics.items():
                children = self._children.get(name, set())
                gone = {labels for labels in children if labels[0] == deployment}
                for labels in gone:
                    metric.remove(*labels)
                children -= gone

    def _child(self, name: str, *labels: str) -> None:
        with self._children_lock:
            self._children.setdefault(name, set()).add(labels)

    # --- exposition ---------------------------------------------------------------------------

    def render(self, accept: str = "") -> tuple[bytes, str]:
        """The body and Content-Type for ``GET /metrics``, negotiated from the Accept header.

        Without one (or for plain text) the Prometheus text format 0.0.4; ``application/
        openmetrics-text`` gets OpenMetrics. ``_created`` samples are left out (see
        ``_WithoutCreated``).
        """
        encoder, content_type = choose_encoder(accept)
        return encoder(_WithoutCreated(self.registry)), content_type
