"""The agent's threads with real engine processes under the real supervisor: stopping engines never
pauses the heartbeat. The agent runs (``Agent.run``: report, watch and in-flight threads) against a
recording client in place of the server, noting when every report (the heartbeat) came; its
replicas are started the agent's own way (the model from the cache, pinned; the llama.cpp
adapter's command line) with a stand-in engine as the binary: it answers ``/health`` and, on
SIGTERM, notes its pid in TERM_LOG and takes SLOW_EXIT seconds to exit, or, given ``--stubborn``,
stays and is killed after the grace. The heartbeat gaps and stop times are printed (``pytest -s``) to be quoted.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from builders import cpu_32c_128g
from fleetserve.agent.cache import ModelCache
from fleetserve.agent.runtime import Agent, AgentSettings
from fleetserve.agent.supervisor import Supervisor
from fleetserve.dev.tinymodel import write_tiny_model
from fleetserve.drivers import Driver, RuntimeVariant
from fleetserve.engines.spec import EngineKind
from fleetserve.errors import StaleEpoch
from fleetserve.protocol import Assignment, AssignmentSet, StatusReport
from fleetserve.spec.resources import DeviceClass, Model, Node, Profile, Replica, ReplicaState, Shard

pytestmark = pytest.mark.slow

INTERVAL = 0.5  # the agent's report (heartbeat) interval
GRACE = 3.0  # the supervisor's stop grace: SIGTERM, this long, SIGKILL
SLOW_EXIT = 1.5  # a stand-in that heeds SIGTERM exits this long after it
# How far past the interval a heartbeat may come: generous (two cores shared with other work), and
# still less than one stop (SLOW_EXIT) would add were it on the report thread.
LATE = 1.0
ENGINES = 8

STAND_IN = r"""
import os, signal, sys, time
from http.server import BaseHTTPRequestHandler, HTTPServer
args = sys.argv[1:]
port = int(args[args.index("--port") + 1])
stubborn = "--stubborn" in args
def on_term(*_):
    with open(os.environ["TERM_LOG"], "a") as log:
        log.write(f"{os.getpid()}\n")
    if not stubborn:
        time.sleep(float(os.environ["SLOW_EXIT"]))
        os._exit(0)
