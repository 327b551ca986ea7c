"""Where an engine's processes live, so that every one of them can be found and stopped — by this
agent, and by the next one after this agent was killed.

- **A cgroup per replica** (cgroup v2, where this agent may create one): the engine and its
  sidecars are moved into ``<cgroup2>/fleetserve/<agent>/<replica>`` before they exec, so every
  process they ever start is in it, even one that leaves its process group (``setsid``).
  ``cgroup.kill`` stops them all at once. A hybrid host has its cgroup2 hierarchy at
  ``/sys/fs/cgroup/unified``; a pure v2 host at ``/sys/fs/cgroup``.
- **A process group per process**, always (``start_new_session``): the fallback where no cgroup
  can be made, and how a graceful stop sends SIGTERM first.
- **A record per replica** in the agent's state directory (``engines/<replica>.json``): the
  pid, start time and process group of each process, and the cgroup. A restarted agent reads
  them (``reap_leftovers``) and stops what its previous run left before it starts anything. A pid
  counts as the recorded process only if its start time (``/proc/PID/stat``, in clock ticks
  since boot) matches, so a reused pid is never killed; a recorded cgroup counts only if it is one
  of this agent's own (under ``<cgroup2>/fleetserve/<agent>``), so a record cannot aim the agent
  at anyone else's processes. The records' directory is the agent's alone (0700).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import signal
import time
from collections.abc import Iterable
from pathlib import Path

from pydantic import BaseModel, ValidationError

log = logging.getLogger("fleetserve.supervisor")

CGROUP2_MOUNTS = (Path("/sys/fs/cgroup/unified"), Path("/sys/fs/cgroup"))
"""Where a cgroup v2 hierarchy is mounted: the hybrid layout's, then the unified layout's."""

EMPTY_WAIT_SECONDS = 5.0
"""How long to wait for a killed cgroup to empty before removing it is given up."""


class ProcessRecord(BaseModel):
    """One process an agent started: its pid, its start time in clock ticks, its process group."""

    pid: int
    start_time: int
    pgid: int


class EngineRecord(BaseModel):
    """What a restarted agent needs to stop a replica's engine: its processes and its cgroup."""

    replica: str
    processes: list[ProcessRecord]
    cgroup: str | None = None


def start_time(pid: int) -> int | None:
    """The process's start time (clock ticks after boot), or None when it is gone or a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text(encoding="ascii", errors="replace")
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after its last ')'.
    fields = stat.rsplit(")", 1)[1].split()
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def process_group(pid: int) -> int | None:
    """The process group of ``pid``, or None when it is gone."""
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def cgroup2_root() -> Path | None:
    """The cgroup v2 hierarchy this process may create cgroups in, or None (not root, no v2)."""
    for mount in CGROUP2_MOUNTS:
        if (mount / "cgroup.procs").exists() and os.access(mount, os.W_OK):
            return mount
    return None


def agent_key(state_dir: Path) -> str:
    """A name for one agent's cgroups, stable across its restarts: a hash of its state directory."""
    return hashlib.blake2b(str(state_dir.resolve()).encode(), digest_size=6).hexdigest()


