"""Engine metrics mapped to fleetserve's canonical names, one mapping per engine.

Each engine publishes the same few signals under its own names (design.md, Metrics):

    signal             canonical (labels deployment, replica, node, engine, model)   kind
    running            fleetserve_requests_running                                    gauge
    waiting            fleetserve_requests_waiting                                    gauge
    kv_cache_usage     fleetserve_kv_cache_usage_ratio (0-1)                          gauge
    prompt_tokens      fleetserve_prompt_tokens_total                                 counter
    generation_tokens  fleetserve_generation_tokens_total                             counter
    ttft               fleetserve_time_to_first_token_seconds (_bucket, _sum, _count) histogram

A ``MetricMapping`` (``fleetserve.metrics.mapping``) names, per signal, the engine metric that
feeds it; a blank (``None``) field means the engine has no such metric and the canonical series
stays absent: never zero, never borrowed from another engine. Each engine fleetserve runs carries
its mapping in its row (``fleetserve.engines``, ``ENGINES[kind].metrics``); further engines are
mapped by configuration (``mapping_from_config``). Two rules (``effective_mapping``): an empty
mapping means the default engine's names (vLLM's, ``engines.registry.DEFAULT_MAPPING``); a
mapping that names its own running metric is a complete statement, its blanks stay blank.

llama.cpp has no KV gauge today (older builds exported ``llamacpp:kv_cache_usage_ratio``). Its
``/slots`` endpoint shows how full each slot's context is; ``kv_from_slots`` turns that into a
ratio the caller may hand to ``normalize``, which uses it only where the scrape has no KV series.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from types import MappingProxyType

from fleetserve.engines.registry import DEFAULT_MAPPING
from fleetserve.errors import ConfigError, Problem
from fleetserve.metrics.mapping import MetricMapping, Signal
from fleetserve.metrics.promtext import COUNTER, GAUGE, HISTOGRAM, Sample, samples_of, series


def _sum(values: Sequence[float]) -> float:
    return float(sum(values))


def _mean(values: Sequence[float]) -> float:
    return float(sum(values)) / len(values)


@dataclass(frozen=True)
class Canonical:
    """A canonical engine metric: its sample name, Prometheus type, and how series combine."""

    name: str
    kind: str
    # Several source series can feed one replica (vLLM's data-parallel engines, engine="0", "1"):
    # counts and counters add up, a usage ratio of equal-sized caches is their mean.
    combine: Callable[[Sequence[float]], float]

    @property
    def family(self) -> str:
        """The family name: the sample name without a counter's ``_total``."""
        return self.name.removesuffix("_total") if self.kind == COUNTER else self.name


CANONICAL: Mapping[Signal, Canonical] = MappingProxyType(
    {
        Signal.RUNNING: Canonical("fleetserve_requests_running", GAUGE, _sum),
        Signal.WAITING: Canonical("fleetserve_requests_waiting", GAUGE, _sum),
        Signal.KV_CACHE_USAGE: Canonical("fleetserve_kv_cache_usage_ratio", GAUGE, _mean),
        Signal.PROMPT_TOKENS: Canonical("fleetserve_prompt_tokens_total", COUNTER, _sum),
        Signal.GENERATION_TOKENS: Canonical("fleetserve_generation_tokens_total", COUNTER, _sum),
        Signal.TTFT: Canonical("fleetserve_time_to_first_token_seconds", HISTOGRAM, _sum),
    }
)


def effective_mapping(mapping: MetricMapping) -> MetricMapping:
    """The mapping to apply: an empty one means the default engine's names; any other is taken as written."""
    return DEFAULT_MAPPING if mapping.is_empty else mapping


_METRIC_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
_CONFIG_KEYS = tuple(s.value for s in Signal)


def mapping_from_config(config: Mapping[str, object], location: str = "") -> MetricMapping:
    """A mapping from configuration, e.g. ``{"running": "sglang:num_running_reqs", ...}``.

    Keys are the signal names; a value is a metric name, or null/empty for "the engine has none".
    ``kv_cache_usage`` may also be a list: the current name first, then older ones. A mapping
    that names anything must name its running metric (routing and autoscaling read it); an empty
    mapping means vLLM's names. Every problem is reported at once in a ``ConfigError``.
    """
    problems: list[Problem] = []
    values: dict[str, str | None] = {}
    fallbacks: tuple[str, ...] = ()

    def name_of(key: str, value: object) -> str | None:
        if value is None or value == "":
            return None
        if not isinstance(value, str) or not _METRIC_NAME.match(value):
            problems.append(Problem(location, key, f"{value!r} is not a Prometheus metric name"))
            return None
        return value

    for key, value in config.items():
        if key not in _CONFIG_KEYS:
            problems.append(
                Problem(location, key, f"unknown signal; expected one of {', '.join(_CONFIG_KEYS)}")
            )
        elif key == Signal.KV_CACHE_USAGE and isinstance(value, list | tuple):
            names = [n for i, v in enumerate(value) if (n := name_of(f"{key}[{i}]", v)) is not None]
            values[key] = names[0] if names else None
            fallbacks = tuple(names[1:])
        else:
            values[key] = name_of(key, value)

    mapping = MetricMapping(
        running=values.get(Signal.RUNNING),
        waiting=values.get(Signal.WAITING),
        kv_cache_usage=values.get(Signal.KV_CACHE_USAGE),
        kv_cache_usage_fallbacks=fallbacks,
        prompt_tokens=values.get(Signal.PROMPT_TOKENS),
        generation_tokens=values.get(Signal.GENERATION_TOKENS),
        ttft=values.get(Signal.TTFT),
    )
    if (
        not mapping.is_empty
        and mapping.running is None
        and not any(p.field == Signal.RUNNING for p in problems)
    ):
        problems.append(
            Problem(
                location,
                Signal.RUNNING.value,
                "a mapping that names any metric must name the running one; leave the whole "
                "mapping empty to use vLLM's names",
            )
        )
    if problems:
        raise ConfigError(problems)
    return mapping


