"""Token rotation with the real CLI, server and agents: a join token made with an expiry and
written to a 0600 file, an agent enrolling from that file (never the command line), the token
revoked (a new agent is refused, the enrolled node keeps its own credential), and the admin token
rotated."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest
from e2e_support import AgentFactory, ServerFactory, cli_env, run_cli, short_deadline_args, wait_for

pytestmark = pytest.mark.slow


def test_a_join_token_is_created_used_from_a_file_and_revoked_and_the_admin_token_rotated(
    servers: ServerFactory, agents: AgentFactory, tmp_path: Path
) -> None:
    server = servers.start(f"sqlite:///{tmp_path / 'state.db'}", extra_args=short_deadline_args(tmp_path))
    env = cli_env(server, tmp_path)
    join_file = tmp_path / "join-token"
    made = run_cli("tokens", "create", "join", "--expires", "1h", "--out", str(join_file), env=env)
    assert made.returncode == 0, made.stderr
    assert "expires" in made.stdout and str(join_file) in made.stdout
    token = join_file.read_text().strip()
    assert token.startswith("fs_join_") and token not in made.stdout
    assert stat.S_IMODE(join_file.stat().st_mode) == 0o600

    # The agent reads the token from the file; the factory's environment token is a wrong one.
    first = agents.start(server.url, "fs_join_wrong", "node-1", extra_args=("--token-file", str(join_file)))
    wait_for(lambda: "registered node node-1 at epoch 1" in first.log(), timeout=60, what="node-1 to enrol")
    assert token not in " ".join(first.proc.args)  # type: ignore[arg-type]

    listed = json.loads(run_cli("tokens", "list", "-o", "json", env=env).stdout)
    (ours,) = [t for t in listed if t["kind"] == "join" and t["expiresAt"]]
    assert all("token" not in t for t in listed)
    revoked = run_cli("tokens", "revoke", str(ours["id"]), env=env)
    assert revoked.returncode == 0, revoked.stderr

    second = agents.start(server.url, "fs_join_wrong", "node-2", extra_args=("--token-file", str(join_file)))
    wait_for(lambda: "401" in second.log(), timeout=60, what="node-2 to be refused")
    assert "node-2" not in run_cli("get", "nodes", env=env).stdout
    # node-1 keeps reporting with its own credential.
    first_beat = json.loads(run_cli("get", "nodes", "node-1", "-o", "json", env=env).stdout)
    wait_for(
        lambda: (
            json.loads(run_cli("get", "nodes", "node-1", "-o", "json", env=env).stdout)["status"][
                "lastHeartbeat"
            ]
            > first_beat["status"]["lastHeartbeat"]
        ),
        timeout=15,
        what="node-1's next heartbeat",
    )

    # Admin rotation: a new admin token, then the old one revoked; the last one cannot be.
    new_admin = tmp_path / "admin-token"
    assert run_cli("tokens", "create", "admin", "--out", str(new_admin), env=env).returncode == 0
    old_id = next(t["id"] for t in listed if t["kind"] == "admin")
    assert run_cli("tokens", "revoke", str(old_id), env=env).returncode == 0
    assert run_cli("get", "nodes", env=env).returncode != 0  # the old admin token is refused
    rotated = {k: v for k, v in env.items() if k != "FLEETSERVE_TOKEN"} | {
        "FLEETSERVE_TOKEN_FILE": str(new_admin)
    }
    assert run_cli("get", "nodes", env=rotated).returncode == 0
    tokens = json.loads(run_cli("tokens", "list", "-o", "json", env=rotated).stdout)
    (current,) = [t for t in tokens if t["kind"] == "admin" and t["valid"]]
    last = run_cli("tokens", "revoke", str(current["id"]), env=rotated)
    assert last.returncode != 0 and "last valid admin token" in last.stderr
