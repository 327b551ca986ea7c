"""No orphan survives its agent: an engine, its child and a grandchild that left the process group
(``setsid``) are stopped — the engine by its parent-death signal when the agent is killed with
SIGKILL, the rest by the next agent, from its record, before that agent can start anything.

Real processes: a Python "agent" running a Supervisor over a state directory, an engine script
that starts a child in its process group and a grandchild in a session of its own. With cgroups
(this machine: root, a cgroup2 hierarchy) every one of them is stopped; in the process-group
fallback, those still in the engine's group are.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from test_supervisor import gone, kill_leftovers, wait_for

from fleetserve.agent.containment import (
    Containment,
    EngineRecord,
    ProcessRecord,
    cgroup2_root,
    start_time,
    stop_recorded,
)
from fleetserve.agent.supervisor import Supervisor

pytestmark = pytest.mark.slow

# The engine: a child in its process group, a grandchild (through the child) in a new session.
# Each writes its pid to a file once it runs.
ENGINE = r"""
import os, subprocess, sys, time
out = sys.argv[1]
subprocess.Popen([sys.executable, "-c", '''
import os, subprocess, sys, time
open(sys.argv[1] + "/child", "w").write(str(os.getpid()))
subprocess.Popen([sys.executable, "-c", "import os, sys, time; open(sys.argv[1] + '/escaped', 'w').write(str(os.getpid())); time.sleep(300)", sys.argv[1]], start_new_session=True)
time.sleep(300)
''', out])
time.sleep(300)
"""

AGENT = r"""
import sys, time
from pathlib import Path
from fleetserve.agent.supervisor import Supervisor
from fleetserve.engines.launch import LaunchSpec
sup = Supervisor(Path(sys.argv[1]) / "logs", grace_seconds=1.0, poll_seconds=0.1,
                 state_dir=Path(sys.argv[1]) / "state", use_cgroups=sys.argv[2] == "1")
sup.start("leaky-0", LaunchSpec(argv=(sys.executable, "-c", sys.argv[3], sys.argv[4]), env={},
                                health_url=None, metrics_url=None))
while not sup.own_pids():
    time.sleep(0.05)
print(next(iter(sup.own_pids())), flush=True)
deadline = time.monotonic() + 10
while len(sup.own_pids()) < int(sys.argv[5]) and time.monotonic() < deadline:
    time.sleep(0.05)
print(" ".join(map(str, sorted(sup.own_pids()))), flush=True)
time.sleep(300)
"""

CGROUPS = cgroup2_root() is not None


def run_agent_then_kill_it(tmp_path: Path, cgroups: bool) -> tuple[int, int, int, set[int]]:
    """Start the agent, wait for its engine's child and escaped grandchild, SIGKILL the agent;
    (engine, child, escaped) pids and what the agent's supervisor called its own pids."""
    pids = tmp_path / "pids"
    pids.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    # With cgroups the supervisor knows the engine's descendants too: 3 processes, else 1.
    own = "3" if cgroups else "1"
    args = [sys.executable, "-c", AGENT, str(tmp_path), str(int(cgroups)), ENGINE, str(pids), own]
    with subprocess.Popen(args, stdout=subprocess.PIPE, text=True, env=env) as agent:
        try:
            assert agent.stdout is not None
            engine = int(agent.stdout.readline())
            child = int(wait_for(lambda: (pids / "child").exists() and (pids / "child").read_text(), 10, str))
            escaped = int(
                wait_for(lambda: (pids / "escaped").exists() and (pids / "escaped").read_text(), 10, str)
            )
            own_pids = {int(pid) for pid in agent.stdout.readline().split()}
        finally:
            agent.kill()
            agent.wait()
    return engine, child, escaped, own_pids


