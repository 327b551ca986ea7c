"""A control plane SIGKILLed in the middle of a reconcile cycle restarts on the same database with
its state intact and consistent, and converges.

300 nodes and ~700 replicas make one cycle last seconds (each replica is its own transaction),
so the kill lands mid-cycle: while it allocates (twice) and while it releases a scale-down
(once). After each kill, with no process running, the database must hold only whole replicas
(every shard row and every device row, no orphan, no device twice, no node overcommitted) and
every applied document. The restarted server must keep its tokens (the token file is not
rewritten, the old admin token still works) and drive the replicas to the desired counts.

The killed server's reconciler lease stays in the database until its TTL (15 s) runs out. The
last restart waits that out, as an operator would; the others expire the dead holder's lease in
the database first (the process is verifiably dead), to keep the test short.
"""

from __future__ import annotations

import random
import time
from typing import Any

import pytest
from e2e_support import synthetic_models

pytestmark = pytest.mark.slow

GPU_CLASS = "nvidia-h100-80gb"
NODES = 300
# Replicas per GPU deployment in the three rounds: allocate, scale down (releases), scale up.
SCALES = (50, 12, 45)
KILL_SEED = 20240611


def fleet(nodes: int) -> list[dict[str, Any]]:
    """Every fifth node a CPU box, the others 8-GPU nodes on one InfiniBand fabric."""
    docs: list[dict[str, Any]] = [
        {"kind": "DeviceClass", "name": GPU_CLASS, "driver": "gpu.nvidia.com", "memory": "80GiB"},
        {"kind": "Fabric", "name": "ib-a", "type": "infiniband"},
        *synthetic_models("m-small"),
    ]
    for i in range(nodes):
        if i % 5 == 4:
            docs.append({"kind": "Node", "name": f"cpu-{i:03d}", "cpu": {"cores": 64, "memory": "512GiB"}})
        else:
            docs.append(
                {
                    "kind": "Node",
                    "name": f"gpu-{i:03d}",
                    "labels": {"rack": f"r{i // 20}"},
                    "cpu": {"cores": 96, "memory": "1TiB"},
                    "gpus": [{"class": GPU_CLASS, "count": 8}],
                    "hcas": [{"name": "mlx5_0", "fabric": "ib-a"}, {"name": "mlx5_1", "fabric": "ib-a"}],
                    "nvlinkDomains": [[0, 1, 2, 3, 4, 5, 6, 7]],
                }
            )
    return docs


def deployments(scale: int) -> dict[str, dict[str, Any]]:
    """Nine GPU deployments (tp1/tp2/tp4), one two-node tp8 deployment, one CPU deployment."""
    out: dict[str, dict[str, Any]] = {}
    for j in range(9):
        tp = (1, 2, 4)[j % 3]
        out[f"gpu-{j}"] = {
            "kind": "Deployment",
            "name": f"gpu-{j}",
            "model": "m-small",
            "replicas": scale,
            "profiles": [
                {
                    "name": f"tp{tp}",
                    "engine": "vllm",
                    "deviceClass": GPU_CLASS,
                    "devicesPerNode": tp,
                    "cpu": {"cores": 4, "memory": "32GiB"},
                }
            ],
        }
    out["multi"] = {
        "kind": "Deployment",
        "name": "multi",
        "model": "m-small",
        "replicas": scale // 5,
        "profiles": [
            {"name": "tp8-pp2", "engine": "vllm", "deviceClass": GPU_CLASS, "devicesPerNode": 8, "nodes": 2}
        ],
    }
    out["cpu"] = {
        "kind": "Deployment",
        "name": "cpu",
        "model": "m-cpu",
        "replicas": scale,
        "profiles": [{"name": "cpu", "engine": "llama.cpp", "cpu": {"cores": 16, "memory": "64GiB"}}],
    }
    return out


def desired_total(deps: dict[str, dict[str, Any]]) -> int:
    return sum(int(d["replicas"]) for d in deps.values())


def kill_mid_cycle(server, scalar, start: int, target: int, fraction: float, timeout: float = 90.0) -> int:
    """SIGKILL the server once the replica count has moved ``fraction`` of the way from
    ``start`` to ``target``; the count it had then (and the test fails if the cycle was over)."""
    threshold = start + (target - start) * fraction
    deadline = time.monotonic() + timeout
    count = start
    while time.monotonic() < deadline:
        count = int(scalar("SELECT count(*) FROM replicas"))
        if (target > start and count >= threshold) or (target < start and count <= threshold):
            break
        time.sleep(0.002)
    else:
        pytest.fail(f"the reconciler made no progress from {start} towards {target} replicas: {count}")
    server.kill()
    at_kill = int(scalar("SELECT count(*) FROM replicas"))
    assert min(start, target) < at_kill < max(start, target), (
        f"the kill came too late to be mid-cycle: {at_kill} replicas, {start} -> {target}"
    )
    return at_kill


