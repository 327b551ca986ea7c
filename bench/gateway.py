"""Gateway benchmark: what a proxy adds in front of an OpenAI-compatible engine, in one run.

Run from the repository root (loopback only; about two to four minutes)::

    .venv/bin/python bench/gateway.py             # every row
    .venv/bin/python bench/gateway.py --quick     # shorter phases
    .venv/bin/python bench/gateway.py --skip litellm,nginx

Rows, each in front of the same fake engine (``fleetserve.dev.fake_openai``: raw asyncio and
httptools, answering at once; JSON answers, or streams of 64 content events each written on its
own, then ``[DONE]``):

- ``direct``: the load generator straight to the engine (the baseline);
- ``nginx``: Debian's nginx, one worker, keep-alive upstream, ``proxy_buffering off``
  (installed with ``apt-get install nginx`` when missing; where that fails the row says why);
- ``litellm``: LiteLLM's proxy from PyPI (``litellm[proxy]``), installed on first use into its
  OWN virtual environment ``bench/.venv-litellm`` (never the project's: its pins would change
  ours), one uvicorn worker; where it cannot be installed the row says why;
- ``fleetserve gateway``: ``fleetserve gateway`` over a SQLite store holding one Running replica
  (the engine) and an API key without limits;
- ``fleetserve server``: the same gateway inside ``fleetserve server`` (the reconciler, observer
  and admin API running beside it).

The proxy is pinned to CPU 0 (``taskset``); the load generator (this process, uvloop and
``fleetserve.httpclient``'s keep-alive connections) and the engine to CPU 1. Figures per row:
the median latency at concurrency 1 and what the proxy adds to the direct median; requests per
second at concurrency 16; the proxy's CPU-seconds per 1,000 requests and per 1,000 streams of 64
events (user + system time of the proxy's processes from /proc, over the concurrency-16 phases).
The targets (design.md, "Gateway") are marked met or missed; the machine may be shared and
noisy, so nothing is asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import httpx
import psutil
import uvloop

from fleetserve.httpclient import HttpClient, Origin

ROOT = Path(__file__).resolve().parent.parent
PYTHON = Path(sys.executable)
FLEETSERVE = PYTHON.with_name("fleetserve")
LITELLM_VENV = Path(os.environ.get("FLEETSERVE_BENCH_LITELLM_VENV", ROOT / "bench" / ".venv-litellm"))
PROXY_CPU = "0"
LOAD_CPUS = {1}
STREAM_EVENTS = 64

TARGET_ADDED_P50_MS = 0.5
TARGET_RPS = 3000
TARGET_CPU_PER_1K = 0.3
TARGET_CPU_PER_1K_STREAMS = 1.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(
    check: Callable[[], bool], timeout: float, what: str, proc: subprocess.Popen[bytes] | None
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what}: the process exited with {proc.returncode}")
        try:
            if check():
                return
        except (httpx.HTTPError, OSError):
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{what}: not ready after {timeout:.0f} s")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process and all its descendants (from /proc)."""
    total = 0.0
    try:
        root = psutil.Process(pid)
        for proc in [root, *root.children(recursive=True)]:
            try:
                times = proc.cpu_times()
                total += times.user + times.system
            except psutil.NoSuchProcess:
                continue
    except psutil.NoSuchProcess:
        pass
    return total


# --- the load generator ----------------------------------------------------------------------------


def request_bytes(port: int, stream: bool, key: str) -> bytes:
    if stream:
        body = (
            b'{"model":"tiny","messages":[{"role":"user","content":"Tell me a story."}],'
            b'"max_tokens":%d,"stream":true}' % STREAM_EVENTS
        )
    else:
        body = b'{"model":"tiny","messages":[{"role":"user","content":"Hello!"}],"max_tokens":16}'
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nAuthorization: Bearer %s\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % (port, key.encode(), len(body))
    ) + body


@dataclass
class Phase:
    count: int
    errors: int
    seconds: float
    latencies: list[float]


