"""vLLM's KV cache events reach the gateways through the agent, for real: a real ``fleetserve
server`` and ``fleetserve agent`` serve deployment ``tiny`` on a llama.cpp replica and a vLLM CPU
replica (the tiny model as GGUF, and as safetensors from an offline Hub mirror), cache-aware.

The agent starts vLLM with ``--kv-events-config`` naming a socket the agent bound on 127.0.0.1
(vLLM connects to it; nothing of the engine listens for events), consumes the events and reports
the blocks held in its status report; prompts routed to vLLM show as blocks stored there. Then
vLLM's cache is reset (``POST /reset_prefix_cache``, a development route: the agent runs with
``VLLM_SERVER_DEV_MODE=1``): vLLM publishes AllBlocksCleared (with its next engine step: a short
request sent to it directly, not through the gateway), the agent reports the clear, the
store's change counter moves, the observer moves the replica's epoch, and the gateway's model of
the replica is cleared: it no longer expects the prompt cached there (its pick's reason says 0
tokens).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from e2e_support import LiveFleet, engine_headers, hf_cache_repo, live_fleet, run_cli, wait_for

from fleetserve.dev.tinymodel import write_tiny_model

pytestmark = pytest.mark.slow

NODE = "cpu-kv"
REPO = "fleetserve/tiny-kv"
DEPLOYMENT = "tiny"
LLAMA, VLLM = "llama-cpu", "vllm-cpu"
# vLLM's first start on 2 shared cores: imports, the model, torch.compile's warm-up.
VLLM_START_TIMEOUT = 600.0
# About 200 tokens with the chat template (one a byte): under the tiny model's 256 of context.
SYSTEM = "You are the careful assistant of the fleet; answer briefly and kindly. " * 2 + "Be exact. " * 2


def documents(gguf: Path) -> list[dict[str, Any]]:
    return [
        {
            "kind": "Model",
            "name": DEPLOYMENT,
            "source": str(gguf.resolve()),
            "format": "gguf",
            "alternates": [
                {
                    "format": "safetensors",
                    "source": f"hf://{REPO}",
                    "size": "2MB",
                    "architecture": {"layers": 2, "kvHeads": 2, "headDim": 64, "contextLength": 256},
                }
            ],
        },
        {
            "kind": "Deployment",
            "name": DEPLOYMENT,
            "model": DEPLOYMENT,
            "replicas": 2,
            "routing": {"policy": "cache-aware"},
            "profiles": [
                {"name": LLAMA, "engine": "llama.cpp", "cpu": {"cores": 2}, "context": 256},
                {"name": VLLM, "engine": "vllm", "runtime": "cpu", "cpu": {"cores": 1}, "context": 256},
            ],
        },
    ]


def tiny_safetensors(snapshot: Path) -> None:
    out = run_cli("dev", "tiny-model", "--format", "safetensors", str(snapshot))
    assert out.returncode == 0, out.stderr


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveFleet]:
    tmp = tmp_path_factory.mktemp("vllm-kv")
    mirror = tmp / "mirror"
    hf_cache_repo(mirror, REPO, tiny_safetensors)
    gguf = write_tiny_model(tmp / "tiny.gguf")
    with live_fleet(tmp, NODE, mirror, cores=3, agent_env={"VLLM_SERVER_DEV_MODE": "1"}) as fleet:
        fleet.server.apply(documents(gguf))
        wait_for(
            lambda: both_running(fleet), timeout=VLLM_START_TIMEOUT, what="both replicas Running", interval=1
        )
        yield fleet


def replicas(fleet: LiveFleet) -> dict[str, dict[str, Any]]:
    """The deployment's Running replicas with a port, by profile."""
    with fleet.server.client(timeout=10) as api:
        listed = api.get("/replicas", params={"deployment": DEPLOYMENT}).json()
        rows = [api.get(f"/replicas/{r['name']}").json() for r in listed]
    for row in rows:
        if row["state"] in ("Failed", "CrashLoop"):
            raise AssertionError(f"{row['name']}: {row['state']}: {row.get('status')}")
    return {r["profile"]: r for r in rows if r["state"] == "Running" and r["status"].get("port")}


def both_running(fleet: LiveFleet) -> bool:
    return set(replicas(fleet)) == {LLAMA, VLLM}


