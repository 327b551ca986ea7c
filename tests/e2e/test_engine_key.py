"""Engines behind the gateway only: every replica's engine demands its own API key.

A real ``fleetserve server`` and ``fleetserve agent`` run the real llama-server on the tiny
model. Playing someone on the node's network who found the engine's port: every request to the
engine without the replica's key (or with another key) is refused, while the gateway, which
reads the key from the store, answers, and the observer, which scrapes with it, publishes the
engine's metrics. The key is on no command line, in no admin API answer and in no log.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from e2e_support import (
    AgentFactory,
    ServerFactory,
    engine_key,
    llama_servers,
    run_cli,
    tiny_documents,
    wait_for,
)

pytestmark = pytest.mark.slow

NODE = "node-k"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("model") / "tiny.gguf"
    out = run_cli("dev", "tiny-model", str(path))
    assert out.returncode == 0 and path.exists(), out.stderr
    return path


def test_the_engine_refuses_a_request_without_its_key_and_the_gateway_still_answers(
    servers: ServerFactory, agents: AgentFactory, tmp_path: Path, tiny_model: Path
) -> None:
    server = servers.start(f"sqlite:///{tmp_path / 'state.db'}")
    agent = agents.start(server.url, server.join_token, NODE)
    with server.client(timeout=10) as api:
        wait_for(
            lambda: api.get(f"/nodes/{NODE}").status_code == 200, timeout=60, what="the node to register"
        )
        server.apply(tiny_documents(tiny_model), api)

        def running() -> dict[str, object] | None:
            for listed in api.get("/replicas", params={"deployment": "tiny"}).json():
                replica: dict[str, object] = api.get(f"/replicas/{listed['name']}").json()
                if replica["state"] == "Running" and replica["status"].get("port"):  # type: ignore[attr-defined]
                    return replica
            return None

        replica = wait_for(running, timeout=90, what="the tiny replica to be Running")
        name, port = str(replica["name"]), int(replica["status"]["port"])  # type: ignore[index]
        key = engine_key(server.database_url, name)
        assert len(key) >= 43
        # The admin API never shows the key: not in the replica, its status, the node or the deployment.
        for path in (f"/replicas/{name}", "/replicas", f"/nodes/{NODE}", "/deployments/tiny"):
            assert key not in api.get(path).text, path

    engine = f"http://127.0.0.1:{port}"
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    with httpx.Client(timeout=30) as http:
        # The attacker: no key, another replica's kind of key, the gateway's own API key, the
        # join and admin tokens. Every one is refused, on every route that serves or tells.
        wrong = ["", "Bearer not-the-key", f"Bearer {key[:-1]}", f"Bearer {server.join_token}",
                 f"Bearer {server.admin_token}", f"Basic {key}"]  # fmt: skip
        for authorization in wrong:
            headers = {"Authorization": authorization} if authorization else {}
            for method, path in (
                ("POST", "/v1/chat/completions"),
                ("POST", "/completion"),
                ("GET", "/metrics"),
                ("GET", "/slots"),
                ("GET", "/props"),
            ):
                refused = http.request(method, engine + path, headers=headers, json=chat)
                assert refused.status_code == 401, (
                    authorization[:12],
                    path,
                    refused.status_code,
                    refused.text,
                )
        # Liveness stays open (the agent's probe); it tells nothing and serves nothing.
        assert http.get(engine + "/health").status_code == 200
        opened = {"Authorization": f"Bearer {key}"}
        answer = http.post(engine + "/v1/chat/completions", headers=opened, json=chat)
        assert answer.status_code == 200, answer.text
        assert http.get(engine + "/metrics", headers=opened).status_code == 200
        assert http.get(engine + "/slots", headers=opened).status_code == 200

        # The gateway knows the key through the store: a client with an API key is answered.
        with server.client(timeout=10) as api:
            api_key = api.post("/keys", json={"name": "user", "models": ["*"]}).json()["key"]
        through = http.post(
            f"{server.url}/v1/chat/completions", headers={"Authorization": f"Bearer {api_key}"}, json=chat
        )
        assert through.status_code == 200, through.text
        assert through.json()["usage"]["completion_tokens"] >= 1

        # The observer scrapes the engine with the key: its series reach the server's /metrics.
        def scraped() -> bool:
            text = http.get(f"{server.url}/metrics").text
            return any(
                line.startswith("fleetserve_requests_running{") and f'replica="{name}"' in line
                for line in text.splitlines()
            )

        wait_for(scraped, timeout=20, what="the engine's series on the server's /metrics")

    # The key is in the engine's environment only: never on a command line, never in a log.
    [proc] = llama_servers(agent.cache_dir)
    assert not [arg for arg in proc.cmdline() if key in arg]
    assert "--api-key" not in proc.cmdline()
    assert key not in agent.log() and key not in server.log()
    assert key not in (agent.engine_log_dir / f"{name}.log").read_text(errors="replace")