signal.signal(signal.SIGTERM, on_term)
class Health(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()
    def log_message(self, *a):
        pass
HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


def gone(pid: int) -> bool:
    """The process no longer exists, or is a zombie nobody reaped yet."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def wait_for(check: Callable[[], Any], timeout: float, what: Callable[[], str]) -> Any:
    """Poll ``check`` until it returns something truthy; fail with ``what()`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not (value := check()):
        if time.monotonic() > deadline:
            pytest.fail(f"not within {timeout:g}s: {what()}")
        time.sleep(0.02)
    return value


@dataclass
class RecordingClient:
    """The server's side of the agent's calls, in memory: answers with ``current`` assignments and
    ``stop_answer``, raises StaleEpoch once when ``stale`` is set, and notes every report and when
    (monotonic) it came."""

    current: AssignmentSet
    stop_answer: list[str] = field(default_factory=list)
    stale: bool = False
    beats: list[float] = field(default_factory=list)
    reports: list[StatusReport] = field(default_factory=list)
    registrations: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    closed: threading.Event = field(default_factory=threading.Event)

    def classes(self) -> list[DeviceClass]:
        return []

    def register(self, node: Node) -> tuple[Node, AssignmentSet]:
        with self.lock:
            self.registrations += 1
            return node, self.current

    def status(self, report: StatusReport) -> list[str]:
        with self.lock:
            self.beats.append(time.monotonic())
            self.reports.append(report)
            if self.stale:
                self.stale = False
                raise StaleEpoch("the node registered again")
            return list(self.stop_answer)

    def assignments(self, node: str, epoch: int, since: str | None, wait: float) -> AssignmentSet:
        deadline = time.monotonic() + min(wait, 1.0)
        while time.monotonic() < deadline and self.current.revision == since and not self.closed.is_set():
            time.sleep(0.02)
        return self.current

    def timed_reports(self, after: float) -> list[tuple[float, StatusReport]]:
        with self.lock:
            return [(t, r) for t, r in zip(self.beats, self.reports, strict=True) if t > after]


@dataclass
class Running:
    """An agent running in a thread, with its client, supervisor and cache."""

    agent: Agent
    client: RecordingClient
    supervisor: Supervisor
    cache: ModelCache
    model: Model
    term_log: Path

    def sigterms(self) -> dict[int, int]:
        """How many SIGTERMs each engine process received."""
        if not self.term_log.exists():
            return {}
        pids = [int(line) for line in self.term_log.read_text().split()]
        return {pid: pids.count(pid) for pid in pids}

    def assign(self, revision: str, names: list[str], epoch: int = 1) -> AssignmentSet:
        return AssignmentSet(
            epoch=epoch, revision=revision, assignments=[assignment(n, self.model) for n in names]
        )

    def engine_pids(self, names: list[str]) -> dict[str, int]:
        """Each replica's engine pid once every one is Running."""
        return wait_for(
            lambda: (
                (s := self.supervisor.status())
                and all(n in s and s[n].state is ReplicaState.RUNNING and s[n].pids for n in names)
                and {n: s[n].pids[-1] for n in names}
            ),
            60,
            lambda: f"every engine Running: {self.supervisor.status()}",
        )


def assignment(name: str, model: Model) -> Assignment:
    """Replica ``name`` on node n1; an odd-numbered one's stand-in ignores SIGTERM."""
    stubborn = int(name.rsplit("-", 1)[1]) % 2 == 1
    profile = Profile(name="cpu", engine=EngineKind.LLAMACPP, engine_args=("--stubborn",) if stubborn else ())
    replica = Replica(name=name, deployment="d", profile="cpu", shards=(Shard(node="n1", cpu_cores=1),))
    return Assignment(
        replica=replica, profile=profile, runtime=RuntimeVariant.CPU, driver=Driver.CPU, model=model
    )


@pytest.fixture
def running(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Running]:
    monkeypatch.setenv("SLOW_EXIT", str(SLOW_EXIT))
    monkeypatch.setenv("TERM_LOG", str(tmp_path / "sigterms"))
    binary = tmp_path / "stand-in-engine"
    binary.write_text(f"#!{sys.executable}\n{STAND_IN}")
    binary.chmod(0o755)
    model_file = write_tiny_model(tmp_path / "models" / "tiny.gguf")
    model = Model(name="tiny", source=str(model_file), format="gguf")
    names = [f"r-{i}" for i in range(ENGINES)]
    client = RecordingClient(AssignmentSet(epoch=1, revision="1"))
    client.current = AssignmentSet(epoch=1, revision="1", assignments=[assignment(n, model) for n in names])
    supervisor = Supervisor(tmp_path / "logs", grace_seconds=GRACE, poll_seconds=0.1)
    cache = ModelCache(tmp_path / "cache")
    node = cpu_32c_128g("n1")
    agent = Agent(
        client,  # type: ignore[arg-type]  # the recording client answers every call the agent makes
        lambda classes, pids, cached: (node, []),
        supervisor,
        cache,
        AgentSettings(interval=INTERVAL, binaries={(EngineKind.LLAMACPP, RuntimeVariant.CPU): str(binary)}),
    )
    stop = threading.Event()
    thread = threading.Thread(target=agent.run, args=(stop,), name="agent", daemon=True)
    thread.start()
    try:
        yield Running(agent, client, supervisor, cache, model, tmp_path / "sigterms")
    finally:
        pids = [pid for s in supervisor.status().values() for pid in s.pids]
        stop.set()
        client.closed.set()
        thread.join(timeout=GRACE + 10)
        for pid in pids:  # only if the agent failed to stop what it started
            if not gone(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        assert not thread.is_alive(), "the agent did not shut down"


def heartbeat_gaps(beats: list[float]) -> list[float]:
    return [round(b - a, 3) for a, b in itertools.pairwise(beats)]


@pytest.mark.parametrize(
    "how",
    [
        pytest.param("released", id="unassigned-and-answered-stop-by-the-server"),
        pytest.param("fenced", id="fenced-when-the-report-finds-the-epoch-stale"),
    ],
)
def test_eight_engines_stop_at_once_while_every_heartbeat_comes_on_time(running: Running, how: str) -> None:
    names = [f"r-{i}" for i in range(ENGINES)]
    pids = running.engine_pids(names)
    assert running.cache.pinned() == ["tiny"]
    client = running.client
    t0 = time.monotonic()
    with client.lock:
        if how == "released":
            # As a release reaches an agent: the assignments drop them (the watch thread) and the
            # answer to every report names them (the report thread), over and over.
            client.current = running.assign("2", [])
            client.stop_answer = names
        else:
            # The report finds the epoch stale: the report thread registers again and fences.
            client.current = running.assign("2", [], epoch=2)
            client.stale = True
    # Half the engines heed SIGTERM (gone after SLOW_EXIT); half are killed at the grace: mid-way
    # they still run, still the node's own, their model still pinned, and no report lists them.
    wait_for(lambda: all(gone(pids[n]) for n in names[::2]), GRACE, lambda: "the heeding engines to exit")
    stubborn = [pids[n] for n in names[1::2]]
    assert not any(gone(p) for p in stubborn), "the stubborn engines went before the grace"
    assert set(stubborn) <= running.supervisor.own_pids()
    assert running.cache.pinned() == ["tiny"]
    wait_for(lambda: all(gone(p) for p in pids.values()), 3 * GRACE, lambda: "every engine gone")
    took = time.monotonic() - t0
    wait_for(lambda: running.cache.pinned() == [], 2, lambda: f"pins left: {running.cache.pinned()}")
    time.sleep(2 * INTERVAL)  # two heartbeats more after the stops
    with client.lock:
        beats = [b for b in client.beats if b >= t0 - INTERVAL]
        client.stop_answer = []
    gaps = heartbeat_gaps(beats)
    print(
        f"\n{how}: {ENGINES} engines stopped in {took:.2f} s (grace {GRACE:g} s, heeding ones exit "
        f"after {SLOW_EXIT:g} s); {len(beats)} heartbeats every {INTERVAL:g} s, "
        f"max gap {max(gaps):.3f} s; gaps: {gaps}"
    )
    # All eight at once: about one grace, not the 18 s one after another would take.
    assert GRACE * 0.9 <= took <= GRACE + 2.0, took
    assert max(gaps) <= INTERVAL + LATE, gaps
    # Asked again and again (every report's answer, and the watch thread), each engine was
    # stopped once: one SIGTERM each.
    assert running.sigterms() == dict.fromkeys(pids.values(), 1)
    # Once the stops started (from the second report on), no report lists them (not Running).
    listed = [(round(t - t0, 2), sorted(r.replicas)) for t, r in client.timed_reports(beats[1]) if r.replicas]
    assert listed == [], listed
    if how == "fenced":
        assert client.registrations == 2


def test_a_name_assigned_again_starts_only_once_its_old_engine_is_gone(running: Running) -> None:
    client = running.client
    with client.lock:
        client.current = running.assign("2", ["r-1"])  # r-1's stand-in ignores SIGTERM
    old = running.engine_pids(["r-1"])["r-1"]
    wait_for(lambda: set(running.supervisor.names()) == {"r-1"}, 3 * GRACE, lambda: "the others stopped")
    wait_for(lambda: running.supervisor.status().keys() == {"r-1"}, 5, lambda: "r-1 alone in status")
    t0 = time.monotonic()
    with client.lock:
        client.current = running.assign("3", [])
    wait_for(lambda: "r-1" in running.supervisor.stopping(), 5, lambda: "r-1 stopping")
    with client.lock:
        client.current = running.assign("4", ["r-1"])  # back before its old engine is gone
    wait_for(lambda: running.agent.revision == "4", 5, lambda: "the agent following revision 4")
    while not gone(old):
        status = running.supervisor.status()
        assert "r-1" not in status, f"a second engine under r-1 while the old one runs: {status}"
        time.sleep(0.05)
    gone_after = time.monotonic() - t0
    new = running.engine_pids(["r-1"])["r-1"]
    assert new != old
    # Meanwhile the report said what the assignment was: waiting to start, not Running.
    said = {
        (r.replicas["r-1"].state, r.replicas["r-1"].message)
        for t, r in client.timed_reports(t0)
        if "r-1" in r.replicas and r.replicas["r-1"].state is not ReplicaState.RUNNING
    }
    assert (ReplicaState.STARTING, "waiting for the previous engine under this name to stop") in said
    assert gone_after >= GRACE * 0.9
    assert running.sigterms()[old] == 1
    assert running.cache.pinned() == ["tiny"]  # the new engine's pin (the old one's dropped)


def test_a_replica_the_server_stops_while_still_assigned_here_waits_for_newer_assignments(
    running: Running,
) -> None:
    # The server's answer is newer than the assignments the agent holds: r-0 is stopped and not
    # started again until assignments newer than the stop list it.
    names = [f"r-{i}" for i in range(ENGINES)]
    old = running.engine_pids(names)["r-0"]
    with running.client.lock:
        running.client.stop_answer = ["r-0"]
    wait_for(lambda: gone(old), 3 * GRACE, lambda: "r-0's engine stopped")
    with running.client.lock:
        running.client.stop_answer = []
    time.sleep(4 * INTERVAL)
    assert "r-0" not in running.supervisor.names()
    with running.client.lock:
        running.client.current = running.assign("2", names)
    new = running.engine_pids(names)["r-0"]
    assert new != old
