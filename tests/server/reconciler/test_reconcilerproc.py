"""The reconciler process's messages and settings (``server/reconciler/process.py``); the processes
themselves run in ``tests/e2e/test_reconciler_process.py``."""

from __future__ import annotations

import multiprocessing
import threading
from datetime import timedelta
from pathlib import Path

import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from builders import deployment
from fleetserve.autoscale import Signals, SignalsQuery
from fleetserve.cli.main import app
from fleetserve.errors import ConfigError
from fleetserve.metrics.exposition import FleetMetrics
from fleetserve.reconcile.health import HeartbeatPolicy
from fleetserve.server.process import ControlPlane, ReconcilerMode, reconciler_process
from fleetserve.server.reconciler import process as reconcilerproc
from fleetserve.server.reconciler.loop import CycleFigures, CyclePhase
from fleetserve.server.reconciler.process import (
    Answer,
    Ask,
    Cycle,
    ReconcilerLinkError,
    Stop,
    ToReconciler,
    ToServer,
    _ServerLink,
)
from fleetserve.spec.resources import Deployment, Replica
from fleetserve.store.db import shown_url

POLICY = HeartbeatPolicy(timedelta(seconds=40), timedelta(seconds=300))
PG = "postgresql://fleet:s3cret@db.example:5432/fleet"


def control(tmp_path: Path) -> ControlPlane:
    return ControlPlane(tmp_path / "models", 1.5, POLICY, None)


@pytest.mark.parametrize(
    ("mode", "url", "process"),
    [
        (ReconcilerMode.AUTO, PG, True),
        (ReconcilerMode.AUTO, "state.db", False),
        (ReconcilerMode.AUTO, "sqlite:///state.db", False),
        (ReconcilerMode.THREAD, PG, False),
        (ReconcilerMode.PROCESS, PG, True),
    ],
)
def test_auto_runs_the_reconciler_in_a_process_on_postgresql_and_on_a_thread_on_sqlite(
    tmp_path: Path, mode: ReconcilerMode, url: str, process: bool
) -> None:
    config = reconciler_process(mode, url, control(tmp_path), "warning")
    assert (config is not None) == process
    if config is not None:
        assert (config.database_url, config.interval, config.policy, config.log_level) == (
            url,
            1.5,
            POLICY,
            "warning",
        )
        host, pid, _ = config.holder.split(":")
        assert int(pid) > 0 and host


