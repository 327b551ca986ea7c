"""The control plane's /metrics: rendering, parsing back, series replacement, counters, dashboards."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families

from fleetserve.metrics.exposition import (
    ENGINE_LABELS,
    ENGINE_METRICS,
    GPU_LABELS,
    GPU_METRICS,
    METRICS,
    FleetMetrics,
    Kind,
    exposed_series_names,
)
from fleetserve.server.agents.callcpu import CallCpu

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "fleetserve.json"
PROMETHEUS = ROOT / "deploy" / "prometheus" / "prometheus.yml"


def engine_labels(replica: str, deployment: str = "chat", node: str = "gpu-1") -> dict[str, str]:
    return {"deployment": deployment, "replica": replica, "node": node, "engine": "vllm", "model": "llama"}


def gpu_labels(device: str, node: str = "gpu-1", driver: str = "gpu.nvidia.com") -> dict[str, str]:
    return {"node": node, "device": device, "driver": driver, "class": "nvidia-h100-80gb"}


def samples(metrics: FleetMetrics, accept: str = "") -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample of a render, parsed back with prometheus_client's own parser."""
    body, _ = metrics.render(accept)
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(body.decode())
        for s in family.samples
    }


def value(metrics: FleetMetrics, name: str, labels: dict[str, str]) -> float | None:
    return samples(metrics).get((name, frozenset(labels.items())))


def names(metrics: FleetMetrics) -> set[str]:
    return {name for name, _ in samples(metrics)}


# ---- rendering ------------------------------------------------------------------------------


def test_engine_and_gpu_samples_render_and_parse_back() -> None:
    m = FleetMetrics()
    m.set_engine_samples(
        [
            ("fleetserve_requests_running", engine_labels("chat-0"), 3),
            ("fleetserve_requests_waiting", engine_labels("chat-0"), 1),
            ("fleetserve_kv_cache_usage_ratio", engine_labels("chat-0"), 0.25),
            ("fleetserve_prompt_tokens_total", engine_labels("chat-0"), 1200),
            ("fleetserve_generation_tokens_total", engine_labels("chat-0"), 800),
        ]
    )
    m.set_gpu_samples(
        [
            ("fleetserve_gpu_utilization_ratio", gpu_labels("0"), 0.9),
            ("fleetserve_gpu_memory_used_bytes", gpu_labels("0"), 70 * 2**30),
            ("fleetserve_gpu_energy_joules_total", gpu_labels("0"), 5e6),
            ("fleetserve_gpu_tensor_active_ratio", gpu_labels("0"), 0.4),
        ]
    )
    body, content_type = m.render()
    assert content_type.startswith("text/plain; version=0.0.4")
    families = {f.name: f for f in text_string_to_metric_families(body.decode())}
    assert families["fleetserve_requests_running"].type == "gauge"
    assert families["fleetserve_prompt_tokens"].type == "counter"
    assert families["fleetserve_gpu_energy_joules"].type == "counter"
    assert value(m, "fleetserve_requests_running", engine_labels("chat-0")) == 3
    assert value(m, "fleetserve_kv_cache_usage_ratio", engine_labels("chat-0")) == 0.25
    assert value(m, "fleetserve_prompt_tokens_total", engine_labels("chat-0")) == 1200
    assert value(m, "fleetserve_gpu_memory_used_bytes", gpu_labels("0")) == 70 * 2**30
    assert value(m, "fleetserve_gpu_energy_joules_total", gpu_labels("0")) == 5e6


def test_openmetrics_is_negotiated_from_the_accept_header() -> None:
    m = FleetMetrics()
    m.set_engine_samples([("fleetserve_generation_tokens_total", engine_labels("chat-0"), 7)])
    m.gateway_request("chat", 200, 0.5)
    body, content_type = m.render("application/openmetrics-text; version=1.0.0; charset=utf-8")
    assert content_type.startswith("application/openmetrics-text")
    families = {f.name: f for f in parse_openmetrics(body.decode())}  # type: ignore[no-untyped-call]
    (tokens,) = families["fleetserve_generation_tokens"].samples
    assert (tokens.name, tokens.value) == ("fleetserve_generation_tokens_total", 7)
    assert families["fleetserve_gateway_request_seconds"].type == "histogram"


