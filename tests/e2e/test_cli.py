"""The admin CLI as an operator runs it: the installed ``fleetserve`` console script, in a
subprocess, against a live ``fleetserve server`` subprocess over a real socket.

One server (SQLite) for the module; the datacenter example is applied through the CLI once.
Tests that change state each touch their own objects (hgx-01 cordon, hgx-03 drain, qwen-7b).
"""

from __future__ import annotations

import json
import stat
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from e2e_support import FLEETSERVE, ROOT, ServerFactory, ServerProcess, clean_env, free_port, wait_for

pytestmark = pytest.mark.slow

EXAMPLES = ROOT / "examples" / "datacenter"


def fleetserve(*args: str, env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(FLEETSERVE), *args], capture_output=True, text=True, env=env, timeout=timeout, check=False
    )


def env_for(server: ServerProcess, tmp: Path, **extra: str) -> dict[str, str]:
    """FLEETSERVE_SERVER/FLEETSERVE_TOKEN set; HOME and XDG_CONFIG_HOME in ``tmp`` so no real
    config file is ever read or written."""
    base = {
        "HOME": str(tmp / "home"),
        "XDG_CONFIG_HOME": str(tmp / "xdg"),
        "FLEETSERVE_SERVER": server.url,
        "FLEETSERVE_TOKEN": server.admin_token,
        "COLUMNS": "250",
    }
    base.update(extra)
    return clean_env(**{k: v for k, v in base.items() if v != ""})


def api_get(server: ServerProcess, path: str, **params: Any) -> Any:
    with server.client() as api:
        response = api.get(path, params=params)
    assert response.status_code == 200, response.text
    return response.json()


@pytest.fixture(scope="module")
def dc(module_servers: ServerFactory, tmp_path_factory: pytest.TempPathFactory) -> ServerProcess:
    """A server with the datacenter example applied through `fleetserve apply`, placed."""
    server = module_servers.start(f"sqlite:///{tmp_path_factory.mktemp('cli') / 'state.db'}", name="cli")
    tmp = tmp_path_factory.mktemp("apply")
    out = fleetserve(
        "apply",
        "-f",
        str(EXAMPLES / "fleet.yaml"),
        "-f",
        str(EXAMPLES / "deployments.yaml"),
        env=env_for(server, tmp),
    )
    assert out.returncode == 0, out.stderr
    assert "node/hgx-01 created" in out.stdout
    assert "deployment/llama-405b created" in out.stdout
    assert "deviceclass/intel-gaudi3 created" in out.stdout
    wait_for(
        lambda: (
            len(api_get(server, "/replicas", deployment="llama-405b")) == 4
            and len(api_get(server, "/replicas", deployment="qwen-7b")) == 3
        ),
        timeout=30,
        what="the example's replicas to be placed",
    )
    time.sleep(1.0)  # a few more 0.2 s cycles that only keep what runs
    return server


def test_get_lists_nodes_deployments_and_replicas_in_each_format(dc, tmp_path):
    env = env_for(dc, tmp_path)
    nodes = fleetserve("get", "nodes", env=env)
    assert nodes.returncode == 0, nodes.stderr
    lines = nodes.stdout.splitlines()
    assert lines[0].split()[:3] == ["NAME", "STATE", "CORDON"]
    rows = {line.split()[0]: line for line in lines[1:] if line.strip()}
    assert len(rows) == 17
    assert "NVSwitch fabric manager errors, RMA ticket 4411" in rows["hgx-08"]
    assert "8x nvidia-h100-80gb" in rows["hgx-01"] and "112c/2.0TiB" in rows["hgx-01"]

    deployments = fleetserve("get", "deployments", "-o", "json", env=env)
    assert deployments.returncode == 0, deployments.stderr
    by_name = {d["name"]: d for d in json.loads(deployments.stdout)}
    assert set(by_name) == {"llama-405b", "llama-70b", "qwen-7b", "gaudi-trial"}
    assert by_name["llama-405b"]["status"]["desiredReplicas"] == 4
    gaudi = {c["type"]: c for c in by_name["gaudi-trial"]["status"]["conditions"]}
    assert gaudi["Accepted"]["status"] is False
    assert gaudi["Accepted"]["reason"] == "UnsupportedDevices"

    replicas = fleetserve("get", "replicas", "-o", "yaml", env=env)
    assert replicas.returncode == 0, replicas.stderr
    listed = yaml.safe_load(replicas.stdout)
    names = {r["name"] for r in listed}
    assert {"llama-405b-0", "qwen-7b-0"} <= names
    two_node = [r for r in listed if r["deployment"] == "llama-405b" and r["profile"] == "h100-tp8-pp2"]
    assert two_node and all(len(r["shards"]) == 2 and r["fabric"] == "ib-east" for r in two_node)
    assert not any(r["deployment"] == "gaudi-trial" for r in listed)


