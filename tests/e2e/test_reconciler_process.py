"""The reconciler in a process of its own (``server/reconciler/process.py``), on a real PostgreSQL.

A server process (here the test's own, or a small script standing in for one) starts the
reconciler as a spawned child: the child places replicas, asks the server what the autoscaler
sees and records its cycles on the server's metrics; it is started again when it dies, and
leads at once under the server's name; it hands the lease over when told to stop, and when its
server is killed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import psutil
import pytest
from e2e_support import wait_for

from builders import deployment, gpu_host_32c_256g, safetensors_8gb
from fleetserve.autoscale import Signals, SignalsQuery
from fleetserve.metrics.exposition import FleetMetrics
from fleetserve.reconcile.health import HeartbeatPolicy
from fleetserve.server.reconciler.loop import LEASE
from fleetserve.server.reconciler.process import ReconcilerConfig, ReconcilerProcess
from fleetserve.spec.policies import ReplicaRange
from fleetserve.spec.resources import DeviceClass
from fleetserve.store import SqlStore

pytestmark = pytest.mark.slow

POLICY = HeartbeatPolicy(not_ready_after=timedelta(seconds=40), lost_after=timedelta(seconds=300))
H100 = DeviceClass(name="h100", driver="gpu.nvidia.com", memory="80GiB")
MODEL = safetensors_8gb()
HOLDER = "test-host:4242:feedbeef"
TTL = timedelta(seconds=15)  # the reconciler's lease


@pytest.fixture
def store(pg_database: str) -> Iterator[SqlStore]:
    with SqlStore.open(pg_database) as opened:
        yield opened


def seed(store: SqlStore, autoscaled: bool = True) -> None:
    """One node with four H100s, the model, and deployment ``chat`` of 1 (or 1 to 3) replicas."""
    store.put_class(H100)
    store.register(gpu_host_32c_256g("gpu-a", H100.name, 4))
    store.put_model(MODEL)
    profile = {"name": "gpu", "engine": "vllm", "deviceClass": H100.name, "devicesPerNode": 1}
    chat = deployment("chat", 1, profile, model=MODEL.name)
    if autoscaled:
        chat = chat.model_copy(update={"replicas": ReplicaRange(min=1, max=3)})
    store.put_deployment(chat)


def replicas(store: SqlStore) -> list[str]:
    return sorted(r.name for r in store.replicas("chat"))


def someone_else_may_lead(store: SqlStore) -> bool:
    return store.try_acquire_leadership(LEASE, "someone-else", datetime.now(UTC), TTL)


def test_the_reconciler_process_places_asks_the_server_records_its_cycles_and_hands_the_lease_over(
    pg_database: str, store: SqlStore
) -> None:
    seed(store)
    held = {"n": 0}
    asked: list[SignalsQuery] = []

    def answer(query: SignalsQuery) -> Signals:
        asked.append(query)
        return Signals(query.deployment, len(query.ready), query.total, gateway_waiting=held["n"])

    metrics = FleetMetrics()
    child = ReconcilerProcess(ReconcilerConfig(pg_database, 0.1, POLICY, HOLDER), answer, metrics)
    child.start()
    try:
        wait_for(lambda: replicas(store) == ["chat-0"], 60, "the child to place chat-0")
        assert child.pid not in (None, os.getpid())
        assert not someone_else_may_lead(store), "the child holds the lease"
        # The gateway (this process) holds 20 requests: the child's autoscaler sees them and scales up.
        held["n"] = 20
        wait_for(lambda: len(replicas(store)) == 3, 30, "the autoscaler to scale chat to 3")
        assert asked[0].deployment == "chat" and asked[0].metric == "outstanding"
        wait_for(lambda: any(q.total == 3 for q in asked), 30, "a question about the three replicas")
        registry = metrics.registry
        wait_for(
            lambda: registry.get_sample_value("fleetserve_reconcile_quiet_total") or 0,
            30,
            "a quiet cycle counted in this process's metrics",
        )
        full = registry.get_sample_value("fleetserve_reconcile_seconds_count")
        assert full is not None and full >= 2, "full cycles timed in this process's metrics"
        plan = registry.get_sample_value("fleetserve_reconcile_phase_seconds_count", {"phase": "plan"})
        assert plan == full
        desired = registry.get_sample_value("fleetserve_autoscaler_desired_replicas", {"deployment": "chat"})
        assert desired == 3
    finally:
        child.stop(15)
    assert child.pid is None and child.starts == 1
    assert someone_else_may_lead(store), "the lease was handed over on stop, not left to expire"


def test_a_reconciler_process_that_dies_is_started_again_and_leads_at_once(
    pg_database: str, store: SqlStore
) -> None:
    seed(store, autoscaled=False)
    child = ReconcilerProcess(
        ReconcilerConfig(pg_database, 0.1, POLICY, HOLDER),
        lambda q: Signals(q.deployment, len(q.ready), q.total),
    )
    child.start()
    try:
        wait_for(lambda: replicas(store) == ["chat-0"], 60, "the child to place chat-0")
        first = child.pid
        assert first is not None
        os.kill(first, signal.SIGKILL)
        killed = time.monotonic()
        wait_for(lambda: child.starts == 2 and child.pid not in (None, first), 30, "a second child")
        chat = store.get_deployment("chat").deployment
        store.put_deployment(chat.model_copy(update={"replicas": 2}))
        # Well inside the dead child's 15-s lease: the new one leads under the same (server's) name.
        wait_for(lambda: len(replicas(store)) == 2, 13, "the second child to place chat-1 at once")
        assert time.monotonic() - killed < TTL.total_seconds()
    finally:
        child.stop(15)


# A stand-in for a server process: starts the reconciler process and prints its pid.
SERVER = """
import sys, time
from datetime import timedelta
from fleetserve.autoscale import Signals
from fleetserve.reconcile.health import HeartbeatPolicy
from fleetserve.server.reconciler.process import ReconcilerConfig, ReconcilerProcess

def answer(query):
    return Signals(query.deployment, len(query.ready), query.total)

if __name__ == "__main__":
    policy = HeartbeatPolicy(timedelta(seconds=40), timedelta(seconds=300))
    child = ReconcilerProcess(ReconcilerConfig(sys.stdin.readline().strip(), 0.1, policy, sys.argv[1]), answer)
    child.start()
    while child.pid is None:
        time.sleep(0.05)
    print(child.pid, flush=True)
    time.sleep(600)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_reconciler_process_whose_server_is_killed_stops_and_hands_the_lease_over(
    pg_database: str, store: SqlStore
) -> None:
    seed(store, autoscaled=False)
    with subprocess.Popen(
        [sys.executable, "-c", SERVER, HOLDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    ) as server:
        try:
            assert server.stdin is not None and server.stdout is not None
            server.stdin.write(pg_database + "\n")  # as the server gets it: never in argv
            server.stdin.close()
            child = psutil.Process(int(server.stdout.readline()))
            wait_for(lambda: replicas(store) == ["chat-0"], 60, "the child to place chat-0")
            assert not someone_else_may_lead(store)
            server.kill()
            server.wait(10)

            def gone() -> bool:
                try:
                    return child.status() == psutil.STATUS_ZOMBIE
                except psutil.NoSuchProcess:
                    return True

            wait_for(gone, 10, "the reconciler process to end with its server")
            assert someone_else_may_lead(store), "it handed the lease over on its way out"
        finally:
            if server.poll() is None:
                server.kill()
                server.wait(10)