def test_missing_labels_render_empty_and_nan_values_are_dropped() -> None:
    m = FleetMetrics()
    m.set_engine_samples(
        [
            ("fleetserve_requests_running", {"deployment": "chat", "replica": "chat-0"}, 2),
            ("fleetserve_kv_cache_usage_ratio", engine_labels("chat-0"), float("nan")),
        ]
    )
    # Prometheus treats an empty label as absent: the parser drops nothing, the series is there.
    assert (
        value(
            m,
            "fleetserve_requests_running",
            engine_labels("chat-0") | {"node": "", "engine": "", "model": ""},
        )
        == 2
    )
    assert "fleetserve_kv_cache_usage_ratio" not in names(m)


def test_a_later_duplicate_sample_wins() -> None:
    m = FleetMetrics()
    m.set_engine_samples(
        [
            ("fleetserve_requests_running", engine_labels("chat-0"), 1),
            ("fleetserve_requests_running", engine_labels("chat-0"), 5),
        ]
    )
    assert value(m, "fleetserve_requests_running", engine_labels("chat-0")) == 5


@pytest.mark.parametrize(
    ("sentence", "call", "match"),
    [
        (
            "an engine sample under a vendor name is refused",
            lambda m: m.set_engine_samples([("vllm:num_requests_running", engine_labels("r"), 1)]),
            "not a canonical engine metric",
        ),
        (
            "a GPU metric handed over as an engine sample is refused",
            lambda m: m.set_engine_samples([("fleetserve_gpu_power_watts", gpu_labels("0"), 1)]),
            "not a canonical engine metric",
        ),
        (
            "an unknown label is refused",
            lambda m: m.set_gpu_samples([("fleetserve_gpu_power_watts", gpu_labels("0") | {"uuid": "x"}, 1)]),
            "unknown labels",
        ),
    ],
)
def test_bad_samples_are_refused(sentence: str, call: Any, match: str) -> None:
    m = FleetMetrics()
    m.set_engine_samples([("fleetserve_requests_running", engine_labels("chat-0"), 1)])
    with pytest.raises(ValueError, match=match):
        call(m)
    # The refused batch replaced nothing.
    assert value(m, "fleetserve_requests_running", engine_labels("chat-0")) == 1


# ---- replacement ----------------------------------------------------------------------------


def test_series_of_removed_replicas_and_gpus_disappear() -> None:
    m = FleetMetrics()
    m.set_engine_samples(
        [
            ("fleetserve_requests_running", engine_labels("chat-0"), 1),
            ("fleetserve_requests_running", engine_labels("chat-1"), 2),
        ]
    )
    m.set_gpu_samples(
        [
            ("fleetserve_gpu_power_watts", gpu_labels("0"), 300),
            ("fleetserve_gpu_power_watts", gpu_labels("1"), 310),
        ]
    )
    m.set_engine_samples([("fleetserve_requests_running", engine_labels("chat-1"), 4)])
    m.set_gpu_samples([("fleetserve_gpu_power_watts", gpu_labels("1"), 305)])
    got = samples(m)
    assert ("fleetserve_requests_running", frozenset(engine_labels("chat-0").items())) not in got
    assert got[("fleetserve_requests_running", frozenset(engine_labels("chat-1").items()))] == 4
    assert ("fleetserve_gpu_power_watts", frozenset(gpu_labels("0").items())) not in got
    # Engine samples replace engine series only; GPU series stay until the GPU cycle replaces them.
    m.set_engine_samples([])
    assert "fleetserve_requests_running" not in names(m)
    assert "fleetserve_gpu_power_watts" in names(m)


def test_desired_replicas_are_replaced_wholesale() -> None:
    m = FleetMetrics()
    m.set_desired_replicas({"chat": 3, "embed": 0})
    assert value(m, "fleetserve_autoscaler_desired_replicas", {"deployment": "embed"}) == 0
    m.set_desired_replicas({"chat": 4})
    assert value(m, "fleetserve_autoscaler_desired_replicas", {"deployment": "chat"}) == 4
    assert value(m, "fleetserve_autoscaler_desired_replicas", {"deployment": "embed"}) is None


def test_forgetting_a_deployment_removes_its_own_series() -> None:
    m = FleetMetrics()
    for dep in ("chat", "embed"):
        m.gateway_request(dep, 200, 0.1)
        m.gateway_answer(dep, 429, 0.1)
        m.gateway_stream(dep, f"{dep}-0", "vllm", 0.05, 0.01)
        m.gateway_key_request("team-a", dep, 0.1, 10, 20)
        m.gateway_rejection(dep, "QueueFull")
        m.set_queue_depth(dep, 2)
        m.engine_restart(dep, f"{dep}-0")
    m.forget_deployment("chat")
    left = {
        dict(labels).get("deployment", dict(labels).get("model"))
        for name, labels in samples(m)
        if name.startswith("fleetserve_gateway")
    }
    assert left == {"embed"}
    models = {dict(labels).get("model") for name, labels in samples(m) if "key" in dict(labels)}
    assert models == {"embed"}
    assert value(m, "fleetserve_engine_restarts_total", {"deployment": "chat", "replica": "chat-0"}) is None
    assert value(m, "fleetserve_engine_restarts_total", {"deployment": "embed", "replica": "embed-0"}) == 1
    m.forget_deployment("chat")  # twice is harmless


