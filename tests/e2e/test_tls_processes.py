"""TLS off loopback, with real ``fleetserve server``, ``gateway``, ``agent`` and CLI processes.

A server listening on the wildcard address (not loopback) generates a CA and a certificate on
first start and prints the join command pinning the CA by its hash. Agents and the admin CLI
that give that pin verify the server and work; a wrong pin, or no pin at all, is refused with a
clear error before any token is sent. Plain HTTP to or on a non-loopback address is refused
unless ``--insecure``. Every connection goes to this machine only: the servers listen on
0.0.0.0 and the clients dial 127.0.0.1 (the certificate names it) or 0.0.0.0.
"""

from __future__ import annotations

import contextlib
import re
import signal
import ssl
import stat
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from cryptography import x509
from e2e_support import FLEETSERVE, AgentFactory, clean_env, free_port, run_cli, wait_for

from fleetserve.tls import CaPin, ensure_generated

pytestmark = pytest.mark.slow

START_TIMEOUT = 60.0
WRONG_PIN = "sha256:" + "0" * 64


@dataclass
class Listener:
    """A running ``fleetserve server`` or ``gateway`` and what it printed."""

    proc: subprocess.Popen[bytes]
    port: int
    log_path: Path
    tls_dir: Path

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.proc.wait(timeout=30)


def _spawn(tmp_path: Path, name: str, args: list[str]) -> tuple[subprocess.Popen[bytes], Path]:
    log_path = tmp_path / f"{name}.log"
    with log_path.open("wb") as out:
        proc = subprocess.Popen(
            [str(FLEETSERVE), *args], stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=clean_env(PYTHONUNBUFFERED="1", COLUMNS="250"), cwd=tmp_path,
        )  # fmt: skip
    return proc, log_path


def _wait_answers(listener: Listener, url: str, verify: Any) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    with httpx.Client(timeout=2.0, verify=verify) as http:
        while time.monotonic() < deadline:
            if listener.proc.poll() is not None:
                pytest.fail(f"it exited ({listener.proc.returncode}):\n{listener.log()}")
            with contextlib.suppress(httpx.HTTPError):
                if http.get(url).status_code == 200:
                    return
            time.sleep(0.1)
    pytest.fail(f"{url} did not answer:\n{listener.log()}")


@pytest.fixture
def tls_server(tmp_path: Path) -> Iterator[Listener]:
    """``fleetserve server --host 0.0.0.0``: off loopback, so it generates its CA in --tls-dir."""
    port = free_port()
    tls_dir = tmp_path / "tls"
    proc, log_path = _spawn(
        tmp_path,
        "server",
        ["server", "--database-url", f"sqlite:///{tmp_path / 'state.db'}", "--host", "0.0.0.0",
         "--port", str(port), "--tls-dir", str(tls_dir), "--tls-san", "cp.fleet.test",
         "--token-file", str(tmp_path / "tokens.yaml"), "--reconcile-interval", "0.2",
         "--approve-new-nodes"],
    )  # fmt: skip
    server = Listener(proc, port, log_path, tls_dir)
    try:
        wait_for(lambda: (tls_dir / "ca.crt").exists() or proc.poll() is not None, 60, "the CA")
        _wait_answers(server, f"{server.url}/healthz", trusting(tls_dir / "ca.crt"))
        yield server
    finally:
        server.stop()


def trusting(ca_file: Path) -> ssl.SSLContext:
    """A client context that trusts exactly ``ca_file``."""
    return ssl.create_default_context(cafile=str(ca_file))


def tokens(tmp_path: Path) -> dict[str, str]:
    loaded: dict[str, str] = yaml.safe_load((tmp_path / "tokens.yaml").read_text())
    return loaded


def printed_pin(server: Listener) -> str:
    found = re.search(r"pin (sha256:[0-9a-f]{64})", server.log())
    assert found, server.log()
    return found[1]


def test_off_loopback_the_server_generates_a_ca_prints_the_join_pin_and_serves_only_tls(
    tls_server: Listener, tmp_path: Path
) -> None:
    ca_file = tls_server.tls_dir / "ca.crt"
    ca = x509.load_pem_x509_certificate(ca_file.read_bytes())
    pin = printed_pin(tls_server)
    assert pin == str(CaPin.of(ca))
    log = tls_server.log()
    assert f"fleetserve server: https://cp.fleet.test:{tls_server.port}" in log
    assert f"fleetserve agent --server https://cp.fleet.test:{tls_server.port} --ca-hash {pin}" in log
    assert f"fleetserve login --server https://cp.fleet.test:{tls_server.port} --ca-hash {pin}" in log
    assert stat.S_IMODE(tls_server.tls_dir.stat().st_mode) == 0o700
    for key in ("ca.key", "server.key"):
        assert stat.S_IMODE((tls_server.tls_dir / key).stat().st_mode) == 0o600, key
    # The published CA is exactly the pinned one; no token needed to read it.
    with httpx.Client(verify=trusting(ca_file), timeout=10) as http:
        published = http.get(f"{tls_server.url}/tls/ca.crt")
        assert published.status_code == 200 and published.content == ca_file.read_bytes()
        assert http.get(f"https://localhost:{tls_server.port}/healthz").status_code == 200
    # Plain HTTP gets no answer on the TLS port, and the system's CAs do not vouch for it.
    with pytest.raises(httpx.TransportError), httpx.Client(timeout=5) as plain:
        plain.get(f"http://127.0.0.1:{tls_server.port}/healthz")
    with (
        pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"),
        httpx.Client(timeout=5) as system,
    ):
        system.get(f"{tls_server.url}/healthz")


