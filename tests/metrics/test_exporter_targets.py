"""GPU metrics exporters as scrape targets: the driver table's rows, and scrapes of recorded exporter
output (tests/fixtures/metrics, published from real devices) mapped onto ``fleetserve_gpu_*``."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleetserve.drivers import DRIVERS, Driver, metrics_exporters
from fleetserve.metrics.exporters import (
    ExporterTarget,
    detect_driver,
    exporter_source,
    gpu_series,
    local_targets,
)
from fleetserve.metrics.gpu import SOURCES, GpuSource
from fleetserve.metrics.targets import Scrape

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "metrics"


def recorded(name: str) -> str:
    return (FIXTURES / name).read_text(encoding="utf-8")


def test_every_exporter_of_the_table_reads_a_source_of_its_own_driver() -> None:
    exporters = metrics_exporters()
    # Every accelerator a cluster can hold has one; Apple's row (agents only) reads ioreg instead.
    assert set(exporters) == {d for d, spec in DRIVERS.items() if spec.is_accelerator and spec.kube_supported}
    for driver, exporter in exporters.items():
        assert SOURCES[GpuSource(exporter.source)].driver is driver
        assert exporter.pod_selectors and all("=" in s for s in exporter.pod_selectors)
    assert DRIVERS[Driver.CPU].metrics_exporter is None


def test_an_agent_probes_each_exporter_at_its_default_port_on_loopback() -> None:
    assert [(t.driver, t.url) for t in local_targets("n1")] == [
        (Driver.NVIDIA, "http://127.0.0.1:9400/metrics"),
        (Driver.AMD, "http://127.0.0.1:5000/metrics"),
    ]
    assert {t.node for t in local_targets("n1")} == {"n1"}


def test_a_dcgm_scrape_is_labelled_with_the_targets_node_and_the_nodes_classes() -> None:
    target = ExporterTarget(Driver.NVIDIA, "gpu-1", "http://10.0.0.5:9400/metrics", pod="gpu-operator/dcgm-a")
    samples = {
        s.name: s for s in target.samples(recorded("dcgm_exporter_nvidia_l4.prom"), {"0": "nvidia-l4"})
    }
    labels = {"node": "gpu-1", "device": "0", "driver": "gpu.nvidia.com", "class": "nvidia-l4"}
    assert {n: dict(s.labels) for n, s in samples.items()} == {n: labels for n in samples}
    assert samples["fleetserve_gpu_power_watts"].value == 16.365
    assert samples["fleetserve_gpu_memory_used_bytes"].value == 0.0
    assert target.key == "exporter/gpu-operator/dcgm-a"
    assert dict(target.target().labels) == {"node": "gpu-1", "driver": "gpu.nvidia.com"}


def test_without_a_node_or_class_the_exporters_own_labels_name_them() -> None:
    target = ExporterTarget(Driver.AMD, "", "http://127.0.0.1:5000/metrics")
    (sample,) = target.samples(recorded("amd_exporter_mi300x_pr236_excerpt.prom"))
    assert dict(sample.labels) == {
        "node": "smc300x-clt-r4c3-18",
        "device": "0",
        "driver": "gpu.amd.com",
        "class": "102-G30211-0C",
    }
    assert target.key == "exporter/gpu.amd.com/http://127.0.0.1:5000/metrics"


@pytest.mark.parametrize(
    ("fixture", "driver"),
    [
        ("dcgm_exporter_nvidia_l4.prom", Driver.NVIDIA),
        ("dcgm_exporter_nvidia_a100_mig.prom", Driver.NVIDIA),
        ("amd_exporter_issue259_excerpt.prom", Driver.AMD),
        ("amd_exporter_mi300x_pr236_excerpt.prom", Driver.AMD),
        ("llamacpp_b11434_tiny_after_3_requests.prom", None),
        ("vllm_2025-01_qwen2.5-coder-1.5b.prom", None),
    ],
)
def test_which_exporter_wrote_a_body_is_told_by_what_it_serves(fixture: str, driver: Driver | None) -> None:
    assert detect_driver(recorded(fixture)) is driver


def test_a_body_that_is_not_prometheus_text_is_no_exporters() -> None:
    assert detect_driver("<html>hello</html>\n{") is None
    assert exporter_source(Driver.NVIDIA) is GpuSource.DCGM


def _scrape(key: str, body: bytes | None, stale: bool = False, error: str | None = None) -> Scrape:
    return Scrape(key=key, fetched_at=1.0, age=0.5, body=body, error=error, stale=stale)


def test_only_fresh_readable_scrapes_give_series_and_the_rest_say_why() -> None:
    fresh = ExporterTarget(Driver.NVIDIA, "gpu-1", "http://a/metrics", pod="ns/a")
    stale = ExporterTarget(Driver.NVIDIA, "gpu-2", "http://b/metrics", pod="ns/b")
    unseen = ExporterTarget(Driver.AMD, "mi-1", "http://c/metrics", pod="ns/c")
    broken = ExporterTarget(Driver.AMD, "mi-2", "http://d/metrics", pod="ns/d")
    empty = ExporterTarget(Driver.AMD, "mi-3", "http://e/metrics", pod="ns/e")
    l4 = recorded("dcgm_exporter_nvidia_l4.prom").encode()
    scrapes = {
        fresh.key: _scrape(fresh.key, l4),
        stale.key: _scrape(stale.key, l4, stale=True, error="connect failed: refused"),
        broken.key: _scrape(broken.key, b"gpu_gfx_activity{gpu_id=0} x\n"),
        empty.key: _scrape(empty.key, recorded("llamacpp_b11434_tiny_after_3_requests.prom").encode()),
    }
    values, why = gpu_series([fresh, stale, unseen, broken, empty], scrapes, lambda node: {})
    assert {labels["node"] for _, labels, _ in values} == {"gpu-1"}
    assert {name for name, _, _ in values} == {
        "fleetserve_gpu_utilization_ratio",
        "fleetserve_gpu_memory_used_bytes",
        "fleetserve_gpu_power_watts",
        "fleetserve_gpu_energy_joules_total",
        "fleetserve_gpu_temperature_celsius",
        "fleetserve_gpu_tensor_active_ratio",
    }
    assert why[stale.key] == "stale: connect failed: refused"
    assert why[unseen.key] == "not scraped yet"
    assert why[broken.key].startswith("unreadable metrics: not Prometheus text exposition")
    assert why[empty.key] == "no amd-exporter GPU samples in its metrics"
    assert fresh.key not in why
