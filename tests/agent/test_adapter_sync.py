"""The agent's run-time adapter loading (``agent/adapters.py``) against a loopback stand-in of vLLM's
``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (the live engine is
tests/e2e/test_adapters_live.py): what it calls with which key, what it pins and unpins, what it
reports loaded, and that an engine the supervisor restarted gets its run-time adapters again."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import pytest

from fleetserve.agent.adapters import AdapterSync
from fleetserve.engines.spec import EngineKind
from fleetserve.spec.resources import Model, ModelFormat
from loopback_http import serving_on_loopback

seen: list[tuple[str, dict[str, Any], str | None]] = []
refused: set[str] = set()


class FakeVllm(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        seen.append((self.path, body, self.headers.get("Authorization")))
        status = 400 if body.get("lora_name") in refused else 200
        self.send_response(status)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def port() -> Iterator[int]:
    seen.clear()
    refused.clear()
    with serving_on_loopback(FakeVllm, "fake-vllm-lora") as port:
        yield port


def lora(name: str) -> Model:
    return Model(name=name, source=f"hf://org/{name}", format=ModelFormat.SAFETENSORS, size=1000)


class Cache:
    """The node cache as the sync sees it: a path per adapter, pins counted."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.pins: dict[str, int] = {}
        self.lock = threading.Lock()

    def fetch(self, model: Model) -> Path:
        with self.lock:
            self.pins[model.name] = self.pins.get(model.name, 0) + 1
        return self.root / model.name

    def release(self, name: str) -> None:
        with self.lock:
            self.pins[name] -= 1


def settle(sync: AdapterSync, replica: str) -> None:
    deadline = time.monotonic() + 10
    while replica in sync._busy and time.monotonic() < deadline:
        time.sleep(0.01)
    assert replica not in sync._busy


def test_added_adapters_are_loaded_and_dropped_ones_unloaded_with_the_engines_key(
    port: int, tmp_path: Path
) -> None:
    cache = Cache(tmp_path)
    sync = AdapterSync(cache.fetch, cache.release, "127.0.0.1")
    sync.started("r-0", ["a"])
    assert sync.loaded("r-0") == ["a"]
    sync.sync("r-0", EngineKind.VLLM, [lora("a"), lora("b")], port, 0, "k")
    settle(sync, "r-0")
    assert seen == [
        ("/v1/load_lora_adapter", {"lora_name": "b", "lora_path": str(tmp_path / "b")}, "Bearer k")
    ]
    assert sync.loaded("r-0") == ["a", "b"] and cache.pins == {"b": 1}
    seen.clear()
    sync.sync("r-0", EngineKind.VLLM, [lora("b")], port, 0, "k")
    settle(sync, "r-0")
    assert seen == [("/v1/unload_lora_adapter", {"lora_name": "a"}, "Bearer k")]
    assert sync.loaded("r-0") == ["b"]
    # Nothing changed: no call.
    seen.clear()
    sync.sync("r-0", EngineKind.VLLM, [lora("b")], port, 0, "k")
    settle(sync, "r-0")
    assert seen == []
    assert sync.stopped("r-0") == ("b",)


def test_a_refused_load_is_not_reported_and_is_tried_again(port: int, tmp_path: Path) -> None:
    cache = Cache(tmp_path)
    sync = AdapterSync(cache.fetch, cache.release, "127.0.0.1")
    sync.started("r-0", [])
    refused.add("b")
    sync.sync("r-0", EngineKind.VLLM, [lora("b")], port, 0, None)
    settle(sync, "r-0")
    assert sync.loaded("r-0") is None and cache.pins == {"b": 0}
    refused.clear()
    sync.sync("r-0", EngineKind.VLLM, [lora("b")], port, 0, None)
    settle(sync, "r-0")
    assert sync.loaded("r-0") == ["b"] and cache.pins == {"b": 1}
    assert [c[0] for c in seen] == ["/v1/load_lora_adapter", "/v1/load_lora_adapter"]


def test_a_restarted_engine_gets_its_run_time_adapters_again(port: int, tmp_path: Path) -> None:
    cache = Cache(tmp_path)
    sync = AdapterSync(cache.fetch, cache.release, "127.0.0.1")
    sync.started("r-0", ["a"])
    sync.sync("r-0", EngineKind.VLLM, [lora("a"), lora("b")], port, 0, None)
    settle(sync, "r-0")
    seen.clear()
    # The supervisor restarted it (restarts 0 -> 1): it holds its argv's "a" only; "b" again.
    sync.sync("r-0", EngineKind.VLLM, [lora("a"), lora("b")], port, 1, None)
    settle(sync, "r-0")
    assert [(c[0], c[1]["lora_name"]) for c in seen] == [("/v1/load_lora_adapter", "b")]
    assert sync.loaded("r-0") == ["a", "b"] and cache.pins == {"b": 1}


def test_an_engine_that_loads_adapters_only_at_start_is_never_called(port: int, tmp_path: Path) -> None:
    cache = Cache(tmp_path)
    sync = AdapterSync(cache.fetch, cache.release, "127.0.0.1")
    sync.started("r-0", ["a"])
    sync.sync("r-0", EngineKind.LLAMACPP, [lora("a"), lora("b")], port, 0, None)
    assert "r-0" not in sync._busy and seen == [] and sync.loaded("r-0") == ["a"]
