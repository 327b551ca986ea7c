"""No churn from the control plane's own trouble: a real ``fleetserve server`` stopped (SIGSTOP) for
twice its NotReady deadline — past its Lost deadline too — under 200 simulated agents
(``bench/controlplane.py``'s ``Fleet``: real HTTP, each agent enrolled with its own credential,
heartbeating every second, a status report every third beat, one assignments long-poll held).

Two ways the server meets it, one per case:

- SQLite (the reconciler a thread of the server): the whole server stops, its reconcile loop with
  it; its next cycle finds the gap in its own clock and restarts every node's grace
  (``reconcile/disruption.py``): nobody is even marked NotReady.
- PostgreSQL with ``--reconciler process``: only the server's process stops; the reconciler's own
  process goes on and sees every node fall silent at once: disruption mode. Nodes are marked
  NotReady (past the Lost deadline, none is judged Lost) and their next heartbeat, at the
  registration they hold, makes them Ready again. Rows the server was writing when it stopped stay
  locked by it: the reconciler skips those nodes (``SKIP LOCKED``) rather than wait on it.

Either way: no agent is told to register again, no replica is released or moved, and every node
is Ready again within one heartbeat interval of SIGCONT.
"""

from __future__ import annotations

import asyncio
import re
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from e2e_support import ServerFactory, sql_poller

from builders import cpu_8c_32g

BENCH = Path(__file__).resolve().parents[2] / "bench"
AGENTS = 200
REPLICAS = 100
INTERVAL = 1.0  # the agents' heartbeat interval
NOT_READY_AFTER = 3.0
LOST_AFTER = 5.0
STOPPED = 2 * NOT_READY_AFTER  # past the Lost deadline too


def documents() -> list[dict[str, Any]]:
    model = {"kind": "Model", "name": "tiny", "source": "/models/tiny.gguf", "format": "gguf", "size": "1MB"}
    deployment = {
        "kind": "Deployment",
        "name": "tiny",
        "model": "tiny",
        "replicas": REPLICAS,
        "profiles": [{"name": "cpu", "engine": "llama.cpp", "cpu": {"cores": 1}}],
    }
    return [model, deployment]


PLACED = "SELECT COUNT(*) FROM replica_shards"
NOT_READY = "SELECT COUNT(*) FROM nodes WHERE state <> 'Ready'"
LOST = "SELECT COUNT(*) FROM nodes WHERE state = 'Lost'"
EPOCHS = "SELECT MAX(epoch) FROM nodes"


def placements(scalar: Any, database_url: str) -> dict[str, str]:
    """Every replica's node, read straight from the database."""
    if database_url.startswith("postgresql://"):
        import psycopg

        with psycopg.connect(database_url) as conn:
            rows = conn.execute("SELECT replica, node FROM replica_shards").fetchall()
    else:
        import sqlite3

        with sqlite3.connect(database_url.removeprefix("sqlite:///")) as conn:
            rows = conn.execute("SELECT replica, node FROM replica_shards").fetchall()
    return {replica: node for replica, node in rows}


def rows_held(database_url: str) -> int:
    """How many node rows another transaction holds locked (PostgreSQL): those a server stopped in
    the middle of a heartbeat batch still holds. They are counted by what cannot be share-locked
    without waiting, in a transaction that is rolled back at once."""
    import psycopg

    with psycopg.connect(database_url) as conn:
        total = conn.execute("SELECT COUNT(*) FROM nodes").fetchone()
        free = conn.execute("SELECT name FROM nodes FOR SHARE SKIP LOCKED").fetchall()
        conn.rollback()
    assert total is not None
    return int(total[0]) - len(free)


