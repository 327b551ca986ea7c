"""Rate limits shared by several real ``fleetserve gateway`` processes through one Redis
(127.0.0.1:6379, ``scripts/ensure-redis.sh``), and a gateway that loses its Redis.

Three gateways run over one SQLite store holding a replica whose engine is a fake OpenAI engine
(fleetserve.dev.fake_openai) in this process. Each test module uses a namespace of its own in
Redis, so parallel runs never share windows.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest

from fake_engine import engines_on, fake_openai_engine
from fleetserve.store.sql import SqlStore

pytestmark = pytest.mark.slow

FLEETSERVE = Path(sys.executable).with_name("fleetserve")
REDIS = "redis://127.0.0.1:6379/0"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(check, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = check()
        except (httpx.HTTPError, OSError):
            value = None
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def start_gateway(
    database: Path, redis_url: str, namespace: str, log: Path
) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEETSERVE_")}
    with log.open("wb") as out:
        proc = subprocess.Popen(
        [str(FLEETSERVE), "gateway", "--database-url", f"sqlite:///{database}", "--port", str(port),
         "--redis-url", redis_url, "--redis-namespace", namespace, "--log-level", "warning"],
        stdout=out, stderr=subprocess.STDOUT, env=env,
    )  # fmt: skip
    return proc, port


def routed(port: int, key: str) -> bool:
    got = httpx.get(
        f"http://127.0.0.1:{port}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=2
    )
    return got.status_code == 200 and [m["id"] for m in got.json()["data"]] == ["tiny"]


def ask(port: int, key: str, **fields: object) -> httpx.Response:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8, **fields}
    return httpx.post(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {key}"},
        timeout=30,
    )


class Fleet:
    def __init__(self, database: Path, ports: list[int], store: SqlStore) -> None:
        self.database = database
        self.ports = ports
        self.store = store

    def key(self, name: str, rpm: int | None = None, tpm: int | None = None) -> str:
        return self.store.create_api_key(name, ["*"], rpm, tpm, datetime.now(UTC))[1]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    tmp = tmp_path_factory.mktemp("shared")
    database = tmp / "state.db"
    namespace = f"test-{uuid.uuid4().hex}"
    procs = []
    with fake_openai_engine() as engine_port, SqlStore.open(database) as store:
        engines_on(store, [engine_port], tmp / "tiny.gguf")
        probe = store.create_api_key("probe", ["*"], None, None, datetime.now(UTC))[1]
        try:
            for i in range(3):
                procs.append(start_gateway(database, REDIS, namespace, tmp / f"gateway-{i}.log"))
            for proc, port in procs:
                wait_for(
                    lambda g=proc, p=port: g.poll() is None and routed(p, probe), 60, f"gateway on {port}"
                )
            yield Fleet(database, [port for _, port in procs], store)
        finally:
            for proc, _ in procs:
                proc.terminate()
            for proc, _ in procs:
                proc.wait(20)


def test_three_gateways_share_one_request_window(fleet):
    key = fleet.key("five-a-minute", rpm=5)
    statuses = [ask(fleet.ports[i % 3], key).status_code for i in range(12)]
    # Each gateway alone would have let 5 through (12 in all): together they let 5 through.
    assert statuses.count(200) == 5 and statuses.count(429) == 7, statuses
    assert statuses[:5] == [200] * 5


def test_tokens_used_through_one_gateway_count_at_the_others(fleet):
    key = fleet.key("hundred-tokens", tpm=100)
    first = ask(fleet.ports[0], key, max_tokens=60)
    assert first.status_code == 200 and first.json()["usage"]["total_tokens"] >= 60
    second = ask(fleet.ports[1], key, max_tokens=60, stream=True)  # streamed, no usage asked for
    assert second.status_code == 200 and '"usage"' not in second.text
    third = ask(fleet.ports[2], key, max_tokens=1)
    assert third.status_code == 429, third.text
    assert third.json()["error"]["type"] == "tokens"


def redis_server(port: int, log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        proc = subprocess.Popen(
        ["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no"],
        stdout=out, stderr=subprocess.STDOUT,
    )  # fmt: skip
    wait_for(lambda: socket.create_connection(("127.0.0.1", port), 1).close() or True, 10, "redis-server")
    return proc


def metric(port: int, name: str) -> float | None:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return None


def test_a_gateway_that_loses_redis_falls_back_to_its_own_windows_and_says_so(fleet, tmp_path):
    redis_port = free_port()
    redis = redis_server(redis_port, tmp_path / "redis.log")
    log = tmp_path / "gateway.log"
    proc, port = start_gateway(fleet.database, f"redis://127.0.0.1:{redis_port}/0", "lost", log)
    try:
        key = fleet.key("two-a-minute-lost", rpm=2)
        wait_for(lambda: proc.poll() is None and routed(port, key), 60, "the gateway")
        assert ask(port, key).status_code == 200
        assert metric(port, "fleetserve_ratelimit_shared") == 1.0
        redis.send_signal(signal.SIGKILL)
        redis.wait(10)
        # Served from this gateway's own windows, which start empty: 2 more, then 429.
        statuses = [ask(port, key).status_code for _ in range(3)]
        assert statuses == [200, 200, 429], statuses
        assert metric(port, "fleetserve_ratelimit_shared") == 0.0
        assert metric(port, "fleetserve_ratelimit_fallbacks_total") == 1.0
        text = log.read_text(errors="replace")
        assert text.count("lost Redis at redis://127.0.0.1:") == 1, text
        # Redis back: after the retry pause the windows are shared again.
        redis = redis_server(redis_port, tmp_path / "redis.log")
        wait_for(
            lambda: ask(port, key).status_code == 200 and metric(port, "fleetserve_ratelimit_shared") == 1.0,
            20,
            "shared again",
        )
        assert "answers again" in log.read_text(errors="replace")
    finally:
        proc.terminate()
        proc.wait(20)
        redis.kill()
        redis.wait(10)
