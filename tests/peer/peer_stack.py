"""The fleetserve stack the peer suite's gateway run talks to: a server over SQLite (its gateway on
the tests' port) and an agent on this machine, started and stopped as ``fleetserve up`` does
(``cli/local.py``), one for the whole run; and the admin calls ``peer_wrap`` makes on it for each
test (an empty fleet, one deployment, an API key).

One stack for the run, not one per test: starting a server and an agent costs about 10 s of the
two CPUs per test, which would make the run take most of CI's time. Each test still gets a fresh
engine: the wrapper deletes every deployment first and waits until its replicas are gone.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx
import yaml

from fleetserve.process import die_with_parent


class StackError(Exception):
    """The stack could not do what was asked (the message says what, for the test's log)."""


def wait(
    what: str, check: Callable[[], Any], timeout: float, procs: Sequence[subprocess.Popen[bytes]] = ()
) -> Any:
    """``check()``'s first true value, polled until ``timeout``; a process of ``procs`` exiting,
    or the time running out, is a StackError."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for proc in procs:
            if proc.poll() is not None:
                raise StackError(f"{what}: {proc.args[1]!r} exited ({proc.returncode})")
        try:
            result = check()
        except httpx.HTTPError:
            result = None
        if result:
            return result
        time.sleep(0.05)
    raise StackError(f"{what}: not done after {timeout:.0f} s")


class Stack:
    """A fleetserve server and agent in ``data``, the server (and its gateway) on ``host:port``."""

    def __init__(self, data: Path, host: str, port: int, models: Path) -> None:
        self.data = data
        self.host, self.port = host, port
        self.models = models
        self.url = f"http://{host}:{port}"
        self.procs: list[subprocess.Popen[bytes]] = []
        self.exe = str(Path(sys.executable).with_name("fleetserve"))
        self.admin_token = ""

    def spawn(self, argv: list[str], log: str, env: dict[str, str] | None = None) -> None:
        with open(self.data / log, "ab") as out:
            proc = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                preexec_fn=die_with_parent, env=env,
            )  # fmt: skip
        self.procs.append(proc)

    def start(self) -> None:
        d = self.data
        d.mkdir(parents=True, exist_ok=True)
        self.models.mkdir(parents=True, exist_ok=True)
        self.spawn(
            [self.exe, "server", "--database-url", str(d / "fleetserve.db"), "--host", self.host,
             "--port", str(self.port), "--token-file", str(d / "tokens.yaml"),
             "--models-dir", str(d / "server-models"), "--reconcile-interval", "0.1",
             "--approve-new-nodes", "--grace-seconds", "0"],
            "server.log",
        )  # fmt: skip
        wait(
            "starting the server",
            lambda: httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200,
            60,
            self.procs,
        )
        tokens = yaml.safe_load((d / "tokens.yaml").read_text(encoding="utf-8"))
        self.admin_token = tokens["admin"]
        self.spawn(
            [self.exe, "agent", "--server", self.url, "--address", "127.0.0.1",
             "--credential-file", str(d / "node-credential"), "--cache-dir", str(d / "cache"),
             "--log-dir", str(d / "engine-logs"), "--interval", "0.2", "--model-dir", str(self.models)],
            "agent.log",
            env={**os.environ, "FLEETSERVE_JOIN_TOKEN": tokens["join"]},
        )  # fmt: skip
        with Admin(self.url, self.admin_token) as admin:
            wait("registering the agent", lambda: admin.client.get("/api/v1/nodes").json(), 60, self.procs)

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.procs)

    def stop(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in reversed(self.procs):
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


class Admin:
    """The admin calls of one test's start and stop."""

    def __init__(self, url: str, token: str) -> None:
        self.client = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=30)

    def __enter__(self) -> Admin:
        return self

    def __exit__(self, *exc: object) -> None:
        self.client.close()

    def clear(self, timeout: float = 30) -> None:
        """Delete every deployment and model and revoke every key; wait until no replica is left."""
        for deployment in self.client.get("/api/v1/deployments").json():
            self.client.delete(f"/api/v1/deployments/{deployment['name']}")
        for key in self.client.get("/api/v1/keys").json():
            if not key.get("revoked"):
                self.client.delete(f"/api/v1/keys/{key['id']}")
        wait(
            "stopping the last test's replicas",
            lambda: not self.client.get("/api/v1/replicas").json(),
            timeout,
        )
        for model in self.client.get("/api/v1/models").json():
            self.client.delete(f"/api/v1/models/{model['name']}")

    def deploy(
        self, name: str, model: Path, profile: dict[str, Any], timeout: float = 120, task: str = "generate"
    ) -> None:
        """Apply the model and a one-replica deployment of ``task``; wait until its replica runs."""
        documents = [
            {"kind": "Model", "name": name, "source": str(model), "format": "gguf"},
            # The fleet's default deployment: a lone llama-server serves whatever model name it
            # is sent, and the tests send several ("gpt-3.5-turbo-instruct", "test", none).
            {"kind": "Deployment", "name": name, "model": name, "replicas": 1, "drainSeconds": 0,
             "profiles": [profile], "routing": {"default": True}, "task": task},
        ]  # fmt: skip
        applied = self.client.post("/api/v1/apply", json={"documents": documents})
        if applied.status_code != 200:
            raise StackError(f"fleetserve refused the deployment: {applied.text}")
        wait("starting llama-server", lambda: self._running(name), timeout)

    def _running(self, name: str) -> bool:
        for listed in self.client.get("/api/v1/replicas", params={"deployment": name}).json():
            view = self.client.get(f"/api/v1/replicas/{listed['name']}").json()
            if view.get("state") in ("Failed", "CrashLoop"):
                raise StackError(f"replica {listed['name']} is {view.get('state')}: {view.get('status')}")
            if view.get("state") == "Running" and (view.get("status") or {}).get("port"):
                return True
        return False

    def key(self) -> str:
        created = self.client.post("/api/v1/keys", json={"name": "peer", "models": ["*"]})
        created.raise_for_status()
        key: str = created.json()["key"]
        return key