async def load(
    port: int, key: str, concurrency: int, seconds: float, stream: bool, most: int | None = None
) -> Phase:
    """``concurrency`` keep-alive connections sending requests back to back for ``seconds``."""
    client = HttpClient(max_idle_per_origin=concurrency)
    origin = Origin("127.0.0.1", port)
    request = request_bytes(port, stream, key)
    latencies: list[float] = []
    errors = 0
    count = 0
    deadline = time.perf_counter() + seconds

    async def worker() -> None:
        nonlocal errors, count
        while time.perf_counter() < deadline and (most is None or count < most):
            began = time.perf_counter()
            try:
                response = await client.request(origin, request, 30)
                body = await response.read()
                ok = response.status == 200 and (not stream or body.rstrip().endswith(b"[DONE]"))
            except Exception:
                ok = False
            if ok:
                count += 1
                latencies.append(time.perf_counter() - began)
            else:
                errors += 1
                await asyncio.sleep(0.01)

    began = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - began
    await client.aclose()
    return Phase(count, errors, elapsed, latencies)


@dataclass
class Row:
    name: str
    p50_ms: float | None = None
    rps: float | None = None
    cpu_per_1k: float | None = None
    cpu_per_1k_streams: float | None = None
    share: float | None = None  # of its core the proxy got during the c=16 phase
    errors: int = 0
    note: str = ""


def measure(name: str, port: int, key: str, pid: int | None, quick: bool) -> Row:
    span = 1.5 if quick else 3.0

    async def run() -> Row:
        await load(port, key, 4, 0.5, False)  # warm up connections and caches
        await load(port, key, 2, 0.3, True)
        single = await load(port, key, 1, span, False, most=3000)
        before = cpu_seconds(pid) if pid else 0.0
        many = await load(port, key, 16, span, False)
        cpu = (cpu_seconds(pid) - before) if pid else None
        before = cpu_seconds(pid) if pid else 0.0
        streams = await load(port, key, 16, span, True)
        stream_cpu = (cpu_seconds(pid) - before) if pid else None
        return Row(
            name,
            p50_ms=statistics.median(single.latencies) * 1000 if single.latencies else None,
            rps=many.count / many.seconds,
            cpu_per_1k=cpu / many.count * 1000 if cpu is not None and many.count else None,
            cpu_per_1k_streams=stream_cpu / streams.count * 1000
            if stream_cpu is not None and streams.count
            else None,
            share=cpu / many.seconds if cpu is not None else None,
            errors=single.errors + many.errors + streams.errors,
        )

    return uvloop.run(run())


# --- the proxies ------------------------------------------------------------------------------------


def start_engine() -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    proc = subprocess.Popen(
        [
            "taskset",
            "-c",
            ",".join(map(str, sorted(LOAD_CPUS))),
            str(PYTHON),
            "-m",
            "fleetserve.dev.fake_openai",
            str(port),
        ],
        stdout=subprocess.DEVNULL,
    )
    wait_until(
        lambda: httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200,
        15,
        "the fake engine",
        proc,
    )
    return proc, port


def store_for(tmp: Path, engine_port: int) -> tuple[str, str]:
    """A SQLite store with deployment ``tiny``'s replica Running at the engine, and a key; (url, key)."""
    from fleetserve.protocol import ReplicaStatus
    from fleetserve.spec.resources import Deployment, Model, Node, Replica, ReplicaState, Shard
    from fleetserve.store.sql import SqlStore

    url = f"sqlite:///{tmp / 'state.db'}"
    now = datetime.now(UTC)
    with SqlStore.open(url) as store:
        # A vLLM replica: the fake engine, like vLLM, serves 64 requests at once (llama.cpp's 4 slots
        # would have the gateway's admission queue the load generator's 16).
        store.put_model(
            Model.model_validate(
                {
                    "name": "tiny",
                    "source": "hf://bench/tiny",
                    "format": "safetensors",
                    "size": "1GB",
                    "architecture": {"layers": 2, "kvHeads": 4, "headDim": 64, "contextLength": 256},
                }
            )
        )
        store.put_deployment(
            Deployment.model_validate(
                {
                    "name": "tiny",
                    "model": "tiny",
                    "replicas": 1,
                    "profiles": [{"name": "cpu", "engine": "vllm", "cpu": {"cores": 1}}],
                }
            )
        )
        node = Node.model_validate(
            {"name": "c1", "cpu": {"cores": 4, "memory": "8GiB"}, "address": "127.0.0.1"}
        )
        epoch = store.register(node).epoch
        shard = Shard(node="c1", cpu_cores=1, memory=1 << 30)
        store.allocate(Replica(name="tiny-0", deployment="tiny", profile="cpu", shards=(shard,)))
        store.report("c1", epoch, now, {"tiny-0": (ReplicaState.RUNNING, ReplicaStatus(port=engine_port))})
        _, key = store.create_api_key("bench", ["*"], None, None, now)
    return url, key


