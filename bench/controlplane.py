"""Control-plane benchmark: a real ``fleetserve server`` under thousands of simulated agents.

Run from the repository root (PostgreSQL on 127.0.0.1:5432 with trust auth, as the tests use)::

    .venv/bin/python bench/controlplane.py                  # 1,000 nodes, 10,000 desired replicas
    .venv/bin/python bench/controlplane.py --quick          # 300 nodes, 3,000 replicas, short phases
    .venv/bin/python bench/controlplane.py --nodes 5000     # the fleet the targets are set for
    .venv/bin/python bench/controlplane.py --baseline main  # and a column of main's server, same run

Columns, each a fresh database: ``postgres`` (a database ``fleetserve_bench_<pid>_<n>`` it creates
and drops), ``postgres, 2 servers`` (a second server started on that same database, half the agents
moved to it, a second steady phase), ``sqlite`` (a file in a temporary directory) and, with
``--baseline REF``, ``postgres @REF``: the server of a git ref (a temporary ``git worktree`` run
with PYTHONPATH at its ``src``) under the same load, for before/after figures in one run.

The fleet and the deployments are the placement benchmark's (``bench/placement.py``: its
``build_snapshot`` and ``build_workload``, its models and profiles): a mixed fleet of NVIDIA, AMD
and CPU nodes, and eight deployments whose replica counts follow its seeded mix.

The agents are coroutines of this one process (uvloop, ``fleetserve.httpclient``: real HTTP on
keep-alive connections), each speaking the agents' API as ``agent/client.py`` does: it enrols with
the join token (the server runs with ``--approve-new-nodes``) and keeps the credential it gets;
then, spread over the interval, a heartbeat every ``--heartbeat`` seconds (every third one a full
status report instead, which doubles as a heartbeat, as the real agent's does, reporting each
assigned replica Running), and one assignments long-poll held open at a time (``wait=20``). Short
requests go through at most ``--connections`` connections (one per 10 agents, at least 64: fewer
would queue the fleet's heartbeats in this process, not in the server); each agent holds one
long-poll.

Phases per column: enrol every node; apply the deployments scaled to 1,000 replicas and time
until every placed replica is in some agent's assignments; scale them to ``--replicas`` and wait
until the placements settle and every placed replica is reported Running (a settled fleet: each
Starting -> Running is a change the whole-fleet readers read again); then a steady phase of
``--steady`` seconds, over which the table's latencies, request rate, reconcile cycles (from the
server's ``/metrics`` histograms, differenced over the phase; p50/p99 interpolated in buckets as
PromQL's histogram_quantile does), CPU and RSS (from /proc; a server's reconciler process apart)
are measured, with the CPU of the PostgreSQL backends serving the benchmark's database and of this
load process. Then the database's rows and size.

Server CPU per call, over the steady phase: ``server CPU ms per request answered`` is the servers'
whole CPU (every thread, from /proc; a reconciler process apart) over the requests this process
had answered in the phase, and holds for any server, ``--baseline`` ones too. Per kind
(heartbeat, status report, long-poll, enrolment) the servers' own always-on accounting
(``server/agents/callcpu.py``, ``fleetserve_agent_call_cpu_seconds_total`` and
``fleetserve_agent_calls_total`` by ``kind`` on ``/metrics``, differenced over the phase and summed
over the servers): each call is charged the CPU of the threads that worked for it, read from
each thread's own clock (its coroutine's steps on the event loop, what it handed to a worker
thread, its even share of a batch's statement). ``charged`` is that over the kind's calls;
then every CPU-second of the servers is put on some call, the CPU charged to no call (uvicorn's
HTTP parsing and writing, the loop's selector, the collector, the whole-fleet readers; its
fraction of the server's CPU is its own row) split evenly over all calls (``even``) or in
proportion to each call's own charge (``prop.``). The targets (``CPU_TARGETS``: 0.3 ms per
heartbeat, 1 ms per status report) are judged against the larger of the two, and printed met or
not. A held long-poll is counted when it ends.

``--profile DIR`` runs each server under ``bench/stacksample.py``, a sampling profiler weighted by
each thread's CPU time; the benchmark marks its phases (enrol, apply, scale, steady), and each phase
is written to ``DIR/COLUMN/server-a.PHASE`` (collapsed stacks) with a ``.top`` summary: CPU per
thread, per kind of work (heartbeat, status report, enrolment, long-poll, credential check,
reconciler, assignment watch, observer, ...) and per frame.

``--nodes 5000 --skip pair,sqlite`` is the fleet the targets are set for: 5,000 agents ask for
about 750 requests a second (500 heartbeats and reports, 250 re-issued long-polls). One server
process answers them with about a quarter of a core in a settled fleet (heartbeats, reports and
credential checks gathered into batches, re-issued polls held without FastAPI:
``server/agents/door.py``; the reconciler in a process of its own). Each server is started
with ``--max-connections`` past the fleet's held polls and this process's connections when
they need more than its default 4,096. That column runs to the end in
about six minutes on the 2-core development machine (enrolment about 85 nodes a second, the
scale-up about 90 s), this process and PostgreSQL sharing the two cores with the server. The
default stays at 1,000 agents so that all three columns (the second server and SQLite too) end
well inside ten minutes. ``--deadline SECONDS`` (and SIGTERM or Ctrl-C) prints the phases that
ended, with how far enrolment got.

The latencies are this process's view, so its own stalls would read as the server's: its
collector is paused over the steady phase (after one last pass, whose held-back requests are let
through before the phase starts: ``SETTLE_SECONDS``), /proc is read on a thread, and the table
shows how late its event loop woke a 10 ms sleeper (``load process loop lag``). ``--trace DIR``
writes every steady-phase request (send time, kind, latency) and every stall of this loop over
20 ms to ``DIR/COLUMN.csv``, to line the slow ones up with what the server was doing then.

This prints figures; it asserts nothing (the machine may be shared and noisy).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import psycopg
import uvloop
import yaml
from prometheus_client.parser import text_string_to_metric_families

from fleetserve.httpclient import HttpClient, Origin, UpstreamError
from fleetserve.snapshot import ClusterSnapshot
from fleetserve.spec.resources import Deployment

sys.path.insert(0, str(Path(__file__).resolve().parent))
import contextlib

import placement as fleetgen

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
POSTGRES = os.environ.get("FLEETSERVE_BENCH_POSTGRES", "postgresql://postgres@127.0.0.1:5432/test")
API = "/api/v1/agent"
POLL_WAIT = 20.0
MAX_REPLICAS = 10_000  # a deployment's replica count is at most this (spec/base.py)
MAX_CONNECTIONS = 4096  # the server's --max-connections default (listener.py); raised past it


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def request_bytes(method: str, path: str, port: int, token: str, body: Any) -> bytes:
    """One HTTP/1.1 request, JSON body (None: none)."""
    payload = b"" if body is None else json.dumps(body).encode()
    head = (
        f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAuthorization: Bearer {token}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
    )
    return head.encode() + payload


def quantile(sorted_values: Sequence[float], q: float) -> float:
    return fleetgen.percentile(sorted_values, q)


# --- documents ------------------------------------------------------------------------------------


def spec_doc(kind: str, resource: Any) -> dict[str, Any]:
    return {"kind": kind, **resource.model_dump(mode="json", by_alias=True, exclude_none=True)}


def model_docs() -> list[dict[str, Any]]:
    """Model documents whose declared facts are the placement benchmark's ``MODELS``."""
    from fleetserve.spec.resources import Model

    # A ref from before models had alternates (``--baseline`` in bench/reconcile.py, whose columns
    # import the ref's fleetserve) refuses the field; its vLLM loaded GGUF weights as well.
    alternates = "alternates" in Model.model_fields
    out = []
    for m in fleetgen.MODELS.values():
        # kv bytes per token = layers * kvHeads * 2 * headDim * 2 (f16): one head of 128.
        layers = max(1, m.kv_bytes_per_token // (2 * 128 * 2))
        shape = {"layers": layers, "kvHeads": 1, "headDim": 128, "contextLength": m.context_length}
        primary = "gguf" if m.name.endswith("gguf") else "safetensors"
        other = "safetensors" if primary == "gguf" else "gguf"
        doc: dict[str, Any] = {
            "kind": "Model",
            "name": m.name,
            "source": f"hf://bench/{m.name}",
            "format": primary,
            "size": m.weight_bytes,
            "architecture": shape,
        }
        if alternates:
            # The same weights in the other format: the deployments' profiles run llama.cpp and
            # vLLM alike, and each engine serves the format it loads.
            doc["alternates"] = [
                {
                    "format": other,
                    "source": f"hf://bench/{m.name}-{other}",
                    "size": m.weight_bytes,
                    "architecture": shape,
                }
            ]
        out.append(doc)
    return out


def deployment_docs(snapshot: ClusterSnapshot, total: int, seed: int) -> list[dict[str, Any]]:
    """The placement benchmark's deployments, replica counts from its seeded mix of ``total``; a
    count above a deployment's limit (``MAX_REPLICAS``) is split over copies named ``NAME-2``..."""
    counts: dict[str, int] = {}
    for request in fleetgen.build_workload(snapshot, total, seed):
        counts[request.deployment] = counts.get(request.deployment, 0) + 1
    docs = []
    for name, model, _, profiles in fleetgen.DEPLOYMENTS:
        left, copy = counts.get(name, 0), 1
        while True:
            part = min(left, MAX_REPLICAS)
            named = name if copy == 1 else f"{name}-{copy}"
            docs.append(
                spec_doc("Deployment", Deployment(name=named, model=model, replicas=part, profiles=profiles))
            )
            left -= part
            copy += 1
            if left <= 0:
                break
    return docs


# --- the server -----------------------------------------------------------------------------------


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    port: int
    log: Path
    profile: Path | None = None  # the stack sampler's output (--profile)

    def mark(self, phase: str) -> None:
        """Under --profile: end the sampler's current section; the next is ``phase``."""
        if self.profile is not None and self.proc.poll() is None:
            (self.profile.parent / f"{self.profile.name}.phase").write_text(phase)
            self.proc.send_signal(signal.SIGUSR1)

    @property
    def origin(self) -> Origin:
        return Origin("127.0.0.1", self.port)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def start_server(
    url: str,
    work: Path,
    name: str,
    token_file: Path,
    src: Path | None,
    profile: Path | None = None,
    connections: int = 0,
) -> Server:
    port = free_port()
    env = dict(os.environ)
    if src is not None:  # the baseline: another checkout's package first
        env["PYTHONPATH"] = str(src)
    log = work / f"{name}.log"
    stacks = None
    if profile is None:
        launch = [PYTHON, "-c", "from fleetserve.cli.main import app; app()"]
    else:  # under the stack sampler, which writes where its CPU went per phase
        profile.mkdir(parents=True, exist_ok=True)
        stacks = profile / name
        launch = [PYTHON, str(Path(__file__).resolve().parent / "stacksample.py"), str(stacks), "--"]
    args = [
        *launch, "server",
        "--database-url", url, "--port", str(port), "--approve-new-nodes",
        "--token-file", str(token_file), "--models-dir", str(work / "models"),
        "--not-ready-after", "60", "--lost-after", "300", "--log-level", "warning",
    ]  # fmt: skip
    if connections > MAX_CONNECTIONS:  # every agent's held poll and the short requests' pool
        args += ["--max-connections", str(connections)]
    with log.open("wb") as out:  # the child keeps its own descriptor
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, cwd=work, env=env)
    server = Server(proc, port, log, stacks)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server {name} exited with {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return server
        except OSError:
            time.sleep(0.2)
    server.stop()
    raise RuntimeError(f"server {name} did not listen within 90 s")


def create_database() -> tuple[str, Callable[[], None]]:
    """A fresh PostgreSQL database and the function that drops it."""
    name = f"fleetserve_bench_{os.getpid()}_{random.randrange(10**6)}"
    with psycopg.connect(POSTGRES, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    base = POSTGRES.rsplit("/", 1)[0]

    def drop() -> None:
        with psycopg.connect(POSTGRES, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    return f"{base}/{name}", drop


def database_figures(url: str, sqlite_file: Path | None) -> tuple[int, int, str]:
    """(rows in all tables, bytes on disk, the biggest tables) of the benchmark's database."""
    from sqlalchemy import func, inspect, select

    from fleetserve.store.db import make_engine
    from fleetserve.store.tables import Base

    engine = make_engine(url)
    counts: dict[str, int] = {}
    try:
        with engine.connect() as conn:
            present = set(inspect(conn).get_table_names())  # a baseline's schema may lack new tables
            for table in (t for t in Base.metadata.sorted_tables if t.name in present):
                counts[table.name] = int(conn.execute(select(func.count()).select_from(table)).scalar() or 0)
            if sqlite_file is None:
                size = int(conn.exec_driver_sql("SELECT pg_database_size(current_database())").scalar() or 0)
    finally:
        engine.dispose()
    if sqlite_file is not None:
        size = sum(p.stat().st_size for p in sqlite_file.parent.glob(sqlite_file.name + "*"))
    top = sorted(counts.items(), key=lambda kv: -kv[1])[:3]
    return sum(counts.values()), size, ", ".join(f"{k} {v:,}" for k, v in top)


# --- metrics of the server ------------------------------------------------------------------------

Buckets = dict[str, list[tuple[float, float]]]  # histogram (with its phase label) -> cumulative buckets


def read_histograms(text: str) -> tuple[Buckets, dict[str, tuple[float, float]]]:
    """The reconcile histograms of a /metrics text: buckets, and (sum, count) per series; the
    count of quiet cycles (``fleetserve_reconcile_quiet_total``, absent before it existed) as the
    series ``quiet``."""
    buckets: Buckets = {}
    totals: dict[str, tuple[float, float]] = {}
    for family in text_string_to_metric_families(text):
        if family.name == "fleetserve_reconcile_quiet":
            totals["quiet"] = (0.0, sum(s.value for s in family.samples if s.name.endswith("_total")))
        if family.name not in ("fleetserve_reconcile_seconds", "fleetserve_reconcile_phase_seconds"):
            continue
        for s in family.samples:
            key = family.name + (f"/{s.labels['phase']}" if "phase" in s.labels else "")
            if s.name.endswith("_bucket"):
                le = float("inf") if s.labels["le"] in ("+Inf", "inf") else float(s.labels["le"])
                buckets.setdefault(key, []).append((le, s.value))
            elif s.name.endswith("_sum"):
                totals[key] = (s.value, totals.get(key, (0.0, 0.0))[1])
            elif s.name.endswith("_count"):
                totals[key] = (totals.get(key, (0.0, 0.0))[0], s.value)
    return buckets, totals


# The agents' calls the server accounts (``fleetserve_agent_calls_total{kind}``), as rows name them.
CALL_KINDS = {
    "heartbeat": "heartbeat",
    "status": "status report",
    "assignments": "long-poll",
    "register": "enrolment",
}


def call_counters(text: str) -> dict[str, tuple[float, float]]:
    """Per call kind, (CPU seconds charged, calls) of a /metrics text (empty: a server without them)."""
    seconds: dict[str, float] = {}
    calls: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        into = {"fleetserve_agent_call_cpu_seconds": seconds, "fleetserve_agent_calls": calls}.get(
            family.name
        )
        if into is None:
            continue
        for s in family.samples:
            if s.name.endswith("_total"):
                into[s.labels["kind"]] = s.value
    return {kind: (seconds.get(kind, 0.0), calls[kind]) for kind in calls}


# Whole-process server CPU per call the issue sets (issue 34): ms per heartbeat, per status report.
CPU_TARGETS = {"heartbeat": 0.3, "status": 1.0}


def whole_process(
    charged: dict[str, tuple[float, float]], cpu: float
) -> dict[str, tuple[float, float, float]]:
    """Per kind, (charged, even, proportional) server CPU seconds per call: what the kind's calls
    were charged (``callcpu``), then with all of the servers' CPU (``cpu``) charged to calls —
    what no call was charged for either split evenly over every call (``even``) or in
    proportion to what each call was charged (``proportional``). Each of the two puts every
    CPU-second of the servers on some call; neither is exact (uvicorn's parsing costs about
    the same per call, the collector and background readers follow no call), so a target is
    judged against the larger of the two."""
    all_calls = sum(c for _, c in charged.values())
    all_charged = sum(s for s, _ in charged.values())
    rest = cpu - all_charged
    out = {}
    for kind, (seconds, calls) in charged.items():
        if not calls:
            continue
        own = seconds / calls
        even = own + (rest / all_calls if all_calls else 0.0)
        proportional = own * cpu / all_charged if all_charged else even
        out[kind] = (own, even, proportional)
    return out


def call_cpu_figures(
    f: dict[str, str], cpu: float, requests: int, before: Sequence[str], after: Sequence[str]
) -> None:
    """Server CPU per call: the servers' whole CPU (``cpu``, from /proc) over the ``requests``
    answered, and per kind what the servers charged to each call (``callcpu``), then with all of
    the servers' CPU charged to calls (``whole_process``), and whether the kind meets its target
    (``CPU_TARGETS``, against the larger whole-process figure)."""
    f["server CPU ms per request answered"] = f"{cpu / requests * 1e3:.3f}" if requests else "-"
    charged: dict[str, list[float]] = {}
    for b, a in zip(before, after, strict=True):
        was = call_counters(b)
        for kind, (seconds, calls) in call_counters(a).items():
            s0, c0 = was.get(kind, (0.0, 0.0))
            total = charged.setdefault(kind, [0.0, 0.0])
            total[0] += seconds - s0
            total[1] += calls - c0
    if not charged:
        return  # a server from before the accounting
    rest = cpu - sum(s for s, _ in charged.values())
    per_call = whole_process({k: (s, c) for k, (s, c) in charged.items()}, cpu)
    for kind, label in CALL_KINDS.items():
        calls = charged.get(kind, (0.0, 0.0))[1]
        figures = per_call.get(kind)
        f[f"CPU ms per {label}: charged / even / prop."] = (
            " / ".join(f"{x * 1e3:.3f}" for x in figures) + f" ({calls:,.0f})" if figures else "-"
        )
    for kind, target in CPU_TARGETS.items():
        figures = per_call.get(kind)
        whole = max(figures[1:]) * 1e3 if figures else None
        f[f"{CALL_KINDS[kind]}: whole-process CPU <= {target:g} ms"] = (
            "-" if whole is None else f"{'met' if whole <= target else 'NOT met'} ({whole:.3f} ms)"
        )
    f["server CPU charged to no call"] = f"{rest / cpu:.0%}" if cpu else "-"


def bucket_quantile(q: float, cumulative: list[tuple[float, float]]) -> float | None:
    """histogram_quantile: linear interpolation within the bucket the rank falls in."""
    cumulative = sorted(cumulative)
    if not cumulative or cumulative[-1][1] <= 0:
        return None
    rank = q * cumulative[-1][1]
    lower, below = 0.0, 0.0
    for le, count in cumulative:
        if count >= rank:
            if le == float("inf"):
                return lower
            return lower + (le - lower) * ((rank - below) / (count - below) if count > below else 0.0)
        lower, below = le, count
    return lower


def cycle_figures(f: dict[str, str], before: str | None, texts: Sequence[str], phase: str) -> None:
    """Reconcile cycles between ``before`` (a /metrics text; None: over the servers' whole life,
    as when two ran and either may have led) and ``texts`` (every server's, now): the leader's
    full cycles split by phase, and how many were quiet (nothing changed: nothing read)."""
    b1: Buckets = {}
    s1: dict[str, tuple[float, float]] = {}
    for text in texts:  # the leader: whichever server counted the most cycles
        bk, sm = read_histograms(text)
        ran = sm.get("fleetserve_reconcile_seconds", (0, 0))[1] + sm.get("quiet", (0, 0))[1]
        if ran > s1.get("fleetserve_reconcile_seconds", (0, 0))[1] + s1.get("quiet", (0, 0))[1]:
            b1, s1 = bk, sm
    b0, s0 = read_histograms(before) if before is not None else ({}, {})
    for key, label in (
        ("fleetserve_reconcile_seconds", "reconcile cycle"),
        ("fleetserve_reconcile_phase_seconds/snapshot", "  snapshot"),
        ("fleetserve_reconcile_phase_seconds/plan", "  plan"),
        ("fleetserve_reconcile_phase_seconds/commit", "  commit"),
    ):
        name = f"{label}{phase} p50 / p99 s (mean)"
        if key not in b1:
            f[name] = "-"
            continue
        start = dict(b0.get(key, []))
        diff = [(le, count - start.get(le, 0.0)) for le, count in b1[key]]
        total_sum = s1[key][0] - s0.get(key, (0.0, 0.0))[0]
        count = s1[key][1] - s0.get(key, (0.0, 0.0))[1]
        p50, p99 = bucket_quantile(0.5, diff), bucket_quantile(0.99, diff)
        if p50 is None or p99 is None or count <= 0:
            f[name] = "-"
        else:
            f[name] = f"{p50:.2f} / {p99:.2f} ({total_sum / count:.2f})"
        if label == "reconcile cycle":
            quiet = s1["quiet"][1] - s0.get("quiet", (0.0, 0.0))[1] if "quiet" in s1 else None
            f[f"reconcile cycles{phase}: full / quiet"] = f"{count:,.0f} / " + (
                "-" if quiet is None else f"{quiet:,.0f}"
            )


# --- the agents -----------------------------------------------------------------------------------


@dataclass
class Stats:
    """What the load saw: latencies per request kind while recording, counts, failures."""

    recording: bool = False
    latencies: dict[str, list[float]] = field(default_factory=dict)
    requests: int = 0
    failures: dict[str, int] = field(default_factory=dict)
    first_error: dict[str, str] = field(default_factory=dict)
    reregistered: int = 0
    since: float = 0.0  # perf_counter: requests sent before it are not recorded
    trace: list[tuple[float, str, float]] | None = None  # (sent, unix s; kind; seconds): --trace

    def record(self, kind: str, seconds: float, sent: float) -> None:
        if not self.recording:
            return
        self.requests += 1  # answered in the phase: the rate counts it wherever it was sent
        if sent >= self.since or kind == "long-poll":  # a held poll's wait is no latency
            self.latencies.setdefault(kind, []).append(seconds)
            if self.trace is not None:
                self.trace.append((time.time() - seconds, kind, seconds))

    def fail(self, kind: str, error: BaseException) -> None:
        self.failures[kind] = self.failures.get(kind, 0) + 1
        self.first_error.setdefault(kind, f"{type(error).__name__}: {error}"[:300])


SETTLE_SECONDS = 3.0  # after the load's last collection, before a steady phase records (steady())


class LoopLag:
    """How late this process's event loop wakes a 10 ms sleeper: a stall here (a collection, a
    blocking read) delays every simulated agent's request and reads as server latency."""

    TICK = 0.01

    def __init__(self) -> None:
        self.late: list[float] = []
        self.stalls: list[tuple[float, str, float]] = []  # over 20 ms, for --trace: (began, kind, s)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            began = time.perf_counter()
            await asyncio.sleep(self.TICK)
            late = max(0.0, time.perf_counter() - began - self.TICK)
            self.late.append(late)
            if late > 0.02:
                self.stalls.append((time.time() - late, "load-loop-stall", late))

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    def figure(self) -> str:
        late = sorted(self.late)
        return f"{quantile(late, 99) * 1e3:.1f} / {late[-1] * 1e3:.1f}" if late else "-"


class StaleRegistration(Exception):
    """The server answered 409: register again."""


class Fleet:
    """Simulated agents over one HTTP client: enrolment, heartbeats, reports, long-polls."""

    def __init__(self, nodes: Sequence[dict[str, Any]], join_token: str, origin: Origin, connections: int):
        self.nodes = nodes
        self.join_token = join_token
        self.origins = [origin] * len(nodes)
        self.client = HttpClient(max_idle_per_origin=len(nodes) + connections)
        self.short = asyncio.Semaphore(connections)
        # Enrolments have their own connections: a thousand waiting to enrol must not hold back
        # the heartbeats of the agents already enrolled (real agents do not queue behind each other).
        self.enrolling = asyncio.Semaphore(max(1, connections // 2))
        self.credentials: list[str] = [""] * len(nodes)
        self.epochs = [0] * len(nodes)
        self.revisions: list[str | None] = [None] * len(nodes)
        self.assigned: list[list[str]] = [[] for _ in nodes]
        self.stats = Stats()
        self.changed = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    def assigned_total(self) -> int:
        return sum(len(a) for a in self.assigned)

    async def call(
        self, i: int, method: str, path: str, body: Any, token: str, kind: str, timeout: float = 30.0
    ) -> Any:
        origin = self.origins[i]
        request = request_bytes(method, API + path, origin.port, token, body)
        began = time.perf_counter()
        response = await self.client.request(origin, request, timeout)
        data = await response.read()
        took = time.perf_counter() - began
        if response.status == 409:
            raise StaleRegistration()
        if response.status >= 400:
            raise RuntimeError(f"{method} {path}: {response.status} {data[:300]!r}")
        self.stats.record(kind, took, began)
        return json.loads(data)

    async def register(self, i: int) -> None:
        token = self.credentials[i] or self.join_token
        async with self.enrolling:
            got = await self.call(i, "POST", "/register", self.nodes[i], token, "register", 120.0)
        if got.get("credential"):
            self.credentials[i] = got["credential"]
        self.epochs[i] = got["epoch"]
        self.revisions[i] = got["revision"]
        self.assigned[i] = [a["replica"]["name"] for a in got["assignments"]]

    async def enrol_all(self, interval: float, report_every: int) -> None:
        """Enrol every node (bounded by the connection limit), each agent starting its heartbeats
        and long-poll as soon as it has enrolled, as a real one does."""

        async def one(i: int) -> None:
            # A real agent whose server does not answer tries again, backing off (to 30 s).
            delay = 1.0
            while True:
                try:
                    await self.register(i)
                    break
                except (UpstreamError, OSError) as exc:
                    self.stats.fail("register", exc)
                    await asyncio.sleep(delay * (0.5 + random.random()))
                    delay = min(2 * delay, 30.0)
            self.start(i, interval, report_every)

        await asyncio.gather(*(one(i) for i in range(len(self.nodes))))

    async def _beats(self, i: int, interval: float, report_every: int) -> None:
        name = self.nodes[i]["name"]
        await asyncio.sleep(random.random() * interval)  # spread over the interval
        n = 0
        while True:
            n += 1
            try:
                async with self.short:
                    if n % report_every == 0:
                        report = {
                            "node": name,
                            "epoch": self.epochs[i],
                            "replicas": {r: {"state": "Running"} for r in self.assigned[i]},
                        }
                        await self.call(i, "POST", "/status", report, self.credentials[i], "report")
                    else:
                        beat = {"node": name, "epoch": self.epochs[i]}
                        await self.call(i, "POST", "/heartbeat", beat, self.credentials[i], "heartbeat")
            except StaleRegistration:
                self.stats.reregistered += 1
                await self._safe_register(i)
            except (UpstreamError, RuntimeError, OSError) as exc:
                self.stats.fail("report" if n % report_every == 0 else "heartbeat", exc)
            await asyncio.sleep(interval)

    async def _safe_register(self, i: int) -> None:
        try:
            await self.register(i)
        except (UpstreamError, RuntimeError, OSError, StaleRegistration) as exc:
            self.stats.fail("register", exc)

    async def _polls(self, i: int) -> None:
        name = self.nodes[i]["name"]
        await asyncio.sleep(random.random() * 2)
        while True:
            query = f"/assignments?node={name}&epoch={self.epochs[i]}&wait={POLL_WAIT:g}"
            if self.revisions[i]:
                query += f"&since={self.revisions[i]}"
            try:
                got = await self.call(i, "GET", query, None, self.credentials[i], "long-poll", POLL_WAIT + 30)
                if got["revision"] != self.revisions[i]:
                    self.revisions[i] = got["revision"]
                    self.assigned[i] = [a["replica"]["name"] for a in got["assignments"]]
                    self.changed.set()
            except StaleRegistration:
                self.stats.reregistered += 1
                await self._safe_register(i)
            except (UpstreamError, RuntimeError, OSError) as exc:
                self.stats.fail("long-poll", exc)
                await asyncio.sleep(1)

    def start(self, i: int, interval: float, report_every: int) -> None:
        self._tasks.append(asyncio.create_task(self._beats(i, interval, report_every)))
        self._tasks.append(asyncio.create_task(self._polls(i)))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        await self.client.aclose()


class Shards:
    """How many replica shards the benchmark's database holds: what the reconciler has placed so
    far (one assignment entry per shard, on the shard's node)."""

    def __init__(self, url: str) -> None:
        from fleetserve.store.db import make_engine

        self.engine = make_engine(url)

    def count(self) -> int:
        from sqlalchemy import func, select

        from fleetserve.store.tables import ReplicaShardRow

        with self.engine.connect() as conn:
            return int(conn.execute(select(func.count()).select_from(ReplicaShardRow)).scalar() or 0)

    def not_running(self) -> int:
        """Replicas placed but not yet reported Running by their agents."""
        from sqlalchemy import func, select

        from fleetserve.store.tables import ReplicaRow

        with self.engine.connect() as conn:
            query = select(func.count()).select_from(ReplicaRow).where(ReplicaRow.state != "Running")
            return int(conn.execute(query).scalar() or 0)

    def close(self) -> None:
        self.engine.dispose()


async def all_running(shards: Shards, timeout: float) -> float:
    """Wait until every placed replica is reported Running (agents report every third beat, so
    up to 30 s after the last assignment); the seconds it took."""
    began = time.perf_counter()
    while time.perf_counter() - began < timeout:
        if await asyncio.to_thread(shards.not_running) == 0:
            break
        await asyncio.sleep(1.0)
    else:
        left = await asyncio.to_thread(shards.not_running)
        print(f"  {left:,} replicas still not Running after {timeout:.0f} s", file=sys.stderr, flush=True)
    return time.perf_counter() - began


async def settle(
    fleet: Fleet, shards: Shards, quiet: float, timeout: float, began: float
) -> tuple[float, int]:
    """Wait until the placements have settled: the store's shard count and the agents' assigned
    total equal, and neither changed for ``quiet`` seconds (a reconcile cycle still computing
    shows no change in either, so equal totals alone do not end it); (seconds from ``began`` to
    the last change, total)."""
    last: tuple[int, int] = (-1, -1)
    last_change = began
    while time.perf_counter() - began < timeout:
        now_seen = (fleet.assigned_total(), await asyncio.to_thread(shards.count))
        now = time.perf_counter()
        if now_seen != last:
            last, last_change = now_seen, now
        elif now_seen[0] == now_seen[1] > 0 and now - last_change >= quiet:
            return last_change - began, now_seen[0]
        fleet.changed.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(fleet.changed.wait(), timeout=0.5)
    print(f"  not settled in {timeout:.0f} s: (assigned, placed) {last}", file=sys.stderr, flush=True)
    return time.perf_counter() - began, fleet.assigned_total()


# --- one column -----------------------------------------------------------------------------------


@dataclass
class Column:
    label: str
    figures: dict[str, str] = field(default_factory=dict)


def cpu_of(procs: Sequence[psutil.Process]) -> float:
    total = 0.0
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):  # a reconciler process started again
            t = p.cpu_times()
            total += t.user + t.system
    return total


def rss_of(procs: Sequence[psutil.Process]) -> float:
    total = 0
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            total += p.memory_info().rss
    return total / 2**20


async def admin(origin: Origin, token: str, method: str, path: str, body: Any) -> Any:
    client = HttpClient()
    request = request_bytes(method, f"/api/v1{path}", origin.port, token, body)
    try:
        response = await client.request(origin, request, 300)
        data = await response.read()
        if response.status >= 400:
            raise RuntimeError(f"{method} {path}: {response.status} {data[:500]!r}")
        return json.loads(data)
    finally:
        await client.aclose()


async def metrics_text(origin: Origin) -> str:
    """The server's /metrics; empty (figures shown as '-') when it does not answer in 60 s."""
    client = HttpClient()
    try:
        request = f"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1:{origin.port}\r\n\r\n".encode()
        response = await client.request(origin, request, 60)
        return (await response.read()).decode()
    except UpstreamError as exc:
        print(f"  /metrics of :{origin.port} did not answer: {exc}", file=sys.stderr, flush=True)
        return ""
    finally:
        await client.aclose()


def backend_cpu(database: str | None) -> dict[int, float]:
    """Per PostgreSQL backend serving ``database`` (its process title names it), its CPU seconds."""
    out: dict[int, float] = {}
    if database is None:
        return out
    for p in psutil.process_iter(["cmdline"]):
        title = " ".join(p.info["cmdline"] or ())
        if title.startswith("postgres:") and f" {database} " in title:
            with contextlib.suppress(psutil.Error):
                t = p.cpu_times()
                out[p.pid] = t.user + t.system
    return out


async def steady(
    fleet: Fleet,
    servers: Sequence[Server],
    seconds: float,
    col: Column,
    database: str | None,
    trace: Path | None = None,
) -> None:
    """The steady phase: latencies, request rate, reconcile cycles, CPU and RSS; under --trace,
    every request's send time, kind and latency written to ``trace`` (CSV)."""
    procs = [psutil.Process(s.proc.pid) for s in servers]
    # A server on PostgreSQL runs its reconciler in a process of its own (``--reconciler``).
    children = [c for p in procs for c in p.children(recursive=True)]
    me = psutil.Process()
    # This process's own collector is paused over the phase, its long-lived agents' state frozen
    # out of it: its full passes (0.6 to 0.8 s at 5,000 agents) stalled every simulated agent
    # and were read as server latency. That last pass still stalls this loop once, and the
    # requests it held back then arrive at the server at once: the phase starts when they are
    # answered (SETTLE_SECONDS later) and records only requests sent after it. Readings of /proc
    # run on a thread so that they do not stall the simulated agents either.
    gc.collect()
    gc.freeze()
    gc.disable()
    lag = LoopLag()
    lag.start()
    try:
        await asyncio.sleep(SETTLE_SECONDS)
        cpu0, child0, load0, db0 = await asyncio.to_thread(
            lambda: (cpu_of(procs), cpu_of(children), cpu_of([me]), backend_cpu(database))
        )
        before_texts = [await metrics_text(s.origin) for s in servers]
        before_text = before_texts[0]
        t0 = time.perf_counter()
        lag.late.clear()
        lag.stalls.clear()
        fleet.stats = Stats(
            recording=True, since=t0, reregistered=fleet.stats.reregistered, trace=[] if trace else None
        )
        rss: list[float] = []
        child_rss: list[float] = []
        end = t0 + seconds
        while time.perf_counter() < end:
            rss.append(await asyncio.to_thread(rss_of, procs))
            child_rss.append(await asyncio.to_thread(rss_of, children))
            await asyncio.sleep(min(2.0, max(0.0, end - time.perf_counter())))
        elapsed = time.perf_counter() - t0
        fleet.stats.recording = False
    finally:
        lag.stop()
        gc.enable()
        gc.unfreeze()
    cpu1, child1, load1, db1 = await asyncio.to_thread(
        lambda: (cpu_of(procs), cpu_of(children), cpu_of([me]), backend_cpu(database))
    )
    cpu, child_cpu, load = cpu1 - cpu0, child1 - child0, load1 - load0
    # Backends that ended in the phase are not seen; those that began count from zero.
    database_cpu = sum(t - db0.get(pid, 0.0) for pid, t in db1.items())
    rss.append(rss_of(procs))
    child_rss.append(rss_of(children))
    if trace is not None and fleet.stats.trace is not None:
        trace.parent.mkdir(parents=True, exist_ok=True)
        with trace.open("w") as out:
            out.write("sent_unix_s,kind,ms\n")
            lines = sorted(fleet.stats.trace + lag.stalls)
            out.writelines(f"{t:.4f},{k},{v * 1e3:.2f}\n" for t, k, v in lines)
    # The leader's histograms: whichever server holds the lease reconciles.
    texts = [await metrics_text(s.origin) for s in servers]
    stats = fleet.stats
    f = col.figures
    for kind in ("heartbeat", "report", "long-poll"):
        values = sorted(stats.latencies.get(kind, []))
        if kind == "long-poll":
            f[f"{kind}s answered"] = f"{len(values):,}"
            continue
        f[f"{kind} p50 / p99 ms"] = (
            f"{quantile(values, 50) * 1e3:.1f} / {quantile(values, 99) * 1e3:.1f}" if values else "-"
        )
        f[f"{kind}s sent"] = f"{len(values):,}"
    f["failed requests"] = ", ".join(f"{k} {v}" for k, v in sorted(stats.failures.items())) or "0"
    for kind, error in sorted(stats.first_error.items()):
        print(f"  [{col.label}] first {kind} failure: {error}", file=sys.stderr, flush=True)
    f["requests/s sustained"] = f"{stats.requests / elapsed:,.0f}"
    cycle_figures(f, None if servers[0] is not servers[-1] else before_text, texts, "")
    f["server CPU (cores busy)"] = f"{cpu / elapsed:.2f}"
    call_cpu_figures(f, cpu, stats.requests, before_texts, texts)
    f["reconciler process CPU (cores)"] = f"{child_cpu / elapsed:.2f}" if children else "-"
    f["database CPU (cores busy)"] = f"{database_cpu / elapsed:.2f}" if database else "-"
    f["load process CPU (cores busy)"] = f"{load / elapsed:.2f}"
    f["load process loop lag p99 / max ms"] = lag.figure()
    f["server RSS MiB start/end"] = f"{rss[0]:,.0f} / {rss[-1]:,.0f}"
    f["reconciler process RSS MiB"] = f"{child_rss[0]:,.0f} / {child_rss[-1]:,.0f}" if children else "-"
    f["re-registrations (409)"] = str(stats.reregistered)


def write_documents(snapshot: ClusterSnapshot) -> list[dict[str, Any]]:
    docs = [spec_doc("DeviceClass", c) for c in snapshot.classes.values()]
    docs += [spec_doc("Fabric", f) for f in snapshot.fabrics.values()]
    return docs + model_docs()


def trace_file(args: argparse.Namespace, label: str) -> Path | None:
    """Where --trace writes a column's steady-phase requests (None without --trace)."""
    if args.trace is None:
        return None
    return Path(args.trace).resolve() / ("".join(c if c.isalnum() else "-" for c in label) + ".csv")


async def run_column(
    label: str,
    url: str,
    work: Path,
    snapshot: ClusterSnapshot,
    args: argparse.Namespace,
    src: Path | None,
    sqlite_file: Path | None,
    pair: Column | None,
    col: Column,
) -> None:
    """Run one column, writing its figures into ``col`` as each phase ends (a run stopped early
    still shows the phases it finished)."""
    token_file = work / "tokens.yaml"
    database = None if sqlite_file is not None else url.rsplit("/", 1)[1]
    profile = None
    if args.profile is not None:
        profile = Path(args.profile).resolve() / "".join(c if c.isalnum() else "-" for c in label)
    # Every agent holds a poll open beside the short requests' connections.
    room = args.nodes + args.connections + 64
    servers = [start_server(url, work, "server-a", token_file, src, profile, room)]
    fleet: Fleet | None = None
    shards = Shards(url)
    try:
        tokens = yaml.safe_load(token_file.read_text())
        origin = servers[0].origin
        await admin(origin, tokens["admin"], "POST", "/apply", {"documents": write_documents(snapshot)})
        nodes = [
            n.model_dump(mode="json", by_alias=True, exclude={"state"}, exclude_none=True)
            for n in snapshot.nodes
        ]
        fleet = Fleet(nodes, tokens["join"], origin, args.connections)
        fleet.stats.recording = True
        print(f"  [{label}] enrolling {len(nodes):,} nodes ...", file=sys.stderr, flush=True)
        servers[0].mark("enrol")
        began = time.perf_counter()
        try:
            await fleet.enrol_all(args.heartbeat, 3)
        finally:  # stopped while enrolling: how far it got
            took = time.perf_counter() - began
            reg = sorted(fleet.stats.latencies.get("register", []))
            col.figures["enrolment: nodes/s"] = f"{len(reg) / took:,.0f}" + (
                f" ({len(reg):,} of {len(nodes):,} enrolled in {took:.0f} s)" if len(reg) < len(nodes) else ""
            )
            if reg:
                col.figures["enrolment p50 / p99 ms"] = (
                    f"{quantile(reg, 50) * 1e3:.1f} / {quantile(reg, 99) * 1e3:.1f}"
                )
            retried = fleet.stats.failures.get("register", 0)
            if retried:
                col.figures["enrolment: attempts failed, tried again"] = (
                    f"{retried:,} ({fleet.stats.first_error['register'][:40]})"
                )
        fleet.stats.recording = False
        await asyncio.sleep(2)

        print(f"  [{label}] apply {args.apply:,} replicas ...", file=sys.stderr, flush=True)
        servers[0].mark("apply")
        began = time.perf_counter()
        await admin(
            origin,
            tokens["admin"],
            "POST",
            "/apply",
            {"documents": deployment_docs(snapshot, args.apply, args.seed)},
        )
        # Until the last replica placed is in its agent's assignments (some of a mixed fleet's
        # replicas may not fit: the figure says how many were placed).
        seconds, total = await settle(fleet, shards, min(args.quiet, 8.0), args.settle_timeout, began)
        col.figures[f"apply {args.apply:,} -> all assigned s"] = f"{seconds:.1f} ({total:,} placed)"

        print(f"  [{label}] scale to {args.replicas:,} replicas ...", file=sys.stderr, flush=True)
        servers[0].mark("scale")
        before_scale = await metrics_text(origin)
        began = time.perf_counter()
        await admin(
            origin,
            tokens["admin"],
            "POST",
            "/apply",
            {"documents": deployment_docs(snapshot, args.replicas, args.seed)},
        )
        seconds, total = await settle(fleet, shards, args.quiet, args.settle_timeout, began)
        col.figures[f"scale to {args.replicas:,}: placed"] = f"{total:,} in {seconds:.0f} s"
        cycle_figures(col.figures, before_scale, [await metrics_text(origin)], " in scale-up")
        # Steady means settled: every replica placed and reported Running (each Starting ->
        # Running is a change that the whole-fleet readers read again).
        waited = await all_running(shards, args.settle_timeout)
        col.figures["then all reported Running s"] = f"{waited:.0f}"

        print(f"  [{label}] steady {args.steady:.0f} s ...", file=sys.stderr, flush=True)
        servers[0].mark("steady")
        await steady(fleet, servers, args.steady, col, database, trace_file(args, label))
        servers[0].mark("after-steady")

        if pair is not None:
            print(
                f"  [{label}] a second server, half the agents moved to it ...", file=sys.stderr, flush=True
            )
            servers.append(start_server(url, work, "server-b", token_file, src, profile, room))
            for i in range(1, len(nodes), 2):
                fleet.origins[i] = servers[1].origin
            await asyncio.sleep(3)
            for server in servers:
                server.mark("steady-pair")
            await steady(fleet, servers, args.steady, pair, database, trace_file(args, pair.label))
    finally:
        shards.close()
        if fleet is not None:
            await fleet.stop()
        for s in servers:
            s.stop()
    rows, size, top = database_figures(url, sqlite_file)
    col.figures["database rows"] = f"{rows:,}"
    col.figures["database size MiB"] = f"{size / 2**20:,.1f}"
    col.figures["  largest tables"] = top
    if pair is not None:
        pair.figures.update({k: v for k, v in col.figures.items() if k.startswith(("database", "  largest"))})


def baseline_checkout(ref: str, into: Path) -> Path:
    """A git worktree of ``ref`` (detached); its ``src``."""
    subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "add", "--detach", "--quiet", str(into), ref], check=True
    )
    return into / "src"


def table(columns: Sequence[Column]) -> list[str]:
    names: list[str] = []
    for c in columns:
        names += [n for n in c.figures if n not in names]
    width = max(len(n) for n in names)
    cols = [max(len(c.label), *(len(v) for v in c.figures.values())) for c in columns]
    lines = [" " * width + "".join(f"  {c.label:>{w}}" for c, w in zip(columns, cols, strict=True))]
    for n in names:
        lines.append(
            f"{n:<{width}}"
            + "".join(f"  {c.figures.get(n, '-'):>{w}}" for c, w in zip(columns, cols, strict=True))
        )
    return lines


async def main_async(args: argparse.Namespace) -> int:
    snapshot = fleetgen.build_snapshot(args.nodes, args.gpus, fleetgen.MODELS, args.seed)
    gpus = sum(len(n.devices) for n in snapshot.nodes)
    print(
        f"fleetserve control-plane benchmark (seed {args.seed}{', quick' if args.quick else ''}): "
        f"{len(snapshot.nodes):,} agents, {gpus:,} GPUs, {args.replicas:,} desired replicas in "
        f"{len(fleetgen.DEPLOYMENTS)} deployments; heartbeat every {args.heartbeat:g} s (every 3rd a "
        f"status report), one long-poll per agent (wait {POLL_WAIT:g} s), {args.connections} connections "
        f"for the rest; steady phase {args.steady:g} s",
        flush=True,
    )
    columns: list[Column] = []
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    stopped = False
    this = asyncio.current_task()
    assert this is not None
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, this.cancel)
    if args.deadline:
        loop.call_later(args.deadline, this.cancel)
    with tempfile.TemporaryDirectory(prefix="fleetserve-bench-cp-") as tmp:
        plan: list[tuple[str, str, Path | None]] = []
        if args.baseline:
            plan.append(
                (
                    f"postgres @{args.baseline}",
                    "postgres",
                    baseline_checkout(args.baseline, Path(tmp) / "baseline"),
                )
            )
        if "postgres" not in skip:
            plan.append(("postgres", "postgres", None))
        if "sqlite" not in skip:
            plan.append(("sqlite", "sqlite", None))
        try:
            for n, (label, kind, src) in enumerate(plan):
                work = Path(tmp) / f"col{n}"
                work.mkdir()
                pair = (
                    Column("postgres, 2 servers")
                    if kind == "postgres" and src is None and "pair" not in skip
                    else None
                )
                col = Column(label)
                columns.append(col)
                try:
                    if kind == "postgres":
                        url, drop = create_database()
                        try:
                            await run_column(label, url, work, snapshot, args, src, None, pair, col)
                        finally:
                            drop()
                    else:
                        db = work / "state.db"
                        await run_column(label, f"sqlite:///{db}", work, snapshot, args, src, db, None, col)
                except (RuntimeError, OSError, UpstreamError, psycopg.Error) as exc:
                    print(f"  [{label}] failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
                    col.figures["failed"] = type(exc).__name__
                    pair = None
                if pair is not None:
                    columns.append(pair)
        except asyncio.CancelledError:
            # --deadline passed, or SIGTERM / SIGINT: the table of what was measured so far.
            print("  stopped before the end: the figures below are the phases that ended", file=sys.stderr)
            stopped = True
        finally:
            if args.baseline:
                subprocess.run(
                    ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(Path(tmp) / "baseline")],
                    check=False,
                )
    print()
    for line in table(columns) if any(c.figures for c in columns) else ["(no phase ended)"]:
        print(line)
    print(
        "\nlatencies: this process's view (request written to answer read), over the steady phase only;\n"
        "reconcile figures: the leader's /metrics histograms over the scale-up and over the steady\n"
        "phase (p50/p99 interpolated in buckets; for '2 servers' over the leader's whole life); full\n"
        "cycles read and plan, quiet ones found nothing changed and read nothing (fleetserve_reconcile_\n"
        "quiet_total; '-': a server without them); CPU: user+system of the server\n"
        "processes over the steady phase, in cores; RSS: sampled every 2 s; targets: reconcile cycle\n"
        "<= 1 s, heartbeat p99 <= 50 ms, RSS flat over cycles"
    )
    return 1 if stopped else 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="a small run: 300 nodes, 3,000 replicas, 15 s phases"
    )
    parser.add_argument("--nodes", type=int, help="agents (1000; see the module's docstring for 5000)")
    parser.add_argument("--gpus", type=int, help="GPUs in the fleet (8 per node)")
    parser.add_argument("--replicas", type=int, help="desired replicas after the scale-up (10 per node)")
    parser.add_argument("--steady", type=float, help="seconds of each steady phase (30)")
    parser.add_argument(
        "--heartbeat", type=float, default=10.0, help="seconds between an agent's heartbeats (10)"
    )
    parser.add_argument(
        "--connections",
        type=int,
        help="connections for requests other than long-polls (one per 10 agents, at least 64)",
    )
    parser.add_argument("--apply", type=int, help="replicas of the timed first apply (1000; quick 200)")
    parser.add_argument(
        "--quiet",
        type=float,
        default=15.0,
        help="seconds without a new assignment that end the scale-up (15)",
    )
    parser.add_argument("--seed", type=int, default=1, help="seed of the fleet and the workload (1)")
    parser.add_argument(
        "--skip", default="", help="comma-separated columns to leave out: postgres, pair, sqlite"
    )
    parser.add_argument(
        "--baseline", metavar="REF", help="also run the server of this git ref (e.g. main) first"
    )
    parser.add_argument(
        "--deadline",
        type=float,
        metavar="SECONDS",
        help="stop after this many seconds and print the phases measured so far (exit status 1)",
    )
    parser.add_argument(
        "--profile",
        metavar="DIR",
        help="run each server under bench/stacksample.py, writing where its CPU went to DIR/COLUMN/",
    )
    parser.add_argument(
        "--trace",
        metavar="DIR",
        help="write each steady phase's requests (send time, kind, latency) to DIR/COLUMN.csv",
    )
    args = parser.parse_args(argv)
    args.nodes = args.nodes or (300 if args.quick else 1000)
    args.gpus = args.gpus or 8 * args.nodes
    # Real agents each have their own connection: too few here would queue the fleet's heartbeats
    # behind each other in this process (late past the server's 40 s NotReady deadline at 5,000).
    args.connections = args.connections or max(64, args.nodes // 10)
    args.replicas = args.replicas or 10 * args.nodes
    args.steady = args.steady or (15.0 if args.quick else 30.0)
    args.apply = args.apply or (200 if args.quick else 1000)
    args.settle_timeout = 120.0 if args.quick else 300.0
    return uvloop.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
