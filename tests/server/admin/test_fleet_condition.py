"""The fleet's DisruptionMode condition, end to end in one process: a reconciler cycle that finds
most of the fleet silent sets it (``GET /api/v1/fleet``, ``fleetserve_disruption_mode`` on
/metrics, the line ``get nodes`` prints), the nodes' heartbeats at their registration make them
Ready again, and the next cycle clears it. The figures cross a process boundary as JSON (a
reconciler in a process of its own sends them): they survive the trip."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from fastapi.testclient import TestClient

from builders import cpu_8c_32g
from fleetserve.adminapi.fleet import FleetView
from fleetserve.cli.views import fleet_lines
from fleetserve.reconcile.health import HeartbeatPolicy
from fleetserve.server.app import create_app
from fleetserve.server.reconciler.loop import CycleFigures, Reconciler
from fleetserve.spec.resources import NodeState
from fleetserve.store.credentials import TokenKind
from fleetserve.store.sql import SqlStore

T0 = datetime(2026, 12, 7, 12, 0, tzinfo=UTC)
POLICY = HeartbeatPolicy(timedelta(seconds=40), timedelta(seconds=300))


def gauge(client: TestClient) -> str:
    return next(
        line.split()[1]
        for line in client.get("/metrics").text.splitlines()
        if line.startswith("fleetserve_disruption_mode ")
    )


def test_most_of_the_fleet_silent_sets_the_condition_and_heartbeats_clear_it(tmp_path) -> None:
    with SqlStore.open(tmp_path / "state.db") as store:
        admin = {"Authorization": f"Bearer {store.create_token(TokenKind.ADMIN, T0).plaintext}"}
        for i in range(10):
            store.register(cpu_8c_32g(f"n{i}"))
            store.heartbeat(f"n{i}", T0 if i < 4 else T0 - timedelta(minutes=10))
        app = create_app(store, models_dir=tmp_path / "models", gateway=False)
        clock = {"now": T0}
        loop = Reconciler(store, POLICY, clock=lambda: clock["now"], metrics=app.state.metrics)
        with TestClient(app) as client:
            off = FleetView.model_validate(client.get("/api/v1/fleet", headers=admin).json())
            assert [(c.type, c.status) for c in off.conditions] == [("DisruptionMode", "False")]
            assert fleet_lines(off) == []

            cycle = loop.run_once()
            # Six of ten silent for ten minutes, past the Lost deadline: NotReady, none Lost.
            assert sorted(new for _, _, new in cycle.transitions) == ["NotReady"] * 6
            assert {n.state for n in store.nodes()} == {NodeState.READY, NodeState.NOT_READY}
            on = FleetView.model_validate(client.get("/api/v1/fleet", headers=admin).json())
            assert [(c.type, c.status, c.reason) for c in on.conditions] == [
                ("DisruptionMode", "True", "NodesSilent")
            ]
            assert fleet_lines(on) == [
                "DisruptionMode: 6 of 10 nodes silent since 2026-12-07T12:00:00+00:00; not re-placing"
            ]
            assert gauge(client) == "1.0"
            figures = cycle.figures()
            assert CycleFigures.model_validate_json(figures.model_dump_json()) == figures

            # Their agents come back at the registration they hold: Ready, no new epoch.
            clock["now"] = T0 + timedelta(seconds=5)
            for i in range(4, 10):
                store.heartbeat(f"n{i}", clock["now"], epoch=1)
            assert {n.state for n in store.nodes()} == {NodeState.READY}
            assert loop.run_once().disruption is None
            cleared = FleetView.model_validate(client.get("/api/v1/fleet", headers=admin).json())
            assert [(c.type, c.status) for c in cleared.conditions] == [("DisruptionMode", "False")]
            assert gauge(client) == "0.0"