def start_fleetserve(kind: str, tmp: Path, engine_port: int) -> tuple[subprocess.Popen[bytes], int, str]:
    work = tmp / kind
    work.mkdir()
    url, key = store_for(work, engine_port)
    port = free_port()
    args = [str(FLEETSERVE), kind, "--database-url", url, "--port", str(port), "--log-level", "warning"]
    if kind == "server":
        args += ["--not-ready-after", "600", "--lost-after", "1200", "--models-dir", str(work / "models")]
    log = (work / "log").open("wb")
    proc = subprocess.Popen(
        ["taskset", "-c", PROXY_CPU, *args], stdout=log, stderr=subprocess.STDOUT, cwd=work
    )

    def routed() -> bool:
        got = httpx.get(
            f"http://127.0.0.1:{port}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=2
        )
        return got.status_code == 200 and any(m["id"] == "tiny" for m in got.json()["data"])

    wait_until(routed, 60, f"fleetserve {kind}", proc)
    return proc, port, key


NGINX_CONF = """
worker_processes 1;
daemon off;
pid {tmp}/nginx.pid;
error_log {tmp}/error.log warn;
events {{ worker_connections 1024; }}
http {{
    access_log off;
    client_body_temp_path {tmp}/body;
    proxy_temp_path {tmp}/proxy;
    fastcgi_temp_path {tmp}/fastcgi;
    uwsgi_temp_path {tmp}/uwsgi;
    scgi_temp_path {tmp}/scgi;
    upstream engine {{ server 127.0.0.1:{engine}; keepalive 64; }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://engine;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
        }}
    }}
}}
"""


def ensure_nginx() -> str | None:
    """The nginx binary, installed from Debian when missing; None with the reason printed."""
    found = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)
    if found:
        return found
    print("nginx is missing: installing Debian's nginx (apt-get install -y nginx)", flush=True)
    sudo = [] if os.geteuid() == 0 else ["sudo", "-n"]
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    done = subprocess.run(
        [*sudo, "apt-get", "install", "-y", "-qq", "nginx"], env=env, capture_output=True, check=False
    )
    if done.returncode != 0:
        print(f"  could not install nginx: {done.stderr.decode(errors='replace')[-300:]}")
        print("  install it yourself: sudo apt-get install nginx")
        return None
    return shutil.which("nginx") or "/usr/sbin/nginx"


def start_nginx(binary: str, tmp: Path, engine_port: int) -> tuple[subprocess.Popen[bytes], int]:
    work = tmp / "nginx"
    work.mkdir()
    port = free_port()
    (work / "nginx.conf").write_text(NGINX_CONF.format(tmp=work, engine=engine_port, port=port))
    proc = subprocess.Popen(
        ["taskset", "-c", PROXY_CPU, binary, "-p", str(work), "-c", str(work / "nginx.conf")],
        stdout=subprocess.DEVNULL,
        stderr=(work / "stderr").open("wb"),
    )
    wait_until(
        lambda: httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200, 15, "nginx", proc
    )
    return proc, port


