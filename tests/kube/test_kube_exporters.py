"""GPU metrics exporters found through the Kubernetes API (the official client against the fake API
server) by their pods' labels and named ports, then scraped onto ``fleetserve_gpu_*``.

The exporter pods are shaped as the NVIDIA GPU operator's ``nvidia-dcgm-exporter`` DaemonSet, the
dcgm-exporter Helm chart's and the AMD GPU operator's metrics exporter write them; the exporters
they point at serve recorded output of real devices on loopback (``tests/loopback_exporter.py``).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
from fake_apiserver import FakeApiServer
from kubernetes import client
from typer.testing import CliRunner

from fleetserve.cli.main import app
from fleetserve.drivers import Driver
from fleetserve.kube.apply import KubeError
from fleetserve.kube.exporters import discover_exporters, exporters_from_pods
from fleetserve.metrics.exporters import ExporterTarget
from fleetserve.metrics.exposition import FleetMetrics
from fleetserve.server.gpu_exporters import ExporterScrape
from loopback_exporter import AMD_MI300X, DCGM_L4, running_exporter


def pod(
    name: str,
    labels: dict[str, str],
    node: str | None,
    port_name: str,
    port: int,
    namespace: str = "gpu-operator",
    phase: str = "Running",
    ip: str | None = "127.0.0.1",
) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "containers": [
            {
                "name": "exporter",
                "image": "exporter",
                "ports": [{"name": port_name, "containerPort": port, "protocol": "TCP"}],
            }
        ]
    }
    if node is not None:
        spec["nodeName"] = node
    status: dict[str, Any] = {"phase": phase}
    if ip is not None:
        status["podIP"] = ip
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "spec": spec,
        "status": status,
    }


OPERATOR_DCGM = {"app": "nvidia-dcgm-exporter"}
HELM_DCGM = {"app.kubernetes.io/name": "dcgm-exporter"}
AMD_EXPORTER = {"app.kubernetes.io/name": "metrics-exporter"}


def test_exporter_pods_are_found_by_each_drivers_labels_and_named_port(
    fake_api: FakeApiServer, kube_api: client.ApiClient
) -> None:
    fake_api.add(pod("nvidia-dcgm-exporter-x7k2p", OPERATOR_DCGM, "gpu-1", "metrics", 9400))
    fake_api.add(pod("dcgm-exporter-4hq9z", HELM_DCGM, "gpu-2", "metrics", 9400, namespace="monitoring"))
    fake_api.add(
        pod("amd-metrics-exporter-9zc1d", AMD_EXPORTER, "mi-1", "exporter-port", 5000, "kube-amd-gpu")
    )
    fake_api.add(pod("gateway-0", {"app": "fleetserve"}, "gpu-1", "metrics", 9400, namespace="fleetserve"))
    found = discover_exporters(kube_api)
    assert [(t.driver, t.pod, t.node, t.url) for t in found.targets] == [
        (Driver.NVIDIA, "gpu-operator/nvidia-dcgm-exporter-x7k2p", "gpu-1", "http://127.0.0.1:9400/metrics"),
        (Driver.NVIDIA, "monitoring/dcgm-exporter-4hq9z", "gpu-2", "http://127.0.0.1:9400/metrics"),
        (Driver.AMD, "kube-amd-gpu/amd-metrics-exporter-9zc1d", "mi-1", "http://127.0.0.1:5000/metrics"),
    ]
    assert found.skipped == []
    pod_lists = [r for r in fake_api.requests if r.path == "/api/v1/pods"]
    assert {r.query["labelSelector"] for r in pod_lists} == {
        "app=nvidia-dcgm-exporter",
        "app.kubernetes.io/name=dcgm-exporter",
        "app.kubernetes.io/name=metrics-exporter",
    }


def test_a_pod_that_cannot_be_scraped_is_said_never_dropped_silently() -> None:
    pods = {
        Driver.NVIDIA: [
            pod("pending", OPERATOR_DCGM, "gpu-1", "metrics", 9400, phase="Pending"),
            pod("no-ip", OPERATOR_DCGM, "gpu-1", "metrics", 9400, ip=None),
            pod("unbound", OPERATOR_DCGM, None, "metrics", 9400),
            pod("other-port", OPERATOR_DCGM, "gpu-1", "http", 8080),
            pod("good", OPERATOR_DCGM, "gpu-3", "metrics", 9400, ip="10.0.3.7"),
        ]
    }
    found = exporters_from_pods(pods)
    assert [t.url for t in found.targets] == ["http://10.0.3.7:9400/metrics"]
    assert found.skipped == [
        "dcgm-exporter pod gpu-operator/pending is Pending, not Running; not scraped",
        "dcgm-exporter pod gpu-operator/no-ip on node gpu-1 has no IP (status.podIP); not scraped",
        "dcgm-exporter pod gpu-operator/unbound is bound to no node (no spec.nodeName); not scraped",
        "dcgm-exporter pod gpu-operator/other-port on node gpu-1 has no container port named metrics; "
        "not scraped",
    ]


def test_a_pod_both_nvidia_selectors_pick_is_one_target_and_ipv6_is_bracketed() -> None:
    both = pod("dcgm-0", {**OPERATOR_DCGM, **HELM_DCGM}, "gpu-1", "metrics", 9400, ip="fd00::7")
    found = exporters_from_pods({Driver.NVIDIA: [both, both]})
    assert [t.url for t in found.targets] == ["http://[fd00::7]:9400/metrics"]


def test_an_unreachable_api_server_is_a_kube_error_saying_which_listing(tmp_path: Path) -> None:
    from fleetserve.kube.apply import api_client

    config = tmp_path / "kubeconfig"
    config.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        "clusters: [{name: k, cluster: {server: 'http://127.0.0.1:9'}}]\n"
        "users: [{name: u, user: {token: t}}]\ncontexts: [{name: c, context: {cluster: k, user: u}}]\n",
        encoding="utf-8",
    )
    api = api_client(kubeconfig=config)
    try:
        with pytest.raises(KubeError, match="listing the dcgm-exporter pods"):
            discover_exporters(api)
    finally:
        api.close()


def test_discovered_exporters_are_scraped_onto_fleetserve_gpu_series_labelled_by_pod_node(
    fake_api: FakeApiServer, kube_api: client.ApiClient
) -> None:
    with running_exporter(DCGM_L4) as dcgm, running_exporter(AMD_MI300X) as amd:
        fake_api.add(pod("nvidia-dcgm-exporter-x7k2p", OPERATOR_DCGM, "gpu-1", "metrics", dcgm.port))
        fake_api.add(
            pod("amd-exporter-9zc1d", AMD_EXPORTER, "mi-1", "exporter-port", amd.port, "kube-amd-gpu")
        )

        def discover() -> list[ExporterTarget]:
            return discover_exporters(kube_api).targets

        # The store knows gpu-1 and its L4; mi-1 is not a fleetserve node: the exporter's model names it.
        scrape = ExporterScrape(discover, lambda names: {"gpu-1": {"0": "nvidia-l4-24gb"}})
        metrics = FleetMetrics()

        async def discover_and_publish() -> None:
            await scrape.refresh_once()  # exporters found anew are scraped at once
            metrics.set_gpu_samples(scrape.gpu_samples())
            await scrape.scraper.aclose()

        asyncio.run(discover_and_publish())
    text = metrics.render()[0].decode()
    gpu_lines = [line for line in text.splitlines() if line.startswith("fleetserve_gpu_")]
    print("\n".join(gpu_lines))
    l4 = 'class="nvidia-l4-24gb",device="0",driver="gpu.nvidia.com",node="gpu-1"'
    assert f"fleetserve_gpu_utilization_ratio{{{l4}}} 0.0" in gpu_lines
    assert f"fleetserve_gpu_power_watts{{{l4}}} 16.365" in gpu_lines
    assert f"fleetserve_gpu_temperature_celsius{{{l4}}} 31.0" in gpu_lines
    assert f"fleetserve_gpu_energy_joules_total{{{l4}}} 4742.776" in gpu_lines
    mi = 'class="102-G30211-0C",device="0",driver="gpu.amd.com",node="mi-1"'
    assert f"fleetserve_gpu_utilization_ratio{{{mi}}} 0.0" in gpu_lines
    assert not any('node="i-030791dc5a37cd257"' in line for line in gpu_lines), (
        "the exporter's Hostname is not the node when the pod's node is known"
    )
    assert dcgm.scrapes == 1 and amd.scrapes == 1


def test_kube_exporters_prints_the_table(fake_api: FakeApiServer, tmp_path: Path) -> None:
    fake_api.add(pod("nvidia-dcgm-exporter-x7k2p", OPERATOR_DCGM, "gpu-1", "metrics", 9400, ip="10.0.1.4"))
    fake_api.add(pod("stuck", AMD_EXPORTER, "mi-1", "exporter-port", 5000, "kube-amd-gpu", phase="Pending"))
    config = fake_api.write_kubeconfig(tmp_path / "kubeconfig")
    result = CliRunner().invoke(app, ["kube", "exporters", "--kubeconfig", str(config)])
    print(result.output)
    assert result.exit_code == 0, result.output
    lines = [line.split() for line in result.stdout.splitlines()]
    assert lines[0] == ["DRIVER", "POD", "NODE", "URL"]
    assert lines[1] == [
        "gpu.nvidia.com", "gpu-operator/nvidia-dcgm-exporter-x7k2p", "gpu-1", "http://10.0.1.4:9400/metrics"
    ]  # fmt: skip
    assert "skipped: amd-device-metrics-exporter pod kube-amd-gpu/stuck is Pending" in result.stderr


def test_the_control_planes_metrics_carry_the_exporters_it_finds_classed_by_its_own_nodes(
    fake_api: FakeApiServer, tmp_path: Path
) -> None:
    from fastapi.testclient import TestClient

    from fleetserve.server.app import Serving, create_app
    from fleetserve.server.process import KubeAccess, kube_exporter_scrape
    from fleetserve.spec.resources import DeviceClass, Node
    from fleetserve.store.sql import SqlStore

    config = fake_api.write_kubeconfig(tmp_path / "kubeconfig")
    with SqlStore.open(tmp_path / "state.db") as store, running_exporter(DCGM_L4) as dcgm:
        store.put_class(
            DeviceClass.model_validate(
                {"name": "nvidia-l4-24gb", "driver": "gpu.nvidia.com", "memory": "24GiB"}
            )
        )
        store.register(
            Node.model_validate(
                {
                    "name": "gpu-1",
                    "cpu": {"cores": 8, "memory": "32GiB"},
                    "devices": [{"index": 0, "class": "nvidia-l4-24gb"}],
                }
            )
        )
        fake_api.add(pod("nvidia-dcgm-exporter-x7k2p", OPERATOR_DCGM, "gpu-1", "metrics", dcgm.port))
        serving = Serving.build(
            store, gateway=False, exporters=kube_exporter_scrape(store, KubeAccess(config))
        )
        with TestClient(create_app(store, models_dir=tmp_path / "models", serving=serving)) as http:
            lines: list[str] = []
            for _ in range(100):
                lines = [x for x in http.get("/metrics").text.splitlines() if x.startswith("fleetserve_gpu_")]
                if lines:
                    break
                time.sleep(0.1)
    l4 = 'class="nvidia-l4-24gb",device="0",driver="gpu.nvidia.com",node="gpu-1"'
    assert f"fleetserve_gpu_power_watts{{{l4}}} 16.365" in lines


def test_a_kubeconfig_without_kube_exporters_is_refused_before_the_server_starts(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        app, ["server", "--database-url", str(tmp_path / "fs.db"), "--kubeconfig", str(tmp_path / "kc")]
    )
    assert result.exit_code == 2
    assert "--kubeconfig and --kube-context go with --kube-exporters" in result.output
    assert not (tmp_path / "fs.db").exists()


def test_the_server_with_a_kubeconfig_it_cannot_load_fails_naming_it(tmp_path: Path) -> None:
    from fleetserve.server.process import KubeAccess, kube_exporter_scrape
    from fleetserve.store.sql import SqlStore

    missing = tmp_path / "no-such-kubeconfig"
    with SqlStore.open(tmp_path / "state.db") as store, pytest.raises(KubeError, match=str(missing)):
        kube_exporter_scrape(store, KubeAccess(missing))