def test_an_agent_with_the_printed_pin_joins_and_one_with_a_wrong_pin_or_none_is_refused(
    tls_server: Listener, tmp_path: Path, agents: AgentFactory
) -> None:
    pin = printed_pin(tls_server)
    secrets = tokens(tmp_path)
    impostor = agents.start(tls_server.url, secrets["join"], "wrong-pin", extra_args=("--ca-hash", WRONG_PIN))
    assert impostor.proc.wait(timeout=60) != 0
    assert f"the server's CA has the hash {pin}, not the pinned {WRONG_PIN}" in impostor.log(), impostor.log()
    unpinned = agents.start(tls_server.url, secrets["join"], "no-pin")
    good = agents.start(tls_server.url, secrets["join"], "pinned", extra_args=("--ca-hash", pin))
    ca = trusting(tls_server.tls_dir / "ca.crt")
    headers = {"Authorization": f"Bearer {secrets['admin']}"}
    with httpx.Client(base_url=f"{tls_server.url}/api/v1", headers=headers, verify=ca, timeout=10) as api:

        def names() -> set[str]:
            return {n["name"] for n in api.get("/nodes").json() if n["state"] == "Ready"}

        wait_for(lambda: "pinned" in names(), timeout=60, what="the pinned agent to register over TLS")
        wait_for(
            lambda: "CERTIFICATE_VERIFY_FAILED" in unpinned.log(), timeout=30, what="no-pin to be refused"
        )
        assert names() == {"pinned"}, "neither the wrong pin nor the system's CAs let an agent in"
    assert unpinned.alive() and good.alive()


def test_the_cli_verifies_the_server_against_the_pin(tls_server: Listener, tmp_path: Path) -> None:
    pin = printed_pin(tls_server)
    admin = tokens(tmp_path)["admin"]
    home = {"HOME": str(tmp_path / "home"), "XDG_CONFIG_HOME": str(tmp_path / "xdg"), "COLUMNS": "250"}
    env = clean_env(FLEETSERVE_SERVER=tls_server.url, FLEETSERVE_TOKEN=admin, **home)

    listed = run_cli("get", "nodes", env={**env, "FLEETSERVE_CA_HASH": pin})
    assert listed.returncode == 0, listed.stderr
    wrong = run_cli("get", "nodes", env={**env, "FLEETSERVE_CA_HASH": WRONG_PIN})
    assert wrong.returncode != 0
    assert f"not the pinned {WRONG_PIN}" in wrong.stderr, wrong.stderr
    unpinned = run_cli("get", "nodes", env=env)
    assert unpinned.returncode != 0
    assert "could not be verified" in unpinned.stderr and "FLEETSERVE_CA_HASH" in unpinned.stderr, (
        unpinned.stderr
    )
    with_file = run_cli("get", "nodes", env={**env, "FLEETSERVE_CA_FILE": str(tls_server.tls_dir / "ca.crt")})
    assert with_file.returncode == 0, with_file.stderr

    # login keeps the pin with the server: later commands need neither flag nor environment.
    bare = clean_env(**home)
    refused = run_cli("login", "--server", tls_server.url, "--token", admin, "--ca-hash", WRONG_PIN, env=bare)
    assert refused.returncode != 0 and "not the pinned" in refused.stderr, refused.stderr
    logged = run_cli("login", "--server", tls_server.url, "--token", admin, "--ca-hash", pin, env=bare)
    assert logged.returncode == 0, logged.stderr
    config = yaml.safe_load((tmp_path / "xdg" / "fleetserve" / "config.yaml").read_text())
    assert config["ca_hash"] == pin
    again = run_cli("get", "nodes", env=bare)
    assert again.returncode == 0, again.stderr


