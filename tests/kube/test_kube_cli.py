"""``fleetserve kube render`` and ``kube stack`` from the command line, with golden files.

The golden files are the manifests rendered for the sample fleets. After an intended change,
regenerate them with ``FLEETSERVE_UPDATE_GOLDEN=1 pytest tests/kube/test_kube_cli.py`` and
review the diff.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from fleetserve.cli.main import app

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
GOLDEN = ROOT / "tests" / "golden" / "kube"
UPDATE = os.environ.get("FLEETSERVE_UPDATE_GOLDEN") == "1"


def run(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(app, list(args))
    return result.exit_code, result.stdout, result.stderr


def files(name: str) -> list[str]:
    return [str(p) for p in sorted((EXAMPLES / name).glob("**/*.yaml"))]


@pytest.mark.parametrize(
    ("name", "api"), [("datacenter", "dra"), ("homelab", "dra"), ("datacenter", "plugin")]
)
def test_rendered_manifests_match_the_golden_files(name: str, api: str) -> None:
    code, out, err = run("kube", "render", *files(name), "--device-api", api)
    assert code == 0, err
    golden = GOLDEN / f"{name}-{api}.yaml"
    if UPDATE:
        golden.parent.mkdir(parents=True, exist_ok=True)
        golden.write_text(out, encoding="utf-8")
    assert out == golden.read_text(encoding="utf-8"), (
        f"regenerate with FLEETSERVE_UPDATE_GOLDEN=1 and review {golden}"
    )
    # stdout is only manifests; the summary went to stderr.
    assert all(isinstance(d, dict) and "kind" in d for d in yaml.safe_load_all(out))
    assert "replicas rendered" in err


def test_render_json_is_a_list() -> None:
    code, out, _ = run("kube", "render", *files("homelab"), "-o", "json")
    assert code == 0
    data = json.loads(out)
    assert data["kind"] == "List" and {o["kind"] for o in data["items"]} >= {"Deployment", "Service"}


def test_render_reports_the_gate_and_unschedulable_replicas_on_stderr() -> None:
    code, _, err = run("kube", "render", *files("datacenter"))
    assert code == 0
    assert "deployment gaudi-trial: Accepted=False UnsupportedDevices" in err
    assert "gaudi.intel.com" in err


def test_stack_lists_components_and_the_condition(tmp_path: Path) -> None:
    code, out, _ = run("kube", "stack", "dc-east", *files("datacenter"))
    assert code == 0
    assert "StackReady=True Composed" in out
    assert "amd-gpu-operator" in out and "dra-driver-cpu" in out
    code, out, _ = run("kube", "stack", "homelab", *files("homelab"))
    assert code == 0
    assert "nvidia" not in out
    # A class claiming a driver no component provides: the condition, and the recorded stack kept.
    before = tmp_path / "stack.yaml"
    code, out, _ = run("kube", "stack", "dc-east", *files("datacenter"), "-o", "yaml")
    before.write_text(out)
    gaudi = tmp_path / "cluster.yaml"
    gaudi.write_text("kind: Cluster\nname: gaudi\nclasses: [intel-gaudi3]\n")
    fleet = [f for f in files("datacenter") if not f.endswith("cluster.yaml")]
    code, out, _ = run("kube", "stack", "gaudi", *fleet, str(gaudi), "--existing", str(before))
    assert code == 0
    assert "StackReady=False UnsupportedDevices" in out
    assert "class intel-gaudi3 claims driver gaudi.intel.com" in out
    assert "nvidia-dra-driver-gpu" in out and "(kept" in out


def test_bad_input_exits_2_naming_the_problem(tmp_path: Path) -> None:
    code, _, err = run("kube", "render", *files("datacenter"), "--cluster", "nope")
    assert code == 2 and "no Cluster named 'nope'" in err
    code, _, err = run("kube", "render", *[f for f in files("datacenter") if not f.endswith("cluster.yaml")])
    assert code == 2 and "no Cluster document was given" in err
    bad = tmp_path / "existing.yaml"
    bad.write_text("just: text\n")
    code, _, err = run("kube", "render", *files("homelab"), "--existing", str(bad))
    assert code == 2 and "not a Kubernetes object" in err


def test_help_explains_the_subcommands() -> None:
    code, out, _ = run("kube", "--help")
    assert code == 0
    for word in ("render", "stack", "apply", "import", "Cluster"):
        assert word in out
