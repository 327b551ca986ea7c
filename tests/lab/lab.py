"""A multi-host lab on one machine: each host a network namespace with its own address, running a
real ``fleetserve agent`` and the real ``llama-server`` engines it starts; the server (control
plane and gateway) in the root namespace on the bridge's address. Used by tests/lab and
bench/chaos.py.

    root namespace                         host namespaces (ip netns)
    fleetserve server  10.213.N.1 (TLS) ── bridge fslbPID ── veth ── h1: agent, engines  10.213.N.11
                                                   ├── veth ── h2: agent, engines  10.213.N.12
                                                   └── veth ── h3: agent, engines  10.213.N.13

Traffic stays between these namespaces and the root namespace: a private /24 in 10.213.0.0/16
(the first one no interface here uses), no route out, no forwarding. Cutting a host's veth in
the root namespace partitions it (``Lab.cut``/``Lab.heal``).

``unavailable()`` says why a lab cannot be built here (not root, no ``ip``, namespaces refused);
``Lab.close()`` stops every process and removes every namespace, link and cgroup it made, whether
the run passed or not.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import ssl
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx
import psutil
import yaml

from fleetserve.process import die_with_parent

FLEETSERVE = Path(sys.executable).with_name("fleetserve")
T = TypeVar("T")

# Short deadlines keep the lab fast: NotReady after 2 s of silence, Lost (re-placed) after 6 s.
NOT_READY_AFTER = 2.0
LOST_AFTER = 6.0
# Disruption mode from two silent hosts (of three): the lab's "most hosts" (the default floor is
# three nodes, Kubernetes'; a lab of three hosts could never reach it with one host left).
DISRUPTION_MIN_NODES = 2
AGENT_INTERVAL = 0.5
RECONCILE_INTERVAL = 0.2


def unavailable() -> str | None:
    """Why a lab cannot be built on this machine, or None when it can."""
    if os.geteuid() != 0:
        return "the multi-host lab needs root (network namespaces, veth pairs, a bridge)"
    if shutil.which("ip") is None or shutil.which("nsenter") is None:
        return "the multi-host lab needs iproute2's `ip` (ip netns) and util-linux's `nsenter`"
    probe = f"fslprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, check=False)
    if made.returncode != 0:
        return f"`ip netns add` is refused here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, check=False)
    if not FLEETSERVE.exists():
        return f"no fleetserve console script beside {sys.executable}"
    return None


def ip(*args: str, netns: str | None = None) -> None:
    """Run ``ip ARGS`` (inside ``netns`` if given); raise with its stderr when it fails."""
    argv = ["ip", *(("-n", netns) if netns else ()), *args]
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip()}")


def free_subnet() -> str:
    """The first 10.213.X.0/24 that no interface here has an address in: '10.213.X'."""
    used = subprocess.run(["ip", "-o", "-4", "addr"], capture_output=True, text=True, check=True).stdout
    start = os.getpid() % 200
    for i in range(256):
        prefix = f"10.213.{(start + i) % 256}"
        if f" {prefix}." not in used:
            return prefix
    raise RuntimeError("every 10.213.X.0/24 is in use")


def sweep_stale() -> list[str]:
    """Remove the namespaces, links and bridges of labs whose process is gone (one killed before
    it could clean up); what was removed. Labs name everything after their pid."""
    removed = []
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=False).stdout
    names = [line.split()[0] for line in netns.splitlines() if line.strip()]
    names += [line.split(":")[1].strip().split("@")[0] for line in links.splitlines() if ":" in line]
    for name in names:
        found = re.fullmatch(r"fsl(?:b|v)?(\d+)(?:h\d+)?", name)
        if found is None or psutil.pid_exists(int(found.group(1))):
            continue
        kind = ["netns", "del", name] if not name.startswith(("fslb", "fslv")) else ["link", "del", name]
        if subprocess.run(["ip", *kind], capture_output=True, check=False).returncode == 0:
            removed.append(name)
    return removed


def wait_until(check: Callable[[], T | None], timeout: float, what: str, interval: float = 0.1) -> T:
    """Poll ``check`` until it returns something truthy; raise TimeoutError naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"not within {timeout:g} s: {what}")
        time.sleep(interval)