@pytest.mark.skipif(not CGROUPS, reason="no writable cgroup2 hierarchy here (not root, or no cgroup v2)")
def test_a_restarted_agent_stops_what_its_killed_predecessor_left_before_starting_anything(tmp_path):
    engine, child, escaped, own_pids = run_agent_then_kill_it(tmp_path, cgroups=True)
    try:
        assert own_pids == {engine, child, escaped}  # GPU processes of its engines are not foreign
        wait_for(lambda: gone(engine), 5, lambda: f"engine {engine} outlived its agent")
        # Without a parent-death signal of their own, the engine's descendants outlive the agent.
        assert not gone(child) and not gone(escaped)
        assert os.getpgid(escaped) != os.getpgid(child)  # it left the process group
        record = EngineRecord.model_validate_json(
            (tmp_path / "state" / "engines" / "leaky-0.json").read_text()
        )
        assert record.cgroup is not None
        [v2] = [
            line[3:] for line in Path(f"/proc/{escaped}/cgroup").read_text().splitlines() if line[:3] == "0::"
        ]
        assert v2.endswith("/leaky-0") and record.cgroup.endswith(v2)  # born in the replica's cgroup

        restarted = Supervisor(tmp_path / "logs", state_dir=tmp_path / "state")
        try:
            assert restarted.own_pids() == frozenset()
            # Stopped during construction: before this supervisor could start a single engine.
            assert gone(child) and gone(escaped)
            assert restarted.leftovers == ["leaky-0: 2 process(es)"]
            assert not (tmp_path / "state" / "engines" / "leaky-0.json").exists()
            assert not Path(record.cgroup).exists()
        finally:
            restarted.shutdown()
    finally:
        kill_leftovers(engine, child, escaped)


def test_without_cgroups_the_process_group_of_a_killed_agents_engine_is_stopped(tmp_path):
    engine, child, escaped, own_pids = run_agent_then_kill_it(tmp_path, cgroups=False)
    try:
        assert own_pids == {engine}
        wait_for(lambda: gone(engine), 5, lambda: f"engine {engine} outlived its agent")
        assert not gone(child)
        restarted = Supervisor(tmp_path / "logs", state_dir=tmp_path / "state", use_cgroups=False)
        try:
            assert gone(child), "the engine's child (in its process group) outlived the restarted agent"
            assert restarted.leftovers == ["leaky-0: 1 process(es)"]
        finally:
            restarted.shutdown()
    finally:
        kill_leftovers(engine, child, escaped)


def test_a_record_whose_process_is_not_the_recorded_one_kills_nothing(tmp_path):
    # A pid reused by an unrelated process: same pid, another start time.
    with subprocess.Popen(["sleep", "30"], start_new_session=True) as stranger:
        try:
            started = start_time(stranger.pid)
            assert started is not None
            for wrong in (started - 1, started + 10_000):
                record = EngineRecord(
                    replica="old-0",
                    processes=[ProcessRecord(pid=stranger.pid, start_time=wrong, pgid=stranger.pid)],
                )
                assert stop_recorded(record) == 0
                assert stranger.poll() is None
        finally:
            stranger.send_signal(signal.SIGKILL)


def test_an_unreadable_record_is_dropped_and_a_stopped_engine_leaves_no_record(tmp_path):
    containment = Containment(tmp_path / "state", use_cgroups=False)
    containment.records.mkdir(parents=True)
    (containment.records / "junk-0.json").write_text("{not json")
    assert containment.reap_leftovers() == []
    assert list(containment.records.iterdir()) == []
    sup = Supervisor(tmp_path / "logs", grace_seconds=1.0, poll_seconds=0.1, state_dir=tmp_path / "state")
    try:
        from test_supervisor import spec_of

        sup.start("short-0", spec_of("sleep", "30"))
        assert (containment.records / "short-0.json").exists()
        sup.stop("short-0")
        assert not (containment.records / "short-0.json").exists()
    finally:
        sup.shutdown()


@pytest.mark.skipif(not CGROUPS, reason="no writable cgroup2 hierarchy here (not root, or no cgroup v2)")
def test_a_record_naming_a_cgroup_not_the_agents_own_kills_nothing_there(tmp_path):
    # Someone who can write the record aims it at another cgroup (another agent's, a system one).
    root = cgroup2_root()
    assert root is not None
    victim_cgroup = root / f"fs-victim-{os.getpid()}"
    victim_cgroup.mkdir()
    victim = subprocess.Popen(["sleep", "30"])
    try:
        (victim_cgroup / "cgroup.procs").write_text(str(victim.pid))
        containment = Containment(tmp_path / "state")
        containment.records.mkdir(parents=True)
        for aimed in (victim_cgroup, containment.parent / ".." / victim_cgroup.name):
            record = EngineRecord(replica="evil-0", processes=[], cgroup=str(aimed))
            (containment.records / "evil-0.json").write_text(record.model_dump_json())
            assert containment.reap_leftovers() == []
            assert victim.poll() is None and victim_cgroup.is_dir()
    finally:
        victim.kill()
        victim.wait()
        wait_for(lambda: not (victim_cgroup / "cgroup.procs").read_text().strip(), 5, str)
        victim_cgroup.rmdir()
