"""GPU metrics exporters found on both paths, with real processes, onto the server's ``/metrics``.

- Kubernetes: a real ``fleetserve server --kube-exporters --kubeconfig`` lists the exporter pods
  through the official client from the fake API server (tests/kube/fake_apiserver.py, LABELLED
  FAKE) and scrapes the exporters they point at.
- Agents: a real ``fleetserve agent --gpu-exporter URL`` relays the exporter beside it, for the GPU
  its inventory file declares (this machine has none to discover).

The exporters are ``tests/loopback_exporter.py`` serving recorded output of real devices (an NVIDIA
L4's DCGM exporter, an AMD MI300X's device-metrics-exporter) on loopback.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import httpx
import pytest
from e2e_support import ROOT, AgentFactory, ServerFactory, wait_for

from loopback_exporter import AMD_MI300X, DCGM_L4, running_exporter

pytestmark = pytest.mark.slow

L4_CLASS = {
    "kind": "DeviceClass",
    "name": "nvidia-l4-24gb",
    "driver": "gpu.nvidia.com",
    "memory": "24GiB",
    "match": {"productName": "NVIDIA L4"},
}


def _fake_apiserver() -> ModuleType:
    """tests/kube/fake_apiserver.py (beside the kube tests, not on this directory's path)."""
    module = sys.modules.get("fake_apiserver")
    if module is None:
        spec = importlib.util.spec_from_file_location("fake_apiserver", ROOT / "tests/kube/fake_apiserver.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["fake_apiserver"] = module
        spec.loader.exec_module(module)
    return module


def gpu_lines(server_url: str) -> list[str]:
    text = httpx.get(server_url + "/metrics", timeout=5).text
    return [line for line in text.splitlines() if line.startswith("fleetserve_gpu_")]


def exporter_pod(
    name: str, labels: dict[str, str], node: str, port_name: str, port: int
) -> dict[str, object]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "gpu-operator", "labels": labels},
        "spec": {
            "nodeName": node,
            "containers": [{"name": "exporter", "ports": [{"name": port_name, "containerPort": port}]}],
        },
        "status": {"phase": "Running", "podIP": "127.0.0.1"},
    }


def test_the_server_finds_exporter_pods_through_the_api_and_publishes_their_gpus(
    servers: ServerFactory, tmp_path: Path
) -> None:
    fake = _fake_apiserver()
    with (
        fake.running_fake_apiserver() as api,
        running_exporter(DCGM_L4) as dcgm,
        running_exporter(AMD_MI300X) as amd,
    ):
        api.add(
            exporter_pod(
                "nvidia-dcgm-exporter-x7k2p", {"app": "nvidia-dcgm-exporter"}, "gpu-1", "metrics", dcgm.port
            )
        )
        api.add(
            exporter_pod(
                "amd-metrics-exporter-9zc1d", {"app.kubernetes.io/name": "metrics-exporter"}, "mi-1",
                "exporter-port", amd.port,
            )
        )  # fmt: skip
        kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig")
        server = servers.start(
            f"sqlite:///{tmp_path / 'fs.db'}",
            extra_args=("--kube-exporters", "--kubeconfig", str(kubeconfig)),
        )
        lines = wait_for(
            lambda: (found := gpu_lines(server.url)) and any('node="mi-1"' in x for x in found) and found,
            30,
            "fleetserve_gpu_* of both exporters on the server's /metrics",
        )
        print("\n".join(lines))
    l4 = 'class="NVIDIA L4",device="0",driver="gpu.nvidia.com",node="gpu-1"'
    assert f"fleetserve_gpu_power_watts{{{l4}}} 16.365" in lines
    assert f"fleetserve_gpu_temperature_celsius{{{l4}}} 31.0" in lines
    mi = 'class="102-G30211-0C",device="0",driver="gpu.amd.com",node="mi-1"'
    assert f"fleetserve_gpu_utilization_ratio{{{mi}}} 0.0" in lines
    print("\n".join(line for line in server.log().splitlines() if "exporter" in line))
    assert "GPU metrics exporters: 2 found" in server.log()


def test_an_agent_relays_the_exporter_beside_it_instead_of_reading_the_gpus_itself(
    servers: ServerFactory, agents: AgentFactory, tmp_path: Path
) -> None:
    server = servers.start(f"sqlite:///{tmp_path / 'fs.db'}")
    server.apply([L4_CLASS])
    inventory = tmp_path / "inventory.yaml"
    inventory.write_text("kind: Node\ndevices:\n  - {index: 0, class: nvidia-l4-24gb}\n", encoding="utf-8")
    with running_exporter(DCGM_L4) as dcgm:
        agent = agents.start(
            server.url,
            server.join_token,
            "l4-box",
            extra_args=("--gpu-exporter", dcgm.url, "--inventory-file", str(inventory)),
        )
        lines = wait_for(lambda: gpu_lines(server.url), 60, "the relayed fleetserve_gpu_* on the server")
        print("\n".join(lines))
        agent.stop()
    l4 = 'class="nvidia-l4-24gb",device="0",driver="gpu.nvidia.com",node="l4-box"'
    assert f"fleetserve_gpu_power_watts{{{l4}}} 16.365" in lines
    assert f"fleetserve_gpu_energy_joules_total{{{l4}}} 4742.776" in lines
    assert f"fleetserve_gpu_tensor_active_ratio{{{l4}}} 0.0" in lines
    print("\n".join(line for line in agent.log().splitlines() if "GPU metrics" in line))
    assert f"relaying the exporter(s) at {dcgm.url} (gpu.nvidia.com)" in agent.log()
