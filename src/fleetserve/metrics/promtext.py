"""Prometheus text exposition in, flat samples out.

Engines and exporters publish the text format (``# HELP``/``# TYPE`` lines, then one sample per
line). ``parse`` reads it with ``prometheus_client.parser`` and flattens the metric families into
``Sample`` values; the canonical metrics fleetserve derives from them are ``Sample`` values too, so
one type flows from a scrape to fleetserve's own exposition.

Names with colons (``llamacpp:requests_processing``, ``vllm:num_requests_running``) are valid
Prometheus names and pass through unchanged. One quirk of the parser is undone in ``matches``: a
family declared ``counter`` whose sample lacks the ``_total`` suffix (llama-server's
``llamacpp:n_tokens_max``) comes back named with ``_total`` appended.

Errors: text the parser cannot read raises ``ExpositionError``, a ``FleetserveError``, with the
parser's ``ValueError`` chained as its cause.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from prometheus_client.parser import text_string_to_metric_families

from fleetserve.errors import FleetserveError

# Prometheus metric types, as the parser names them; "unknown" when no # TYPE line was given.
COUNTER = "counter"
GAUGE = "gauge"
HISTOGRAM = "histogram"
UNKNOWN = "unknown"


class ExpositionError(FleetserveError):
    """A scrape body is not valid Prometheus text exposition."""


def _frozen(labels: Mapping[str, str]) -> Mapping[str, str]:
    return MappingProxyType(dict(labels))


@dataclass(frozen=True)
class Sample:
    """One sample: its name, labels and value, with the family and type it was declared under."""

    name: str
    labels: Mapping[str, str] = field(default_factory=dict, hash=False)
    value: float = 0.0
    family: str = ""
    kind: str = UNKNOWN

    def __post_init__(self) -> None:
        # A read-only copy: a sample handed around must not change under its holder.
        object.__setattr__(self, "labels", _frozen(self.labels))
        if not self.family:
            object.__setattr__(self, "family", self.name)

    def __repr__(self) -> str:
        labels = ",".join(f'{k}="{v}"' for k, v in self.labels.items())
        return f"Sample({self.name}{{{labels}}} {self.value!r})"

    def matches(self, metric: str) -> bool:
        """Whether this sample is the series ``metric`` names (counters with or without ``_total``)."""
        if self.name == metric:
            return True
        # The parser appends _total to a counter sample that lacked it; the family keeps the name.
        return self.kind == COUNTER and self.family == metric and self.name == metric + "_total"


def parse(text: str) -> tuple[Sample, ...]:
    """Every sample of a text exposition, in document order; raise ExpositionError if unreadable."""
    samples: list[Sample] = []
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                samples.append(
                    Sample(
                        name=s.name,
                        labels=s.labels,
                        value=float(s.value),
                        family=family.name,
                        kind=family.type,
                    )
                )
    except ValueError as exc:
        raise ExpositionError(f"not Prometheus text exposition: {exc}") from exc
    return tuple(samples)


def samples_of(source: str | Iterable[Sample]) -> tuple[Sample, ...]:
    """Samples from either a scrape body (parsed) or samples already parsed (passed through)."""
    if isinstance(source, str):
        return parse(source)
    return tuple(source)


def series(samples: Iterable[Sample], metric: str) -> tuple[Sample, ...]:
    """The samples of one metric name, in order."""
    return tuple(s for s in samples if s.matches(metric))
