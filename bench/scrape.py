"""Scraper benchmark: CPU share and staleness scraping many llama.cpp-like endpoints at 1 Hz.

Run from the repository root::

    .venv/bin/python bench/scrape.py                 # 1,000 endpoints, 30 s per phase
    .venv/bin/python bench/scrape.py --quick         # 100 endpoints, 5 s per phase
    .venv/bin/python bench/scrape.py --targets 2000 --seconds 60
    .venv/bin/python bench/scrape.py --hung 10      # 10 of the endpoints accept, never answer

This prints figures; it asserts nothing (the machine may be shared and noisy).

The fake engines are ONE separate asyncio server process (this file with ``--serve``) listening on
as many ports of 127.0.0.1 as there are targets, one port per engine, so every target is its own
origin and needs its own connection, as real engines on separate hosts do. Each answers
``GET /metrics`` with the text llama-server b11434 writes with ``--metrics`` (the same metric
names, HELP and TYPE lines; about 2.6 KB), its counters advancing with time at a per-engine
rate, its headers as llama-server's (``Content-Length``, ``Keep-Alive: timeout=5, max=100``: the
connection is closed after 100 requests, as cpp-httplib does). Its CPU time is the server's, so
it is not counted in the scraper's figures; it is printed apart.

Two phases run one after the other against the same endpoints, each after a short warm-up:

- ``Scraper``: ``fleetserve.metrics.scraper.Scraper`` with its default fetcher (keep-alive,
  ``concurrency`` at once), its ``run`` loop at the interval;
- ``Scraper+httpx``: the same with ``HttpxFetcher`` (one shared ``httpx.AsyncClient``, one
  small pool per origin), the first version's fetcher, for comparison;
- ``naive``: one thread, every target in turn with ``urllib.request.urlopen`` (a fresh
  connection per request), a sweep started every interval, or at once when the last one overran.
  (``httpx.get`` per target is slower still: it builds a TLS context for every call.)

Figures per phase: the process's CPU time (``time.process_time``, every thread) over the
measured wall time, less the sampler's own CPU (``time.thread_time`` around each sample), as a
share of one core; scrapes per second and failures; and staleness — every 100 ms the age of
each target's latest successful scrape is sampled, and the p50, p99 and max over all samples are
printed. At 1 Hz an ideal scraper's staleness is spread evenly over 0..1 s (p50 0.5 s).
Endpoints that hang (``--hung``) count as failures; staleness is over the answering ones, to
show whether the hung ones hold the others up.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import functools
import io
import json
import os
import pstats
import random
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import psutil  # type: ignore[import-untyped]

from fleetserve.metrics.httpxfetch import HttpxFetcher
from fleetserve.metrics.scraper import Scraper
from fleetserve.metrics.targets import Target

KEEPALIVE_MAX = 100
"""Requests llama-server (cpp-httplib) answers on one connection before closing it."""

DEFAULT, HTTPX, NAIVE = "Scraper", "Scraper+httpx", "naive"
PHASES = (DEFAULT, HTTPX, NAIVE)

SAMPLE_EVERY = 0.1
WARMUP = 2.0

# What llama-server b11434 writes at /metrics with --metrics: name, type, HELP text, value.
LLAMACPP_METRICS: tuple[tuple[str, str, str, str], ...] = (
    ("prompt_tokens_total", "counter",
     "Number of prompt tokens processed, excluding cached tokens", "{prompt_tokens}"),
    ("prompt_tokens_cached_total", "counter",
     "Number of prompt tokens reused from the cache", "{cached_tokens}"),
    ("prompt_seconds_total", "counter", "Total time spent processing prompts", "{prompt_seconds:.6g}"),
    ("tokens_predicted_total", "counter", "Number of generation tokens processed", "{predicted_tokens}"),
    ("tokens_predicted_seconds_total", "counter",
     "Total time spent generating tokens", "{predicted_seconds:.6g}"),
    ("n_decode_total", "counter",
     "Total number of llama_decode() calls, excluding speculative decoding and multimodal decoding",
     "{decodes}"),
    ("n_tokens_max", "counter", "Largest observed sequence length (prompt + generation)", "{tokens_max}"),
    ("spec_decode_num_draft_tokens_total", "counter", "Speculative: Total draft tokens generated", "0"),
    ("spec_decode_num_accepted_tokens_total", "counter",
     "Speculative: Total draft tokens accepted by the target model", "0"),
    ("spec_decode_num_drafts_total", "counter",
     "Speculative: Total speculative decoding verification steps", "0"),
    ("prompt_tokens_seconds", "gauge", "Average prompt throughput in tokens/s", "{prompt_rate:.6g}"),
    ("predicted_tokens_seconds", "gauge",
     "Average generation throughput in tokens/s", "{predicted_rate:.6g}"),
    ("requests_processing", "gauge", "Number of requests processing", "{processing}"),
    ("requests_deferred", "gauge", "Number of requests deferred", "{deferred}"),
    ("n_busy_slots_per_decode", "gauge",
     "Average number of busy slots per llama_decode() call", "{busy_slots:.6g}"),
)  # fmt: skip

METRICS_TEMPLATE = "".join(
    f"# HELP llamacpp:{name} {help_text}\n# TYPE llamacpp:{name} {kind}\nllamacpp:{name} {value}\n"
    for name, kind, help_text, value in LLAMACPP_METRICS
)


# ---- the fake engines (child process) -------------------------------------------------------


class FakeEngine:
    """One fake llama-server's counters: they advance with time at this engine's own rates."""

    def __init__(self, rng: random.Random, started: float, hung: bool = False) -> None:
        self.started = started
        self.hung = hung  # accepts connections and reads requests, never answers
        self.prompt_rate = rng.uniform(200.0, 3000.0)
        self.predicted_rate = rng.uniform(10.0, 120.0)
        self.slots = rng.choice((1, 2, 4, 8))

    def render(self, now: float) -> bytes:
        up = now - self.started + 100.0
        predicted = int(up * self.predicted_rate)
        processing = int(now * 7 + self.slots) % (self.slots + 1)
        return METRICS_TEMPLATE.format(
            prompt_tokens=int(up * self.prompt_rate),
            cached_tokens=int(up * self.prompt_rate * 0.3),
            prompt_seconds=up * 0.05,
            predicted_tokens=predicted,
            predicted_seconds=up * 0.6,
            decodes=predicted,
            tokens_max=min(4096, predicted),
            prompt_rate=self.prompt_rate,
            predicted_rate=self.predicted_rate,
            processing=processing,
            deferred=max(0, processing - self.slots + 1),
            busy_slots=1.0 + processing / 2,
        ).encode()


class EngineProtocol(asyncio.Protocol):
    """A minimal HTTP/1.1 server connection: GET /metrics with keep-alive, as llama-server answers."""

    def __init__(self, engine: FakeEngine) -> None:
        self.engine = engine
        self.buffer = b""
        self.served = 0
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if self.engine.hung:
            return
        self.buffer += data
        while self.transport is not None and (end := self.buffer.find(b"\r\n\r\n")) >= 0:
            head, self.buffer = self.buffer[:end], self.buffer[end + 4 :]
            path = head.split(b" ", 2)[1] if head.count(b" ") >= 2 else b""
            self.served += 1
            close = self.served >= KEEPALIVE_MAX or b"connection: close" in head.lower()
            if path == b"/metrics":
                status, body = b"200 OK", self.engine.render(time.time())
            else:
                status, body = b"404 Not Found", b"File Not Found"
            self.transport.write(
                b"HTTP/1.1 " + status + b"\r\nServer: llama.cpp\r\n"
                b"Content-Type: text/plain; version=0.0.4\r\n"
                b"Content-Length: " + str(len(body)).encode() + b"\r\n"
                + (b"Connection: close\r\n" if close else b"Keep-Alive: timeout=5, max=100\r\n")
                + b"\r\n" + body
            )  # fmt: skip
            if close:
                self.transport.close()
                self.transport = None

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None


def hung_indices(targets: int, hung: int) -> list[int]:
    """Which endpoints hang: ``hung`` of them, evenly spread."""
    return [i * targets // hung for i in range(hung)] if hung else []


async def serve(targets: int, seed: int, hung: int) -> None:
    """Listen on ``targets`` ports, print them as one JSON line, serve until terminated."""
    loop = asyncio.get_running_loop()
    rng = random.Random(seed)
    started = time.time()
    servers = []
    hanging = set(hung_indices(targets, hung))
    for i in range(targets):
        engine = FakeEngine(rng, started, hung=i in hanging)
        servers.append(
            await loop.create_server(functools.partial(EngineProtocol, engine), "127.0.0.1", 0, backlog=1024)
        )
    ports = [s.sockets[0].getsockname()[1] for s in servers]
    print(json.dumps(ports), flush=True)
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    for s in servers:
        s.close()


# ---- measuring (parent process) -------------------------------------------------------------


@dataclass
class PhaseResult:
    """One phase's figures."""

    name: str
    seconds: float
    cpu_seconds: float
    sampler_cpu_seconds: float
    scrapes: int
    failures: int
    ages: list[float]
    server_cpu_seconds: float


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) by nearest rank; NaN when empty."""
    if not sorted_values:
        return float("nan")
    rank = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[rank]


class Sampler:
    """Samples every target's age of its latest successful scrape; times its own CPU."""

    def __init__(self, keys: Sequence[str], fetched_at: Callable[[str], float | None]) -> None:
        self.keys = keys
        self.fetched_at = fetched_at
        self.ages: list[float] = []
        self.cpu = 0.0
        self.start = time.monotonic()

    def sample(self) -> None:
        cpu0 = time.thread_time()
        now = time.monotonic()
        for key in self.keys:
            at = self.fetched_at(key)
            # Never scraped yet: as stale as the whole phase so far.
            self.ages.append(now - (at if at is not None else self.start))
        self.cpu += time.thread_time() - cpu0