@dataclass(frozen=True)
class EngineLabels:
    """The canonical labels of one replica's engine metrics."""

    deployment: str
    replica: str
    node: str
    engine: str
    model: str

    def as_dict(self) -> dict[str, str]:
        """The labels as a name → value dict, in canonical order."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _finite(samples: Iterable[Sample]) -> list[float]:
    # NaN is how exporters say "no reading"; it must not turn into a number.
    return [s.value for s in samples if math.isfinite(s.value)]


def _bound(le: float) -> str:
    # A bucket bound as Prometheus writes it: 0.02, 1.0, +Inf.
    return ("+Inf" if le > 0 else "-Inf") if math.isinf(le) else repr(le)


def _histogram(samples: Sequence[Sample], base: str, labels: Mapping[str, str]) -> list[Sample]:
    canon = CANONICAL[Signal.TTFT]
    buckets: dict[float, float] = {}
    for s in series(samples, base + "_bucket"):
        le = s.labels.get("le")
        if le is not None:
            bound = float(le)
            buckets[bound] = buckets.get(bound, 0.0) + s.value
    out = [
        Sample(
            name=canon.name + "_bucket",
            labels={**labels, "le": _bound(bound)},
            value=count,
            family=canon.family,
            kind=canon.kind,
        )
        for bound, count in sorted(buckets.items())
    ]
    for suffix in ("_sum", "_count"):
        values = _finite(series(samples, base + suffix))
        if values and out:
            out.append(Sample(canon.name + suffix, labels, _sum(values), canon.family, canon.kind))
    return out


def normalize(
    engine_text: str | Iterable[Sample],
    mapping: MetricMapping,
    labels: EngineLabels,
    kv_cache_usage: float | None = None,
) -> tuple[Sample, ...]:
    """The canonical samples of one replica's scrape, under ``labels``.

    ``engine_text`` is the engine's ``/metrics`` body or samples already parsed from it. Only the
    metrics ``mapping`` names are read, so another engine's series in the same text are ignored.
    A signal whose metric is blank or absent yields no sample. ``kv_cache_usage`` (e.g. from
    ``kv_from_slots``) fills the KV ratio only when the scrape carries none.
    """
    samples = samples_of(engine_text)
    effective = effective_mapping(mapping)
    base = labels.as_dict()
    out: list[Sample] = []
    for signal, canon in CANONICAL.items():
        names = effective.names(signal)
        if signal is Signal.TTFT:
            out.extend(_histogram(samples, names[0], base) if names else [])
            continue
        # The first name with a reading wins: a current name before its older spellings.
        found = next((v for v in (_finite(series(samples, n)) for n in names) if v), None)
        if found is None and signal is Signal.KV_CACHE_USAGE and kv_cache_usage is not None:
            found = [kv_cache_usage]
        if found is not None:
            out.append(Sample(canon.name, base, canon.combine(found), canon.family, canon.kind))
    return tuple(out)


def _count(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def kv_from_slots(slots_json: object) -> float | None:
    """The share of llama-server's context held by requests in flight, from its ``/slots`` JSON.

    ``slots_json`` is the response body or the JSON already decoded.

    Each slot has ``n_ctx`` cells; a slot that ``is_processing`` holds ``n_prompt_tokens`` of them
    (its prompt plus the tokens generated so far). An idle slot's leftover prompt is a reusable
    cache, not load, so it counts as free, as vLLM counts cached-but-unreferenced blocks. Returns
    ``None`` (unknown, never a guess) for anything that is not a list of well-formed slots.
    """
    try:
        data = json.loads(slots_json) if isinstance(slots_json, str | bytes) else slots_json
    except ValueError:
        return None
    if not isinstance(data, list) or not data:
        return None
    total = used = 0
    for slot in data:
        if not isinstance(slot, Mapping):
            return None
        n_ctx = _count(slot.get("n_ctx"))
        if not n_ctx:
            return None
        total += n_ctx
        if slot.get("is_processing") is True:
            held = _count(slot.get("n_prompt_tokens"))
            if held is None:
                return None
            used += min(held, n_ctx)
    return used / total


def in_flight(body: str | Iterable[Sample], mapping: MetricMapping) -> int | None:
    """Requests an engine is running or holding (its running plus waiting gauges), from one scrape;
    None when the engine publishes neither (a drain then waits out its deadline)."""
    effective = effective_mapping(mapping)
    samples = samples_of(body)
    found = False
    total = 0.0
    for signal in (Signal.RUNNING, Signal.WAITING):
        for name in effective.names(signal):
            values = _finite(series(samples, name))
            if values:
                found = True
                total += sum(values)
                break
    return max(0, math.ceil(total)) if found else None
