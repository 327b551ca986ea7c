"""Helpers of the process-level tests: real ``fleetserve server`` subprocesses on real sockets,
and the control-plane state read straight from its database. The fixtures are in conftest.py.

``ServerFactory.start(database_url)`` runs the console script installed beside the test
interpreter on a free loopback port, waits for ``GET /healthz``, and reads the admin and join tokens from its
``--token-file``. Every process a test started is stopped at teardown (SIGTERM, then SIGKILL),
whether the test passed or not; its output is kept in a log file under the test's tmp_path and
shown when a start fails.

``read_state(database_url)`` reads the whole control-plane state straight from the database, in
one consistent read (a REPEATABLE READ transaction on PostgreSQL, one read transaction on
SQLite), and ``State.violations()`` lists every broken allocation invariant.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

FLEETSERVE = Path(sys.executable).with_name("fleetserve")
ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT = 60.0  # a cold interpreter on a loaded 2-core machine takes a few seconds


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def clean_env(**extra: str) -> dict[str, str]:
    """The test's environment without any FLEETSERVE_* setting, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEETSERVE_")}
    env.update(extra)
    return env


@dataclass
class ServerProcess:
    """One running ``fleetserve server``."""

    name: str
    url: str
    database_url: str
    token_file: Path
    log_path: Path
    proc: subprocess.Popen[bytes]
    admin_token: str
    join_token: str

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.admin_token}"}

    def client(self, timeout: float = 30.0) -> httpx.Client:
        """An HTTP client of the admin API with the admin token (the caller closes it)."""
        return httpx.Client(base_url=self.url + "/api/v1", headers=self.headers, timeout=timeout)

    def apply(self, documents: list[dict[str, Any]], client: httpx.Client | None = None) -> dict[str, Any]:
        """POST /apply; fails the test on anything but 200."""
        if client is None:
            with self.client(timeout=120) as own:
                return self.apply(documents, own)
        response = client.post("/apply", json={"documents": documents})
        assert response.status_code == 200, f"apply via {self.name}: {response.status_code} {response.text}"
        result: dict[str, Any] = response.json()
        return result

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the server and its own processes (on PostgreSQL its reconciler's), children
        first: no shutdown code runs, as in a crash or an OOM kill of the machine. A reconciler
        process that outlived its server would finish the cycle in progress (it takes its
        server's death as Stop), and the kill would not be mid-cycle."""
        import psutil

        if self.proc.poll() is None:
            with contextlib.suppress(psutil.NoSuchProcess):
                for child in psutil.Process(self.proc.pid).children(recursive=True):
                    with contextlib.suppress(psutil.NoSuchProcess):
                        child.kill()
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM (a graceful shutdown), then SIGKILL if it does not end in time."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.proc.wait(timeout=30)

    def log(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")


class ServerFactory:
    """Starts servers for one test and stops every one of them at teardown."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.started: list[ServerProcess] = []
        self._handles: list[Any] = []

    def start(
        self,
        database_url: str,
        *,
        name: str = "server",
        reconcile_interval: float = 0.2,
        token_file: Path | None = None,
        extra_args: tuple[str, ...] = (),
        approve_new_nodes: bool = True,
    ) -> ServerProcess:
        """A server on a free port. ``approve_new_nodes``: agents of new names enrol without an
        operator's approval (most tests start agents; the attacker tests turn it off)."""
        token_file = token_file or self.tmp_path / f"{name}-tokens.yaml"
        for attempt in range(3):
            port = free_port()
            log_path = self.tmp_path / f"{name}-{len(self.started) + 1}-{attempt}.log"
            handle = open(log_path, "wb")  # noqa: SIM115 - closed at teardown, after the process ended
            self._handles.append(handle)
            args = [
                str(FLEETSERVE),
                "server",
                "--database-url",
                database_url,
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--reconcile-interval",
                str(reconcile_interval),
                # No agent heartbeats here: operator-declared nodes stay Ready.
                "--not-ready-after",
                "3600",
                "--lost-after",
                "7200",
                "--token-file",
                str(token_file),
                *(["--approve-new-nodes"] if approve_new_nodes else []),
                *extra_args,
            ]
            proc = subprocess.Popen(
                args, stdout=handle, stderr=subprocess.STDOUT, env=clean_env(PYTHONUNBUFFERED="1")
            )
            url = f"http://127.0.0.1:{port}"
            placeholder = ServerProcess(name, url, database_url, token_file, log_path, proc, "", "")
            self.started.append(placeholder)
            if self._wait_healthy(placeholder):
                tokens = yaml.safe_load(token_file.read_text(encoding="utf-8"))
                placeholder.admin_token = tokens["admin"]
                placeholder.join_token = tokens["join"]
                return placeholder
            placeholder.stop()
            if "address already in use" not in placeholder.log().lower():
                break  # not a port race: do not hide the failure behind retries
        pytest.fail(f"fleetserve server {name} did not become healthy; its output:\n{placeholder.log()}")

    @staticmethod
    def _wait_healthy(server: ServerProcess) -> bool:
        deadline = time.monotonic() + START_TIMEOUT
        with httpx.Client(timeout=2.0) as http:
            while time.monotonic() < deadline:
                if server.proc.poll() is not None:
                    return False
                try:
                    if http.get(server.url + "/healthz").status_code == 200:
                        return True
                except httpx.HTTPError:
                    pass
                time.sleep(0.05)
        return False

    def close(self) -> None:
        for server in reversed(self.started):
            with contextlib.suppress(Exception):
                server.stop(timeout=10)
            if server.proc.poll() is None:  # pragma: no cover - stop() kills; belt and braces
                server.proc.kill()
                server.proc.wait()
        for handle in self._handles:
            handle.close()


def _json(value: Any) -> Any:
    return json.loads(value) if isinstance(value, str | bytes) else value


@dataclass
class State:
    """Every row the allocation invariants are about, from one consistent read."""

    nodes: dict[str, dict[str, Any]]
    replicas: dict[str, dict[str, Any]]
    shards: list[tuple[str, int, str, int, int, int]]  # replica, shard, node, cores, memory, epoch
    allocations: list[tuple[str, int, str]]  # node, device_index, replica
    deployments: dict[str, dict[str, Any]]
    models: set[str]
    classes: set[str]
    fabrics: set[str]
    leases: list[tuple[str, str, Any]]  # name, holder, expires_at
    tokens: list[tuple[str, bool]]  # kind, revoked
    counts: dict[str, int] = field(default_factory=dict)

    def replicas_of(self, deployment: str) -> list[str]:
        return sorted(n for n, r in self.replicas.items() if r["deployment"] == deployment)

    def violations(self) -> list[str]:
        """Every broken invariant, as readable lines (empty: the state is consistent)."""
        out: list[str] = []
        shards_of: dict[str, list[tuple[int, str, int, int]]] = defaultdict(list)
        for replica, shard, node, cores, memory, _epoch in self.shards:
            if replica not in self.replicas:
                out.append(f"orphan replica_shards row ({replica}, {shard}) on {node}")
            shards_of[replica].append((shard, node, cores, memory))
        devices_of: dict[str, set[tuple[str, int]]] = defaultdict(set)
        table_keys = Counter((node, index) for node, index, _ in self.allocations)
        for key, n in table_keys.items():
            if n > 1:
                out.append(f"device {key} has {n} rows in device_allocations")
        for node, index, replica in self.allocations:
            if replica not in self.replicas:
                out.append(f"orphan device_allocations row {node}[{index}] -> {replica}")
            devices_of[replica].add((node, index))
        holder: dict[tuple[str, int], str] = {}
        cores_used: Counter[str] = Counter()
        memory_used: Counter[str] = Counter()
        for name, row in self.replicas.items():
            spec = row["spec"]
            if spec.get("name") != name or spec.get("deployment") != row["deployment"]:
                out.append(f"replica {name}: columns and stored spec disagree on name/deployment")
            if spec.get("profile") != row["profile"]:
                out.append(f"replica {name}: profile column {row['profile']} != spec {spec.get('profile')}")
            want_shards = [
                (i, s["node"], int(s.get("cpuCores", 0)), int(s.get("memory", 0)))
                for i, s in enumerate(spec.get("shards", []))
            ]
            if not want_shards:
                out.append(f"replica {name} has no shard in its spec")
            if sorted(shards_of.get(name, [])) != want_shards:
                out.append(
                    f"replica {name}: shard rows {sorted(shards_of.get(name, []))} != spec {want_shards}"
                )
            want_devices = [(s["node"], int(d)) for s in spec.get("shards", []) for d in s.get("devices", [])]
            if len(set(want_devices)) != len(want_devices):
                out.append(f"replica {name} names a device twice: {want_devices}")
            if devices_of.get(name, set()) != set(want_devices):
                out.append(
                    f"replica {name}: device rows {sorted(devices_of.get(name, set()))} != spec {sorted(want_devices)}"
                )
            for key in want_devices:
                if key in holder:
                    out.append(f"device {key} is held by {holder[key]} and {name}")
                holder[key] = name
                node = self.nodes.get(key[0])
                if node is None:
                    out.append(f"replica {name} holds a device on unknown node {key[0]}")
                    continue
                device = {int(d["index"]): d for d in node["spec"].get("devices", [])}.get(key[1])
                if device is None:
                    out.append(f"replica {name} holds device {key} that the node does not have")
                elif device["class"] != spec.get("deviceClass"):
                    out.append(
                        f"replica {name} ({spec.get('deviceClass')}) holds {key} of class {device['class']}"
                    )
            for s in spec.get("shards", []):
                cores_used[s["node"]] += int(s.get("cpuCores", 0))
                memory_used[s["node"]] += int(s.get("memory", 0))
                node = self.nodes.get(s["node"])
                if node is not None and spec.get("fabric"):
                    fabric_of = {h["name"]: h["fabric"] for h in node["spec"].get("hcas", [])}
                    for hca in s.get("hcas", []):
                        if fabric_of.get(hca) != spec["fabric"]:
                            out.append(
                                f"replica {name} uses HCA {s['node']}/{hca} outside fabric {spec['fabric']}"
                            )
        for node_name, cores in cores_used.items():
            node = self.nodes.get(node_name)
            if node is None:
                out.append(f"replicas use node {node_name}, which is not stored")
                continue
            cpu = node["spec"]["cpu"]
            if cores > int(cpu["cores"]):
                out.append(f"node {node_name}: {cores} cores claimed of {cpu['cores']}")
            if memory_used[node_name] > int(cpu["memory"]):
                out.append(f"node {node_name}: {memory_used[node_name]} bytes claimed of {cpu['memory']}")
        return out


_QUERIES = {
    "nodes": "SELECT name, spec, state, cordon_reason, epoch FROM nodes",
    "replicas": "SELECT name, deployment, profile, spec, state FROM replicas",
    "shards": "SELECT replica, shard, node, cpu_cores, memory, node_epoch FROM replica_shards",
    "allocations": "SELECT node, device_index, replica FROM device_allocations",
    "deployments": "SELECT name, spec, generation, status FROM deployments",
    "models": "SELECT name FROM models",
    "classes": "SELECT name FROM device_classes",
    "fabrics": "SELECT name FROM fabrics",
    "leases": "SELECT name, holder, expires_at FROM leader_lease",
    "tokens": "SELECT kind, revoked FROM tokens",
    "decisions": "SELECT count(*) FROM decisions",
}


def _state_from_rows(rows: dict[str, list[tuple[Any, ...]]]) -> State:
    return State(
        nodes={
            r[0]: {"spec": _json(r[1]), "state": r[2], "cordon": r[3], "epoch": r[4]} for r in rows["nodes"]
        },
        replicas={
            r[0]: {"deployment": r[1], "profile": r[2], "spec": _json(r[3]), "state": r[4]}
            for r in rows["replicas"]
        },
        shards=[(r[0], int(r[1]), r[2], int(r[3]), int(r[4]), int(r[5])) for r in rows["shards"]],
        allocations=[(r[0], int(r[1]), r[2]) for r in rows["allocations"]],
        deployments={
            r[0]: {"spec": _json(r[1]), "generation": int(r[2]), "status": _json(r[3])}
            for r in rows["deployments"]
        },
        models={r[0] for r in rows["models"]},
        classes={r[0] for r in rows["classes"]},
        fabrics={r[0] for r in rows["fabrics"]},
        leases=[(r[0], r[1], r[2]) for r in rows["leases"]],
        tokens=[(r[0], bool(r[1])) for r in rows["tokens"]],
        counts={"decisions": int(rows["decisions"][0][0])},
    )


def read_state(database_url: str) -> State:
    """The whole state of ``database_url`` (a SQLite path / sqlite:/// URL, or postgresql://…),
    read in one transaction so every table is seen at the same instant."""
    if database_url.startswith("postgresql://"):
        import psycopg

        with psycopg.connect(database_url, connect_timeout=10) as conn:
            conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
            with conn.transaction(force_rollback=True), conn.cursor() as cur:
                rows = {key: cur.execute(query).fetchall() for key, query in _QUERIES.items()}
        return _state_from_rows(rows)
    path = database_url.removeprefix("sqlite:///")
    conn = sqlite3.connect(path, isolation_level=None, timeout=30)
    try:
        conn.execute("BEGIN")  # a deferred read transaction: one snapshot for every SELECT
        rows = {key: conn.execute(query).fetchall() for key, query in _QUERIES.items()}
        conn.execute("ROLLBACK")
    finally:
        conn.close()
    return _state_from_rows(rows)


@contextlib.contextmanager
def sql_poller(database_url: str) -> Iterator[Callable[[str], Any]]:
    """One open connection for cheap, frequent one-value queries (each in its own transaction)."""
    if database_url.startswith("postgresql://"):
        import psycopg

        with psycopg.connect(database_url, autocommit=True, connect_timeout=10) as conn:

            def scalar_pg(query: str) -> Any:
                row = conn.execute(query).fetchone()
                return None if row is None else row[0]

            yield scalar_pg
        return
    conn = sqlite3.connect(database_url.removeprefix("sqlite:///"), isolation_level=None, timeout=30)
    try:

        def scalar_sqlite(query: str) -> Any:
            row = conn.execute(query).fetchone()
            return None if row is None else row[0]

        yield scalar_sqlite
    finally:
        conn.close()


def engine_key(database_url: str, replica: str) -> str:
    """The replica's engine API key, as the store holds it (only the gateway, the observer and
    the replica's agent are given it; a test reads it here to reach the engine itself)."""
    with sql_poller(database_url) as scalar:
        key = scalar(f"SELECT engine_key FROM replicas WHERE name = '{replica}'")
    assert isinstance(key, str) and key, f"replica {replica} has no engine key"
    return key


def engine_headers(database_url: str, replica: str) -> dict[str, str]:
    """The Authorization header that opens the replica's engine."""
    return {"Authorization": f"Bearer {engine_key(database_url, replica)}"}


def wait_for(condition: Callable[[], Any], timeout: float, what: str, interval: float = 0.1) -> Any:
    """Poll ``condition`` until it returns something truthy; fail with ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = condition()
        if last:
            return last
        time.sleep(interval)
    pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}; last seen: {last!r}")


# --- agents, engines and the CLI as real processes ------------------------------------------------
#
# ``AgentFactory.start(server, name)`` runs ``fleetserve agent`` with its own cache and engine-log
# directories under the test's tmp_path (so every engine it starts names that path in its argv, and
# its stdout is ``<log-dir>/<replica>.log``: which replica a llama-server serves is readable from
# /proc). At teardown every agent is resumed (SIGCONT), stopped (SIGTERM, then SIGKILL), and any
# llama-server still naming the test's tmp_path (an orphaned engine) or process naming an agent's
# directory is killed.


def processes_mentioning(marker: Path | str, program: str | None = None) -> list[Any]:
    """Live (non-zombie) processes with an argument containing ``marker`` (a directory: matched
    with its trailing slash), optionally only those whose program's base name is ``program``."""
    import psutil

    needle = str(marker).rstrip("/") + "/"
    found = []
    for proc in psutil.process_iter(["pid", "cmdline", "status"]):
        try:
            cmdline = proc.info["cmdline"] or []
            if proc.info["status"] == psutil.STATUS_ZOMBIE or not cmdline:
                continue
            if program is not None and Path(cmdline[0]).name != program:
                continue
            if any(needle in arg or arg == needle.rstrip("/") for arg in cmdline):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def llama_servers(marker: Path | str) -> list[Any]:
    """The live llama-server processes whose argv names ``marker`` (their model under a cache there)."""
    return processes_mentioning(marker, program="llama-server")


def engine_identity(proc: Any) -> tuple[str, str] | None:
    """(node, replica) an engine serves, read from its stdout — ``<tmp>/<node>/logs/<replica>.log``
    as AgentFactory lays the directories out; None when it is gone or not laid out so."""
    try:
        target = Path(os.readlink(f"/proc/{proc.pid}/fd/1"))
    except OSError:
        return None
    if target.suffix != ".log" or target.parent.name != "logs":
        return None
    return target.parent.parent.name, target.stem


def engine_ready(port: int) -> bool:
    """Whether the engine on 127.0.0.1:``port`` answers /health with 200 (loaded, serving)."""
    try:
        with httpx.Client(timeout=2) as http:
            return http.get(f"http://127.0.0.1:{port}/health").status_code == 200
    except httpx.HTTPError:
        return False


def replica_details(server: ServerProcess, deployment: str) -> list[dict[str, Any]]:
    """The replicas of ``deployment`` as GET /api/v1/replicas/NAME shows them (with status)."""
    with server.client(timeout=10) as api:
        listed = api.get("/replicas", params={"deployment": deployment})
        assert listed.status_code == 200, listed.text
        out = []
        for row in listed.json():
            detail = api.get(f"/replicas/{row['name']}")
            if detail.status_code == 200:
                out.append(detail.json())
    return out


def port_answers(port: int, path: str = "/health", timeout: float = 1.0) -> bool:
    """Whether anything answers HTTP on 127.0.0.1:``port``."""
    try:
        with httpx.Client(timeout=timeout) as http:
            http.get(f"http://127.0.0.1:{port}{path}")
        return True
    except httpx.HTTPError:
        return False


def kill_processes_mentioning(marker: Path | str) -> list[str]:
    """SIGKILL every live process naming ``marker``; their command lines, for a report."""
    import psutil

    killed = []
    for proc in processes_mentioning(marker):
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            killed.append(" ".join(proc.cmdline()))
            proc.kill()
    return killed


@dataclass
class AgentProcess:
    """One running ``fleetserve agent``."""

    name: str
    root: Path  # <tmp>/<name>: cache/ and logs/ of this agent
    log_path: Path
    proc: subprocess.Popen[bytes]

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def cache_dir(self) -> Path:
        return self.root / "cache"

    @property
    def engine_log_dir(self) -> Path:
        return self.root / "logs"

    @property
    def credential_file(self) -> Path:
        """Where the agent keeps its node credential (the default: beside its cache)."""
        return self.root / "node-credential"

    def credential(self) -> str:
        """The node credential the agent was issued at enrolment. The server marks the node Ready
        when it answers the enrolment, a moment before the agent has written the file: wait for it."""
        deadline = time.monotonic() + 30
        while not self.credential_file.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        data = yaml.safe_load(self.credential_file.read_text(encoding="utf-8"))
        return str(data["credential"])

    def alive(self) -> bool:
        return self.proc.poll() is None

    def signal(self, signum: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signum)

    def stop(self, timeout: float = 20.0) -> int:
        """Resume if stopped, SIGTERM, then SIGKILL if it does not end in time; its exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait(timeout=30)

    def log(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    def engines(self) -> list[Any]:
        """The live llama-server processes this agent started (their model is in its cache)."""
        return llama_servers(self.cache_dir)


class AgentFactory:
    """Starts agents for one test; stops every one of them, and every orphan, at teardown."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.started: list[AgentProcess] = []
        self._handles: list[Any] = []

    def start(
        self,
        server_url: str,
        token: str,
        name: str,
        *,
        interval: float = 0.5,
        extra_args: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
    ) -> AgentProcess:
        root = self.tmp_path / name
        root.mkdir(parents=True, exist_ok=True)
        log_path = root / f"agent-{sum(a.name == name for a in self.started) + 1}.log"
        handle = open(log_path, "wb")  # noqa: SIM115 - closed at teardown, after the process ended
        self._handles.append(handle)
        # The join token travels in the environment, never on the command line.
        args = [
            str(FLEETSERVE), "agent", "--server", server_url, "--name", name,
            "--address", "127.0.0.1", "--cache-dir", str(root / "cache"), "--log-dir", str(root / "logs"),
            "--interval", str(interval),
            # Tests write their models under pytest's base temporary directory.
            "--model-dir", str(self.tmp_path.parent), *extra_args,
        ]  # fmt: skip
        proc = subprocess.Popen(
            args,
            stdout=handle,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=clean_env(PYTHONUNBUFFERED="1", **{"FLEETSERVE_JOIN_TOKEN": token, **(env or {})}),
        )
        agent = AgentProcess(name, root, log_path, proc)
        self.started.append(agent)
        return agent

    def close(self) -> list[str]:
        """Stop every agent, then kill every llama-server still naming the test's tmp_path and
        anything still naming an agent's directory; the llama-servers that were left (orphans)."""
        for agent in reversed(self.started):
            with contextlib.suppress(Exception):
                agent.stop(timeout=15)
            if agent.proc.poll() is None:  # pragma: no cover - stop() kills; belt and braces
                agent.proc.kill()
                agent.proc.wait()
        # An engine dies with its agent (SIGTERM: stopped; SIGKILL: parent-death signal), but give
        # a dying one a moment before calling it an orphan.
        deadline = time.monotonic() + 5.0
        while llama_servers(self.tmp_path) and time.monotonic() < deadline:
            time.sleep(0.1)
        orphans = [" ".join(p.cmdline()) for p in llama_servers(self.tmp_path)]
        for proc in llama_servers(self.tmp_path):
            with contextlib.suppress(Exception):
                proc.kill()
        for root in {agent.root for agent in self.started}:  # anything else an agent started
            kill_processes_mentioning(root)
        for handle in self._handles:
            handle.close()
        return orphans


def cli_env(server: ServerProcess, home: Path, **extra: str) -> dict[str, str]:
    """The environment of an admin CLI run against ``server``: FLEETSERVE_SERVER/FLEETSERVE_TOKEN
    set, HOME and XDG_CONFIG_HOME under ``home`` so no real config file is read or written."""
    return clean_env(
        HOME=str(home / "home"),
        XDG_CONFIG_HOME=str(home / "xdg"),
        FLEETSERVE_SERVER=server.url,
        FLEETSERVE_TOKEN=server.admin_token,
        COLUMNS="250",
        **extra,
    )


def run_cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """Run the installed ``fleetserve`` console script; never raises on a non-zero exit."""
    return subprocess.run(
        [str(FLEETSERVE), *args],
        capture_output=True,
        text=True,
        env=env if env is not None else clean_env(),
        timeout=timeout,
        check=False,
    )


def tiny_documents(
    model_path: Path, name: str = "tiny", *, cores: int = 1, replicas: int = 1
) -> list[dict[str, Any]]:
    """A Model of the tiny GGUF at ``model_path`` and a Deployment with one llama.cpp CPU profile."""
    return [
        {"kind": "Model", "name": name, "source": str(model_path.resolve()), "format": "gguf"},
        {
            "kind": "Deployment",
            "name": name,
            "model": name,
            "replicas": replicas,
            "profiles": [{"name": "cpu", "engine": "llama.cpp", "cpu": {"cores": cores}, "context": 256}],
        },
    ]


def short_deadline_args(tmp_path: Path) -> tuple[str, ...]:
    """Server arguments for tests with real agents: NotReady after 2 s, Lost after 4 s, and the
    server's model-file directory under the test's tmp_path (these override ServerFactory's
    "no heartbeats" defaults: the last value of an option wins)."""
    return ("--not-ready-after", "2", "--lost-after", "4", "--models-dir", str(tmp_path / "server-models"))


# Requests the tiny model answers slowly, so load can be held: llama-server's `grammar` field.
# SLOW: 2,000 alternative rules cost ~10 ms per token; GROWING: parse stacks that grow with every
# token, for one long request. ignore_eos keeps token counts exact.
SLOW_RULES = 2000
SLOW = {
    "grammar": "root ::= "
    + " | ".join(f"r{i}" for i in range(SLOW_RULES))
    + "\n"
    + "\n".join(f"r{i} ::= [a-z]*" for i in range(SLOW_RULES)),
    "ignore_eos": True,
}
# 4 slots share the replica's 256-token KV cache: ~23 prompt + 30 generated tokens each fit.
SLOW_TOKENS = 30
GROWING = {"grammar": "root ::= x\nx ::= [a-z] x? x?", "ignore_eos": True}


def slow_chat(model: str, content: str, **extra: Any) -> dict[str, Any]:
    """A chat request the tiny model answers slowly (SLOW_TOKENS under the SLOW grammar)."""
    return {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": SLOW_TOKENS,
        **extra,
        **SLOW,
    }


def synthetic_models(gpu_model: str = "m-gpu") -> list[dict[str, Any]]:
    """A safetensors model for GPU deployments and a GGUF one for CPU deployments, by size only."""
    return [
        {
            "kind": "Model",
            "name": gpu_model,
            "format": "safetensors",
            "size": "14GB",
            "architecture": {"layers": 32, "kvHeads": 8, "headDim": 128, "contextLength": 8192},
        },
        {
            "kind": "Model",
            "name": "m-cpu",
            "format": "gguf",
            "size": "4GB",
            "architecture": {"layers": 28, "kvHeads": 4, "headDim": 128, "contextLength": 8192},
        },
    ]


def stop_process(proc: subprocess.Popen[Any], grace: float = 10) -> None:
    """SIGTERM ``proc``, then SIGKILL it if it has not exited within ``grace`` seconds; reaped."""
    proc.terminate()
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def server_and_mirrored_agent(
    servers: ServerFactory,
    agents: AgentFactory,
    tmp: Path,
    node: str,
    mirror: Path,
    cores: int,
    agent_env: dict[str, str] | None = None,
) -> tuple[ServerProcess, AgentProcess]:
    """A server on SQLite in ``tmp`` (short deadlines) and one agent, ``node``, of ``cores`` CPU
    cores, fetching from the Hub stand-in at ``mirror`` (``agent_env``: added to its environment,
    which its engines start from); returned once the node is Ready."""
    inventory = tmp / "inventory.yaml"
    inventory.write_text(f"kind: Node\ncpu: {{cores: {cores}}}\n")
    server = servers.start(f"sqlite:///{tmp / 'state.db'}", extra_args=short_deadline_args(tmp))
    agent = agents.start(
        server.url,
        server.join_token,
        node,
        extra_args=("--hf-mirror", str(mirror), "--inventory-file", str(inventory)),
        env=agent_env,
    )

    def registered() -> bool:
        with server.client(timeout=10) as api:
            return any(n["name"] == node and n["state"] == "Ready" for n in api.get("/nodes").json())

    wait_for(registered, timeout=60, what=f"{node} to register")
    return server, agent


def api_key(server: ServerProcess, name: str, models: list[str]) -> str:
    """A new API key named ``name`` for ``models`` (``["*"]``: every one)."""
    with server.client(timeout=10) as api:
        made = api.post("/keys", json={"name": name, "models": models})
    assert made.status_code == 200, made.text
    return str(made.json()["key"])


def hf_cache_repo(root: Path, repo: str, write: Callable[[Path], Any], commit: str = "0" * 40) -> Path:
    """Lay ``repo`` out as huggingface_hub's cache lays it out under ``root`` (what an agent's
    ``--hf-mirror`` serves as ``hf://REPO``): ``write(snapshot)`` fills the snapshot folder of
    ``commit``, which ``refs/main`` names. The snapshot folder."""
    cached = root / f"models--{repo.replace('/', '--')}"
    snapshot = cached / "snapshots" / commit
    write(snapshot)
    (cached / "refs").mkdir(exist_ok=True)
    (cached / "refs" / "main").write_text(commit)
    return snapshot


@dataclass
class LiveFleet:
    """A real server and one agent serving real engines, and a gateway API key: what the live
    engine tests (tasks, speculative decoding, adapters) read their deployments through."""

    server: ServerProcess
    agent: AgentProcess
    key: str

    def running(self, deployment: str) -> dict[str, Any] | None:
        """``deployment``'s first replica that is Running with a port, as the admin API details it;
        a Failed or CrashLoop replica fails the test at once, naming its status."""
        rows = replica_details(self.server, deployment)
        for row in rows:
            if row["state"] in ("Failed", "CrashLoop"):
                raise AssertionError(f"{deployment}: {row['state']}: {row.get('status')}")
        up = [r for r in rows if r["state"] == "Running" and r["status"].get("port")]
        return up[0] if up else None

    def openai(self) -> Any:
        from openai import OpenAI

        return OpenAI(base_url=f"{self.server.url}/v1", api_key=self.key, max_retries=0, timeout=120)

    def post(self, path: str, body: dict[str, Any]) -> httpx.Response:
        headers = {"Authorization": f"Bearer {self.key}"}
        return httpx.post(f"{self.server.url}{path}", json=body, headers=headers, timeout=120)

    def engine(self, port: int) -> Any:
        """The one engine process of this agent listening on ``port`` (a ``psutil.Process``)."""
        found = [
            p
            for p in processes_mentioning(self.agent.cache_dir)
            if "--port" in p.cmdline() and p.cmdline()[p.cmdline().index("--port") + 1] == str(port)
        ]
        assert len(found) == 1, [p.cmdline() for p in found]
        return found[0]

    def engine_argv(self, port: int) -> list[str]:
        """The command line of the one engine process of this agent listening on ``port``."""
        return list(self.engine(port).cmdline())

    def argv(self, deployment: str) -> list[str]:
        """The command line of the engine serving ``deployment``'s Running replica."""
        replica = self.running(deployment)
        assert replica is not None, f"{deployment} has no Running replica"
        return self.engine_argv(int(replica["status"]["port"]))


@contextlib.contextmanager
def live_fleet(
    tmp: Path,
    node: str,
    mirror: Path,
    *,
    cores: int,
    key_models: tuple[str, ...] = ("*",),
    agent_env: dict[str, str] | None = None,
) -> Iterator[LiveFleet]:
    """``server_and_mirrored_agent`` and an API key for ``key_models``; at exit every process is
    stopped, and an engine that outlived its agent, or any process still naming ``tmp``, fails."""
    servers, agents = ServerFactory(tmp), AgentFactory(tmp)
    try:
        server, agent = server_and_mirrored_agent(
            servers, agents, tmp, node, mirror, cores=cores, agent_env=agent_env
        )
        yield LiveFleet(server, agent, api_key(server, node, list(key_models)))
    finally:
        orphans = agents.close()
        servers.close()
        leftover = [" ".join(p.cmdline()) for p in processes_mentioning(tmp)]
    assert not orphans, orphans
    assert not leftover, f"processes outlived the fleet: {leftover}"
