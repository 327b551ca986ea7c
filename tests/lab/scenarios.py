"""The lab's chaos scenarios, each under gateway load, each returning its figures: requests sent,
completed, failed and truncated (non-streamed and streamed apart), the time until the
deployment had all its replicas Running again, and where a host was partitioned, the time from
the heal until its old engine was stopped (fenced). Run by tests/lab/test_lab.py (which asserts)
and bench/chaos.py (which prints a table).

Every scenario starts and ends with the deployment ``tiny`` at ``REPLICAS`` Running replicas of
the tiny model, every host's agent up, and every host uncordoned.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from fleetserve.dev.tinymodel import write_tiny_model
from lab import FLEETSERVE, LOST_AFTER, Lab, wait_until
from load import LoadCounts, one_request

MODEL = "tiny"
REPLICAS = 2
HOSTS = 3
# How long each scenario's load runs before the fault and after recovery.
SETTLE = 1.0
RECOVER_TIMEOUT = 60.0
PARTITION_CLIENTS = 4


SLOW = 1.0
"""Requests that take longer than this (seconds) are listed with their start."""


@dataclass
class Timing:
    """How long a load run's requests took: the slowest, and (monotonic start, seconds) of each
    that took over ``SLOW`` seconds — a request that paid a connect timeout to a host that
    dropped off the network shows there."""

    slowest: float = 0.0
    slow: list[tuple[float, float]] = field(default_factory=list)


class BackgroundLoad:
    """``workers`` clients sending chat completions back to back (load.one_request) while a
    ``with`` block runs; their ``counts`` and ``timing``."""

    def __init__(self, lab: Lab, *, workers: int, stream: bool = False, timeout: float = 15.0) -> None:
        self.counts, self.timing = LoadCounts(), Timing()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        headers = {"Authorization": f"Bearer {lab.api_key}"}

        def work() -> None:
            with httpx.Client(timeout=timeout, verify=lab.verify or True) as client:
                while not self._stop.is_set():
                    started = time.monotonic()
                    one_request(client, lab.gateway_url, MODEL, self.counts, stream=stream, headers=headers)
                    took = time.monotonic() - started
                    with self._lock:
                        self.timing.slowest = max(self.timing.slowest, took)
                        if took > SLOW:
                            self.timing.slow.append((started, took))

        self._threads = [threading.Thread(target=work, daemon=True) for _ in range(workers)]

    def __enter__(self) -> BackgroundLoad:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join()


@dataclass
class Result:
    """One scenario's figures."""

    name: str
    requests: LoadCounts = field(default_factory=LoadCounts)
    streams: LoadCounts = field(default_factory=LoadCounts)
    timing: Timing = field(default_factory=Timing)  # of the non-streamed requests
    recovered: float | None = None  # seconds from the fault to all replicas Running again
    fenced: float | None = None  # seconds from the heal to the old engine stopped
    fault_at: float = 0.0  # time.monotonic() of the fault
    not_ready_at: float | None = None  # time.monotonic() when the host was seen NotReady
    healed_at: float | None = None  # time.monotonic() of the heal
    # Requests the old engine took up between the heal and its stop (a partition's fencing).
    served_after_heal: int | None = None
    notes: list[str] = field(default_factory=list)
    # Engines seen serving one replica at once, at most (1: never two engines under one replica).
    max_engines_per_replica: int = 0


def deployment(engine_args: tuple[str, ...] = ()) -> dict[str, Any]:
    return {
        "kind": "Deployment",
        "name": MODEL,
        "model": MODEL,
        "replicas": REPLICAS,
        "profiles": [
            {
                "name": "cpu",
                "engine": "llama.cpp",
                "cpu": {"cores": 2},  # a whole host each: the replicas are on two hosts, the third is spare
                "context": 256,
                "engineArgs": list(engine_args),
            }
        ],
    }


def start(workdir: Path) -> Lab:
    """A lab of ``HOSTS`` hosts serving ``tiny`` with ``REPLICAS`` replicas, answering at the
    gateway; closed again if any of that fails."""
    lab = Lab(workdir)
    try:
        lab.build(HOSTS)
        lab.start_server()
        for name in lab.hosts:
            lab.start_agent(name)
        model = write_tiny_model(workdir / "models" / "tiny.gguf")
        lab.apply([{"kind": "Model", "name": MODEL, "source": str(model), "format": "gguf"}, deployment()])
        settled(lab)
    except BaseException:
        lab.close()
        raise
    return lab


def serves(lab: Lab) -> bool:
    try:
        response = httpx.post(
            f"{lab.gateway_url}/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
            headers={"Authorization": f"Bearer {lab.api_key}"},
            timeout=10,
            verify=lab.verify or True,
        )
    except httpx.HTTPError:
        return False
    return response.status_code == 200


def ready(lab: Lab) -> dict[str, str] | None:
    """{replica: host} when ``REPLICAS`` replicas are Running, each with exactly one live engine,
    and the gateway answers; else None."""
    running = lab.running(MODEL)
    engines = Counter(lab.engines().values())
    if len(running) == REPLICAS and all(engines[r] == 1 for r in running) and serves(lab):
        return running
    return None