async def scraper_phase(
    name: str,
    urls: Sequence[str],
    healthy: Sequence[int],
    seconds: float,
    args: argparse.Namespace,
    server: psutil.Process,
) -> PhaseResult:
    fetcher = HttpxFetcher() if name == HTTPX else None
    scraper = Scraper(fetcher, concurrency=args.concurrency, timeout=args.timeout, interval=args.interval)
    scraper.set_targets(
        Target(f"engine-{i}", url, {"deployment": f"d{i % 50}", "replica": str(i), "engine": "llama.cpp"})
        for i, url in enumerate(urls)
    )
    states = scraper._states  # the sampler reads fetched_at directly: no Scrape objects to build

    def fetched_at(key: str) -> float | None:
        return states[key].fetched_at

    stop = asyncio.Event()
    runner = asyncio.create_task(scraper.run(stop))
    try:
        await asyncio.sleep(WARMUP)
        profiler = cProfile.Profile() if args.profile else None
        keys = [t.key for t in scraper.targets()]
        sampler = Sampler([keys[i] for i in healthy], fetched_at)
        before = scraper.stats()
        server0 = sum(server.cpu_times()[:2])
        cpu0, wall0 = time.process_time(), time.monotonic()
        if profiler is not None:
            profiler.enable()
        tick = wall0
        while (now := time.monotonic()) < wall0 + seconds:
            sampler.sample()
            tick += SAMPLE_EVERY
            await asyncio.sleep(max(0.0, tick - now))
        if profiler is not None:
            profiler.disable()
        cpu, wall = time.process_time() - cpu0, time.monotonic() - wall0
        server_cpu = sum(server.cpu_times()[:2]) - server0
        after = scraper.stats()
    finally:
        stop.set()
        await runner
        await scraper.aclose()
        if fetcher is not None:
            await fetcher.aclose()
    if profiler is not None:
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(25)
        print(out.getvalue())
    return PhaseResult(
        name=name,
        seconds=wall,
        cpu_seconds=cpu,
        sampler_cpu_seconds=sampler.cpu,
        scrapes=(after.scrapes_ok + after.scrapes_failed) - (before.scrapes_ok + before.scrapes_failed),
        failures=after.scrapes_failed - before.scrapes_failed,
        ages=sampler.ages,
        server_cpu_seconds=server_cpu,
    )