class Containment:
    """Makes, fills, kills and records the cgroups and process groups of one agent's engines."""

    def __init__(self, state_dir: Path, cgroup_root: Path | None = None, use_cgroups: bool = True) -> None:
        self.records = state_dir / "engines"
        root = (cgroup_root or cgroup2_root()) if use_cgroups else None
        self.parent = root / "fleetserve" / agent_key(state_dir) if root is not None else None

    # --- cgroups --------------------------------------------------------------------------------

    def owns(self, cgroup: Path) -> bool:
        """Whether ``cgroup`` is one this agent makes (directly under its own parent cgroup)."""
        return self.parent is not None and cgroup.parent == self.parent and cgroup.name not in ("", ".", "..")

    def make_cgroup(self, replica: str) -> Path | None:
        """A fresh, empty cgroup for ``replica``'s processes, or None where none can be made."""
        if self.parent is None:
            return None
        path = self.parent / replica
        try:
            if path.exists():
                kill_cgroup(path)
            path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            log.warning("no cgroup for %s (%s): its process groups will do", replica, exc)
            return None
        return path

    # --- records --------------------------------------------------------------------------------

    def record(self, replica: str, pids: Iterable[int], cgroup: Path | None) -> None:
        """Write down ``replica``'s processes and cgroup (atomically: a crash leaves old or new)."""
        processes = []
        for pid in pids:
            started, pgid = start_time(pid), process_group(pid)
            if started is not None and pgid is not None:
                processes.append(ProcessRecord(pid=pid, start_time=started, pgid=pgid))
        entry = EngineRecord(replica=replica, processes=processes, cgroup=str(cgroup) if cgroup else None)
        self.records.mkdir(parents=True, exist_ok=True)
        self.records.chmod(0o700)
        path = self.records / f"{replica}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(entry.model_dump_json(), encoding="utf-8")
        os.replace(tmp, path)

    def forget(self, replica: str, cgroup: Path | None) -> None:
        """``replica``'s processes are all gone: remove its cgroup and its record."""
        if cgroup is not None and self.owns(cgroup):
            remove_cgroup(cgroup)
        with contextlib.suppress(FileNotFoundError):
            (self.records / f"{replica}.json").unlink()

    def reap_leftovers(self) -> list[str]:
        """Stop every engine a previous run of this agent recorded and left running; the replicas
        whose processes were found alive, each with what was stopped."""
        stopped: list[str] = []
        if not self.records.is_dir():
            return stopped
        for path in sorted(self.records.glob("*.json")):
            try:
                entry = EngineRecord.model_validate_json(path.read_text(encoding="utf-8"))
            except (OSError, ValidationError) as exc:
                log.warning("ignoring unreadable engine record %s: %s", path, exc)
                path.unlink(missing_ok=True)
                continue
            if entry.cgroup is not None and not self.owns(Path(entry.cgroup)):
                log.warning(
                    "engine record %s names a cgroup not this agent's: %s; ignored", path, entry.cgroup
                )
                entry = entry.model_copy(update={"cgroup": None})
            killed = stop_recorded(entry)
            if killed:
                stopped.append(f"{entry.replica}: {killed} process(es)")
                log.warning("stopped %d process(es) of %s left by a previous agent", killed, entry.replica)
            self.forget(entry.replica, Path(entry.cgroup) if entry.cgroup else None)
        for path in self.records.glob("*.tmp"):
            path.unlink(missing_ok=True)
        return stopped


def cgroup_pids(path: Path) -> list[int]:
    """The processes in the cgroup ``path`` (none when it is gone)."""
    try:
        return [int(line) for line in (path / "cgroup.procs").read_text().split()]
    except OSError:
        return []


def kill_cgroup(path: Path) -> int:
    """SIGKILL every process in the cgroup (``cgroup.kill``, or one by one on older kernels) and
    wait for it to empty; how many processes it held."""
    pids = cgroup_pids(path)
    if not pids:
        return 0
    try:
        (path / "cgroup.kill").write_text("1")
    except OSError:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + EMPTY_WAIT_SECONDS
    while cgroup_pids(path) and time.monotonic() < deadline:
        time.sleep(0.02)
    return len(pids)


def remove_cgroup(path: Path) -> None:
    """Kill what is left in the cgroup, then remove it (and its agent's directory when empty)."""
    kill_cgroup(path)
    for directory in (path, path.parent):
        with contextlib.suppress(OSError):  # busy (not empty yet) or already gone
            directory.rmdir()


def group_members(pgid: int, leader_start: int) -> list[int]:
    """Live processes of the process group whose leader (pid ``pgid``) started at ``leader_start``.

    A group's members all start after its leader, and its id is not given to a new process while
    any member lives: so a process in group ``pgid`` started no earlier than the leader is one of
    ours, except a process *with pid* ``pgid`` started later — that is a reused pid leading a
    group of its own."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        started = start_time(pid)
        if started is None or started < leader_start or process_group(pid) != pgid:
            continue
        if pid == pgid and started != leader_start:
            continue
        members.append(pid)
    return members


def stop_recorded(entry: EngineRecord) -> int:
    """SIGKILL what is left of a recorded engine: its cgroup if it has one, else each recorded
    process group whose members are provably the recorded ones'; how many processes."""
    if entry.cgroup is not None and Path(entry.cgroup).is_dir():
        return kill_cgroup(Path(entry.cgroup))
    killed = 0
    for proc in entry.processes:
        for pid in group_members(proc.pgid, proc.start_time):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                killed += 1
    return killed


def join_cgroup(path: Path) -> None:  # pragma: no cover - runs in the child between fork and exec
    """Move the calling process into the cgroup ``path`` (a ``preexec_fn``: before exec, so every
    process the engine starts is born inside it)."""
    fd = os.open(path / "cgroup.procs", os.O_WRONLY)
    try:
        os.write(fd, b"0")
    finally:
        os.close(fd)