async def stall_under_agents(server: Any, database_url: str) -> dict[str, Any]:
    sys.path.insert(0, str(BENCH))
    try:
        from controlplane import Fleet
    finally:
        sys.path.remove(str(BENCH))
    from fleetserve.httpclient import Origin

    port = int(server.url.rsplit(":", 1)[1])
    nodes = [
        cpu_8c_32g(f"n{i:03}").model_dump(mode="json", by_alias=True, exclude={"state"}, exclude_none=True)
        for i in range(AGENTS)
    ]
    fleet = Fleet(nodes, server.join_token, Origin("127.0.0.1", port), connections=64)
    figures: dict[str, Any] = {}
    with sql_poller(database_url) as scalar:
        try:
            await fleet.enrol_all(INTERVAL, 3)
            server.apply(documents())
            deadline = time.monotonic() + 60
            while scalar(PLACED) < REPLICAS or fleet.assigned_total() < REPLICAS:
                assert time.monotonic() < deadline, (scalar(PLACED), fleet.assigned_total())
                await asyncio.sleep(0.2)
            await asyncio.sleep(2 * INTERVAL)  # every agent heard since
            assert scalar(NOT_READY) == 0 and scalar(EPOCHS) == 1
            before = placements(scalar, database_url)
            registered = fleet.stats.reregistered

            server.proc.send_signal(signal.SIGSTOP)
            stopped_at = time.monotonic()
            worst, held = 0, 0
            if database_url.startswith("postgresql://"):
                await asyncio.sleep(0.2)  # a transaction the stop did not catch has ended by now
                held = rows_held(database_url)
            while time.monotonic() - stopped_at < STOPPED:
                worst = max(worst, scalar(NOT_READY))
                assert scalar(LOST) == 0
                await asyncio.sleep(0.1)
            server.proc.send_signal(signal.SIGCONT)
            resumed = time.monotonic()
            ready_after = None
            while time.monotonic() - resumed < 4 * LOST_AFTER:
                not_ready = scalar(NOT_READY)
                worst = max(worst, not_ready)
                if not_ready == 0 and ready_after is None:
                    ready_after = time.monotonic() - resumed
                assert scalar(LOST) == 0
                # Past the Lost deadline counted from SIGCONT: nothing may go Lost late either.
                if ready_after is not None and time.monotonic() - resumed > LOST_AFTER + 2 * INTERVAL:
                    break
                await asyncio.sleep(0.05)
            figures = {
                "re-enrolments": fleet.stats.reregistered - registered,
                "replicas moved": sum(
                    1 for r, n in before.items() if placements(scalar, database_url).get(r) != n
                )
                + len(set(placements(scalar, database_url)) - set(before)),
                "most nodes not Ready at once": worst,
                "rows the stopped server held": held,
                "all Ready after SIGCONT s": ready_after,
                "highest epoch": scalar(EPOCHS),
                "failed requests": dict(fleet.stats.failures),
            }
        finally:
            if server.proc.poll() is None:
                server.proc.send_signal(signal.SIGCONT)
            await fleet.stop()
    return figures


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["sqlite, reconciler thread", "postgres, reconciler process"])
def test_a_server_stopped_twice_its_not_ready_deadline_moves_nothing_and_asks_no_node_to_register(
    servers: ServerFactory, tmp_path: Path, request: pytest.FixtureRequest, backend: str
) -> None:
    extra: tuple[str, ...] = ("--not-ready-after", str(NOT_READY_AFTER), "--lost-after", str(LOST_AFTER))
    extra += ("--models-dir", str(tmp_path / "models"), "--log-level", "warning")
    if backend.startswith("postgres"):
        database_url = request.getfixturevalue("pg_database")
        extra += ("--reconciler", "process")
    else:
        database_url = f"sqlite:///{tmp_path / 'state.db'}"
    server = servers.start(database_url, extra_args=extra)
    figures = asyncio.run(stall_under_agents(server, database_url))
    print(f"{backend}: {figures}")
    log = server.log()
    assert figures["re-enrolments"] == 0, (figures, log[-3000:])
    assert figures["highest epoch"] == 1, figures
    assert figures["replicas moved"] == 0, figures
    assert figures["all Ready after SIGCONT s"] is not None, figures
    assert figures["all Ready after SIGCONT s"] <= INTERVAL, figures
    if backend.startswith("postgres"):
        # The reconciler went on: it saw the whole fleet silent, and said so. It marked every node
        # but those whose rows the stopped server held mid-write: it skips them, never waits on them.
        held = figures["rows the stopped server held"]
        assert figures["most nodes not Ready at once"] == AGENTS - held, figures
        assert re.search(r"disruption mode: \d+ of 200 nodes silent since", log), log[-3000:]
        assert "disruption mode ended" in log, log[-3000:]
    else:
        # The reconciler stopped with the server: it found its own stall and judged nobody on it.
        assert figures["most nodes not Ready at once"] == 0, figures
        assert "the reconcile loop did not run for" in log, log[-3000:]
