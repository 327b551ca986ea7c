"""``fleetserve kube apply`` and ``kube import`` end to end, through the official client.

The API server is the LABELLED FAKE of fake_apiserver.py (no Kubernetes API server can run on
this machine); the client, its kubeconfig loading, serialization and HTTP are real.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml
from fake_apiserver import FakeApiServer
from typer.testing import CliRunner

from fleetserve.cli.main import app
from fleetserve.spec.loader import load_text

ROOT = Path(__file__).resolve().parents[2]
DATACENTER = sorted(str(p) for p in (ROOT / "examples" / "datacenter").glob("**/*.yaml"))
FIXTURES = ROOT / "tests" / "fixtures" / "kube"


def kube(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(app, ["kube", *args])
    return result.exit_code, result.stdout, result.stderr


def test_apply_then_a_mistyped_driver_keeps_every_running_object(
    fake_api: FakeApiServer, tmp_path: Path
) -> None:
    config = str(fake_api.write_kubeconfig(tmp_path / "kubeconfig"))
    code, _, err = kube("apply", *DATACENTER, "--kubeconfig", config)
    assert code == 0, err
    patches = fake_api.patches()
    assert patches and all(
        r.content_type == "application/apply-patch+yaml" and r.query.get("fieldManager") == "fleetserve"
        for r in patches
    )
    assert "deployment/inference/qwen-7b-0 applied" in err
    kinds = {k[1] for k in fake_api.objects}
    assert {"deployments", "leaderworkersets", "resourceclaimtemplates", "services", "configmaps"} <= kinds
    first = {k: v["spec"] for k, v in fake_api.objects.items() if "spec" in v}

    # Applying the same files again changes nothing: the replicas are read back and kept.
    code, _, err = kube("apply", *DATACENTER, "--kubeconfig", config)
    assert code == 0, err
    assert {k: v["spec"] for k, v in fake_api.objects.items() if "spec" in v} == first
    before = {k: v["metadata"]["resourceVersion"] for k, v in fake_api.objects.items()}

    # The H100 class's driver is mistyped: its replicas' objects are left exactly as they run.
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(
        (ROOT / "examples/datacenter/fleet.yaml")
        .read_text()
        .replace(
            "name: nvidia-h100-80gb\ndriver: gpu.nvidia.com", "name: nvidia-h100-80gb\ndriver: gpu.nvdia.com"
        )
    )
    edited = [str(fleet) if p.endswith("datacenter/fleet.yaml") else p for p in DATACENTER]
    assert load_text(fleet.read_text()).classes[0].driver == "gpu.nvdia.com"
    n_patches = len(fake_api.patches())
    code, _, err = kube("apply", *edited, "--kubeconfig", config)
    assert code == 0, err
    assert "StackReady=False UnsupportedDevices" in err
    assert "kept as it runs (class nvidia-h100-80gb claims driver gpu.nvdia.com" in err
    sent = {r.path.rsplit("/", 1)[1] for r in fake_api.patches()[n_patches:]}
    h100 = {
        v["metadata"]["name"]
        for v in fake_api.objects.values()
        if '"deviceClass":"nvidia-h100-80gb"'
        in v["metadata"].get("annotations", {}).get("fleetserve.io/placement", "")
    }
    assert h100 and not sent & h100
    for key, version in before.items():
        if key[3] in h100:
            assert fake_api.objects[key]["metadata"]["resourceVersion"] == version
    stack = fake_api.stored("v1", "ConfigMap", "fleetserve-stack-dc-east", "inference")
    assert stack is not None
    assert json.loads(stack["data"]["conditions"])[0]["reason"] == "UnsupportedDevices"
    assert "nvidia-dra-driver-gpu" in json.loads(stack["data"]["components"])


def test_apply_dry_run_stores_nothing(fake_api: FakeApiServer, tmp_path: Path) -> None:
    config = str(fake_api.write_kubeconfig(tmp_path / "kubeconfig"))
    code, _, err = kube("apply", *DATACENTER, "--kubeconfig", config, "--dry-run")
    assert code == 0, err
    assert "dry-run" in err and not fake_api.objects
    assert all(r.query.get("dryRun") == "All" for r in fake_api.patches())


def test_apply_without_a_reachable_cluster_is_a_clear_error(tmp_path: Path) -> None:
    code, _, err = kube("apply", *DATACENTER, "--kubeconfig", str(tmp_path / "missing"))
    assert code == 1
    assert "cannot load the Kubernetes configuration" in err


def test_import_writes_node_documents_that_load(fake_api: FakeApiServer, tmp_path: Path) -> None:
    for name in ("nodes.json", "resourceslices.json"):
        for item in json.loads((FIXTURES / name).read_text())["items"]:
            fake_api.add(item)
    config = str(fake_api.write_kubeconfig(tmp_path / "kubeconfig"))
    out = tmp_path / "nodes.yaml"
    code, _, err = kube(
        "import", str(ROOT / "examples/datacenter/fleet.yaml"), "--kubeconfig", config, "--out", str(out)
    )
    assert code == 0, err
    assert "nodes imported" in err
    text = out.read_text()
    nodes = [d for d in yaml.safe_load_all(text) if d]
    assert nodes and all(d["kind"] == "Node" for d in nodes)
    classes = {d["class"] for n in nodes for d in n.get("devices", [])}
    assert "nvidia-h100-80gb" in classes