# ---- counters and histograms ----------------------------------------------------------------


def test_own_counters_only_go_up_and_histograms_count() -> None:
    m = FleetMetrics()
    for code, seconds in [(200, 0.2), (200, 3.0), (429, 0.01)]:
        m.gateway_request("chat", code, seconds)
    m.gateway_rejection("chat", "QueueFull")
    m.gateway_rejection("chat", "QueueFull")
    m.engine_restart("chat", "chat-0")
    m.observe_reconcile(0.02)
    m.observe_placement(0.004)
    m.set_queue_depth("chat", 5)
    m.set_queue_depth("chat", 2)
    assert value(m, "fleetserve_gateway_requests_total", {"deployment": "chat", "code": "200"}) == 2
    assert value(m, "fleetserve_gateway_requests_total", {"deployment": "chat", "code": "429"}) == 1
    assert value(m, "fleetserve_gateway_rejections_total", {"deployment": "chat", "reason": "QueueFull"}) == 2
    assert value(m, "fleetserve_engine_restarts_total", {"deployment": "chat", "replica": "chat-0"}) == 1
    assert value(m, "fleetserve_gateway_queue_depth", {"deployment": "chat"}) == 2
    assert value(m, "fleetserve_gateway_request_seconds_count", {"deployment": "chat"}) == 3
    assert value(m, "fleetserve_gateway_request_seconds_bucket", {"deployment": "chat", "le": "0.25"}) == 2
    assert value(m, "fleetserve_gateway_request_seconds_sum", {"deployment": "chat"}) == pytest.approx(3.21)
    assert value(m, "fleetserve_reconcile_seconds_count", {}) == 1
    assert value(m, "fleetserve_placement_seconds_bucket", {"le": "0.005"}) == 1
    with pytest.raises(ValueError):
        m.gateway_requests.labels("chat", "200").inc(-1)  # a counter refuses to go down


def test_engine_counters_pass_through_as_counters() -> None:
    m = FleetMetrics()
    m.set_engine_samples([("fleetserve_generation_tokens_total", engine_labels("chat-0"), 100)])
    m.set_engine_samples([("fleetserve_generation_tokens_total", engine_labels("chat-0"), 150)])
    assert value(m, "fleetserve_generation_tokens_total", engine_labels("chat-0")) == 150
    body, _ = m.render()
    assert "# TYPE fleetserve_generation_tokens_total counter" in body.decode()


def test_no_created_series_are_exposed() -> None:
    m = FleetMetrics()
    m.gateway_request("chat", 200, 0.1)
    m.observe_reconcile(0.1)
    assert not {n for n in names(m) if n.endswith("_created")}


def test_each_instance_has_its_own_registry() -> None:
    a, b = FleetMetrics(), FleetMetrics()
    a.gateway_request("chat", 200, 0.1)
    assert value(b, "fleetserve_gateway_requests_total", {"deployment": "chat", "code": "200"}) is None


def test_a_full_render_exposes_exactly_the_declared_names() -> None:
    m = FleetMetrics()
    m.set_engine_samples([(n, engine_labels("chat-0"), 1) for n in ENGINE_METRICS])
    m.set_gpu_samples([(n, gpu_labels("0"), 1) for n in GPU_METRICS])
    m.set_desired_replicas({"chat": 1})
    m.gateway_request("chat", 200, 0.1)
    m.gateway_rejection("chat", "QueueFull")
    m.set_queue_depth("chat", 1)
    m.engine_restart("chat", "chat-0")
    m.observe_placement(0.1)
    m.observe_reconcile(0.1)
    m.observe_reconcile_phase("plan", 0.1)
    m.gateway_stream("chat", "chat-0", "vllm", 0.05, 0.01)
    m.gateway_key_request("team-a", "chat", 0.1, 10, 20)
    m.set_ratelimit_shared(False)
    m.gateway_cache_pick("chat", 2000, 1600)
    CallCpu(m)  # the agents' calls, every kind at 0 from the start
    assert names(m) == exposed_series_names()
    for name, d in METRICS.items():
        assert name.startswith("fleetserve_")
        assert name.endswith("_total") == (d.kind is Kind.COUNTER)
    assert {METRICS[n].labels for n in ENGINE_METRICS} == {ENGINE_LABELS}
    assert {METRICS[n].labels for n in GPU_METRICS} == {GPU_LABELS}


