"""The engine supervisor: starts each replica's processes in their own process group (and, given a
state directory, in one cgroup per replica: ``containment.py``), follows health (503 while
loading, 200 when ready), restarts a crashed engine with exponential backoff, marks a crash loop
with the last lines of its stderr, stops gracefully (SIGTERM, then SIGKILL after a grace period,
then whatever is left in the cgroup), and leaves no orphan: every engine gets PR_SET_PDEATHSIG, so
it dies with the agent even when the agent is killed with SIGKILL, and what the engine started
(which has no parent-death signal) is stopped by the next agent from its record before that agent
starts anything.

All processes are started from the supervisor's own long-lived thread: the parent-death signal
fires when the *thread* that forked the child ends, so forking from a short-lived thread would
kill the engine with it. A stop is marked and its SIGTERM sent there too (so no restart or spawn
can slip in between), but its grace is waited out on the caller's thread: many stops proceed at
once, each with its own grace, while the supervisor thread goes on watching the other engines.
A stopping engine stays in the table (its processes are still the agent's own) and is out of
``status``; its name takes no new engine until it is gone.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import queue
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import httpx

from fleetserve.agent.containment import Containment, cgroup_pids, join_cgroup, kill_cgroup
from fleetserve.engines.launch import LaunchSpec
from fleetserve.process import die_with_parent, group_alive
from fleetserve.spec.resources import ReplicaState

log = logging.getLogger("fleetserve.supervisor")

# Restart backoff: 1 s, doubling, at most a minute.
BACKOFF_START = 1.0
BACKOFF_MAX = 60.0
# This many exits without a healthy run in between is a crash loop.
CRASH_LOOP_AFTER = 3
STDERR_LINES = 50


@dataclass(frozen=True)
class EngineStatus:
    """What the supervisor knows about one replica's engine."""

    state: ReplicaState
    message: str
    restarts: int
    stderr_tail: tuple[str, ...]
    port: int
    pids: tuple[int, ...]


@dataclass
class _Engine:
    name: str
    spec: LaunchSpec
    log_path: Path
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    state: ReplicaState = ReplicaState.STARTING
    message: str = "starting"
    restarts: int = 0
    exits_since_healthy: int = 0
    backoff: float = BACKOFF_START
    restart_at: float | None = None
    stderr: collections.deque[str] = field(default_factory=lambda: collections.deque(maxlen=STDERR_LINES))
    stopping: bool = False  # set on the supervisor thread; the stopping call owns ``procs`` then
    stopped: threading.Event = field(default_factory=threading.Event)
    cgroup: Path | None = None


@dataclass
class _Command:
    """One call for the supervisor thread; ``engine`` is what a "stop" handed its caller to stop."""

    op: str
    name: str
    spec: LaunchSpec | None = None
    done: threading.Event = field(default_factory=threading.Event)
    engine: _Engine | None = None