def test_describe_shows_spec_status_replicas_and_decision(dc, tmp_path):
    out = fleetserve("describe", "deployment", "llama-405b", env=env_for(dc, tmp_path))
    assert out.returncode == 0, out.stderr
    described = yaml.safe_load(out.stdout)
    assert described["name"] == "llama-405b"
    assert [p["name"] for p in described["profiles"]] == ["h100-tp8-pp2", "mi325x-tp8"]
    assert described["status"]["desiredReplicas"] == 4
    assert len(described["replicas"]) == 4
    assert described["explanation"]["deployment"] == "llama-405b"


def test_explain_says_where_each_replica_was_placed_and_why(dc, tmp_path):
    """`explain` answers "why are the replicas where they are": the placement lines (profile,
    node[devices]) and the profile that was tried first, not just the names of what is kept —
    even after later cycles that only kept what runs."""
    out = fleetserve("explain", "llama-405b", env=env_for(dc, tmp_path))
    assert out.returncode == 0, out.stderr
    assert "deployment llama-405b" in out.stdout
    assert "Accepted=True" in out.stdout
    assert "llama-405b-0  profile h100-tp8-pp2  hgx-" in out.stdout, (
        "explain no longer shows where llama-405b-0 was placed; the latest decision is:\n" + out.stdout
    )
    assert "profile mi325x-tp8" in out.stdout
    assert "first tried profile h100-tp8-pp2" in out.stdout


def test_cordon_and_uncordon_show_in_get_node(dc, tmp_path):
    env = env_for(dc, tmp_path)
    out = fleetserve("cordon", "hgx-01", "--reason", "x", env=env)
    assert out.returncode == 0, out.stderr
    assert "node/hgx-01 cordoned" in out.stdout
    node = json.loads(fleetserve("get", "node", "hgx-01", "-o", "json", env=env).stdout)
    assert node["cordon"] == {"reason": "x", "by": "operator"}
    assert node["status"]["replicas"], "a cordon keeps what already runs"

    out = fleetserve("uncordon", "hgx-01", env=env)
    assert out.returncode == 0, out.stderr
    assert "node/hgx-01 uncordoned" in out.stdout
    node = json.loads(fleetserve("get", "node", "hgx-01", "-o", "json", env=env).stdout)
    assert node["cordon"] is None


def test_drain_releases_the_nodes_replicas_and_they_are_placed_elsewhere(dc, tmp_path):
    env = env_for(dc, tmp_path)
    before = api_get(dc, "/nodes/hgx-03")["status"]["replicas"]
    assert before, "hgx-03 holds part of a replica in the example"
    out = fleetserve("drain", "hgx-03", env=env)
    assert out.returncode == 0, out.stderr
    assert f"node/hgx-03 drained; released {', '.join(before)}" in out.stdout
    node = json.loads(fleetserve("get", "node", "hgx-03", "-o", "json", env=env).stdout)
    assert node["cordon"]["reason"] == "drained by operator"

    def replaced() -> bool:
        replicas = api_get(dc, "/replicas", deployment="llama-405b")
        on_node = [r for r in replicas if any(s["node"] == "hgx-03" for s in r["shards"])]
        return len(replicas) == 4 and not on_node

    wait_for(replaced, timeout=30, what="llama-405b to be whole again, off hgx-03")


def test_delete_deployment_stops_its_replicas(dc, tmp_path):
    env = env_for(dc, tmp_path)
    out = fleetserve("delete", "deployment", "qwen-7b", env=env)
    assert out.returncode == 0, out.stderr
    assert "deployment/qwen-7b deleted" in out.stdout
    wait_for(
        lambda: api_get(dc, "/replicas", deployment="qwen-7b") == [],
        timeout=30,
        what="qwen-7b's replicas to stop",
    )
    gone = fleetserve("get", "deployment", "qwen-7b", env=env)
    assert gone.returncode == 2
    assert "no deployment named 'qwen-7b'" in gone.stderr