def ensure_litellm() -> Path | None:
    """LiteLLM's proxy in its own venv (created and installed on first use); None with the reason printed."""
    exe = LITELLM_VENV / "bin" / "litellm"
    if exe.exists():
        return exe
    print(f"installing LiteLLM's proxy into {LITELLM_VENV} (its own venv; a minute or two) ...", flush=True)
    try:
        if not (LITELLM_VENV / "bin" / "python").exists():
            subprocess.run([sys.executable, "-m", "venv", str(LITELLM_VENV)], check=True, capture_output=True)
        done = subprocess.run(
            [
                str(LITELLM_VENV / "bin" / "pip"),
                "install",
                "-q",
                "--disable-pip-version-check",
                "litellm[proxy]",
            ],
            capture_output=True,
            check=False,
            timeout=900,
        )
    except (subprocess.SubprocessError, OSError) as exc:
        print(f"  could not install LiteLLM: {exc}")
        return None
    if done.returncode != 0 or not exe.exists():
        print(f"  could not install LiteLLM: {done.stderr.decode(errors='replace')[-400:]}")
        return None
    return exe


def start_litellm(exe: Path, tmp: Path, engine_port: int) -> tuple[subprocess.Popen[bytes], int, str]:
    work = tmp / "litellm"
    work.mkdir()
    port = free_port()
    key = f"sk-{secrets.token_hex(24)}"  # LiteLLM refuses to start without a (strong) master key
    config = work / "config.yaml"
    config.write_text(
        textwrap.dedent(
            f"""\
            model_list:
              - model_name: tiny
                litellm_params:
                  model: openai/tiny
                  api_base: http://127.0.0.1:{engine_port}/v1
                  api_key: fake
            litellm_settings:
              drop_params: true
              telemetry: false
            general_settings:
              master_key: {key}
            """
        )
    )
    env = {
        **os.environ,
        "LITELLM_LOG": "ERROR",
        "LITELLM_TELEMETRY": "False",
        "DISABLE_SCHEMA_UPDATE": "true",
    }
    env.pop("VIRTUAL_ENV", None)
    proc = subprocess.Popen(
        ["taskset", "-c", PROXY_CPU, str(exe), "--config", str(config), "--host", "127.0.0.1",
         "--port", str(port), "--num_workers", "1"],
        stdout=(work / "log").open("wb"),
        stderr=subprocess.STDOUT,
        env=env,
        cwd=work,
    )  # fmt: skip
    wait_until(
        lambda: httpx.get(f"http://127.0.0.1:{port}/health/liveliness", timeout=2).status_code == 200,
        180,
        "LiteLLM's proxy",
        proc,
    )
    return proc, port, key


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


# --- the table ----------------------------------------------------------------------------------------


def mark(value: float | None, target: float, higher_is_better: bool) -> str:
    if value is None:
        return "—"
    met = value >= target if higher_is_better else value <= target
    return "met" if met else "MISSED"