class Supervisor:
    """Runs and watches engine processes; thread-safe; one per agent."""

    def __init__(
        self,
        log_dir: Path,
        grace_seconds: float = 10.0,
        poll_seconds: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
        state_dir: Path | None = None,
        use_cgroups: bool = True,
    ) -> None:
        self.log_dir = log_dir
        # With a state directory: cgroups and records, and what a previous run left is stopped
        # now, before this supervisor can start anything.
        self.containment = Containment(state_dir, use_cgroups=use_cgroups) if state_dir else None
        self.leftovers = self.containment.reap_leftovers() if self.containment else []
        self.grace = grace_seconds
        self.poll = poll_seconds
        self.clock = clock
        self._engines: dict[str, _Engine] = {}
        self._lock = threading.Lock()
        self._commands: queue.Queue[_Command] = queue.Queue()
        self._stop = threading.Event()
        self._closing = False  # shutting down: nothing starts any more
        self._http = httpx.Client(timeout=2.0)
        self._thread = threading.Thread(target=self._run, name="supervisor", daemon=True)
        self._thread.start()

    # --- commands (from any thread) ------------------------------------------------------------

    def _call(self, op: str, name: str, spec: LaunchSpec | None = None) -> _Command:
        command = _Command(op, name, spec)
        self._commands.put(command)
        command.done.wait()
        return command

    def start(self, name: str, spec: LaunchSpec) -> None:
        """Start a replica's engine (and sidecars); a no-op if it already runs."""
        self._call("start", name, spec)

    def stop(self, name: str) -> None:
        """Stop a replica's engine gracefully and forget it; returns once its processes are gone.

        Safe from any thread and from many at once: each waits out its own grace on its caller's
        thread. A stop of an engine already stopping waits for that stop; it sends nothing again."""
        with self._lock:
            engine = self._engines.get(name)
        if engine is not None and engine.stopping:
            engine.stopped.wait()
            return
        if self._stop.is_set():
            return  # shut down: everything was stopped, and no thread answers calls any more
        mine = self._call("stop", name).engine
        if mine is not None:
            self._finish_stop(mine, time.monotonic() + self.grace)
            return
        with self._lock:
            other = self._engines.get(name)
        if other is not None and other.stopping:  # another call marked it first
            other.stopped.wait()

    def fail(self, name: str, message: str) -> None:
        """Record a replica that cannot start at all (e.g. its engine binary is missing)."""
        with self._lock:
            engine = self._engines.get(name) or _Engine(
                name, LaunchSpec((), {}, None, None), self.log_dir / f"{name}.log"
            )
            engine.state, engine.message = ReplicaState.FAILED, message
            self._engines[name] = engine

    def names(self) -> set[str]:
        """The replicas the supervisor runs or has recorded."""
        with self._lock:
            return set(self._engines)

    def status(self) -> dict[str, EngineStatus]:
        """Every replica's state, restarts, stderr tail and port; a stopping one is not listed."""
        with self._lock:
            return {
                e.name: EngineStatus(
                    e.state, e.message, e.restarts, tuple(e.stderr), e.spec.port,
                    tuple(p.pid for p in e.procs if p.poll() is None),
                )
                for e in self._engines.values()
                if not e.stopping
            }  # fmt: skip

    def stopping(self) -> set[str]:
        """The replicas whose engines are being stopped (their processes not all gone yet)."""
        with self._lock:
            return {e.name for e in self._engines.values() if e.stopping}

    def own_pids(self) -> frozenset[int]:
        """Pids of every process the supervisor started, and (with cgroups) every process those
        started: GPU processes that are not foreign (an engine's workers too)."""
        with self._lock:
            engines = list(self._engines.values())
            started = {p.pid for e in engines for p in e.procs if p.poll() is None}
        return frozenset(started.union(*(cgroup_pids(e.cgroup) for e in engines if e.cgroup)))

    def log_path(self, name: str) -> Path:
        """Where a replica's engine output goes."""
        return self.log_dir / f"{name}.log"

    def shutdown(self) -> None:
        """Stop every engine (all at once, each with its grace; stops in flight are waited for),
        then the supervisor thread. Nothing starts once this is called; a second call does nothing."""
        if self._stop.is_set():
            return
        self._call("close", "")  # every start queued before is done; any later one is refused
        stops = [threading.Thread(target=self.stop, args=(n,), name=f"stop-{n}") for n in self.names()]
        for thread in stops:
            thread.start()
        for thread in stops:
            thread.join()
        self._stop.set()
        self._thread.join(timeout=self.grace + 5)
        self._http.close()

    # --- the supervisor thread -------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                command = self._commands.get(timeout=self.poll)
            except queue.Empty:
                self._watch()
                continue
            try:
                if command.op == "start" and command.spec is not None:
                    self._start(command.name, command.spec)
                elif command.op == "stop":
                    command.engine = self._begin_stop(command.name)
                elif command.op == "close":
                    self._closing = True
            except Exception:  # the supervisor must outlive any one engine's trouble
                log.exception("supervisor: %s %s failed", command.op, command.name)
            finally:
                command.done.set()
            self._watch()

    def _spawn(self, engine: _Engine) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        env = {**engine_environment(os.environ), **engine.spec.env}
        cgroup = self.containment.make_cgroup(engine.name) if self.containment else None
        engine.cgroup = cgroup

        def prepare_child() -> None:  # pragma: no cover - runs in the child between fork and exec
            die_with_parent()
            if cgroup is not None:
                join_cgroup(cgroup)

        out = engine.log_path.open("ab")
        procs: list[subprocess.Popen[bytes]] = []
        try:
            for argv in (*engine.spec.sidecars, engine.spec.argv):
                procs.append(
                    subprocess.Popen(
                        list(argv), env=env, stdout=out, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                        start_new_session=True, preexec_fn=prepare_child,
                    )
                )  # fmt: skip
        except (OSError, subprocess.SubprocessError) as exc:
            self._terminate(procs, cgroup)  # sidecars already started must not outlive the failed start
            engine.procs = []
            engine.state = ReplicaState.FAILED
            engine.message = f"cannot start {engine.spec.argv[0]}: {getattr(exc, 'strerror', None) or exc}"
            engine.restart_at = None
            return
        finally:
            out.close()
        engine.procs = procs
        if self.containment is not None:
            self.containment.record(engine.name, (p.pid for p in procs), cgroup)
        # A restart after a crash loop stays marked CrashLoop until the engine is healthy again.
        looping = engine.exits_since_healthy >= CRASH_LOOP_AFTER
        engine.state = ReplicaState.CRASH_LOOP if looping else ReplicaState.STARTING
        engine.message = engine.message if looping else "loading"
        for proc in procs:
            threading.Thread(target=self._pump, args=(engine, proc.stderr), daemon=True).start()

    def _pump(self, engine: _Engine, stream: IO[bytes] | None) -> None:
        """Copy an engine's stderr to its log file, keeping the last lines for status reports."""
        if stream is None:
            return
        with stream, engine.log_path.open("ab") as out:
            for raw in stream:
                out.write(raw)
                out.flush()
                line = raw.decode("utf-8", errors="replace").rstrip()
                with self._lock:
                    engine.stderr.append(line)

    def _start(self, name: str, spec: LaunchSpec) -> None:
        with self._lock:
            existing = self._engines.get(name)
            if existing is not None and existing.spec == spec and existing.state is not ReplicaState.FAILED:
                return
        if self._closing:
            log.warning("not starting %s: the supervisor is shutting down", name)
            return
        if existing is not None and existing.stopping:
            # Never two engines under one name (nor one cgroup for both): the caller starts it
            # again once the old one is gone (the agent does, ``agent/stopper.py``).
            log.warning("not starting %s: its previous engine is still stopping", name)
            return
        if existing is not None:
            self._stop_engine(name)
        engine = _Engine(name, spec, self.log_path(name))
        with self._lock:
            self._engines[name] = engine
        self._spawn(engine)
        log.info("started %s: %s", name, " ".join(spec.argv))

    def _stop_engine(self, name: str) -> None:
        """Stop ``name`` on the supervisor thread itself (an engine replaced by a new spec)."""
        engine = self._begin_stop(name)
        if engine is not None:
            self._finish_stop(engine, time.monotonic() + self.grace)

    def _begin_stop(self, name: str) -> _Engine | None:
        """On the supervisor thread: mark ``name`` stopping (no restart, no health check, no new
        engine under its name from now on) and SIGTERM its process groups; the engine for the
        caller to finish, or None when there is none or it is stopping already."""
        with self._lock:
            engine = self._engines.get(name)
            if engine is None or engine.stopping:
                return None
            engine.stopping, engine.restart_at = True, None
        terminate_groups(engine.procs)
        return engine

    def _finish_stop(self, engine: _Engine, deadline: float) -> None:
        """On any thread: wait out the grace, kill what is left, and forget the engine."""
        try:
            self._reap(engine.procs, engine.cgroup, deadline)
            if self.containment is not None:
                self.containment.forget(engine.name, engine.cgroup)
        finally:
            with self._lock:
                if self._engines.get(engine.name) is engine:
                    del self._engines[engine.name]
            engine.stopped.set()
        log.info("stopped %s", engine.name)

    def _terminate(self, procs: list[subprocess.Popen[bytes]], cgroup: Path | None = None) -> None:
        """SIGTERM every process group, then SIGKILL every group with anything left after the grace
        period (``_reap``)."""
        terminate_groups(procs)
        self._reap(procs, cgroup, time.monotonic() + self.grace)

    def _reap(self, procs: list[subprocess.Popen[bytes]], cgroup: Path | None, deadline: float) -> None:
        """Wait until ``deadline`` for the SIGTERMed groups, then SIGKILL every group with anything
        left — whether or not its leader (the engine) is still alive: an engine that exited may
        have left children in its group, and only the leader has the parent-death signal — and
        last every process left in the replica's cgroup (one that left its group, too)."""
        groups = [proc.pid for proc in procs]  # each was started as its own session: pgid == pid
        for proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        while time.monotonic() < deadline and any(group_alive(g) for g in groups):
            time.sleep(0.05)
        for pgid in groups:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)
        if cgroup is not None:
            kill_cgroup(cgroup)
        for proc in procs:
            proc.wait()

    def _healthy(self, url: str | None) -> bool | None:
        if url is None:
            return True
        try:
            response = self._http.get(url)
        except httpx.HTTPError:
            return None  # not listening yet
        return response.status_code == 200

    def _watch(self) -> None:
        now = self.clock()
        with self._lock:
            engines = list(self._engines.values())
        for engine in engines:
            if engine.stopping or (engine.state is ReplicaState.FAILED and engine.restart_at is None):
                continue
            if engine.restart_at is not None:
                if now >= engine.restart_at:
                    engine.restart_at = None
                    engine.restarts += 1
                    self._spawn(engine)
                continue
            exited = [p for p in engine.procs if p.poll() is not None]
            if exited:
                code = exited[0].returncode
                self._terminate(engine.procs, engine.cgroup)  # one process died: restart it whole
                engine.exits_since_healthy += 1
                looping = engine.exits_since_healthy >= CRASH_LOOP_AFTER
                engine.state = ReplicaState.CRASH_LOOP if looping else ReplicaState.STARTING
                engine.message = (
                    f"engine exited with status {code}; restart {engine.restarts + 1} in {engine.backoff:g}s"
                )
                engine.restart_at = now + engine.backoff
                engine.backoff = min(engine.backoff * 2, BACKOFF_MAX)
                continue
            healthy = self._healthy(engine.spec.health_url)
            if healthy:
                if engine.state is not ReplicaState.RUNNING:
                    log.info("%s is healthy", engine.name)
                engine.state, engine.message = ReplicaState.RUNNING, "healthy"
                engine.exits_since_healthy = 0
                engine.backoff = BACKOFF_START
            elif engine.state is ReplicaState.RUNNING:
                engine.state, engine.message = ReplicaState.STARTING, "health check failing"


def terminate_groups(procs: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM the process group of each process (each was started as its own session)."""
    for proc in procs:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGTERM)


# The agent's own secrets: engines never see them (the agent downloads models; engines only read
# them). Every FLEETSERVE_* setting goes too (tokens, token files, CA settings); a launch spec's own
# ``env`` sets what an engine needs (its API key, visible devices).
AGENT_SECRETS = frozenset({"HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "FLEETSERVE_JOIN_TOKEN", "FLEETSERVE_TOKEN"})
AGENT_PREFIXES = ("FLEETSERVE_",)


def engine_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The agent's environment without its secrets: what an engine starts from."""
    return {k: v for k, v in environ.items() if k not in AGENT_SECRETS and not k.startswith(AGENT_PREFIXES)}