def naive_phase(
    urls: Sequence[str],
    healthy: Sequence[int],
    seconds: float,
    args: argparse.Namespace,
    server: psutil.Process,
) -> PhaseResult:
    fetched: dict[str, float | None] = dict.fromkeys(urls)
    counts = {"scrapes": 0, "failures": 0}
    stop = threading.Event()

    def sweep_forever() -> None:
        next_sweep = time.monotonic()
        while not stop.is_set():
            for url in urls:
                if stop.is_set():
                    return
                try:
                    with urllib.request.urlopen(url, timeout=args.timeout) as response:
                        response.read()
                        ok = response.status == 200
                except OSError:  # URLError and HTTPError are OSErrors
                    ok = False
                counts["scrapes"] += 1
                if ok:
                    fetched[url] = time.monotonic()
                else:
                    counts["failures"] += 1
            next_sweep += args.interval
            now = time.monotonic()
            if next_sweep > now:
                stop.wait(next_sweep - now)
            else:
                next_sweep = now  # overran: start the next sweep at once

    worker = threading.Thread(target=sweep_forever, name="naive-scraper")
    worker.start()
    try:
        time.sleep(WARMUP)
        sampler = Sampler([urls[i] for i in healthy], fetched.__getitem__)
        scrapes0, failures0 = counts["scrapes"], counts["failures"]
        server0 = sum(server.cpu_times()[:2])
        cpu0, wall0 = time.process_time(), time.monotonic()
        tick = wall0
        while (now := time.monotonic()) < wall0 + seconds:
            sampler.sample()
            tick += SAMPLE_EVERY
            time.sleep(max(0.0, tick - now))
        cpu, wall = time.process_time() - cpu0, time.monotonic() - wall0
        server_cpu = sum(server.cpu_times()[:2]) - server0
        scrapes, failures = counts["scrapes"] - scrapes0, counts["failures"] - failures0
    finally:
        stop.set()
        worker.join()
    return PhaseResult(
        name=NAIVE,
        seconds=wall,
        cpu_seconds=cpu,
        sampler_cpu_seconds=sampler.cpu,
        scrapes=scrapes,
        failures=failures,
        ages=sampler.ages,
        server_cpu_seconds=server_cpu,
    )


