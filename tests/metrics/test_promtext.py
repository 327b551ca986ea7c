"""Prometheus text exposition parsed into flat samples (fixtures: tests/fixtures/metrics/README.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleetserve.errors import FleetserveError
from fleetserve.metrics.promtext import (
    COUNTER,
    GAUGE,
    HISTOGRAM,
    ExpositionError,
    Sample,
    parse,
    samples_of,
    series,
)

FIXTURES = Path(__file__).parents[1] / "fixtures" / "metrics"


def read(name: str) -> str:
    return (FIXTURES / name).read_text(encoding="utf-8")


def value(samples: tuple[Sample, ...], metric: str) -> float:
    (only,) = series(samples, metric)
    return only.value


@pytest.mark.parametrize(
    ("metric", "expected", "kind"),
    [
        ("llamacpp:requests_processing", 2.0, GAUGE),
        ("llamacpp:requests_deferred", 1.0, GAUGE),
        ("llamacpp:prompt_tokens_total", 166.0, COUNTER),
        ("llamacpp:tokens_predicted_total", 191.0, COUNTER),
        # Declared a counter but written without _total: found under the name it was written with.
        ("llamacpp:n_tokens_max", 132.0, COUNTER),
    ],
    ids=[
        "the running gauge of the recorded llama-server is read under its colon name",
        "the deferred gauge of the recorded llama-server is read under its colon name",
        "a counter written with _total is found under that name",
        "the generated-token counter is found under its _total name",
        "a counter written without _total is still found under the name it was written with",
    ],
)
def test_the_recorded_llama_server_scrape_parses_with_colon_names(
    metric: str, expected: float, kind: str
) -> None:
    samples = parse(read("llamacpp_b11434_tiny_busy_2_slots.prom"))
    assert len(samples) == 15
    (found,) = series(samples, metric)
    assert (found.value, found.kind) == (expected, kind)


def test_a_counters_created_gauge_is_not_taken_for_the_counter() -> None:
    samples = parse(read("vllm_0.10_glm-4.5_excerpt.prom"))
    assert value(samples, "vllm:gpu_prefix_cache_hits_total") == 0.0
    assert value(samples, "vllm:gpu_prefix_cache_hits_created") == 1.7537953269353123e09
    (created,) = series(samples, "vllm:gpu_prefix_cache_hits_created")
    assert created.kind == GAUGE


def test_histogram_samples_keep_their_bucket_bound_and_family() -> None:
    samples = parse(read("vllm_2024-04_bloom-560m_ttft_excerpt.prom"))
    buckets = series(samples, "vllm:time_to_first_token_seconds_bucket")
    assert [(b.labels["le"], b.value) for b in buckets][3:5] == [("0.02", 112.0), ("0.04", 211.0)]
    assert {(b.family, b.kind) for b in buckets} == {("vllm:time_to_first_token_seconds", HISTOGRAM)}


@pytest.mark.parametrize(
    "text",
    ['vllm:num_requests_running{model_name="m" 1\n', "vllm:num_requests_running notanumber\n", "x{a=b} 1\n"],
    ids=["an unclosed label set", "a value that is not a number", "an unquoted label value"],
)
def test_text_that_is_not_an_exposition_raises_ours_with_the_parsers_cause(text: str) -> None:
    with pytest.raises(ExpositionError) as caught:
        parse(text)
    assert isinstance(caught.value, FleetserveError)
    assert isinstance(caught.value.__cause__, ValueError)


def test_a_sample_cannot_be_changed_through_its_labels() -> None:
    labels = {"gpu": "0"}
    sample = Sample("DCGM_FI_DEV_GPU_TEMP", labels, 31.0)
    labels["gpu"] = "1"
    assert sample.labels["gpu"] == "0"
    with pytest.raises(TypeError):
        sample.labels["gpu"] = "2"  # type: ignore[index]


def test_samples_already_parsed_pass_through_unparsed() -> None:
    parsed = parse(read("dcgm_exporter_nvidia_l4.prom"))
    assert samples_of(parsed) == parsed
    assert samples_of(iter(parsed)) == parsed


def test_a_sample_prints_as_its_exposition_line() -> None:
    assert repr(Sample("llamacpp:requests_processing", {"node": "a"}, 2.0)) == (
        'Sample(llamacpp:requests_processing{node="a"} 2.0)'
    )
