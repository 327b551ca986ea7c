"""Attacks on the listeners and the gateway's data path, each against real processes (issue 31,
item 8): a real ``fleetserve server`` with a real agent, a real ``fleetserve gateway`` in front
of a real llama-server or of a hostile engine (a raw-socket script), attackers on raw sockets.

    (a) a 112 MB request header to the server, unauthenticated, while nodes heartbeat: 431, the
        heartbeats are answered within the NotReady deadline, no node leaves Ready
    (b) slowloris, 1,000 sockets whose heads never end, against a gateway under a 1,024-file
        limit: past the connection cap refused at once (503), the rest 408 after the head
        timeout, the process never out of descriptors, a normal request served after
    (c) a body of one 80,000-key object: 400 from the gateway, llama-server's CPU untouched
    (d) a 1 GB non-streamed answer from a hostile engine: the gateway holds no more than its
        answer limit (VmHWM), the client gets an error naming the limit, the engine's
        connection is aborted
    (e) Set-Cookie and text/html from an engine: not passed to the client

Each test prints its figures (``-s`` shows them).
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import selectors
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import orjson
import psutil
import pytest
from e2e_support import (
    FLEETSERVE,
    GROWING,
    AgentFactory,
    ServerFactory,
    clean_env,
    free_port,
    run_cli,
    short_deadline_args,
    slow_chat,
    wait_for,
)

from fake_engine import run_replica_on
from fleetserve.engines.binaries import resolve
from fleetserve.engines.spec import EngineKind, RuntimeVariant
from fleetserve.store.sql import SqlStore

pytestmark = pytest.mark.slow

AGENT_API = "/api/v1/agent"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("model") / "tiny.gguf"
    out = run_cli("dev", "tiny-model", str(path))
    assert out.returncode == 0 and path.exists(), out.stderr
    return path


def rss_kib(pid: int, field: str = "VmRSS") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} for {pid}")


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of ``pid`` (/proc/PID/stat utime and stime)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def answer_of(sock: socket.socket, timeout: float) -> tuple[int | None, bytes]:
    """The status and body of the one answer on ``sock`` (None: closed or reset without one)."""
    sock.settimeout(timeout)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except OSError:  # reset, aborted or timed out: what came before it is the answer
        pass
    if not data.startswith(b"HTTP/1.1 "):
        return None, data
    return int(data.split()[1]), data.partition(b"\r\n\r\n")[2]


# --- a standalone gateway over a database that records one replica ------------------------------


class Gateway:
    def __init__(self, proc: subprocess.Popen[bytes], port: int, key: str, log: Path) -> None:
        self.proc, self.port, self.key, self.log = proc, port, key, log

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def post(self, body: bytes | dict[str, Any], path: str = "/v1/chat/completions") -> httpx.Response:
        content = body if isinstance(body, bytes) else orjson.dumps(body)
        headers = {"Authorization": f"Bearer {self.key}", "Content-Type": "application/json"}
        return httpx.post(self.url + path, content=content, headers=headers, timeout=120)


@contextlib.contextmanager
def gateway_before(
    tmp_path: Path, engine_port: int, model: Path, *args: str, open_files: int | None = None
) -> Iterator[Gateway]:
    """``fleetserve gateway`` over a SQLite file whose one replica of ``tiny`` is at ``engine_port``;
    with ``open_files``, under that soft open-file limit."""
    database = tmp_path / "state.db"
    with SqlStore.open(database) as store:
        run_replica_on(store, engine_port, model)
        _, key = store.create_api_key("attacker", ["*"], None, None, datetime.now(UTC))
    port = free_port()

    def limit() -> None:
        if open_files is not None:
            resource.setrlimit(
                resource.RLIMIT_NOFILE, (open_files, resource.getrlimit(resource.RLIMIT_NOFILE)[1])
            )

    log = tmp_path / "gateway.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [
                str(FLEETSERVE),
                "gateway",
                "--database-url",
                f"sqlite:///{database}",
                "--port",
                str(port),
                *args,
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=clean_env(),
            preexec_fn=limit,
        )
    gateway = Gateway(proc, port, key, log)
    try:

        def healthy() -> bool:
            if proc.poll() is not None:
                raise AssertionError(log.read_text(errors="replace"))
            try:
                return httpx.get(gateway.url + "/healthz", timeout=2).status_code == 200
            except httpx.TransportError:
                return False

        wait_for(healthy, timeout=60, what="the gateway to answer")
        yield gateway
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


# --- a hostile engine: a raw-socket script ----------------------------------------------------

HOSTILE = r"""
import socket, sys
mode, port_file = sys.argv[1], sys.argv[2]
listener = socket.create_server(("127.0.0.1", 0))
open(port_file, "w").write(str(listener.getsockname()[1]))
while True:
    conn, _ = listener.accept()
    with conn:
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = conn.recv(65536)
            if not chunk:
                break
            head += chunk
        if not head.startswith(b"POST"):
            conn.sendall(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            continue
        if mode == "cookie":
            body = b"<html><body><script>document.title='pwned'</script>hi</body></html>"
            stream = b"stream\": true" in head or b'"stream":true' in head
            conn.sendall(
                b"HTTP/1.1 200 OK\r\nContent-Type: text/html\r\nSet-Cookie: fleetserve_session=evil; Path=/\r\n"
                b"Set-Cookie: other=1\r\nAccess-Control-Allow-Origin: *\r\nX-Request-Id: hostile-1\r\n"
                b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body
            )
            continue
        # mode "huge": a 1 GB JSON answer, chunked, as fast as the gateway reads it; "declared":
        # the same with its length declared up front
        if mode == "declared":
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % (1 << 30))
            piece = b"x" * (1 << 20)
        else:
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
            piece = b"100000\r\n" + b"x" * (1 << 20) + b"\r\n"
        sent = 0
        try:
            for _ in range(1024):
                conn.sendall(piece)
                sent += 1 << 20
            conn.sendall(b"0\r\n\r\n")
            print(f"sent all {sent} bytes", flush=True)
        except OSError as exc:
            print(f"aborted after {sent} bytes: {type(exc).__name__}", flush=True)
