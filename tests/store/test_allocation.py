"""Two OS processes allocating overlapping replicas at once never share a device or oversubscribe
a node: one wins, the other gets AllocationConflict — on PostgreSQL (row locks plus the
device primary key) and on SQLite (BEGIN IMMEDIATE)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, func, select

from fleetserve.spec.resources import Node
from fleetserve.store import SqlStore, make_engine, migrate
from fleetserve.store.tables import DeviceAllocationRow, ReplicaRow

pytestmark = pytest.mark.slow

ROUNDS = 100
CORES = 4

# One worker: each round it tries a GPU replica (devices overlap the other worker's on device 1)
# and a CPU replica (3 of the node's 4 cores, so only one fits), checks what is committed while it
# holds them, waits ``hold`` seconds, then releases what it got. Prints its counts as JSON.
WORKER = r"""
import json, sys, time
from collections import Counter
from fleetserve.errors import AllocationConflict
from fleetserve.spec.resources import Replica
from fleetserve.store import SqlStore, make_engine

url, schema, who = sys.argv[1:4]
rounds, cores, hold = int(sys.argv[4]), int(sys.argv[5]), float(sys.argv[6])
engine = make_engine(url, connect_args={"options": f"-csearch_path={schema}"} if schema else None)
store = SqlStore(engine)
devices = {"a": [0, 1], "b": [1, 2]}[who]
counts = Counter()
violations = []
print("ready", flush=True)
sys.stdin.readline()
try:
    for i in range(rounds):
        held = []
        for kind, shard in (("gpu", {"node": "n1", "devices": devices}), ("cpu", {"node": "n1", "cpuCores": 3})):
            replica = Replica.model_validate(
                {"name": f"{who}-{kind}-{i}", "deployment": who, "profile": kind, "shards": [shard]}
            )
            try:
                store.allocate(replica)
            except AllocationConflict:
                counts[kind + "_conflicts"] += 1
            else:
                counts[kind] += 1
                held.append(replica.name)
        claims = Counter()
        used_cores = 0
        for replica in store.replicas():
            for shard in replica.shards:
                claims.update((shard.node, d) for d in shard.devices)
                used_cores += shard.cpu_cores
        twice = sorted(k for k, n in claims.items() if n > 1)
        if twice or used_cores > cores:
            violations.append({"round": i, "devices": twice, "cores": used_cores})
        time.sleep(hold)
        for name in held:
            store.release(name)
finally:
    engine.dispose()
print(json.dumps({"counts": counts, "violations": violations}), flush=True)
"""


@pytest.fixture(params=["sqlite", "postgres"])
def database(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, str, Engine]]:
    """(url, schema, migrated engine) for the workers to share."""
    if request.param == "postgres":
        url: str = request.getfixturevalue("postgres_url")
        schema: str = request.getfixturevalue("postgres_schema")
        yield url, schema, request.getfixturevalue("postgres_engine")
        return
    path = str(tmp_path / "state.db")
    engine = make_engine(path)
    try:
        migrate(engine)
        yield path, "", engine
    finally:
        engine.dispose()


def run_workers(url: str, schema: str, hold: float) -> list[dict[str, Any]]:
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, url, schema, who, str(ROUNDS), str(CORES), str(hold)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for who in ("a", "b")
    ]
    try:
        # Both import and connect first, then start together: the rounds really overlap.
        for proc in procs:
            assert proc.stdout is not None
            if proc.stdout.readline().strip() != "ready":
                _, err = proc.communicate(timeout=30)
                pytest.fail(f"worker did not start:\n{err}")
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        outputs = [proc.communicate(timeout=120) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    for proc, (_, err) in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, f"worker failed:\n{err}"
    return [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]


def test_two_processes_never_share_a_device_or_oversubscribe(database: tuple[str, str, Engine]) -> None:
    url, schema, engine = database
    store = SqlStore(engine)
    store.register(
        Node.model_validate(
            {
                "name": "n1",
                "cpu": {"cores": CORES, "memory": "16Gi"},
                "gpus": [{"class": "gpu-a", "count": 4}],
            }
        )
    )

    # SQLite's busy handler polls with growing sleeps, so a waiting writer can miss every gap
    # between another's transactions: holding each round's replicas a little gives it a turn.
    results = run_workers(url, schema, hold=0.01 if not schema else 0.0)

    assert [r["violations"] for r in results] == [[], []]
    totals = {kind: sum(r["counts"].get(kind, 0) for r in results) for kind in ("gpu", "cpu")}
    conflicts = {
        kind: sum(r["counts"].get(f"{kind}_conflicts", 0) for r in results) for kind in ("gpu", "cpu")
    }
    # Every attempt either won or was refused with AllocationConflict (anything else fails a worker).
    assert {k: totals[k] + conflicts[k] for k in totals} == {"gpu": 2 * ROUNDS, "cpu": 2 * ROUNDS}
    assert totals["gpu"] > 0 and totals["cpu"] > 0
    assert conflicts["gpu"] > 0 and conflicts["cpu"] > 0, f"the workers never collided: {results}"
    with engine.connect() as conn:
        left = [conn.scalar(select(func.count()).select_from(t)) for t in (ReplicaRow, DeviceAllocationRow)]
    assert left == [0, 0]
