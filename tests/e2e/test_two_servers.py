"""Two control-plane processes on one PostgreSQL database, both reconciling every 0.2 s, while
replica counts change through both APIs at once.

The deployments ask for more than the fleet has (GPUs and CPU cores both), so every cycle
contends. A checker reads the database directly, in one REPEATABLE READ snapshot at a time, all
through the churn and after it: no device is held by two replicas, no node's cores or memory are
overcommitted, every replica's shard and device rows are exactly its stored spec, and one lease
row names one holder — one of the two processes — and only that process reconciles. A second
test stops the leader gracefully (SIGTERM) and expects the other to take the lease at once.
"""

from __future__ import annotations

import random
import threading
import time
from typing import Any

import pytest
from e2e_support import synthetic_models

pytestmark = pytest.mark.slow

GPU_CLASS = "nvidia-h100-80gb"
CHURN_SECONDS = 4.0
SEED = 7


def fleet() -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = [
        {"kind": "DeviceClass", "name": GPU_CLASS, "driver": "gpu.nvidia.com", "memory": "80GiB"},
        {"kind": "Fabric", "name": "ib-a", "type": "infiniband"},
        *synthetic_models("m-gpu"),
    ]
    for i in range(6):
        docs.append(
            {
                "kind": "Node",
                "name": f"gpu-{i}",
                # 48 cores: eight 8-core tp1 replicas would need 64, so cores bind before GPUs do.
                "cpu": {"cores": 48, "memory": "1TiB"},
                "gpus": [{"class": GPU_CLASS, "count": 8}],
                "hcas": [{"name": "mlx5_0", "fabric": "ib-a"}],
            }
        )
    for i in range(2):
        docs.append({"kind": "Node", "name": f"cpu-{i}", "cpu": {"cores": 32, "memory": "256GiB"}})
    return docs


# name -> (devices per node, nodes, cores per replica, most replicas the churn asks for)
SHAPES: dict[str, tuple[int, int, int, int]] = {
    "tp8": (8, 1, 8, 3),
    "tp4": (4, 1, 8, 5),
    "tp2": (2, 1, 8, 8),
    "tp1": (1, 1, 8, 12),
    "pp2": (8, 2, 4, 2),
    "cpu": (0, 1, 12, 6),
}


def deployment(name: str, replicas: int) -> dict[str, Any]:
    devices, nodes, cores, _ = SHAPES[name]
    if devices == 0:
        profile: dict[str, Any] = {
            "name": "cpu",
            "engine": "llama.cpp",
            "cpu": {"cores": cores, "memory": "32GiB"},
        }
        model = "m-cpu"
    else:
        profile = {
            "name": name,
            "engine": "vllm",
            "deviceClass": GPU_CLASS,
            "devicesPerNode": devices,
            "nodes": nodes,
            "cpu": {"cores": cores, "memory": "64GiB"},
        }
        model = "m-gpu"
    return {"kind": "Deployment", "name": name, "model": model, "replicas": replicas, "profiles": [profile]}


def pid_of(holder: str) -> int:
    """The reconciler's lease holder is ``host:pid:random``."""
    return int(holder.split(":")[1])


class Checker(threading.Thread):
    """Reads the whole state again and again; keeps every violation and every lease seen."""

    def __init__(self, state_of, database_url: str) -> None:
        super().__init__(name="checker", daemon=True)
        self.state_of = state_of
        self.database_url = database_url
        self.stop = threading.Event()
        self.snapshots = 0
        self.allocations_checked = 0
        self.replicas_checked = 0
        self.violations: list[str] = []
        self.leases: list[list[tuple[str, str]]] = []
        self.errors: list[BaseException] = []

    def check_once(self) -> None:
        state = self.state_of(self.database_url)
        self.snapshots += 1
        self.allocations_checked += len(state.allocations)
        self.replicas_checked += len(state.replicas)
        self.violations.extend(f"snapshot {self.snapshots}: {v}" for v in state.violations())
        self.leases.append([(name, holder) for name, holder, _ in state.leases])

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                self.check_once()
                time.sleep(0.01)
        except BaseException as exc:  # reported by the test
            self.errors.append(exc)


def churn(server, seed: int, until: float, log: list[str], answers: list[int]) -> None:
    """Apply random replica counts through ``server`` (and read through it) until ``until``."""
    rng = random.Random(seed)
    with server.client() as api:
        for _ in range(500):  # bounded, whatever the clock does
            if time.monotonic() >= until:
                break
            name = rng.choice(sorted(SHAPES))
            replicas = rng.randint(0, SHAPES[name][3])
            response = api.post("/apply", json={"documents": [deployment(name, replicas)]})
            answers.append(response.status_code)
            if response.status_code != 200:
                log.append(
                    f"apply {name}={replicas} via {server.name}: {response.status_code} {response.text}"
                )
            for path in ("/replicas", "/nodes", f"/deployments/{name}"):
                got = api.get(path)
                answers.append(got.status_code)
                if got.status_code != 200:
                    log.append(f"GET {path} via {server.name}: {got.status_code} {got.text}")
            time.sleep(rng.uniform(0.0, 0.05))


def settled_state(state_of, database_url: str, wanted: dict[str, int]):
    """The state, if it has settled on ``wanted`` (for ``eventually``)."""
    state = state_of(database_url)
    return state if settled(state, wanted) else None


