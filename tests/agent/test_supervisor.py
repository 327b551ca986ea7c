"""The engine supervisor with real processes: the real ``llama-server`` on the tiny model, shell
and Python stand-ins for engines that crash, ignore SIGTERM or outlive their parent.

Every supervisor here uses a 1 s grace period and polls every 0.1 s, and is shut down at the end
of its test. A process counts as gone once it no longer exists or is a zombie: the container's
init may not reap orphans, and a zombie holds no memory, port or device.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import httpx
import pytest

from fleetserve.agent.supervisor import Supervisor
from fleetserve.drivers import Driver, RuntimeVariant
from fleetserve.engines.binaries import resolve
from fleetserve.engines.launch import LaunchContext, LaunchSpec
from fleetserve.engines.registry import ENGINES
from fleetserve.engines.spec import EngineKind
from fleetserve.spec.resources import Profile, Replica, ReplicaState, Shard

pytestmark = pytest.mark.slow

GRACE = 1.0
POLL = 0.1
SLEEP = shutil.which("sleep") or "/bin/sleep"

T = TypeVar("T")


@pytest.fixture
def supervisor(tmp_path: Path) -> Iterator[Supervisor]:
    sup = Supervisor(tmp_path / "logs", grace_seconds=GRACE, poll_seconds=POLL)
    try:
        yield sup
    finally:
        sup.shutdown()


def wait_for(check: Callable[[], T | None], timeout: float, what: Callable[[], str]) -> T:
    """Poll ``check`` until it returns something truthy; fail with ``what()`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"not within {timeout:g}s: {what()}")
        time.sleep(0.05)


def gone(pid: int) -> bool:
    """The process no longer exists, or is a zombie nobody reaped yet."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def kill_leftovers(*pids: int) -> None:
    """SIGKILL processes this test started (directly or not) that are still there."""
    for pid in pids:
        if pid and not gone(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def spec_of(*argv: str, sidecars: tuple[tuple[str, ...], ...] = (), port: int = 0) -> LaunchSpec:
    """A launch spec with no health URL: the engine counts as healthy while it runs."""
    return LaunchSpec(
        argv=tuple(argv), env={}, health_url=None, metrics_url=None, sidecars=sidecars, port=port
    )


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def llama_spec(tmp_path: Path) -> LaunchSpec:
    """The llama.cpp adapter's spec for the real llama-server on the tiny model, one CPU core."""
    from fleetserve.dev.tinymodel import write_tiny_model

    model = write_tiny_model(tmp_path / "models" / "tiny.gguf")
    replica = Replica(name="tiny-0", deployment="tiny", profile="cpu", shards=(Shard(node="n", cpu_cores=1),))
    ctx = LaunchContext(
        replica=replica,
        shard_index=0,
        profile=Profile(name="cpu", engine=EngineKind.LLAMACPP),
        variant=RuntimeVariant.CPU,
        driver=Driver.CPU,
        model_path=model,
        binary=resolve(EngineKind.LLAMACPP, RuntimeVariant.CPU, {}),
        host="127.0.0.1",
        port=free_port(),
        context=256,
    )
    return ENGINES[EngineKind.LLAMACPP].adapter.launch(ctx)


def running(sup: Supervisor, name: str, restarts: int = 0) -> int | None:
    """The engine's pid once it is Running (after ``restarts`` restarts), else None."""
    status = sup.status().get(name)
    if status and status.state is ReplicaState.RUNNING and status.restarts == restarts and status.pids:
        return status.pids[-1]
    return None


# --- the real llama-server ---------------------------------------------------------------------


def test_the_real_llama_server_on_the_tiny_model_reaches_running_and_reports_its_port(supervisor, tmp_path):
    spec = llama_spec(tmp_path)
    supervisor.start("tiny-0", spec)
    pid = wait_for(lambda: running(supervisor, "tiny-0"), 30, lambda: str(supervisor.status()))
    status = supervisor.status()["tiny-0"]
    assert status.port == spec.port
    assert status.message == "healthy"
    assert status.restarts == 0
    assert os.getpgid(pid) == pid
    assert pid in supervisor.own_pids()
    with httpx.Client(timeout=5) as client:
        assert client.get(f"http://127.0.0.1:{status.port}/health").json() == {"status": "ok"}


def test_a_llama_server_killed_with_sigkill_is_restarted_and_running_again(supervisor, tmp_path):
    supervisor.start("tiny-0", llama_spec(tmp_path))
    first = wait_for(lambda: running(supervisor, "tiny-0"), 30, lambda: str(supervisor.status()))
    os.kill(first, signal.SIGKILL)
    second = wait_for(lambda: running(supervisor, "tiny-0", restarts=1), 30, lambda: str(supervisor.status()))
    assert second != first
    assert gone(first)
    assert os.getpgid(second) == second
    status = supervisor.status()["tiny-0"]
    assert status.restarts == 1
    assert status.state is ReplicaState.RUNNING


# --- crash loop ----------------------------------------------------------------------------------


def test_an_engine_that_exits_at_once_goes_to_crash_loop_after_three_exits_with_growing_backoff(
    supervisor, tmp_path
):
    starts = tmp_path / "starts"
    engine = tmp_path / "crasher"
    engine.write_text(f'#!/bin/sh\ndate +%s.%N >> "{starts}"\necho "boom: cannot load model" >&2\nexit 1\n')
    engine.chmod(0o755)
    supervisor.start("bad-0", spec_of(str(engine)))

    def crash_loop() -> bool:
        return supervisor.status()["bad-0"].state is ReplicaState.CRASH_LOOP

    wait_for(crash_loop, 10, lambda: str(supervisor.status()))
    status = supervisor.status()["bad-0"]
    assert status.restarts == 2
    assert "boom: cannot load model" in status.stderr_tail
    assert "exited with status 1" in status.message
    times = [float(line) for line in starts.read_text().split()]
    assert len(times) == 3
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert gaps[0] >= 0.9, gaps  # the first backoff is 1 s
    assert gaps[1] >= 1.9, gaps  # then 2 s
    assert gaps[1] > gaps[0] + 0.5, gaps
    # The next restart waits longer still (4 s): a second later nothing has started again.
    time.sleep(1.0)
    assert len(starts.read_text().split()) == 3
    assert supervisor.status()["bad-0"].state is ReplicaState.CRASH_LOOP
    assert "in 4s" in supervisor.status()["bad-0"].message
    assert "boom: cannot load model" in supervisor.log_path("bad-0").read_text()


def test_an_engine_that_exits_is_restarted_with_its_whole_process_group_gone(supervisor, tmp_path):
    children = tmp_path / "children"
    engine = tmp_path / "forks-then-exits"
    engine.write_text(f'#!/bin/sh\n{SLEEP} 300 &\necho $! >> "{children}"\nexit 1\n')
    engine.chmod(0o755)
    supervisor.start("leaky-0", spec_of(str(engine)))
    try:
        wait_for(
            lambda: "exited with status 1" in supervisor.status()["leaky-0"].message,
            5,
            lambda: str(supervisor.status()),
        )
        first = int(children.read_text().split()[0])
        wait_for(
            lambda: gone(first),
            GRACE + 1,
            lambda: (
                f"the engine exited and was marked for restart, but {first} of its process group still runs"
            ),
        )
    finally:
        if children.exists():
            kill_leftovers(*(int(pid) for pid in children.read_text().split()))


# --- graceful stop -----------------------------------------------------------------------------

# The engine (a Python child) spawns a grandchild in its process group; either or both trap
# SIGTERM. The grandchild writes its pid to a file once its handler is in place.
ENGINE = r"""
import signal, subprocess, sys, time
trap_engine, trap_grandchild, pid_file = sys.argv[1] == "1", sys.argv[2], sys.argv[3]
if trap_engine:
    signal.signal(signal.SIGTERM, lambda *_: print("engine ignores SIGTERM", flush=True))
subprocess.Popen([sys.executable, "-c", '''
import signal, sys, time
if sys.argv[1] == "1":
    signal.signal(signal.SIGTERM, lambda *_: print("grandchild ignores SIGTERM", flush=True))
open(sys.argv[2] + ".tmp", "w").write(str(__import__("os").getpid()))
__import__("os").rename(sys.argv[2] + ".tmp", sys.argv[2])
while True:
    time.sleep(1)
''', trap_grandchild, pid_file])
while True:
    time.sleep(1)
"""


@pytest.mark.parametrize(
    ("trap_engine", "trap_grandchild"),
    [
        pytest.param(True, False, id="the-engine-ignores-sigterm"),
        pytest.param(True, True, id="both-ignore-sigterm"),
        pytest.param(False, True, id="only-the-grandchild-ignores-sigterm"),
        pytest.param(False, False, id="neither-ignores-sigterm"),
    ],
)
def test_stop_terms_the_whole_process_group_and_kills_what_ignores_sigterm_after_the_grace_period(
    supervisor, tmp_path, trap_engine, trap_grandchild
):
    pid_file = tmp_path / "grandchild.pid"
    argv = (sys.executable, "-c", ENGINE, str(int(trap_engine)), str(int(trap_grandchild)), str(pid_file))
    supervisor.start("stubborn-0", spec_of(*argv))
    engine = wait_for(lambda: running(supervisor, "stubborn-0"), 10, lambda: str(supervisor.status()))
    grandchild = 0
    try:
        grandchild = int(
            wait_for(lambda: pid_file.exists() and pid_file.read_text(), 10, lambda: "no pid file")
        )
        assert os.getpgid(engine) == engine
        assert os.getpgid(grandchild) == engine
        started = time.monotonic()
        supervisor.stop("stubborn-0")
        took = time.monotonic() - started
        wait_for(
            lambda: gone(engine) and gone(grandchild),
            2,
            lambda: (
                f"after stop() returned: engine {engine} gone: {gone(engine)}, "
                f"grandchild {grandchild} (same process group) gone: {gone(grandchild)}"
            ),
        )
        assert "stubborn-0" not in supervisor.status()
        assert supervisor.own_pids() == frozenset()
        if trap_engine:
            assert took >= GRACE * 0.9
        else:
            assert took < GRACE + 1.0
    finally:
        kill_leftovers(engine, grandchild)


def test_stops_from_many_threads_and_shutdown_each_wait_one_grace_not_one_per_engine(tmp_path):
    # Engines that ignore SIGTERM: each stop waits out the whole grace, then SIGKILLs.
    sup = Supervisor(tmp_path / "logs", grace_seconds=GRACE, poll_seconds=POLL)
    engine = tmp_path / "deaf"
    engine.write_text(f"#!/bin/sh\ntrap '' TERM\nexec {SLEEP} 300\n")
    engine.chmod(0o755)
    names = [f"deaf-{i}" for i in range(8)]
    pids: list[int] = []
    try:
        for name in names:
            sup.start(name, spec_of(str(engine)))
        pids = list(
            wait_for(lambda: len(sup.own_pids()) == 8 and sup.own_pids(), 10, lambda: str(sup.status()))
        )
        time.sleep(0.2)  # the shell's trap is in place before exec
        started = time.monotonic()
        stops = [threading.Thread(target=sup.stop, args=(n,)) for n in names[:4]]
        for thread in stops:
            thread.start()
        wait_for(lambda: sup.stopping() == set(names[:4]), 2, lambda: str(sup.stopping()))
        assert set(sup.status()) == set(names[4:])  # a stopping engine is out of status...
        assert set(pids) == sup.own_pids()  # ...and its processes still the supervisor's own
        for thread in stops:
            thread.join()
        took = time.monotonic() - started
        assert GRACE * 0.9 <= took < 2 * GRACE, took
        started = time.monotonic()
        sup.shutdown()
        took = time.monotonic() - started
        assert GRACE * 0.9 <= took < 2 * GRACE, took
        assert all(gone(pid) for pid in pids)
    finally:
        sup.shutdown()  # a second shutdown does nothing
        kill_leftovers(*pids)


# --- no orphans --------------------------------------------------------------------------------

PARENT = r"""
import sys, time
from pathlib import Path
from fleetserve.agent.supervisor import Supervisor
from fleetserve.engines.launch import LaunchSpec
sup = Supervisor(Path(sys.argv[1]), grace_seconds=1.0, poll_seconds=0.1)
sup.start("orphan-0", LaunchSpec(argv=(sys.argv[2], "300"), env={}, health_url=None, metrics_url=None))
while not sup.own_pids():
    time.sleep(0.05)
print(next(iter(sup.own_pids())), flush=True)
time.sleep(300)
"""


def test_an_engine_dies_with_its_supervisor_process_even_when_that_is_killed_with_sigkill(tmp_path):
    engine = 0
    with (
        (tmp_path / "parent.err").open("wb") as err,
        subprocess.Popen(
            [sys.executable, "-c", PARENT, str(tmp_path / "logs"), SLEEP],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        ) as parent,
    ):
        try:
            assert parent.stdout is not None
            line = parent.stdout.readline()
            assert line.strip().isdigit(), (
                f"the parent printed {line!r}; stderr: {(tmp_path / 'parent.err').read_text()}"
            )
            engine = int(line)
            assert not gone(engine)
            assert os.getpgid(engine) == engine
            parent.kill()
            parent.wait()
            wait_for(lambda: gone(engine), 5, lambda: f"engine {engine} outlived its parent")
        finally:
            if parent.poll() is None:
                parent.kill()
            kill_leftovers(engine)


# --- cannot start --------------------------------------------------------------------------------


@pytest.mark.parametrize("problem", ["missing", "not-executable"])
def test_a_binary_that_cannot_be_started_is_failed_with_a_clear_message_and_no_crash_loop(
    supervisor, tmp_path, problem
):
    binary = tmp_path / "bin" / "llama-server"
    if problem == "not-executable":
        binary.parent.mkdir()
        binary.write_text("#!/bin/sh\nexit 0\n")
        binary.chmod(0o644)
    supervisor.start("missing-0", spec_of(str(binary), "--port", "1"))
    wait_for(
        lambda: supervisor.status()["missing-0"].state is ReplicaState.FAILED,
        5,
        lambda: str(supervisor.status()),
    )
    status = supervisor.status()["missing-0"]
    assert status.message.startswith(f"cannot start {binary}: ")
    reason = "No such file or directory" if problem == "missing" else "Permission denied"
    assert reason in status.message
    # Longer than the first backoff: no restart was attempted.
    time.sleep(1.5)
    status = supervisor.status()["missing-0"]
    assert status.state is ReplicaState.FAILED
    assert status.restarts == 0
    assert status.pids == ()


# --- own pids, process groups ------------------------------------------------------------------


@pytest.mark.parametrize("sidecars", [0, 1, 2], ids=["engine-only", "one-sidecar", "two-sidecars"])
def test_own_pids_holds_every_process_started_each_in_its_own_process_group(supervisor, sidecars):
    spec = spec_of(SLEEP, "300", sidecars=tuple((SLEEP, "301") for _ in range(sidecars)), port=4321)
    supervisor.start("sleepy-0", spec)
    pids = wait_for(
        lambda: len(supervisor.own_pids()) == sidecars + 1 and supervisor.own_pids(),
        5,
        lambda: str(supervisor.status()),
    )
    status = supervisor.status()["sleepy-0"]
    assert set(status.pids) == pids
    assert status.port == 4321
    for pid in pids:
        assert os.getpgid(pid) == pid
    # The engine, started after its sidecars, is the last pid.
    assert Path(f"/proc/{status.pids[-1]}/cmdline").read_bytes().split(b"\0")[1] == b"300"
    supervisor.stop("sleepy-0")
    assert supervisor.own_pids() == frozenset()
    assert all(gone(pid) for pid in pids)


def test_an_engine_gets_the_agents_environment_without_fleetserves_secrets(supervisor, tmp_path, monkeypatch):
    # The agent's own environment holds its join token and an HF token; the engine sees neither.
    monkeypatch.setenv("FLEETSERVE_JOIN_TOKEN", "fs_join_secret")
    monkeypatch.setenv("FLEETSERVE_TOKEN", "fs_admin_secret")
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    monkeypatch.setenv("KEEP_ME", "yes")
    out = tmp_path / "env.txt"
    dump = f"import os, pathlib; pathlib.Path({str(out)!r}).write_text('\\n'.join(sorted(os.environ))); import time; time.sleep(60)"
    spec = LaunchSpec(
        argv=(sys.executable, "-c", dump),
        env={"CUDA_VISIBLE_DEVICES": "0"},
        health_url=None,
        metrics_url=None,
    )
    supervisor.start("env-0", spec)
    names = wait_for(
        lambda: out.exists() and out.read_text().split("\n"), 30, lambda: "the engine to dump its environment"
    )
    assert "KEEP_ME" in names and "CUDA_VISIBLE_DEVICES" in names and "PATH" in names
    assert [
        n for n in names if n.startswith("FLEETSERVE_") or n in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")
    ] == []
    supervisor.stop("env-0")


def test_an_engine_never_sees_the_agents_secrets(supervisor, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_agent_secret")
    monkeypatch.setenv("FLEETSERVE_JOIN_TOKEN", "fs_join_secret")
    monkeypatch.setenv("PLAIN_SETTING", "kept")
    dump = tmp_path / "env.txt"
    engine = tmp_path / "dump-env"
    engine.write_text(f'#!/bin/sh\nenv > "{dump}"\nexec {SLEEP} 300\n')
    engine.chmod(0o755)
    supervisor.start("env-0", spec_of(str(engine)))
    try:
        wait_for(
            lambda: dump.is_file() and "PLAIN_SETTING" in dump.read_text(),
            5,
            lambda: str(supervisor.status()),
        )
        seen = dump.read_text()
        assert "PLAIN_SETTING=kept" in seen
        assert "hf_agent_secret" not in seen and "fs_join_secret" not in seen
    finally:
        supervisor.stop("env-0")


# --- health after Running -------------------------------------------------------------------------

# An engine stand-in answering /health with 200, or 503 while the file argv[2] exists.
FLAKY = r"""
import os, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
class H(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(503 if os.path.exists(sys.argv[2]) else 200)
        self.send_header("Content-Length", "0")
        self.end_headers()
    def log_message(self, *a):
        pass
HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_a_running_engine_that_fails_its_health_check_is_reported_not_running_until_it_passes(
    supervisor, tmp_path
):
    # Not Running is what takes a replica out of every gateway's routes (routing.routable).
    port, sick = free_port(), tmp_path / "sick"
    spec = LaunchSpec(
        argv=(sys.executable, "-c", FLAKY, str(port), str(sick)),
        env={},
        health_url=f"http://127.0.0.1:{port}/health",
        metrics_url=None,
        port=port,
    )
    supervisor.start("flaky-0", spec)
    wait_for(lambda: running(supervisor, "flaky-0"), 10, lambda: str(supervisor.status()))
    sick.touch()
    wait_for(
        lambda: supervisor.status()["flaky-0"].state is ReplicaState.STARTING,
        5,
        lambda: f"still {supervisor.status()['flaky-0']} while /health answers 503",
    )
    assert supervisor.status()["flaky-0"].message == "health check failing"
    assert supervisor.status()["flaky-0"].restarts == 0  # it runs: it is not restarted for this
    sick.unlink()
    wait_for(lambda: running(supervisor, "flaky-0"), 5, lambda: str(supervisor.status()))
