"""Engine metrics mapped to canonical names (design.md, Metrics; fixtures: tests/fixtures/metrics/README.md).

Every fixture named ``llamacpp_*`` was recorded here from the real llama-server; the ``vllm_*`` ones
are published scrapes. Lines a test appends to a fixture are marked as made up where they appear.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from fleetserve.engines.llamacpp import METRICS as LLAMACPP_MAPPING
from fleetserve.engines.registry import ENGINES
from fleetserve.engines.spec import EngineKind
from fleetserve.engines.vllm import METRICS as VLLM_MAPPING
from fleetserve.errors import ConfigError
from fleetserve.metrics.engine import (
    CANONICAL,
    EngineLabels,
    effective_mapping,
    in_flight,
    kv_from_slots,
    mapping_from_config,
    normalize,
)
from fleetserve.metrics.mapping import MetricMapping, Signal
from fleetserve.metrics.promtext import COUNTER, GAUGE, HISTOGRAM, Sample, parse

# Each engine row's mapping, keyed like the registry.
MAPPINGS = {kind: spec.metrics for kind, spec in ENGINES.items()}

FIXTURES = Path(__file__).parents[1] / "fixtures" / "metrics"
LABELS = EngineLabels(deployment="chat", replica="chat-0", node="node-a", engine="llama.cpp", model="tiny")
CANONICAL_LABELS = {
    "deployment": "chat",
    "replica": "chat-0",
    "node": "node-a",
    "engine": "llama.cpp",
    "model": "tiny",
}

RUNNING = "fleetserve_requests_running"
WAITING = "fleetserve_requests_waiting"
KV = "fleetserve_kv_cache_usage_ratio"
PROMPT = "fleetserve_prompt_tokens_total"
GENERATION = "fleetserve_generation_tokens_total"
TTFT_BUCKET = "fleetserve_time_to_first_token_seconds_bucket"


def read(name: str) -> str:
    return (FIXTURES / name).read_text(encoding="utf-8")


def scalars(samples: tuple[Sample, ...]) -> dict[str, float]:
    """The canonical samples other than histogram buckets, by name."""
    return {s.name: s.value for s in samples if "le" not in s.labels}


@pytest.mark.parametrize(
    ("fixture", "expected"),
    [
        (
            "llamacpp_b11434_tiny_busy_2_slots.prom",
            {RUNNING: 2.0, WAITING: 1.0, PROMPT: 166.0, GENERATION: 191.0},
        ),
        (
            "llamacpp_b11434_tiny_after_3_requests.prom",
            {RUNNING: 0.0, WAITING: 0.0, PROMPT: 73.0, GENERATION: 48.0},
        ),
    ],
    ids=[
        "the real llama-server under load maps running, waiting and both token counters",
        "the real llama-server at rest maps its zeros as readings, not as absences",
    ],
)
def test_the_real_llama_server_scrape_maps_without_kv_or_ttft(
    fixture: str, expected: dict[str, float]
) -> None:
    samples = normalize(read(fixture), MAPPINGS[EngineKind.LLAMACPP], LABELS)
    # Exactly these four: the KV ratio stays absent (b11434 exports no KV gauge) and no TTFT.
    assert scalars(samples) == expected
    assert [s for s in samples if "le" in s.labels] == []
    assert all(dict(s.labels) == CANONICAL_LABELS for s in samples)


def test_the_recorded_slots_give_the_share_of_context_held_by_requests_in_flight() -> None:
    slots = read("llamacpp_b11434_tiny_busy_2_slots.slots.json")
    # Two processing slots of 256 cells each, holding 119 and 53 tokens.
    assert kv_from_slots(slots) == (119 + 53) / 512
    samples = normalize(
        read("llamacpp_b11434_tiny_busy_2_slots.prom"),
        LLAMACPP_MAPPING,
        LABELS,
        kv_cache_usage=kv_from_slots(slots),
    )
    assert scalars(samples)[KV] == 0.3359375


def test_a_kv_gauge_in_the_scrape_wins_over_the_slots_estimate() -> None:
    # Made up: the gauge older llama-server builds exported, appended to the real scrape.
    text = read("llamacpp_b11434_tiny_busy_2_slots.prom") + "llamacpp:kv_cache_usage_ratio 0.25\n"
    assert scalars(normalize(text, LLAMACPP_MAPPING, LABELS, kv_cache_usage=0.9))[KV] == 0.25


@pytest.mark.parametrize(
    ("slots", "expected"),
    [
        (
            [
                {"n_ctx": 256, "is_processing": False, "n_prompt_tokens": 58},
                {"n_ctx": 256, "is_processing": False},
            ],
            0.0,
        ),
        ([{"n_ctx": 100, "is_processing": True, "n_prompt_tokens": 250}], 1.0),
        ([], None),
        ("not json", None),
        ({"n_ctx": 256}, None),
        ([{"is_processing": True, "n_prompt_tokens": 3}], None),
        ([{"n_ctx": 256, "is_processing": True}], None),
        ([{"n_ctx": True, "is_processing": False}], None),
    ],
    ids=[
        "idle slots keep a reusable cache and count as free",
        "a slot cannot hold more than its context",
        "no slots is unknown, not empty",
        "a body that is not JSON is unknown",
        "an object instead of a list is unknown",
        "a slot without n_ctx is unknown",
        "a processing slot without n_prompt_tokens is unknown",
        "a boolean is not a context size",
    ],
)
def test_kv_from_slots_is_a_ratio_or_unknown(slots: object, expected: float | None) -> None:
    body = slots if isinstance(slots, str) else json.dumps(slots)
    assert kv_from_slots(body) == expected
    if not isinstance(slots, str):
        assert kv_from_slots(slots) == expected


@pytest.mark.parametrize(
    ("fixture", "expected"),
    [
        (
            "vllm_2025-01_qwen2.5-coder-1.5b.prom",
            {RUNNING: 0.0, WAITING: 0.0, KV: 0.0, PROMPT: 148.0, GENERATION: 955.0},
        ),
        ("vllm_0.10_glm-4.5_excerpt.prom", {KV: 9.75010481363281e-06}),
        ("vllm_2024-04_bloom-560m_ttft_excerpt.prom", {PROMPT: 1196.0, GENERATION: 218152.0}),
    ],
    ids=[
        "a vLLM that exports only the older gpu_cache_usage_perc still gives a KV ratio",
        "a vLLM 0.10 excerpt gives its kv_cache_usage_perc and nothing it does not show",
        "a vLLM v0 excerpt gives its token counters",
    ],
)
def test_recorded_vllm_scrapes_map_to_canonical_names(fixture: str, expected: dict[str, float]) -> None:
    samples = normalize(read(fixture), MAPPINGS[EngineKind.VLLM], LABELS)
    assert scalars(samples) == expected


def test_the_current_kv_name_wins_when_vllm_exports_both() -> None:
    # Made up: the deprecated series vLLM 0.10 still exported beside the new one.
    old = 'vllm:gpu_cache_usage_perc{engine="0",model_name="zai-org/GLM-4.5"} 0.5\n'
    text = read("vllm_0.10_glm-4.5_excerpt.prom") + old
    assert scalars(normalize(text, VLLM_MAPPING, LABELS))[KV] == 9.75010481363281e-06


def test_vllms_ttft_histogram_becomes_the_canonical_histogram_bucket_by_bucket() -> None:
    samples = normalize(read("vllm_2024-04_bloom-560m_ttft_excerpt.prom"), VLLM_MAPPING, LABELS)
    buckets = [s for s in samples if s.name == TTFT_BUCKET]
    assert [(s.labels["le"], s.value) for s in buckets] == [
        ("0.001", 0.0),
        ("0.005", 0.0),
        ("0.01", 0.0),
        ("0.02", 112.0),
        ("0.04", 211.0),
        ("0.06", 211.0),
        ("0.08", 213.0),
    ]
    assert all(dict(s.labels) == {**CANONICAL_LABELS, "le": s.labels["le"]} for s in buckets)
    assert {(s.family, s.kind) for s in buckets} == {("fleetserve_time_to_first_token_seconds", HISTOGRAM)}


def test_data_parallel_engines_add_up_and_their_kv_ratios_average() -> None:
    # Made up: two engines of one replica, as vLLM labels them with data parallelism.
    text = "".join(
        f'vllm:num_requests_running{{engine="{e}"}} {r}\nvllm:kv_cache_usage_perc{{engine="{e}"}} {kv}\n'
        f'vllm:time_to_first_token_seconds_bucket{{engine="{e}",le="+Inf"}} {r}\n'
        f'vllm:time_to_first_token_seconds_count{{engine="{e}"}} {r}\n'
        for e, r, kv in (("0", 3, 0.5), ("1", 5, 0.25))
    )
    samples = normalize(text, VLLM_MAPPING, LABELS)
    assert scalars(samples) == {RUNNING: 8.0, KV: 0.375, "fleetserve_time_to_first_token_seconds_count": 8.0}
    assert [(s.labels["le"], s.value) for s in samples if s.name == TTFT_BUCKET] == [("+Inf", 8.0)]


def test_a_nan_reading_is_absent_not_a_number() -> None:
    text = "vllm:num_requests_running NaN\nvllm:num_requests_waiting 4\n"
    assert scalars(normalize(text, VLLM_MAPPING, LABELS)) == {WAITING: 4.0}


def test_an_empty_mapping_means_vllms_names() -> None:
    text = read("vllm_2025-01_qwen2.5-coder-1.5b.prom")
    assert effective_mapping(MetricMapping()) is VLLM_MAPPING
    assert effective_mapping(mapping_from_config({})) is VLLM_MAPPING
    assert normalize(text, MetricMapping(), LABELS) == normalize(text, VLLM_MAPPING, LABELS)
    assert scalars(normalize(text, MetricMapping(), LABELS))[PROMPT] == 148.0


def test_a_mapping_that_names_its_running_metric_leaves_its_blanks_blank() -> None:
    # Made up: an SGLang running gauge in the same body as a real vLLM scrape's series.
    text = read("vllm_2025-01_qwen2.5-coder-1.5b.prom") + "sglang:num_running_reqs 3\n"
    for mapping in (
        MetricMapping(running="sglang:num_running_reqs"),
        mapping_from_config({"running": "sglang:num_running_reqs", "waiting": None, "ttft": ""}),
    ):
        assert effective_mapping(mapping) is mapping
        # vllm:num_requests_waiting, the KV gauge and both token counters are in the text, and dropped.
        assert scalars(normalize(text, mapping, LABELS)) == {RUNNING: 3.0}


def test_the_llamacpp_mapping_drops_vllm_series_in_the_same_text_and_vice_versa() -> None:
    text = read("llamacpp_b11434_tiny_busy_2_slots.prom") + read("vllm_2024-04_bloom-560m_ttft_excerpt.prom")
    llama = normalize(text, LLAMACPP_MAPPING, LABELS)
    vllm = normalize(text, VLLM_MAPPING, LABELS)
    # vLLM's token counters (1196, 218152) and its TTFT buckets are present but not picked up.
    assert scalars(llama) == {RUNNING: 2.0, WAITING: 1.0, PROMPT: 166.0, GENERATION: 191.0}
    assert scalars(vllm) == {PROMPT: 1196.0, GENERATION: 218152.0}
    assert len([s for s in vllm if s.name == TTFT_BUCKET]) == 7


def test_normalize_takes_samples_already_parsed() -> None:
    text = read("llamacpp_b11434_tiny_busy_2_slots.prom")
    assert normalize(parse(text), LLAMACPP_MAPPING, LABELS) == normalize(text, LLAMACPP_MAPPING, LABELS)


def test_canonical_samples_carry_their_prometheus_type() -> None:
    samples = normalize(read("vllm_2025-01_qwen2.5-coder-1.5b.prom"), VLLM_MAPPING, LABELS)
    assert {s.name: (s.family, s.kind) for s in samples} == {
        RUNNING: (RUNNING, GAUGE),
        WAITING: (WAITING, GAUGE),
        KV: (KV, GAUGE),
        PROMPT: ("fleetserve_prompt_tokens", COUNTER),
        GENERATION: ("fleetserve_generation_tokens", COUNTER),
    }


def test_every_engine_fleetserve_runs_has_a_mapping_and_only_vllm_a_ttft() -> None:
    assert set(MAPPINGS) == set(EngineKind)
    assert [e for e, m in MAPPINGS.items() if m.ttft] == [EngineKind.VLLM]
    assert set(CANONICAL) == set(Signal)


def test_a_configured_kv_list_is_the_current_name_then_older_ones() -> None:
    mapping = mapping_from_config(
        {"running": "sglang:num_running_reqs", "kv_cache_usage": ["a:new", "a:old"]}
    )
    assert mapping.names(Signal.KV_CACHE_USAGE) == ("a:new", "a:old")
    assert scalars(normalize("sglang:num_running_reqs 1\na:old 0.5\n", mapping, LABELS)) == {
        RUNNING: 1.0,
        KV: 0.5,
    }


@pytest.mark.parametrize(
    ("config", "fields"),
    [
        ({"runing": "x"}, ["runing"]),
        ({"running": 3}, ["running"]),
        ({"running": "1bad"}, ["running"]),
        ({"waiting": "sglang:num_queue_reqs"}, ["running"]),
        ({"running": "a", "kv_cache_usage": ["ok", "not ok"]}, ["kv_cache_usage[1]"]),
    ],
    ids=[
        "a misspelt signal is refused",
        "a number is not a metric name",
        "a name starting with a digit is not a metric name",
        "a mapping that names metrics but not the running one is refused",
        "a bad entry of a KV list is refused by its position",
    ],
)
def test_a_configured_mapping_reports_every_problem(config: dict[str, object], fields: list[str]) -> None:
    with pytest.raises(ConfigError) as caught:
        mapping_from_config(config, location="engines.sglang.metrics")
    assert [p.field for p in caught.value.problems] == fields
    assert all(p.location == "engines.sglang.metrics" for p in caught.value.problems)


def test_no_canonical_value_is_ever_nan() -> None:
    for fixture in sorted(FIXTURES.glob("*.prom")):
        for mapping in MAPPINGS.values():
            assert all(math.isfinite(s.value) for s in normalize(fixture.read_text(), mapping, LABELS))


@pytest.mark.parametrize(
    ("case", "body", "expected"),
    [
        ("running plus waiting", "llamacpp:requests_processing 2\nllamacpp:requests_deferred 1\n", 3),
        ("idle", "llamacpp:requests_processing 0\nllamacpp:requests_deferred 0\n", 0),
        ("only the running gauge", "llamacpp:requests_processing 1\n", 1),
        ("neither gauge: unknown, never zero", "llamacpp:tokens_predicted_total 5\n", None),
        ("a NaN reading is no reading", "llamacpp:requests_processing NaN\n", None),
    ],
)
def test_in_flight_counts_what_the_engine_runs_and_holds(case: str, body: str, expected: int | None) -> None:
    assert in_flight(body, LLAMACPP_MAPPING) == expected, case


def test_in_flight_of_vllm_reads_its_own_names() -> None:
    body = "vllm:num_requests_running 3\nvllm:num_requests_waiting 2\n"
    assert in_flight(body, VLLM_MAPPING) == 5