def settled(lab: Lab, timeout: float = RECOVER_TIMEOUT) -> dict[str, str]:
    """Wait until ``ready``; {replica: host}."""
    return wait_until(lambda: ready(lab), timeout, f"{REPLICAS} Running replicas of {MODEL} answering")


class EngineWatch:
    """Samples every host's engines in the background: the most seen serving one replica."""

    def __init__(self, lab: Lab) -> None:
        self.lab = lab
        self.most = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-watch", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            counts = Counter(self.lab.engines().values())
            self.most = max(self.most, *counts.values(), 0)

    def __enter__(self) -> EngineWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


@contextmanager
def under_load(lab: Lab, result: Result, concurrency: int = 2) -> Iterator[None]:
    """Non-streamed requests (``concurrency`` clients) and streamed ones (one client) at the
    gateway, and the engine watch, while the block runs (plus ``SETTLE`` seconds before and
    after); their counts go into ``result``."""
    requests = BackgroundLoad(lab, workers=concurrency)
    streams = BackgroundLoad(lab, workers=1, stream=True)
    with EngineWatch(lab) as watch, requests, streams:
        time.sleep(SETTLE)
        yield
        time.sleep(SETTLE)
    result.requests, result.streams, result.timing = requests.counts, streams.counts, requests.timing
    result.max_engines_per_replica = watch.most


def engine_pid(lab: Lab, replica: str) -> int:
    return next(pid for pid, name in lab.engines().items() if name == replica)


def launched(lab: Lab, host: str, replica: str) -> int:
    """How many requests the replica's engine on ``host`` has taken up so far (its log's lines
    of a slot launching a task)."""
    path = lab.hosts[host].root / "logs" / f"{replica}.log"
    return path.read_text(encoding="utf-8", errors="replace").count("launch_slot_")


def gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state in ("Z", "X")


# --- the scenarios ----------------------------------------------------------------------------


def kill_engine(lab: Lab) -> Result:
    """SIGKILL one replica's llama-server: its agent restarts it; the gateway retries elsewhere."""
    result = Result("kill -9 an engine")
    replica = sorted(settled(lab))[0]
    pid = engine_pid(lab, replica)
    with under_load(lab, result):
        t0 = result.fault_at = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        wait_until(lambda: gone(pid), 10, f"engine {pid} to die")
        wait_until(
            lambda: replica in (ready(lab) or {}) and engine_pid(lab, replica) != pid,
            RECOVER_TIMEOUT,
            f"{replica} restarted",
        )
        result.recovered = time.monotonic() - t0
    return result


def kill_agent(lab: Lab) -> Result:
    """SIGKILL one host's agent, restart it a moment later (as systemd would): its engine died
    with it, and the new agent starts it again."""
    result = Result("kill -9 an agent")
    running = settled(lab)
    replica = sorted(running)[0]
    host = running[replica]
    with under_load(lab, result):
        t0 = result.fault_at = time.monotonic()
        lab.kill_agent(host)
        wait_until(lambda: not lab.engines(host), 10, f"{host}'s engines to die with their agent")
        time.sleep(0.5)
        lab.start_agent(host)
        settled(lab)
        result.recovered = time.monotonic() - t0
    return result


def partition(lab: Lab) -> Result:
    """Cut one host's link under load: NotReady (out of the routes), then Lost (its replica
    re-placed elsewhere under a new name); heal it: it registers again and is fenced, its old
    engine stopped; nothing is ever served under the old replica's name again."""
    result = Result("partition a host")
    running = settled(lab)
    replica = sorted(running)[0]
    host = running[replica]
    pid = engine_pid(lab, replica)
    # More clients than replicas: some would always be waiting on the silent host if the gateway
    # kept sending it requests.
    with under_load(lab, result, concurrency=PARTITION_CLIENTS):
        t0 = result.fault_at = time.monotonic()
        lab.cut(host)
        try:
            wait_until(lambda: lab.node_state(host) != "Ready", 30, f"{host} judged NotReady", interval=0.05)
            result.not_ready_at = time.monotonic()
            result.notes.append(f"NotReady after {result.not_ready_at - t0:.1f} s")
            replaced = wait_until(
                lambda: (r := lab.running(MODEL)) and len(r) == REPLICAS and host not in r.values() and r,
                RECOVER_TIMEOUT,
                f"{replica} re-placed off {host}",
            )
            settled(lab)
            result.recovered = time.monotonic() - t0
            if replica in replaced:
                raise AssertionError(f"{replica} still listed after {host} was Lost")
            if gone(pid):
                result.notes.append("the old engine stopped while partitioned")
        finally:
            before = launched(lab, host, replica)
            t1 = result.healed_at = time.monotonic()
            lab.heal(host)
        wait_until(lambda: gone(pid), 60, f"the old engine of {replica} stopped after the heal")
        result.fenced = time.monotonic() - t1
        result.served_after_heal = launched(lab, host, replica) - before
        if any(r["name"] == replica for r in lab.replicas(MODEL)):
            raise AssertionError(f"{replica} came back after the heal")
        wait_until(lambda: lab.node_state(host) == "Ready", 30, f"{host} Ready again")
    return result