@dataclass
class Host:
    """One host: its namespace, its address, the root side of its link, its agent's directories."""

    name: str
    netns: str
    address: str
    veth: str
    root: Path
    agent: subprocess.Popen[bytes] | None = None
    starts: int = 0

    @property
    def cache_dir(self) -> Path:
        return self.root / "cache"

    @property
    def state_dir(self) -> Path:
        return self.root / "state"


@dataclass
class Lab:
    """Hosts in network namespaces, a server on the bridge, agents and engines; see the module."""

    workdir: Path
    hosts: dict[str, Host] = field(default_factory=dict)
    tag: str = field(default_factory=lambda: str(os.getpid()))  # names: fslb<pid>, fslv<pid>h1, fsl<pid>h1
    prefix: str = ""
    server: subprocess.Popen[bytes] | None = None
    server_url: str = ""
    admin_token: str = ""
    join_token: str = ""
    api_key: str = ""
    verify: ssl.SSLContext | None = None  # the server's generated CA, once it started
    _logs: list[Any] = field(default_factory=list)

    @property
    def ca_file(self) -> Path:
        return self.workdir / "tls" / "ca.crt"

    @property
    def bridge(self) -> str:
        return f"fslb{self.tag}"

    @property
    def gateway_url(self) -> str:
        return f"{self.server_url}/v1"

    # --- the network ------------------------------------------------------------------------------

    def build(self, hosts: int) -> None:
        """The bridge on 10.213.X.1 and ``hosts`` namespaces h1..hN on .11, .12, …"""
        sweep_stale()
        self.prefix = free_subnet()
        ip("link", "add", self.bridge, "type", "bridge")
        ip("addr", "add", f"{self.prefix}.1/24", "dev", self.bridge)
        ip("link", "set", self.bridge, "up")
        for i in range(1, hosts + 1):
            name = f"h{i}"
            host = Host(
                name=name,
                netns=f"fsl{self.tag}{name}",
                address=f"{self.prefix}.{10 + i}",
                veth=f"fslv{self.tag}{name}",
                root=self.workdir / name,
            )
            self.hosts[name] = host
            ip("netns", "add", host.netns)
            ip("link", "add", host.veth, "type", "veth", "peer", "name", "eth0", "netns", host.netns)
            ip("link", "set", host.veth, "master", self.bridge)
            ip("link", "set", host.veth, "up")
            ip("addr", "add", f"{host.address}/24", "dev", "eth0", netns=host.netns)
            ip("link", "set", "eth0", "up", netns=host.netns)
            ip("link", "set", "lo", "up", netns=host.netns)

    def cut(self, host: str) -> None:
        """Partition ``host``: its link to the bridge goes down (nothing in or out)."""
        ip("link", "set", self.hosts[host].veth, "down")

    def heal(self, host: str) -> None:
        """Reconnect ``host``."""
        ip("link", "set", self.hosts[host].veth, "up")

    # --- processes --------------------------------------------------------------------------------

    def _log(self, name: str) -> Any:
        handle = open(self.workdir / f"{name}.log", "ab")  # noqa: SIM115 - closed in close()
        self._logs.append(handle)
        return handle

    def start_server(self) -> None:
        """``fleetserve server`` on the bridge address, short heartbeat deadlines, SQLite; off
        loopback it serves TLS with a CA it generates (agents and clients verify against it)."""
        port = 18000 + os.getpid() % 1000
        token_file = self.workdir / "tokens.yaml"
        args = [
            str(FLEETSERVE), "server", "--database-url", f"sqlite:///{self.workdir / 'state.db'}",
            "--host", f"{self.prefix}.1", "--port", str(port),
            "--reconcile-interval", str(RECONCILE_INTERVAL),
            "--not-ready-after", str(NOT_READY_AFTER), "--lost-after", str(LOST_AFTER),
            "--disruption-min-nodes", str(DISRUPTION_MIN_NODES),
            "--token-file", str(token_file), "--models-dir", str(self.workdir / "server-models"),
            "--tls-dir", str(self.ca_file.parent),
            "--approve-new-nodes",  # the lab's hosts are new names, enrolled without an operator
        ]  # fmt: skip
        self.server = subprocess.Popen(
            args,
            stdout=self._log("server"),
            stderr=subprocess.STDOUT,
            env=_env(),
            stdin=subprocess.DEVNULL,
            preexec_fn=die_with_parent,  # a lab whose test run is killed leaves no server behind
        )
        self.server_url = f"https://{self.prefix}.1:{port}"

        def healthy() -> bool:
            if self.server is not None and self.server.poll() is not None:
                raise RuntimeError(f"the server exited: {self.log('server')[-3000:]}")
            if self.verify is None:
                try:
                    self.verify = ssl.create_default_context(cafile=str(self.ca_file))
                except (OSError, ssl.SSLError):
                    return False  # not written yet, or half-written
            with contextlib.suppress(httpx.HTTPError):
                response = httpx.get(self.server_url + "/healthz", timeout=2, verify=self.verify)
                return response.status_code == 200
            return False

        wait_until(healthy, 60, "the server to answer /healthz")
        tokens = yaml.safe_load(token_file.read_text(encoding="utf-8"))
        self.admin_token, self.join_token = tokens["admin"], tokens["join"]
        self.api_key = self.api("POST", "/keys", json={"name": "lab", "models": ["*"]})["key"]

    def start_agent(self, name: str) -> None:
        """``fleetserve agent`` inside the host's namespace, on the host's address."""
        host = self.hosts[name]
        host.root.mkdir(parents=True, exist_ok=True)
        host.starts += 1
        args = [
            "nsenter", f"--net=/run/netns/{host.netns}",
            str(FLEETSERVE), "agent", "--server", self.server_url,
            "--name", name, "--address", host.address, "--interval", str(AGENT_INTERVAL),
            "--cache-dir", str(host.cache_dir), "--log-dir", str(host.root / "logs"),
            "--state-dir", str(host.state_dir), "--ca-file", str(self.ca_file),
            "--model-dir", str(self.workdir / "models"),
        ]  # fmt: skip
        # nsenter enters the network namespace only (`ip netns exec` would also remount /sys,
        # hiding the cgroup hierarchy from the agent), then execs: the pid is the agent's.
        host.agent = subprocess.Popen(
            args,
            stdout=self._log(f"{name}-agent-{host.starts}"),
            stderr=subprocess.STDOUT,
            env={**_env(), "FLEETSERVE_JOIN_TOKEN": self.join_token},  # never on argv
            stdin=subprocess.DEVNULL,
            preexec_fn=die_with_parent,  # kept across nsenter's exec
        )

    def kill_agent(self, name: str) -> None:
        """SIGKILL the host's agent (no shutdown code runs)."""
        agent = self.hosts[name].agent
        if agent is not None and agent.poll() is None:
            agent.kill()
            agent.wait(timeout=30)

    def stop_agent(self, name: str) -> None:
        agent = self.hosts[name].agent
        if agent is not None and agent.poll() is None:
            agent.send_signal(signal.SIGTERM)
            try:
                agent.wait(timeout=20)
            except subprocess.TimeoutExpired:
                agent.kill()
                agent.wait()

    def log(self, name: str) -> str:
        path = self.workdir / f"{name}.log"
        return path.read_text(encoding="utf-8", errors="replace") if path.exists() else ""

    # --- the admin API ----------------------------------------------------------------------------

    def api(self, method: str, path: str, **kwargs: Any) -> Any:
        """Call the admin API; raise on anything but 200."""
        response = httpx.request(
            method,
            f"{self.server_url}/api/v1{path}",
            headers={"Authorization": f"Bearer {self.admin_token}"},
            timeout=30,
            verify=self.verify or True,
            **kwargs,
        )
        if response.status_code != 200:
            raise RuntimeError(f"{method} {path}: {response.status_code} {response.text}")
        return response.json()

    def apply(self, documents: list[dict[str, Any]]) -> None:
        self.api("POST", "/apply", json={"documents": documents})

    def replicas(self, deployment: str) -> list[dict[str, Any]]:
        """The deployment's replicas as the admin API lists them (name, state, shards)."""
        rows: list[dict[str, Any]] = self.api("GET", "/replicas", params={"deployment": deployment})
        return rows

    def running(self, deployment: str) -> dict[str, str]:
        """{replica: node} of the deployment's Running replicas."""
        return {
            r["name"]: r["shards"][0]["node"] for r in self.replicas(deployment) if r["state"] == "Running"
        }

    def node_state(self, name: str) -> str:
        return str(self.api("GET", f"/nodes/{name}")["state"])

    def epoch(self, name: str) -> int:
        """The node's registration: a new one for every time its agent registered again."""
        return int(self.api("GET", f"/nodes/{name}")["status"]["epoch"])

    def disruption(self) -> tuple[str | None, float | None]:
        """The fleet's DisruptionMode condition's message while it is True (None: it is not), and
        the server's ``fleetserve_disruption_mode`` gauge (None: not exposed)."""
        conditions = self.api("GET", "/fleet")["conditions"]
        message = next(
            (c["message"] for c in conditions if c["type"] == "DisruptionMode" and c["status"] == "True"),
            None,
        )
        text = httpx.get(f"{self.server_url}/metrics", timeout=30, verify=self.verify or True).text
        gauge = next(
            (
                float(line.split()[1])
                for line in text.splitlines()
                if line.startswith("fleetserve_disruption_mode ")
            ),
            None,
        )
        return message, gauge

    # --- engines ----------------------------------------------------------------------------------

    def engines(self, host: str | None = None) -> dict[int, str]:
        """{pid: replica} of the live llama-servers of one host (or of every host): a host's
        engines have their model under its cache directory and write to ``logs/<replica>.log``."""
        roots = [self.hosts[host].root] if host else [h.root for h in self.hosts.values()]
        out = {}
        for proc in psutil.process_iter(["pid", "cmdline", "status"]):
            try:
                cmdline = proc.info["cmdline"] or []
                if proc.info["status"] == psutil.STATUS_ZOMBIE or not cmdline:
                    continue
                if Path(cmdline[0]).name != "llama-server":
                    continue
                if not any(str(r / "cache") + "/" in arg for arg in cmdline for r in roots):
                    continue
                target = Path(os.readlink(f"/proc/{proc.pid}/fd/1"))
                out[proc.pid] = target.stem
            except (psutil.NoSuchProcess, psutil.AccessDenied, OSError):
                continue
        return out

    # --- teardown ---------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop everything, remove every namespace, link and cgroup; never raises."""
        for name in self.hosts:
            with contextlib.suppress(Exception):
                self.heal(name)  # an agent stopping may still want to tell the server
            with contextlib.suppress(Exception):
                self.stop_agent(name)
        if self.server is not None and self.server.poll() is None:
            self.server.send_signal(signal.SIGTERM)
            try:
                self.server.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.server.kill()
                self.server.wait()
        for pid in self.engines():  # an engine an agent left behind
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        from fleetserve.agent.containment import Containment

        for host in self.hosts.values():
            with contextlib.suppress(Exception):
                Containment(host.state_dir).reap_leftovers()
            subprocess.run(["ip", "netns", "del", host.netns], capture_output=True, check=False)
            subprocess.run(["ip", "link", "del", host.veth], capture_output=True, check=False)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, check=False)
        for handle in self._logs:
            handle.close()


def _env() -> dict[str, str]:
    """The environment of lab processes: no FLEETSERVE_* setting, unbuffered output."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEETSERVE_")}
    env["PYTHONUNBUFFERED"] = "1"
    return env