def test_plain_http_off_loopback_is_refused_by_agent_and_cli_and_allowed_with_insecure(
    tmp_path: Path, agents: AgentFactory
) -> None:
    # 0.0.0.0 is not loopback; were the refusal missing, the connection would still stay on this machine.
    port = free_port()
    plain_url = f"http://0.0.0.0:{port}"
    agent = agents.start(plain_url, "fs_join_x", "plain")
    assert agent.proc.wait(timeout=60) != 0
    assert "plain HTTP to a non-loopback address" in agent.log() and "--insecure" in agent.log(), agent.log()
    home = {"HOME": str(tmp_path / "home"), "XDG_CONFIG_HOME": str(tmp_path / "xdg")}
    cli = run_cli("get", "nodes", env=clean_env(FLEETSERVE_SERVER=plain_url, FLEETSERVE_TOKEN="x", **home))
    assert cli.returncode != 0 and "plain HTTP to a non-loopback address" in cli.stderr, cli.stderr

    # The operator insists: --insecure serves plain HTTP off loopback, and says so.
    proc, log_path = _spawn(
        tmp_path,
        "insecure-server",
        ["server", "--database-url", f"sqlite:///{tmp_path / 'state.db'}", "--host", "0.0.0.0",
         "--port", str(port), "--insecure", "--token-file", str(tmp_path / "tokens.yaml"),
         "--tls-dir", str(tmp_path / "tls"), "--approve-new-nodes"],
    )  # fmt: skip
    server = Listener(proc, port, log_path, tmp_path / "tls")
    try:
        _wait_answers(server, f"http://127.0.0.1:{port}/healthz", True)
        assert "plain HTTP on a non-loopback address (--insecure)" in server.log()
        assert not (tmp_path / "tls").exists()
        join = tokens(tmp_path)["join"]
        insecure = agents.start(plain_url, join, "insecure", extra_args=("--insecure",))
        headers = {"Authorization": f"Bearer {tokens(tmp_path)['admin']}"}
        with httpx.Client(base_url=f"http://127.0.0.1:{port}/api/v1", headers=headers, timeout=10) as api:
            wait_for(
                lambda: any(n["name"] == "insecure" for n in api.get("/nodes").json()),
                timeout=60,
                what="the --insecure agent to register",
            )
        assert insecure.alive()
    finally:
        server.stop()


def test_a_gateway_with_the_same_tls_dir_serves_tls_from_the_servers_ca(
    tls_server: Listener, tmp_path: Path
) -> None:
    port = free_port()
    proc, log_path = _spawn(
        tmp_path,
        "gateway",
        ["gateway", "--database-url", f"sqlite:///{tmp_path / 'state.db'}", "--host", "0.0.0.0",
         "--port", str(port), "--tls-dir", str(tls_server.tls_dir)],
    )  # fmt: skip
    gateway = Listener(proc, port, log_path, tls_server.tls_dir)
    try:
        _wait_answers(gateway, f"{gateway.url}/healthz", trusting(tls_server.tls_dir / "ca.crt"))
        assert printed_pin(gateway) == printed_pin(tls_server)
        assert (tls_server.tls_dir / "gateway.crt").exists()
        with pytest.raises(httpx.TransportError), httpx.Client(timeout=5) as plain:
            plain.get(f"http://127.0.0.1:{port}/healthz")
    finally:
        gateway.stop()


def test_the_operators_certificate_is_served_and_verified_with_its_ca_file(tmp_path: Path) -> None:
    """--tls-cert/--tls-key (here from a CA the test makes): nothing is generated, no CA is
    published, and clients verify the server with --ca-file / FLEETSERVE_CA_FILE."""
    operator = ensure_generated(tmp_path / "operator-pki", "server", ["127.0.0.1"])
    assert operator.ca_file is not None
    port = free_port()
    proc, log_path = _spawn(
        tmp_path,
        "server",
        ["server", "--database-url", f"sqlite:///{tmp_path / 'state.db'}", "--host", "127.0.0.1",
         "--port", str(port), "--tls-cert", str(operator.cert_file), "--tls-key", str(operator.key_file),
         "--tls-dir", str(tmp_path / "generated"), "--token-file", str(tmp_path / "tokens.yaml")],
    )  # fmt: skip
    server = Listener(proc, port, log_path, tmp_path / "generated")
    try:
        _wait_answers(server, f"{server.url}/healthz", trusting(operator.ca_file))
        assert f"fleetserve server: https://127.0.0.1:{port}" in server.log()
        assert "clients verify it with --ca-file" in server.log()
        assert not (tmp_path / "generated").exists()
        with httpx.Client(verify=trusting(operator.ca_file), timeout=10) as http:
            assert http.get(f"{server.url}/tls/ca.crt").status_code == 404
        home = {"HOME": str(tmp_path / "home"), "XDG_CONFIG_HOME": str(tmp_path / "xdg")}
        env = clean_env(FLEETSERVE_SERVER=server.url, FLEETSERVE_TOKEN=tokens(tmp_path)["admin"], **home)
        with_file = run_cli("get", "nodes", env={**env, "FLEETSERVE_CA_FILE": str(operator.ca_file)})
        assert with_file.returncode == 0, with_file.stderr
        pinned = run_cli("get", "nodes", env={**env, "FLEETSERVE_CA_HASH": str(operator.pin)})
        assert pinned.returncode != 0 and "publishes no CA" in pinned.stderr, pinned.stderr
    finally:
        server.stop()
