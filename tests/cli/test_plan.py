"""``fleetserve plan`` run as a user runs it: the installed console script, in a subprocess."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


def fleetserve(*args: str) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("fleetserve", path=str(Path(sys.executable).parent))
    assert exe, "the fleetserve console script is installed beside the test interpreter"
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=60, check=False)


def test_help_explains_each_command():
    out = fleetserve("--help")
    assert out.returncode == 0
    assert "plan" in out.stdout and "Place deployments on a fleet" in out.stdout


def test_plan_prints_decisions_and_explanations_for_the_datacenter_example():
    out = fleetserve(
        "plan",
        "-f",
        str(EXAMPLES / "datacenter/fleet.yaml"),
        "-d",
        str(EXAMPLES / "datacenter/deployments.yaml"),
    )
    assert out.returncode == 0, out.stderr
    assert (
        "llama-405b-0  profile h100-tp8-pp2  nvidia-h100-80gb  hgx-01[0-7] + hgx-02[0-7] via ib-east"
        in out.stdout
    )
    assert "first tried profile h100-tp8-pp2: 0/17 nodes fit" in out.stdout
    assert "Not accepted: UnsupportedDevices" in out.stdout


def test_plan_json_is_data_with_reason_codes():
    out = fleetserve(
        "plan",
        "-o",
        "json",
        "-f",
        str(EXAMPLES / "homelab/fleet.yaml"),
        "-d",
        str(EXAMPLES / "homelab/deployments.yaml"),
    )
    assert out.returncode == 0, out.stderr
    decisions = {d["deployment"]: d for d in json.loads(out.stdout)}
    assert decisions["qwen3"]["placed"][0]["shards"][0]["node"] == "strix-halo"
    [unplaced] = decisions["llama-70b-long"]["unplaced"]
    codes = {r["reason"]: r["count"] for r in unplaced["reports"][0]["reasons"]}
    assert codes == {"DeviceMemoryTooSmall": 1, "NoDeviceOfClass": 1}


def test_strict_exits_1_when_something_is_unschedulable():
    out = fleetserve(
        "plan",
        "--strict",
        "-f",
        str(EXAMPLES / "homelab/fleet.yaml"),
        "-d",
        str(EXAMPLES / "homelab/deployments.yaml"),
    )
    assert out.returncode == 1


def test_a_bad_file_exits_2_naming_file_document_and_field(tmp_path: Path):
    bad = tmp_path / "deploy.yaml"
    bad.write_text(
        "kind: Model\nname: m\nsize: 1GB\n---\n"
        "kind: Deployment\nname: d\nmodel: m\nprofiles: [{name: p, engine: vllm}]\n"
    )
    out = fleetserve("plan", "-f", str(EXAMPLES / "homelab/fleet.yaml"), "-d", str(bad))
    assert out.returncode == 2
    assert "Deployment d: profiles.p.deviceClass: vllm needs a deviceClass" in out.stderr
    assert "Traceback" not in out.stderr
