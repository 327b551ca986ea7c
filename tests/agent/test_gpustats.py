"""The agent's own GPU readings become canonical samples; with no GPU there are none."""

from __future__ import annotations

from pathlib import Path

from fleetserve.agent.gpustats import make_reader
from fleetserve.spec.resources import Node

STRIX_HALO = Path(__file__).resolve().parents[1] / "fixtures/discovery/sysfs/linux_amd_1_strix_halo_gfx1151"


def test_a_strix_halo_read_from_recorded_sysfs_gives_canonical_amd_samples():
    node = Node.model_validate(
        {
            "name": "halo",
            "cpu": {"cores": 16, "memory": "128GiB"},
            "devices": [{"index": 0, "class": "amd-gfx1151"}],
        }
    )
    samples = {s.name: s.model_dump() for s in make_reader(STRIX_HALO)(node)}
    labels = {"node": "halo", "device": "0", "driver": "gpu.amd.com", "class": "amd-gfx1151"}
    assert samples["fleetserve_gpu_utilization_ratio"]["labels"] == labels
    assert 0.0 <= samples["fleetserve_gpu_utilization_ratio"]["value"] <= 1.0
    assert samples["fleetserve_gpu_memory_used_bytes"]["value"] > 0
    assert "fleetserve_gpu_tensor_active_ratio" not in samples, "an NVIDIA-only signal is never faked for AMD"


def test_this_machine_without_a_gpu_reports_no_gpu_samples():
    node = Node.model_validate({"name": "cpu", "cpu": {"cores": 2, "memory": "8GiB"}})
    assert make_reader()(node) == []
