"""The first tokens (``fleetserve.server.process.ensure_tokens``): written to a 0600 file, never
into the output (often a log file); shown only on a terminal when no file is named; never made
again once a token of the kind existed, even after it was revoked."""

from __future__ import annotations

import io
import stat
from datetime import UTC, datetime
from pathlib import Path

import pytest
import yaml
from rich.console import Console

from fleetserve.server.process import DEFAULT_TOKEN_FILE, ensure_tokens
from fleetserve.store import SqlStore, TokenKind


def log_console() -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(file=out, force_terminal=False, width=200), out


def test_the_first_tokens_go_to_the_named_file_0600_and_never_into_the_output(
    sqlite_store: SqlStore, tmp_path: Path
) -> None:
    console, out = log_console()
    ensure_tokens(sqlite_store, tmp_path / "tokens.yaml", console)
    tokens = yaml.safe_load((tmp_path / "tokens.yaml").read_text())
    assert set(tokens) == {"admin", "join"}
    assert stat.S_IMODE((tmp_path / "tokens.yaml").stat().st_mode) == 0o600
    assert tokens["admin"] not in out.getvalue() and tokens["join"] not in out.getvalue()
    assert str(tmp_path / "tokens.yaml") in out.getvalue()


def test_without_a_file_and_off_a_terminal_they_go_to_the_default_file(
    sqlite_store: SqlStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    console, out = log_console()
    ensure_tokens(sqlite_store, None, console)
    tokens = yaml.safe_load((tmp_path / DEFAULT_TOKEN_FILE).read_text())
    assert tokens["admin"].startswith("fs_admin_") and tokens["admin"] not in out.getvalue()


def test_a_revoked_join_token_is_not_made_again_on_restart(sqlite_store: SqlStore, tmp_path: Path) -> None:
    console, _ = log_console()
    ensure_tokens(sqlite_store, tmp_path / "tokens.yaml", console)
    join = next(t for t in sqlite_store.list_tokens() if t.kind is TokenKind.JOIN)
    sqlite_store.revoke_token(join.id)
    before = (tmp_path / "tokens.yaml").read_bytes()
    ensure_tokens(sqlite_store, tmp_path / "tokens.yaml", console)
    assert len(sqlite_store.list_tokens()) == 2
    assert (tmp_path / "tokens.yaml").read_bytes() == before
    assert not sqlite_store.verify_token(yaml.safe_load(before)["join"], TokenKind.JOIN, datetime.now(UTC))
