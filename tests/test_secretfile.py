"""Secret files: 0600 from creation (whatever the umask), replaced atomically, and the 0700 directory."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from fleetserve.secretfile import private_dir, read_secret, write_secret


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_secret_file_is_0600_even_under_a_permissive_umask_and_leaves_no_temporary_file(
    tmp_path: Path,
) -> None:
    old = os.umask(0)
    try:
        path = write_secret(tmp_path / "sub" / "token", "fs_admin_x\n")
    finally:
        os.umask(old)
    assert mode(path) == 0o600
    assert read_secret(path) == "fs_admin_x"
    assert sorted(p.name for p in path.parent.iterdir()) == ["token"]


def test_rewriting_a_world_readable_file_replaces_it_with_a_0600_one(tmp_path: Path) -> None:
    path = tmp_path / "tokens.yaml"
    path.write_text("old")
    path.chmod(0o644)
    inode = path.stat().st_ino
    write_secret(path, "new")
    assert (path.read_text(), mode(path)) == ("new", 0o600)
    assert path.stat().st_ino != inode  # a new file renamed over the old one, never the old one rewritten


def test_a_private_directory_is_0700(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir(mode=0o755)
    assert mode(private_dir(tmp_path / "data")) == 0o700
    assert mode(private_dir(tmp_path / "new" / "dir")) == 0o700