def test_a_bad_apply_file_exits_2_and_names_the_field(dc, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "kind: Deployment\nname: bad\nmodel: qwen2.5-7b\nreplicaz: 3\n"
        "profiles:\n  - {name: cpu, engine: llama.cpp, cpu: {cores: 0}}\n",
        encoding="utf-8",
    )
    out = fleetserve("apply", "-f", str(bad), env=env_for(dc, tmp_path))
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert "replicaz" in out.stderr and "unknown field" in out.stderr
    assert "profiles[0].cpu.cores" in out.stderr
    assert "Deployment bad" in out.stderr
    assert "bad" not in {d["name"] for d in api_get(dc, "/deployments")}, "nothing of a bad batch is written"

    broken = tmp_path / "broken.yaml"
    broken.write_text("kind: Node\nname: [unclosed\n", encoding="utf-8")
    out = fleetserve("apply", "-f", str(broken), env=env_for(dc, tmp_path))
    assert out.returncode == 2
    assert "not valid YAML" in out.stderr and str(broken) in out.stderr


def test_a_wrong_or_missing_token_is_refused_with_a_message_about_the_token(dc, tmp_path):
    out = fleetserve("get", "nodes", env=env_for(dc, tmp_path, FLEETSERVE_TOKEN="fs_admin_wrong"))
    assert out.returncode != 0
    assert "token" in out.stderr and "not a valid admin token" in out.stderr
    assert out.stdout == ""
    joined = fleetserve("get", "nodes", env=env_for(dc, tmp_path, FLEETSERVE_TOKEN=dc.join_token))
    assert joined.returncode != 0 and "admin token" in joined.stderr, "a join token is not an admin token"
    missing = fleetserve("get", "nodes", env=env_for(dc, tmp_path, FLEETSERVE_TOKEN=""))
    assert missing.returncode != 0 and "token" in missing.stderr


def test_server_precedence_flag_then_environment_then_config_file(dc, tmp_path):
    unreachable = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    config = tmp_path / "fleetserve.yaml"

    def with_config(server: str) -> dict[str, str]:
        config.write_text(yaml.safe_dump({"server": server, "token": dc.admin_token}), encoding="utf-8")
        return env_for(dc, tmp_path, FLEETSERVE_CONFIG=str(config), FLEETSERVE_TOKEN="")

    # The environment beats the config file (and the config file's token is used).
    env = with_config(unreachable)
    env["FLEETSERVE_SERVER"] = dc.url
    ok = fleetserve("get", "classes", env=env)
    assert ok.returncode == 0, ok.stderr
    assert "nvidia-h100-80gb" in ok.stdout
    # ... and is read at all: an unreachable environment address is not overridden by the file.
    env = with_config(dc.url)
    env["FLEETSERVE_SERVER"] = unreachable
    failed = fleetserve("get", "classes", env=env)
    assert failed.returncode == 1
    assert f"cannot reach the fleetserve server at {unreachable}" in failed.stderr

    # The flag beats the environment, and is read first.
    env = env_for(dc, tmp_path, FLEETSERVE_SERVER=unreachable)
    ok = fleetserve("get", "classes", "--server", dc.url, env=env)
    assert ok.returncode == 0, ok.stderr
    env = env_for(dc, tmp_path)
    failed = fleetserve("get", "classes", "--server", unreachable, env=env)
    assert failed.returncode == 1
    assert unreachable in failed.stderr

    # Only the config file: it is enough.
    env = with_config(dc.url)
    del env["FLEETSERVE_SERVER"]
    ok = fleetserve("get", "classes", env=env)
    assert ok.returncode == 0, ok.stderr
    # --token beats FLEETSERVE_TOKEN too.
    env = env_for(dc, tmp_path, FLEETSERVE_TOKEN="fs_admin_wrong")
    ok = fleetserve("get", "classes", "--token", dc.admin_token, env=env)
    assert ok.returncode == 0, ok.stderr


def test_login_saves_a_private_config_file_that_later_commands_use(dc, tmp_path):
    env = env_for(dc, tmp_path, FLEETSERVE_SERVER="", FLEETSERVE_TOKEN="")
    config = tmp_path / "xdg" / "fleetserve" / "config.yaml"

    refused = fleetserve("login", "--server", dc.url, "--token", "fs_admin_wrong", env=env)
    assert refused.returncode != 0 and "token" in refused.stderr
    assert not config.exists(), "a refused login saves nothing"

    out = fleetserve("login", "--server", dc.url, "--token", dc.admin_token, env=env)
    assert out.returncode == 0, out.stderr
    assert f"logged in to {dc.url}" in out.stdout
    assert stat.S_IMODE(config.stat().st_mode) == 0o600
    assert yaml.safe_load(config.read_text(encoding="utf-8")) == {"server": dc.url, "token": dc.admin_token}

    # No FLEETSERVE_* variable at all: the saved file is enough.
    assert not any(k.startswith("FLEETSERVE_") for k in env)
    got = fleetserve("get", "nodes", "-o", "json", env=env)
    assert got.returncode == 0, got.stderr
    assert len(json.loads(got.stdout)) == 17
