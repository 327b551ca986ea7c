"""The node's credential on disk: kept for the server it was issued by, and rebound when that
control plane answers at another URL."""

from __future__ import annotations

import stat
from pathlib import Path

from fleetserve.agent.credential import CredentialFile

OLD = "http://127.0.0.1:8080"
NEW = "http://127.0.0.1:9090"


def test_a_credential_is_for_its_server_and_name_only(tmp_path: Path) -> None:
    kept = CredentialFile(tmp_path / "node-credential")
    kept.save(OLD, "n1", "fs_node_secret")
    assert kept.load(OLD, "n1") == "fs_node_secret"
    assert kept.load(NEW, "n1") is None
    assert kept.load(OLD, "n2") is None


def test_rebinding_keeps_the_credential_for_the_new_url_only(tmp_path: Path) -> None:
    kept = CredentialFile(tmp_path / "node-credential")
    kept.save(OLD, "n1", "fs_node_secret")
    kept.rebind(NEW)
    assert kept.load(NEW, "n1") == "fs_node_secret"
    assert kept.load(OLD, "n1") is None
    assert stat.S_IMODE(kept.path.stat().st_mode) == 0o600


def test_rebinding_nothing_or_garbage_writes_nothing(tmp_path: Path) -> None:
    missing = CredentialFile(tmp_path / "none")
    missing.rebind(NEW)
    assert not missing.path.exists()
    garbage = CredentialFile(tmp_path / "garbage")
    garbage.path.write_text("server: [\n", encoding="utf-8")
    garbage.rebind(NEW)
    assert garbage.path.read_text(encoding="utf-8") == "server: [\n"