# ---- the dashboard and the scrape config ----------------------------------------------------

_KEYWORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "bool",
    "and",
    "or",
    "unless",
    "offset",
    "inf",
    "nan",
}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression (or a Grafana ``label_values`` query) references."""
    found: set[str] = set()
    # Names chosen by regex on __name__, e.g. {__name__=~"a|b"}.
    for match in re.finditer(r'__name__\s*=~?\s*"([^"]*)"', expr):
        found |= set(match.group(1).split("|"))
    # label_values(selector, label): only the selector names metrics.
    expr = re.sub(r"label_values\((.*),\s*\w+\s*\)", r"(\1)", expr)
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals
    expr = re.sub(r"\$\{[^}]*\}|\$\w+", "", expr)  # Grafana variables
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # range selectors and subqueries
    expr = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    for match in re.finditer(r"(?<![\w.:])[A-Za-z_:][\w:]*", expr):
        word = match.group(0)
        if expr[match.end() :].lstrip().startswith("("):
            continue  # a function or aggregation
        if word.lower() in _KEYWORDS:
            continue
        found.add(word)
    return found


@pytest.mark.parametrize(
    ("expr", "expected"),
    [
        (
            'sum by (deployment) (rate(fleetserve_generation_tokens_total{node=~"$node"}[$__rate_interval]))',
            {"fleetserve_generation_tokens_total"},
        ),
        (
            "histogram_quantile(0.99, sum by (le) (rate(a_bucket[5m]))) / on(x) group_left(y) b offset 1h",
            {"a_bucket", "b"},
        ),
        ('label_values({__name__=~"x|y"}, node)', {"x", "y"}),
        ("label_values(fleetserve_gpu_power_watts, driver)", {"fleetserve_gpu_power_watts"}),
        ("count(up == 1) * 1e3 + vector(2)", {"up"}),
        ('DCGM_FI_DEV_GPU_UTIL{gpu="0"} / 100', {"DCGM_FI_DEV_GPU_UTIL"}),
    ],
)
def test_metric_names_parses_promql(expr: str, expected: set[str]) -> None:
    assert metric_names(expr) == expected


def _panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))


def _queries(dashboard: dict[str, Any]) -> Iterator[tuple[str, str]]:
    for panel in _panels(dashboard["panels"]):
        for target in panel.get("targets", []):
            yield panel["title"], target["expr"]
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            query = var["query"]
            yield f"${var['name']}", query["query"] if isinstance(query, dict) else query


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return loaded


def test_the_dashboard_queries_only_metrics_fleetserve_exposes(dashboard: dict[str, Any]) -> None:
    exposed = exposed_series_names()
    used: set[str] = set()
    for where, expr in _queries(dashboard):
        referenced = metric_names(expr)
        assert referenced, f"{where}: no metric found in {expr!r}"
        unknown = referenced - exposed
        assert not unknown, f"{where}: {expr!r} uses {sorted(unknown)}, not exposed by FleetMetrics"
        used |= referenced
    # Every canonical series the issue lists has a panel.
    assert {n for n in exposed if not n.endswith(("_sum", "_count"))} <= used


def test_a_dashboard_with_a_vendor_name_would_fail_the_check() -> None:
    assert metric_names("avg(DCGM_FI_DEV_GPU_UTIL)") - exposed_series_names() == {"DCGM_FI_DEV_GPU_UTIL"}


def test_the_dashboard_is_importable_grafana_json(dashboard: dict[str, Any]) -> None:
    assert dashboard["schemaVersion"] >= 39
    assert dashboard["uid"] and dashboard["title"]
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert {"deployment", "node", "driver"} <= set(variables)
    panels = list(_panels(dashboard["panels"]))
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    rows = [p["title"] for p in panels if p["type"] == "row"]
    assert len(rows) == 3
    for panel in panels:
        assert {"h", "w", "x", "y"} <= set(panel["gridPos"])
        assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
        if panel["type"] != "row":
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
            assert panel["targets"]
            refs = [t["refId"] for t in panel["targets"]]
            assert len(refs) == len(set(refs))


def test_the_prometheus_config_scrapes_the_control_plane() -> None:
    config = yaml.safe_load(PROMETHEUS.read_text())
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "fleetserve"]
    assert job["metrics_path"] == "/metrics"
    assert job["static_configs"][0]["targets"]