def test_a_reconciler_process_on_sqlite_is_refused_naming_the_flag(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--reconciler: process needs PostgreSQL"):
        reconciler_process(ReconcilerMode.PROCESS, str(tmp_path / "state.db"), control(tmp_path), "info")
    result = CliRunner().invoke(
        app, ["server", "--reconciler", "process", "--database-url", str(tmp_path / "state.db")]
    )
    assert result.exit_code != 0
    assert "--reconciler: process needs PostgreSQL" in result.output
    assert not (tmp_path / "state.db").exists(), "refused before anything was opened"


def test_every_message_crosses_as_json_and_comes_back_equal() -> None:
    query = SignalsQuery("chat", "waiting", ("chat-0", "chat-1"), 3, 1234.5)
    figures = CycleFigures(
        leader=True,
        seconds=0.25,
        phases={CyclePhase.SNAPSHOT: 0.1, CyclePhase.PLAN: 0.1},
        desired={"chat": 3},
    )
    for message in (Ask(seq=1, query=query), Cycle(figures=figures)):
        assert ToServer.validate_json(message.model_dump_json()) == message
    signals = Signals("chat", 2, 3, (1.0, 2.5), 4, 1200.0)
    for reply in (Answer(seq=1, signals=signals), Answer(seq=2, error="boom"), Stop()):
        assert ToReconciler.validate_json(reply.model_dump_json()) == reply


@pytest.mark.parametrize(
    "data",
    [
        b'{"kind": "stop"}',  # the reconciler's to hear, not the server's
        b'{"kind": "ask", "seq": 1}',
        b'{"kind": "cycle", "figures": {"leader": true, "seconds": -1}}',
        b'{"kind": "cycle", "figures": {"leader": true, "seconds": 1, "phases": {"nap": 1}}}',
        b'{"kind": "cycle", "figures": {"leader": true, "seconds": 1}, "extra": 1}',
        b"not json",
    ],
)
def test_a_message_that_is_not_one_is_refused(data: bytes) -> None:
    with pytest.raises(ValidationError):
        ToServer.validate_json(data)


def test_figures_record_as_a_reconciler_thread_records_them() -> None:
    metrics = FleetMetrics()
    CycleFigures(leader=False, seconds=0.0).record(metrics)  # a follower: nothing to tell
    CycleFigures(leader=True, seconds=0.0, quiet=True).record(metrics)
    phases = {CyclePhase.SNAPSHOT: 0.2, CyclePhase.PLAN: 0.3, CyclePhase.COMMIT: 0.1}
    CycleFigures(leader=True, seconds=0.6, phases=phases, desired={"chat": 2}).record(metrics)
    value = metrics.registry.get_sample_value
    assert value("fleetserve_reconcile_quiet_total") == 1
    assert value("fleetserve_reconcile_seconds_count") == 1
    assert value("fleetserve_reconcile_seconds_sum") == pytest.approx(0.6)
    assert value("fleetserve_placement_seconds_sum") == pytest.approx(0.3)
    assert value("fleetserve_reconcile_phase_seconds_sum", {"phase": "commit"}) == pytest.approx(0.1)
    assert value("fleetserve_autoscaler_desired_replicas", {"deployment": "chat"}) == 2


def chat() -> tuple[Deployment, list[Replica]]:
    profile = {"name": "gpu", "engine": "vllm", "deviceClass": "h100", "devicesPerNode": 1}
    return deployment("chat", 1, profile, model="m"), []


def test_a_late_answer_is_not_taken_for_the_next_questions(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(reconcilerproc, "ANSWER_SECONDS", 0.3)
    ours, theirs = multiprocessing.Pipe()
    link = _ServerLink(theirs)
    threading.Thread(target=link.receive_forever, daemon=True).start()
    dep, reps = chat()
    with pytest.raises(ReconcilerLinkError, match="did not answer the autoscaler's question about chat"):
        link.signals(dep, reps, 0.0)
    first = ToServer.validate_json(ours.recv_bytes())
    assert isinstance(first, Ask)
    stale = Answer(seq=first.seq, signals=Signals("chat", 0, 0, gateway_waiting=1))
    ours.send_bytes(stale.model_dump_json().encode())  # the answer to the question given up on

    def answer_the_next() -> None:
        second = ToServer.validate_json(ours.recv_bytes())
        assert isinstance(second, Ask) and second.seq != first.seq
        fresh = Answer(seq=second.seq, signals=Signals("chat", 0, 0, gateway_waiting=2))
        ours.send_bytes(fresh.model_dump_json().encode())

    answering = threading.Thread(target=answer_the_next, daemon=True)
    answering.start()
    assert link.signals(dep, reps, 0.0).gateway_waiting == 2
    answering.join(5)


def test_an_error_answer_or_a_closed_pipe_fails_the_question_with_its_reason() -> None:
    ours, theirs = multiprocessing.Pipe()
    link = _ServerLink(theirs)
    threading.Thread(target=link.receive_forever, daemon=True).start()
    dep, reps = chat()

    def refuse() -> None:
        ask = ToServer.validate_json(ours.recv_bytes())
        assert isinstance(ask, Ask)
        ours.send_bytes(Answer(seq=ask.seq, error="KeyError: 'chat'").model_dump_json().encode())

    threading.Thread(target=refuse, daemon=True).start()
    with pytest.raises(ReconcilerLinkError, match="could not answer about chat: KeyError"):
        link.signals(dep, reps, 0.0)
    ours.close()
    assert link.stop.wait(5), "the server gone: the reconciler stops"
    with pytest.raises(ReconcilerLinkError):
        link.signals(dep, reps, 0.0)


def test_the_database_url_is_shown_without_its_password() -> None:
    assert shown_url(PG) == "postgresql://fleet:***@db.example:5432/fleet"
    assert shown_url("state.db") == "state.db"
    assert "s3cret" not in shown_url("postgresql://fleet:s3cret@[bad")
