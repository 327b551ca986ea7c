"""A real agent serves a model named by hf:// from a Hub on loopback (tests/agent/cache/fake_hub.py): it
downloads the GGUF through huggingface_hub's metadata calls, llama-server serves it, and a chat
completion comes back through the gateway. A gated repository shows on the replica and the node."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from e2e_support import AgentFactory, ServerFactory, short_deadline_args, wait_for

from agent.cache.fake_hub import FakeHub
from fleetserve.dev.tinymodel import write_tiny_model

pytestmark = pytest.mark.slow

NODE = "hub-node"


@pytest.fixture
def hub() -> Iterator[FakeHub]:
    fake = FakeHub(token="hf_e2e_secret")
    try:
        yield fake
    finally:
        fake.close()


def documents(source: str, size: int) -> list[dict[str, Any]]:
    return [
        {"kind": "Model", "name": "hubtiny", "source": source, "format": "gguf", "size": size},
        {
            "kind": "Deployment",
            "name": "hubtiny",
            "model": "hubtiny",
            "replicas": 1,
            "profiles": [{"name": "cpu", "engine": "llama.cpp", "cpu": {"cores": 1}, "context": 256}],
        },
    ]


def start(servers: ServerFactory, agents: AgentFactory, tmp_path: Path, hub: FakeHub) -> Any:
    server = servers.start(
        f"sqlite:///{tmp_path / 'state.db'}", name="server", extra_args=short_deadline_args(tmp_path)
    )
    agents.start(
        server.url,
        server.join_token,
        NODE,
        # The Hub stand-in is on loopback: the agent refuses that unless told.
        extra_args=("--allow-private-sources",),
        env={"HF_ENDPOINT": hub.endpoint},
    )

    def registered() -> bool:
        with server.client(timeout=10) as api:
            return any(n["name"] == NODE and n["state"] == "Ready" for n in api.get("/nodes").json())

    wait_for(registered, timeout=60, what=f"{NODE} to register")
    return server


def replica(server: Any) -> dict[str, Any] | None:
    with server.client(timeout=10) as api:
        for item in api.get("/replicas", params={"deployment": "hubtiny"}).json():
            view: dict[str, Any] = api.get(f"/replicas/{item['name']}").json()
            return view
    return None


def test_an_agent_serves_an_hf_gguf_from_the_hub_and_answers_through_the_gateway(
    servers: ServerFactory, agents: AgentFactory, tmp_path: Path, hub: FakeHub
) -> None:
    body = write_tiny_model(tmp_path / "upload" / "tiny.gguf").read_bytes()
    commit = hub.add("org/tiny-gguf", {"tiny.gguf": body, "README.md": b"# tiny\n"})
    hub.delay = 0.1  # a slow link: about 3 s for the tiny model, so the download can be watched
    server = start(servers, agents, tmp_path, hub)
    server.apply(documents("hf://org/tiny-gguf/tiny.gguf", len(body)))

    # While it downloads, the replica says from where and how far.
    def downloading() -> dict[str, Any] | None:
        view = replica(server)
        message = view["status"].get("message", "") if view else ""
        return view if "downloading model hubtiny from hf://org/tiny-gguf/tiny.gguf: " in message else None

    assert wait_for(downloading, timeout=60, what="the replica to report the download")["state"] == "Starting"

    def running() -> dict[str, Any] | None:
        view = replica(server)
        return view if view and view["state"] == "Running" and view["status"].get("port") else None

    wait_for(running, timeout=120, what="the hf:// replica to be Running")
    # The node reports the model cached, and what the Hub was asked.
    with server.client(timeout=10) as api:
        node = api.get(f"/nodes/{NODE}").json()
        key = api.post("/keys", json={"name": "hub", "models": ["*"]}).json()["key"]
    assert "hubtiny" in node["modelCache"], node
    assert any(r.path == f"/org/tiny-gguf/resolve/{commit}/tiny.gguf" for r in hub.seen("hub", "HEAD"))
    assert [r.status for r in hub.seen("cdn", "GET")] == [200]

    reply = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={"model": "hubtiny", "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 8},
        headers={"Authorization": f"Bearer {key}"},
        timeout=60,
    )
    assert reply.status_code == 200, reply.text
    answer = reply.json()
    assert answer["usage"]["completion_tokens"] >= 1
    assert answer["choices"][0]["message"]["role"] == "assistant"


def test_a_gated_repository_fails_the_replica_with_the_repository_and_the_fix(
    servers: ServerFactory, agents: AgentFactory, tmp_path: Path, hub: FakeHub
) -> None:
    hub.add("org/gated", {"tiny.gguf": b"GGUF" + bytes(1000)}, gated=True)
    server = start(servers, agents, tmp_path, hub)
    server.apply(documents("hf://org/gated/tiny.gguf", 1004))

    def failed() -> dict[str, Any] | None:
        view = replica(server)
        return view if view and "is gated" in view["status"].get("message", "") else None

    view = wait_for(failed, timeout=60, what="the replica to say the repository is gated")
    message = view["status"]["message"]
    assert view["state"] == "Failed"
    assert "org/gated is gated" in message and "HF_TOKEN" in message and "--hf-token-file" in message
    # The node's download status names the source and the error too.
    with server.client(timeout=10) as api:
        status = api.get(f"/nodes/{NODE}").json()["status"]["agent"]
    (download,) = [d for d in status["downloads"] if d["model"] == "hubtiny"]
    assert download["state"] == "failed" and "org/gated is gated" in download["error"]
    assert download["source"] == "hf://org/gated/tiny.gguf"