def settled(state, wanted: dict[str, int]) -> bool:
    """Every deployment's status is about its current spec and accounts for every replica asked."""
    for name, want in wanted.items():
        row = state.deployments[name]
        status = row["status"] or {}
        have = state.replicas_of(name)
        if row["spec"]["replicas"] != want or status.get("observedGeneration") != row["generation"]:
            return False
        if sorted(status.get("replicas", [])) != have or len(have) + status.get("unschedulable", -1) != want:
            return False
    return True


def test_two_servers_on_one_postgres_never_double_allocate(
    servers, pg_database, state_of, eventually, capsys
):
    a = servers.start(pg_database, name="a")
    b = servers.start(pg_database, name="b", token_file=a.token_file)
    assert b.admin_token == a.admin_token  # the second server found the tokens the first created
    initial = {name: shape[3] for name, shape in SHAPES.items()}
    a.apply([*fleet(), *(deployment(name, n) for name, n in initial.items())])

    checker = Checker(state_of, pg_database)
    checker.start()
    problems: list[str] = []
    answers: list[int] = []
    try:
        # Let the first placements land: demand exceeds capacity, so some stay unschedulable.
        eventually(lambda: state_of(pg_database).allocations, timeout=30, what="first allocations")
        until = time.monotonic() + CHURN_SECONDS
        workers = [
            threading.Thread(target=churn, args=(server, SEED + i, until, problems, answers))
            for i, server in enumerate((a, b, a, b))
        ]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(timeout=120)
        assert not any(w.is_alive() for w in workers)

        final = {"tp8": 2, "tp4": 5, "tp2": 8, "tp1": 12, "pp2": 1, "cpu": 6}  # more than fits
        b.apply([deployment(name, n) for name, n in final.items()])
        state = eventually(
            lambda: settled_state(state_of, pg_database, final),
            timeout=60,
            what="both servers' state to settle on the final counts",
            interval=0.2,
        )
        unschedulable = {n: state.deployments[n]["status"]["unschedulable"] for n in final}
        assert sum(unschedulable.values()) > 0, "the final counts were meant to exceed the fleet"
    finally:
        checker.stop.set()
        checker.join(timeout=30)
    assert not checker.errors, checker.errors
    assert problems == []
    assert checker.violations == []
    assert state.violations() == []
    assert len(state.allocations) > 0 and len(state.replicas) > 0

    # One lease row, one holder, one of the two processes; it did not flap during the churn.
    for seen in checker.leases:
        assert len(seen) <= 1, seen
    holders = {holder for seen in checker.leases for _, holder in seen}
    assert len(holders) == 1, holders
    (holder,) = holders
    assert pid_of(holder) in (a.pid, b.pid), holder
    leader, follower = (a, b) if pid_of(holder) == a.pid else (b, a)
    assert "cycle: allocated" in leader.log()
    assert "cycle: allocated" not in follower.log(), "the follower reconciled while the other held the lease"

    with capsys.disabled():
        print(
            f"\n  concurrency: {checker.snapshots} snapshots, {checker.allocations_checked} device "
            f"allocations and {checker.replicas_checked} replicas checked, {len(answers)} API answers, "
            f"final {len(state.replicas)} replicas on {len(state.allocations)} devices, "
            f"unschedulable {unschedulable}"
        )


def test_a_gracefully_stopped_leader_hands_the_lease_over_at_once(servers, pg_database, state_of, eventually):
    """SIGTERM is a graceful stop: the leader gives its lease up (``release_leadership``), so the
    other server reconciles within a cycle or two instead of waiting out the 15 s TTL."""
    a = servers.start(pg_database, name="a")
    b = servers.start(pg_database, name="b", token_file=a.token_file)
    a.apply([*fleet(), deployment("tp2", 2), deployment("cpu", 1)])
    wanted = {"tp2": 2, "cpu": 1}
    eventually(
        lambda: settled(state_of(pg_database), wanted), timeout=30, what="the first placements", interval=0.2
    )
    (holder,) = [h for _, h, _ in state_of(pg_database).leases]
    leader, follower = (a, b) if pid_of(holder) == a.pid else (b, a)
    assert pid_of(holder) in (a.pid, b.pid), holder

    leader.stop()
    stopped = time.monotonic()
    # Well within the 15 s TTL: a released lease is taken on the follower's next 0.2 s cycle.
    deadline = stopped + 3.0
    while time.monotonic() < deadline:
        holders = [pid_of(h) for _, h, _ in state_of(pg_database).leases]
        if holders == [follower.pid]:
            break
        time.sleep(0.05)
    assert holders == [follower.pid], (
        f"3 s after a graceful stop (exit status {leader.proc.returncode}) the lease still names "
        f"{holders} (leader {leader.pid}, follower {follower.pid}): the stopped server did not "
        f"release it, so reconciling stalls until its TTL runs out. Leader's log tail:\n{leader.log()[-1500:]}"
    )
    follower.apply([deployment("tp2", 3), deployment("cpu", 2)])
    state = eventually(
        lambda: settled_state(state_of, pg_database, {"tp2": 3, "cpu": 2}),
        timeout=15,
        what="the follower to reconcile after the failover",
        interval=0.2,
    )
    assert state.violations() == []
    assert "cycle: allocated" in follower.log()