"""


@contextlib.contextmanager
def hostile_engine(tmp_path: Path, mode: str) -> Iterator[tuple[int, Path]]:
    script = tmp_path / "hostile.py"
    script.write_text(HOSTILE)
    port_file = tmp_path / f"{mode}.port"
    log = tmp_path / f"hostile-{mode}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, str(script), mode, str(port_file)], stdout=out, stderr=subprocess.STDOUT
        )
    try:
        wait_for(lambda: port_file.exists() and port_file.read_text(), timeout=20, what="the hostile engine")
        yield int(port_file.read_text()), log
    finally:
        proc.kill()
        proc.wait(timeout=10)


# --- (a) ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("pace", [0.0, 0.01], ids=["fast", "slow"])
def test_a_a_112_mb_header_is_431_while_heartbeats_are_answered_and_no_node_leaves_ready(
    servers: ServerFactory, agents: AgentFactory, tmp_path: Path, pace: float
) -> None:
    server = servers.start(f"sqlite:///{tmp_path / 'state.db'}", extra_args=short_deadline_args(tmp_path))
    agents.start(server.url, server.join_token, "n1")

    def states() -> dict[str, str]:
        with server.client(timeout=10) as api:
            return {n["name"]: n["state"] for n in api.get("/nodes").json()}

    wait_for(lambda: states().get("n1") == "Ready", timeout=60, what="n1 Ready")
    # A second node whose heartbeats this test sends itself, timing each (registered now: silent
    # for 2 s, it would be NotReady).
    with httpx.Client(base_url=server.url + AGENT_API, timeout=30) as http:
        doc = {"kind": "Node", "name": "hb", "address": "127.0.0.1", "cpu": {"cores": 2, "memory": "4GiB"}}
        registered = http.post(
            "/register", json=doc, headers={"Authorization": f"Bearer {server.join_token}"}
        )
        assert registered.status_code == 200, registered.text
    credential, epoch = registered.json()["credential"], registered.json()["epoch"]

    stop = threading.Event()
    latencies: list[tuple[float, float]] = []  # (sent at, seconds)
    seen_states: list[dict[str, str]] = []
    refusals: list[str] = []  # heartbeats not answered 200

    def heartbeats() -> None:
        with httpx.Client(base_url=server.url + AGENT_API, timeout=30) as hb:
            while not stop.is_set():
                started = time.monotonic()
                reply = hb.post(
                    "/heartbeat",
                    json={"node": "hb", "epoch": epoch},
                    headers={"Authorization": f"Bearer {credential}"},
                )
                if reply.status_code != 200:
                    refusals.append(reply.text)
                latencies.append((started, time.monotonic() - started))
                time.sleep(0.1)

    def watch() -> None:
        while not stop.is_set():
            seen_states.append(states())
            time.sleep(0.2)

    threads = [threading.Thread(target=heartbeats, daemon=True), threading.Thread(target=watch, daemon=True)]
    for thread in threads:
        thread.start()
    time.sleep(1.0)

    # The attack: one unauthenticated request whose header is 112 MB, sent as fast as it goes
    # or 64 KiB every ``pace`` seconds, until the server cuts it off.
    attack_started = time.monotonic()
    sock = socket.create_connection(("127.0.0.1", int(server.url.rsplit(":", 1)[1])))
    got: list[tuple[int | None, bytes]] = []
    reader = threading.Thread(target=lambda: got.append(answer_of(sock, 60)), daemon=True)
    reader.start()
    sent = 0
    with contextlib.suppress(OSError):
        sock.sendall(b"GET /api/v1/nodes HTTP/1.1\r\nHost: x\r\nX-Big: ")
        piece = b"a" * (1 << 16)
        for _ in range(112 * 16):
            sock.sendall(piece)
            sent += len(piece)
            if pace:
                time.sleep(pace)
    reader.join(60)
    attack_ended = time.monotonic()
    sock.close()
    time.sleep(3.0)  # past the NotReady deadline (2 s): had the loop stalled, it would show now
    stop.set()
    for thread in threads:
        thread.join(30)

    status, body = got[0]
    during = [s for at, s in latencies if attack_started - 0.5 <= at <= attack_ended + 0.5]
    ordered = sorted(s for _, s in latencies)
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
    print(
        f"\n(a, {'slow' if pace else 'fast'}) {status}; {sent / 1e6:.1f} MB of 117 MB (112 MiB) sent before the "
        f"connection ended (past 64 KiB read and dropped); attack {attack_ended - attack_started:.2f} s; "
        f"heartbeats {len(latencies)} (during the attack {len(during)}): median "
        f"{statistics.median(s for _, s in latencies) * 1000:.1f} ms, p99 {p99 * 1000:.1f} ms, max "
        f"{max(ordered) * 1000:.1f} ms (during: max {max(during, default=0) * 1000:.1f} ms); "
        f"node states seen: {sorted({(n, s) for st in seen_states for n, s in st.items()})}"
    )
    assert status == 431, (status, body[:200])
    assert "--max-head-bytes" in json.loads(body)["error"]["message"]
    assert during, "no heartbeat was sent while the attack ran"
    assert not refusals, refusals
    assert max(ordered) < 2.0  # the NotReady deadline: every heartbeat answered within it
    assert all(st.get("n1") == "Ready" and st.get("hb") == "Ready" for st in seen_states), seen_states
    assert server.alive()


# --- (b) ------------------------------------------------------------------------------------------


def test_b_slowloris_is_refused_past_the_cap_and_timed_out_under_it_and_the_gateway_serves_after(
    tmp_path: Path, tiny_model: Path
) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 4096:
        pytest.skip(f"the test opens 1,000+ sockets; this machine's hard open-file limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 4096), hard))
    head_timeout = 3.0
    with (
        hostile_engine(tmp_path, "cookie") as (engine_port, _),
        gateway_before(
            tmp_path, engine_port, tiny_model, "--head-timeout", str(head_timeout), open_files=1024
        ) as gateway,
    ):
        fds_before = len(os.listdir(f"/proc/{gateway.proc.pid}/fd"))
        sockets: list[socket.socket] = []
        started = time.monotonic()
        for _ in range(1000):
            sock = socket.create_connection(("127.0.0.1", gateway.port), timeout=10)
            with contextlib.suppress(OSError):
                sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n")
            sock.setblocking(False)
            sockets.append(sock)
        # During the attack a new client is answered at once, not left hanging.
        with socket.create_connection(("127.0.0.1", gateway.port), timeout=10) as probe:
            during, _ = answer_of(probe, 10)
        answers: dict[int, tuple[int | None, float]] = {}
        buffers: dict[int, bytes] = {}
        peak_fds = 0
        selector = selectors.DefaultSelector()
        for i, sock in enumerate(sockets):
            selector.register(sock, selectors.EVENT_READ, i)
        last_trickle = time.monotonic()
        while len(answers) < len(sockets) and time.monotonic() - started < head_timeout + 30:
            for key, _ in selector.select(timeout=0.2):
                i = key.data
                try:
                    chunk = key.fileobj.recv(65536)  # type: ignore[union-attr]
                except (ConnectionResetError, BlockingIOError):
                    chunk = b""
                if chunk:
                    buffers[i] = buffers.get(i, b"") + chunk
                    continue
                data = buffers.get(i, b"")
                status = int(data.split()[1]) if data.startswith(b"HTTP/1.1 ") else None
                answers[i] = (status, time.monotonic() - started)
                selector.unregister(key.fileobj)
            peak_fds = max(peak_fds, len(os.listdir(f"/proc/{gateway.proc.pid}/fd")))
            if time.monotonic() - last_trickle > 1.0:  # slowloris: one more header line a second
                last_trickle = time.monotonic()
                for i, sock in enumerate(sockets):
                    if i not in answers:
                        with contextlib.suppress(OSError):
                            sock.send(b"X-Slow: 1\r\n")
        for sock in sockets:
            sock.close()
        after = httpx.get(gateway.url + "/healthz", timeout=10).status_code
        alive = gateway.proc.poll() is None

    by_status: dict[int | None, list[float]] = {}
    for status, at in answers.values():
        by_status.setdefault(status, []).append(at)
    summary = {s: (len(t), f"{min(t):.2f}-{max(t):.2f} s") for s, t in by_status.items()}
    print(
        f"\n(b) 1000 slowloris sockets, gateway under a 1024-file limit (cap 512), head timeout "
        f"{head_timeout:g} s: answers {summary} (None: reset or closed without an answer); "
        f"a new client during the attack: {during}; descriptors {fds_before} before, peak {peak_fds}; "
        f"/healthz after: {after}"
    )
    assert len(answers) == 1000, f"{1000 - len(answers)} sockets never answered"
    timed_out = by_status.get(408, [])
    assert len(timed_out) == 512  # the cap (half the 1024-file limit): each held one, then 408
    assert min(timed_out) >= head_timeout * 0.9
    refused = len(by_status.get(503, [])) + len(by_status.get(None, []))
    assert refused == 1000 - 512
    assert during in (503, None)
    assert peak_fds < 1024 and alive and after == 200


# --- (c) ------------------------------------------------------------------------------------------


@contextlib.contextmanager
def llama_server(tmp_path: Path, model: Path, context: int = 256) -> Iterator[subprocess.Popen[bytes]]:
    port = free_port()
    binary = resolve(EngineKind.LLAMACPP, RuntimeVariant.CPU, {})
    with (tmp_path / "llama-server.log").open("wb") as out:
        proc = subprocess.Popen(
            [
                binary,
                "-m",
                str(model),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "-c",
                str(context),
                "-t",
                "1",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:

        def ready() -> bool:
            try:
                return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
            except httpx.TransportError:
                return False

        wait_for(ready, timeout=120, what="llama-server to load the tiny model")
        proc.port = port  # type: ignore[attr-defined]
        yield proc
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_c_an_80k_key_body_is_400_before_llama_server_sees_it(tmp_path: Path, tiny_model: Path) -> None:
    with (
        llama_server(tmp_path, tiny_model) as engine,
        gateway_before(tmp_path, engine.port, tiny_model) as gateway,  # type: ignore[attr-defined]
    ):
        served = gateway.post({"model": "tiny", "prompt": "hi", "max_tokens": 2}, "/v1/completions")
        assert served.status_code == 200, served.text  # the engine is reachable through the gateway
        body = orjson.dumps(
            {
                "model": "tiny",
                "prompt": "hi",
                "max_tokens": 2,
                "logit_bias": {str(i): 0 for i in range(80_000)},
            }
        )
        before = cpu_seconds(engine.pid)
        refused = gateway.post(body, "/v1/completions")
        time.sleep(1.0)
        spent = cpu_seconds(engine.pid) - before
    error = refused.json()["error"]
    print(
        f"\n(c) {len(body) / 1e6:.2f} MB body, one object of 80,000 keys: {refused.status_code} "
        f"{error['message']!r}; llama-server CPU during and 1 s after: {spent:.2f} s"
    )
    assert refused.status_code == 400
    assert "--body-limit generation.keys=N" in error["message"]
    assert spent < 0.5  # llama-server idles; it never parsed the body (measured 20 s when it did)


# --- (d) ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["declared", "huge"])
def test_d_a_1_gb_answer_is_not_held_and_never_reaches_the_client_whole(
    tmp_path: Path, tiny_model: Path, mode: str
) -> None:
    """Declared 1 GiB: refused before its first byte, 502 naming the limit. Chunked: passed in
    pieces up to the limit (64 MiB), then cut off, the client's connection closed mid-answer."""
    with (
        hostile_engine(tmp_path, mode) as (engine_port, engine_log),
        gateway_before(tmp_path, engine_port, tiny_model) as gateway,
    ):
        rss_before = rss_kib(gateway.proc.pid)
        try:
            answer: httpx.Response | Exception = gateway.post(
                {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
            )
        except httpx.RemoteProtocolError as exc:
            answer = exc
        peak = rss_kib(gateway.proc.pid, "VmHWM")
        rss_after = rss_kib(gateway.proc.pid)
        served = httpx.get(gateway.url + "/v1/models", headers={"Authorization": f"Bearer {gateway.key}"})
    engine_said = engine_log.read_text()
    said = (
        f"{answer.status_code} {answer.json()['error']!r}"
        if isinstance(answer, httpx.Response)
        else repr(answer)
    )
    print(
        f"\n(d) 1 GiB answer offered ({mode}): client got {said}; gateway RSS {rss_before / 1024:.0f} MiB "
        f"before, peak (VmHWM) {peak / 1024:.0f} MiB, {rss_after / 1024:.0f} MiB after; "
        f"engine: {engine_said.strip().splitlines()}"
    )
    if mode == "declared":
        # The engine answered (a status line came): its answer is not relayed, nor retried elsewhere.
        assert isinstance(answer, httpx.Response)
        error = answer.json()["error"]
        assert answer.status_code == 502 and error["code"] == "answer_too_large"
        assert "1073741824" in error["message"] or "67108864" in error["message"]
        assert "--max-answer-bytes" in error["message"]
    else:
        assert isinstance(answer, httpx.RemoteProtocolError)  # cut off, never ended as if whole
    assert (peak - rss_before) < 200 * 1024  # pieces pass; not 1 GiB
    assert "aborted after" in engine_said  # the gateway cut the engine off
    assert served.status_code == 200  # and went on serving


# --- (e) ------------------------------------------------------------------------------------------


def test_e_set_cookie_and_html_from_an_engine_never_reach_the_client(
    tmp_path: Path, tiny_model: Path
) -> None:
    with (
        hostile_engine(tmp_path, "cookie") as (engine_port, _),
        gateway_before(tmp_path, engine_port, tiny_model) as gateway,
    ):
        plain = gateway.post({"model": "tiny", "messages": [{"role": "user", "content": "hi"}]})
        streamed = gateway.post(
            {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True}
        )
    for name, response in (("answer", plain), ("stream", streamed)):
        print(f"\n(e) {name}: {response.status_code} {sorted(response.headers.items())}")
        assert response.status_code == 200
        assert "set-cookie" not in response.headers
        assert "access-control-allow-origin" not in response.headers
        assert response.headers["content-type"] == "text/plain; charset=utf-8"
        assert response.headers["x-content-type-options"] == "nosniff"
        assert response.headers["x-request-id"] == "hostile-1"


# --- a client that leaves ---------------------------------------------------------------------------


def test_a_client_that_leaves_a_non_streamed_request_stops_the_engines_work(
    tmp_path: Path, tiny_model: Path
) -> None:
    with (
        llama_server(tmp_path, tiny_model) as engine,
        gateway_before(tmp_path, engine.port, tiny_model) as gateway,  # type: ignore[attr-defined]
    ):
        slots_url = f"http://127.0.0.1:{engine.port}/slots"  # type: ignore[attr-defined]
        decoded: list[int] = []

        def upstream() -> list[Any]:
            """The gateway's open connections to the engine."""
            return [
                c
                for c in psutil.Process(gateway.proc.pid).net_connections("tcp")
                if c.raddr and c.raddr.port == engine.port and c.status == "ESTABLISHED"  # type: ignore[attr-defined]
            ]

        def processing() -> int:
            busy = [slot for slot in httpx.get(slots_url, timeout=5).json() if slot.get("is_processing")]
            decoded.extend(t["n_decoded"] for slot in busy for t in slot.get("next_token") or ())
            return len(busy)

        # The tiny model's 233 tokens under a grammar whose parse stacks grow: ~11 s of work, the
        # later tokens the slowest, unless cancelled.
        body = orjson.dumps({**slow_chat("tiny", "hi", max_tokens=2000), **GROWING})
        sock = socket.create_connection(("127.0.0.1", gateway.port))
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: g\r\nAuthorization: Bearer %s\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n"
            % (gateway.key.encode(), len(body))
            + body
        )
        wait_for(lambda: processing() == 1, timeout=30, what="the engine to work on the request")
        time.sleep(1.5)
        left = time.monotonic()
        sock.close()  # the client leaves before any answer
        wait_for(lambda: not upstream(), timeout=10, what="the gateway to abort its engine connection")
        aborted_after = time.monotonic() - left
        # Polled every 2 s: llama-server (b11434) checks a non-streamed request's connection only
        # when no result of any task reached it for a whole second (server_response::
        # recv_with_timeout restarts its wait on every other result), so polling /slots faster
        # than that would itself keep the abandoned request running.
        wait_for(lambda: processing() == 0, timeout=30, what="the engine to drop the request", interval=2.0)
        stopped_after = time.monotonic() - left
        idle_cpu = cpu_seconds(engine.pid)
        time.sleep(2.0)
        spent_idle = cpu_seconds(engine.pid) - idle_cpu
    print(
        f"\n(leave) non-streamed request: gateway's engine connection aborted {aborted_after:.2f} s and "
        f"engine slot free {stopped_after:.2f} s after the client left, at "
        f"{max(decoded)} of the 233 tokens it would have generated; engine CPU then {spent_idle:.2f} s in 2 s"
    )
    engine_log = (tmp_path / "llama-server.log").read_text(errors="replace")
    assert "cancel task" in engine_log  # cancelled by llama-server, not run to its end
    assert max(decoded) < 233
    assert spent_idle < 0.5