def partition_most(lab: Lab) -> Result:
    """Cut most hosts at once — both replicas' hosts, two of three — as a network fault or the
    control plane's own trouble would: disruption mode. Both are marked NotReady, but past the
    Lost deadline neither is judged Lost and nothing is re-placed on the spare host; the condition
    and the gauge say so. Healed, each is Ready again at the registration it held (no agent
    registers again) and its replica serves from the engine it had all along."""
    result = Result("partition most hosts")
    running = settled(lab)
    cut = sorted(set(running.values()))
    spare = sorted(set(lab.hosts) - set(cut))
    pids = {replica: engine_pid(lab, replica) for replica in running}
    epochs = {host: lab.epoch(host) for host in lab.hosts}
    t0 = result.fault_at = time.monotonic()
    for host in cut:
        lab.cut(host)
    try:
        wait_until(
            lambda: all(lab.node_state(h) == "NotReady" for h in cut), 30, f"{cut} NotReady", interval=0.05
        )
        result.not_ready_at = time.monotonic()
        message, gauge = wait_until(lambda: (d := lab.disruption())[0] and d, 10, "disruption mode")
        result.notes.append(f"NotReady after {result.not_ready_at - t0:.1f} s; DisruptionMode: {message}")
        if gauge != 1.0:
            raise AssertionError(f"fleetserve_disruption_mode is {gauge} in disruption mode")
        # Well past the Lost deadline: nobody Lost, nothing moved, nothing started on the spare.
        time.sleep(max(0.0, LOST_AFTER + 3.0 - (time.monotonic() - t0)))
        states = {h: lab.node_state(h) for h in cut}
        if states != dict.fromkeys(cut, "NotReady"):
            raise AssertionError(f"past the Lost deadline in disruption mode: {states}")
        names = {r["name"]: r["shards"][0]["node"] for r in lab.replicas(MODEL)}
        if names != running:
            raise AssertionError(f"replicas moved in disruption mode: {running} -> {names}")
        if any(lab.engines(h) for h in spare):
            raise AssertionError(f"an engine started on the spare host {spare}: {lab.engines()}")
    finally:
        result.healed_at = time.monotonic()
        for host in cut:
            lab.heal(host)
    wait_until(lambda: all(lab.node_state(h) == "Ready" for h in cut), 30, f"{cut} Ready again")
    result.notes.append(f"Ready again {time.monotonic() - result.healed_at:.1f} s after the heal")
    after = settled(lab)
    result.recovered = time.monotonic() - t0
    if after != running or {r: engine_pid(lab, r) for r in after} != pids:
        raise AssertionError(f"replicas or engines changed: {running} {pids} -> {after}")
    if {host: lab.epoch(host) for host in lab.hosts} != epochs:
        raise AssertionError(f"agents registered again: {epochs} -> {[lab.epoch(h) for h in lab.hosts]}")
    wait_until(lambda: lab.disruption() == (None, 0.0), 10, "disruption mode to end")
    return result


def drain(lab: Lab) -> Result:
    """Drain one host under load: its replica moves elsewhere; uncordoned afterwards."""
    result = Result("drain a host")
    running = settled(lab)
    host = running[sorted(running)[0]]
    with under_load(lab, result):
        t0 = result.fault_at = time.monotonic()
        lab.api("POST", f"/nodes/{host}/drain", json={"reason": "lab drain"})
        wait_until(lambda: (r := ready(lab)) and host not in r.values(), RECOVER_TIMEOUT, f"{host} drained")
        wait_until(lambda: not lab.engines(host), 60, f"{host}'s engines stopped")
        result.recovered = time.monotonic() - t0
    lab.api("POST", f"/nodes/{host}/uncordon")
    return result


def rollout_available() -> bool:
    """Whether this fleetserve has rolling updates (``fleetserve rollout``)."""
    done = subprocess.run([str(FLEETSERVE), "rollout", "--help"], capture_output=True, check=False)
    return done.returncode == 0


def roll(lab: Lab) -> Result:
    """Change the deployment's engine arguments under load: every replica is replaced (surge,
    each new one Ready before an old one drains)."""
    result = Result("roll a deployment")
    old = set(settled(lab))
    with under_load(lab, result):
        t0 = result.fault_at = time.monotonic()
        lab.apply([deployment(engine_args=("--seed", "7"))])
        wait_until(
            lambda: (r := ready(lab)) and not (set(r) & old), RECOVER_TIMEOUT, "every replica replaced"
        )
        result.recovered = time.monotonic() - t0
    return result


SCENARIOS: tuple[Callable[[Lab], Result], ...] = (
    kill_engine,
    kill_agent,
    partition,
    partition_most,
    drain,
    roll,
)
