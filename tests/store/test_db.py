"""The SQLite state file holds every engine key: created 0600 in 0700 directories, tightened if
it was left wider, and its WAL files follow."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from sqlalchemy import text

from fleetserve.store.db import make_engine


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_new_state_database_is_0600_in_0700_directories_and_so_are_its_wal_files(tmp_path: Path) -> None:
    path = tmp_path / "data" / "fleetserve" / "state.db"
    before = os.umask(0o022)  # the common default, under which SQLite alone makes 0644 files
    try:
        engine = make_engine(path)
    finally:
        os.umask(before)
    with engine.begin() as c:
        c.execute(text("CREATE TABLE t (x TEXT)"))
        c.execute(text("INSERT INTO t VALUES ('fs_key')"))
    with engine.connect() as c:
        c.execute(text("SELECT * FROM t")).all()
        assert mode(path) == 0o600
        for companion in (path.with_name("state.db-wal"), path.with_name("state.db-shm")):
            assert mode(companion) == 0o600  # another local user reads no key from these either
    engine.dispose()
    assert mode(tmp_path / "data") == 0o700
    assert mode(tmp_path / "data" / "fleetserve") == 0o700


def test_a_state_database_left_0644_is_tightened_when_the_server_opens_it(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    path.touch(mode=0o644)
    path.chmod(0o644)
    make_engine(path).dispose()
    assert mode(path) == 0o600
    assert mode(tmp_path) == stat.S_IMODE(tmp_path.stat().st_mode)  # a directory it did not make is left