def table(rows: list[Row], direct_p50: float | None) -> str:
    head = (
        f"{'proxy':<20} {'p50 c=1':>9} {'added p50':>10} {'':>6} {'rps c=16':>9} {'':>6} "
        f"{'CPU-s/1k req':>12} {'':>6} {'CPU-s/1k streams':>16} {'':>6} {'errors':>6} "
        f"{'core used':>9} {'rps/core':>8}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        if r.p50_ms is None and r.rps is None:
            lines.append(f"{r.name:<20} not measured: {r.note}")
            continue
        added = (
            None if r.name == "direct" or direct_p50 is None or r.p50_ms is None else r.p50_ms - direct_p50
        )
        proxy = r.name != "direct"
        share = "—" if r.share is None else f"{r.share * 100:.0f}%"

        def fmt(value: float | None, spec: str) -> str:
            return "—" if value is None else format(value, spec)

        lines.append(
            f"{r.name:<20} {fmt(r.p50_ms, '.3f') + ' ms':>9} "
            f"{(fmt(added, '+.3f') + ' ms') if added is not None else '—':>10} "
            f"{mark(added, TARGET_ADDED_P50_MS, False) if proxy else '':>6} "
            f"{fmt(r.rps, ',.0f'):>9} {mark(r.rps, TARGET_RPS, True) if proxy else '':>6} "
            f"{fmt(r.cpu_per_1k, '.3f'):>12} "
            f"{mark(r.cpu_per_1k, TARGET_CPU_PER_1K, False) if proxy else '':>6} "
            f"{fmt(r.cpu_per_1k_streams, '.3f'):>16} "
            f"{mark(r.cpu_per_1k_streams, TARGET_CPU_PER_1K_STREAMS, False) if proxy else '':>6} "
            f"{r.errors:>6} {share:>9} "
            f"{fmt(1000 / r.cpu_per_1k if r.cpu_per_1k else None, ',.0f'):>8}"
            + (f"  ({r.note})" if r.note else "")
        )
    lines.append(
        f"targets: added p50 <= {TARGET_ADDED_P50_MS} ms; >= {TARGET_RPS:,} rps on one core at c=16; "
        f"<= {TARGET_CPU_PER_1K} CPU-s per 1,000 requests; <= {TARGET_CPU_PER_1K_STREAMS} CPU-s per "
        f"1,000 streams of {STREAM_EVENTS} events\n"
        "core used: the proxy's CPU time over the c=16 phase's wall time (below 100% when the load "
        "generator, or other work on a shared machine, held it back); rps/core: 1 / CPU per request, "
        "the rate one whole core would carry"
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="shorter phases")
    parser.add_argument(
        "--skip", default="", help="comma-separated rows to leave out: nginx, litellm, gateway, server"
    )
    args = parser.parse_args()
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    if len(os.sched_getaffinity(0)) < 2 and (os.cpu_count() or 1) < 2:
        print(
            "this benchmark pins the proxy and the load generator to two different CPUs; this machine has one"
        )
    os.sched_setaffinity(0, LOAD_CPUS)
    print(
        f"CPUs: proxy on {PROXY_CPU}, load generator and engine on {sorted(LOAD_CPUS)}; "
        f"{os.cpu_count()} in all"
    )
    rows: list[Row] = []
    engine, engine_port = start_engine()
    try:
        with tempfile.TemporaryDirectory(prefix="fleetserve-bench-gw-") as tmpdir:
            tmp = Path(tmpdir)
            print("direct ...", flush=True)
            rows.append(measure("direct", engine_port, "none", None, args.quick))

            if "nginx" not in skip:
                binary = ensure_nginx()
                if binary is None:
                    rows.append(Row("nginx", note="nginx is not installed and could not be (see above)"))
                else:
                    print("nginx ...", flush=True)
                    proc, port = start_nginx(binary, tmp, engine_port)
                    try:
                        rows.append(measure("nginx", port, "none", proc.pid, args.quick))
                    finally:
                        stop(proc)

            if "litellm" not in skip:
                exe = ensure_litellm()
                if exe is None:
                    rows.append(Row("litellm", note="LiteLLM's proxy could not be installed (see above)"))
                else:
                    print("litellm ...", flush=True)
                    try:
                        proc, port, key = start_litellm(exe, tmp, engine_port)
                    except RuntimeError as exc:
                        log = (tmp / "litellm" / "log").read_text(errors="replace")[-600:]
                        print(f"  LiteLLM's proxy did not start: {exc}\n{log}")
                        rows.append(Row("litellm", note=f"did not start: {exc}"))
                    else:
                        try:
                            rows.append(measure("litellm", port, key, proc.pid, args.quick))
                        finally:
                            stop(proc)

            for kind, name in (("gateway", "fleetserve gateway"), ("server", "fleetserve server")):
                if kind in skip:
                    continue
                print(f"{name} ...", flush=True)
                proc, port, key = start_fleetserve(kind, tmp, engine_port)
                try:
                    rows.append(measure(name, port, key, proc.pid, args.quick))
                finally:
                    stop(proc)
    finally:
        stop(engine)
    direct = rows[0].p50_ms
    print()
    print(table(rows, direct))


if __name__ == "__main__":
    main()