def staleness_cell(result: PhaseResult, q: float) -> str:
    return f"{percentile(sorted(result.ages), q):.3f}"


def report(results: Sequence[PhaseResult]) -> None:
    rows: list[tuple[str, list[str]]] = []

    def row(label: str, cell: Callable[[PhaseResult], str]) -> None:
        rows.append((label, [cell(r) for r in results]))

    row("measured wall time (s)", lambda r: f"{r.seconds:.1f}")
    row("CPU, % of one core", lambda r: f"{100 * (r.cpu_seconds - r.sampler_cpu_seconds) / r.seconds:.1f}")
    row("  (sampler CPU, subtracted, %)", lambda r: f"{100 * r.sampler_cpu_seconds / r.seconds:.1f}")
    row("scrapes/s", lambda r: f"{r.scrapes / r.seconds:.0f}")
    row("failures", lambda r: f"{r.failures}")
    for label, q in (("staleness p50 (s)", 0.5), ("staleness p99 (s)", 0.99), ("staleness max (s)", 1.0)):
        row(label, functools.partial(staleness_cell, q=q))
    row("fake server CPU, % (not counted)", lambda r: f"{100 * r.server_cpu_seconds / r.seconds:.1f}")
    width = max(len(label) for label, _ in rows)
    print(f"{'':<{width}}  " + "  ".join(f"{r.name:>15}" for r in results))
    for label, cells in rows:
        print(f"{label:<{width}}  " + "  ".join(f"{c:>15}" for c in cells))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--targets", type=int, default=1000)
    parser.add_argument("--seconds", type=float, default=30.0, help="measured seconds per phase")
    parser.add_argument("--interval", type=float, default=1.0)
    parser.add_argument("--timeout", type=float, default=2.0)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument(
        "--hung", type=int, default=0, help="endpoints that accept but never answer (staleness excludes them)"
    )
    parser.add_argument("--quick", action="store_true", help="100 targets, 5 s per phase")
    parser.add_argument(
        "--phases",
        type=lambda text: [p for p in text.split(",") if p],
        default=list(PHASES),
        help=f"comma-separated, of {', '.join(PHASES)} (default: all, in that order)",
    )
    parser.add_argument("--profile", action="store_true", help="cProfile the Scraper phases")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.targets, args.seconds = 100, 5.0
    unknown = [p for p in args.phases if p not in PHASES]
    if unknown:
        parser.error(f"unknown phases {unknown}; choose from {', '.join(PHASES)}")

    # One socket per target on each side: make sure the soft limit allows it.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))

    if args.serve:
        asyncio.run(serve(args.targets, args.seed, args.hung))
        return

    child = subprocess.Popen(
        [
            sys.executable,
            os.path.abspath(__file__),
            "--serve",
            f"--targets={args.targets}",
            f"--seed={args.seed}",
            f"--hung={args.hung}",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        ports = json.loads(child.stdout.readline())
        server = psutil.Process(child.pid)
        urls = [f"http://127.0.0.1:{port}/metrics" for port in ports]
        hanging = set(hung_indices(len(urls), args.hung))
        healthy = [i for i in range(len(urls)) if i not in hanging]
        with urllib.request.urlopen(urls[healthy[0]]) as response:
            sample = response.read()
        print(
            f"fake engines: {len(urls)} llama-server-like endpoints, one asyncio server process "
            f"(pid {child.pid}) listening on {len(urls)} ports of 127.0.0.1 (one port per engine); "
            f"/metrics body {len(sample)} bytes, counters advancing; {len(hanging)} of them hang "
            "(accept, never answer)"
        )
        print(
            f"scraping: interval {args.interval:g}s, timeout {args.timeout:g}s, concurrency "
            f"{args.concurrency}; {WARMUP:g}s warm-up then {args.seconds:g}s measured per phase; "
            f"staleness sampled every {SAMPLE_EVERY * 1000:g} ms; {os.cpu_count()} CPUs, "
            f"python {sys.version.split()[0]}, {socket.gethostname()}"
        )
        results = []
        for phase in args.phases:
            if phase == NAIVE:
                results.append(naive_phase(urls, healthy, args.seconds, args, server))
            else:
                results.append(asyncio.run(scraper_phase(phase, urls, healthy, args.seconds, args, server)))
        print()
        report(results)
    finally:
        child.terminate()
        child.wait()


if __name__ == "__main__":
    main()