def ask(fleet: LiveFleet, system: str, user: str) -> tuple[dict[str, str], dict[str, Any]]:
    body = {
        "model": DEPLOYMENT,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        "max_tokens": 2,
    }
    answer = httpx.post(
        f"{fleet.server.url}/v1/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {fleet.key}", "x-fleetserve-debug": "pick"},
        timeout=120,
    )
    assert answer.status_code == 200, answer.text
    reason = dict(p.split("=", 1) for p in answer.headers["x-fleetserve-pick"].split("; "))
    return reason, answer.json()


def test_the_agent_relays_vllms_kv_events_and_a_cleared_cache_clears_the_gateways_model(
    fleet: LiveFleet,
) -> None:
    vllm = replicas(fleet)[VLLM]
    name, port = vllm["name"], int(vllm["status"]["port"])
    argv = fleet.engine_argv(port)
    config = json.loads(argv[argv.index("--kv-events-config") + 1])
    assert config["enable_kv_cache_events"] is True and config["publisher"] == "zmq"
    endpoint = config["endpoint"]
    assert endpoint.startswith("tcp://127.0.0.1:"), endpoint
    events_port = int(endpoint.rsplit(":", 1)[1])
    # The events socket is the agent's, bound on loopback; the engine only connects to it.
    agent = psutil.Process(fleet.agent.proc.pid)
    bound = [
        c
        for c in agent.net_connections("tcp")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == events_port
    ]
    assert [c.laddr.ip for c in bound] == ["127.0.0.1"], bound
    engine = fleet.engine(port)
    for process in (engine, *engine.children(recursive=True)):  # its engine core publishes
        listening = [c.laddr for c in process.net_connections("tcp") if c.status == psutil.CONN_LISTEN]
        assert all(a.port != events_port for a in listening), listening

    # System prompts no replica holds, until the gateway sends one to vLLM (least load: a coin);
    # then that one goes there, expected cached.
    prompts = (f"{i:03d} {SYSTEM}" for i in range(1000))

    def sent_to_vllm() -> str | None:
        system = next(prompts)
        return system if ask(fleet, system, "first")[0]["replica"] == name else None

    system = wait_for(sent_to_vllm, timeout=60, what="a pick of vLLM", interval=0.1)
    reason, answer = ask(fleet, system, "second")
    assert reason["replica"] == name and int(reason["cached_tokens"]) > 0, reason
    print(f"prompt tokens {answer['usage']['prompt_tokens']}, pick {reason}")

    def kv() -> dict[str, Any]:
        with fleet.server.client(timeout=10) as api:
            summary: dict[str, Any] = api.get(f"/replicas/{name}").json()["status"].get("kvCache") or {}
            return summary

    held = wait_for(
        lambda: kv() if kv().get("blocks", 0) > 0 else None, timeout=20, what="blocks reported held"
    )
    assert held["stored"] >= held["blocks"] > 0 and held["clears"] == 0
    print(f"vLLM's events as its agent reported them: {held}")

    # vLLM drops its whole cache: AllBlocksCleared.
    headers = engine_headers(fleet.server.database_url, name)
    reset = httpx.post(f"http://127.0.0.1:{port}/reset_prefix_cache", headers=headers, timeout=30)
    assert reset.status_code == 200 and reset.json() == {"success": True}, reset.text
    began = time.monotonic()
    # vLLM publishes its events after an engine step (``Scheduler.update_from_output``): the clear
    # leaves with its next request, here one of the engine's own clients, too short for a block.
    poke = {"model": DEPLOYMENT, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    direct = httpx.post(
        f"http://127.0.0.1:{port}/v1/chat/completions", json=poke, headers=headers, timeout=120
    )
    assert direct.status_code == 200, direct.text
    cleared = wait_for(
        lambda: kv() if kv().get("clears") == 1 else None, timeout=20, what="the clear reported"
    )
    assert cleared["blocks"] == 0
    # The gateway learns it: the next picks expect nothing cached (each ask before it knew taught
    # it the prompt again, which the clear drops too).
    after = wait_for(
        lambda: (r := ask(fleet, system, "after the reset")[0]) and r["cached_tokens"] == "0" and r,
        timeout=20,
        what="the gateway to expect nothing cached",
        interval=0.3,
    )
    print(f"the clear reached the gateway's model {time.monotonic() - began:.2f} s after the reset: {after}")