def check_intact(state, fleet_docs: list[dict[str, Any]], deps: dict[str, dict[str, Any]]) -> None:
    """Whole replicas only, and every applied document still stored as applied."""
    assert state.violations() == []
    assert set(state.nodes) == {d["name"] for d in fleet_docs if d["kind"] == "Node"}
    assert state.classes == {GPU_CLASS}
    assert state.fabrics == {"ib-a"}
    assert state.models == {"m-small", "m-cpu"}
    assert {name: d["spec"]["replicas"] for name, d in state.deployments.items()} == {
        name: d["replicas"] for name, d in deps.items()
    }
    assert sorted(state.tokens) == [("admin", False), ("join", False)]
    unknown = {r["deployment"] for r in state.replicas.values()} - set(deps)
    assert not unknown, f"replicas of deployments never applied: {unknown}"


def converged(state, deps: dict[str, dict[str, Any]]) -> bool:
    for name, dep in deps.items():
        stored = state.deployments[name]
        status = stored["status"] or {}
        if len(state.replicas_of(name)) != dep["replicas"]:
            return False
        if status.get("observedGeneration") != stored["generation"]:
            return False
        if sorted(status.get("replicas", [])) != state.replicas_of(name):
            return False
    return True


def converged_state(state, deps: dict[str, dict[str, Any]]):
    return state if converged(state, deps) else None


def restart_and_check(
    servers, server, database_url: str, token_snapshot: tuple[bytes, int], state_of, nodes: int
):
    """Restart on the same database; tokens kept, the old admin token still works."""
    restarted = servers.start(database_url, name="crash", token_file=server.token_file)
    assert (server.token_file.read_bytes(), server.token_file.stat().st_mtime_ns) == token_snapshot, (
        "the token file was rewritten on restart"
    )
    assert restarted.admin_token == server.admin_token
    assert "new tokens" not in restarted.log()
    with restarted.client() as api:
        listed = api.get("/nodes")
        assert listed.status_code == 200, listed.text
        assert len(listed.json()) == nodes
        assert api.get("/classes").status_code == 200
    assert sorted(state_of(database_url).tokens) == [("admin", False), ("join", False)]
    return restarted


def run_crash_scenario(servers, database_url: str, state_of, poller, eventually) -> dict[str, Any]:
    rng = random.Random(KILL_SEED)
    fleet_docs = fleet(NODES)
    server = servers.start(database_url, name="crash")
    token_snapshot = (server.token_file.read_bytes(), server.token_file.stat().st_mtime_ns)
    assert server.token_file.stat().st_mode & 0o777 == 0o600
    server.apply(fleet_docs)
    kills: list[dict[str, Any]] = []
    checked_replicas = 0
    deps: dict[str, dict[str, Any]] = {}
    with poller(database_url) as scalar:
        for round_no, scale in enumerate(SCALES):
            start = int(scalar("SELECT count(*) FROM replicas"))
            deps = deployments(scale)
            target = desired_total(deps)
            server.apply(list(deps.values()))
            fraction = rng.uniform(0.1, 0.6)
            at_kill = kill_mid_cycle(server, scalar, start, target, fraction)
            assert not server.alive()
            state = state_of(database_url)
            check_intact(state, fleet_docs, deps)
            checked_replicas += len(state.replicas)
            kills.append({"round": round_no, "from": start, "to": target, "at_kill": at_kill})
            last = round_no == len(SCALES) - 1
            if not last:
                # The process is dead: let its lease lapse now instead of in up to 15 s.
                past = "2000-01-01 00:00:00" + ("+00" if database_url.startswith("postgresql") else ".000000")
                scalar(f"UPDATE leader_lease SET expires_at = '{past}' RETURNING name")
            server = restart_and_check(servers, server, database_url, token_snapshot, state_of, NODES)
            final = eventually(
                lambda deps=deps: converged_state(state_of(database_url), deps),
                timeout=90 if last else 60,
                what=f"convergence to {target} replicas after restart {round_no + 1}",
                interval=0.25,
            )
            assert final.violations() == []
            check_intact(final, fleet_docs, deps)
            checked_replicas += len(final.replicas)
    assert server.alive(), server.log()
    with server.client() as api:
        listed = api.get("/deployments").json()
    assert {d["name"]: len(d["status"]["replicas"]) for d in listed} == {
        n: d["replicas"] for n, d in deps.items()
    }
    return {"kills": kills, "replicas_checked": checked_replicas}


def test_sqlite_server_survives_sigkill_mid_reconcile(
    servers, tmp_path, state_of, poller, eventually, capsys
):
    database_url = f"sqlite:///{tmp_path / 'state.db'}"
    summary = run_crash_scenario(servers, database_url, state_of, poller, eventually)
    assert len(summary["kills"]) == 3
    with capsys.disabled():
        print(f"\n  sqlite crash: {summary}")


def test_postgres_server_survives_sigkill_mid_reconcile(
    servers, pg_database, state_of, poller, eventually, capsys
):
    summary = run_crash_scenario(servers, pg_database, state_of, poller, eventually)
    assert len(summary["kills"]) == 3
    with capsys.disabled():
        print(f"\n  postgres crash: {summary}")
