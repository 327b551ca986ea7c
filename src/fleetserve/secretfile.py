"""Secret files (tokens, node credentials, API keys): written atomically with mode 0600 from the
first byte.

``write_secret`` creates a temporary file beside the target with ``O_CREAT | O_EXCL`` and mode
0600 (never a moment with wider permissions, never following a planted link), writes, fsyncs and
renames it over the target: a reader sees the old file or the new one, never half of one.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path


def private_dir(path: Path) -> Path:
    """Create ``path`` (and parents) if needed and make it 0700."""
    path.mkdir(parents=True, exist_ok=True)
    path.chmod(0o700)
    return path


def write_secret(path: Path, text: str | bytes, mode: int = 0o600) -> Path:
    """Write ``text`` to ``path`` atomically, with ``mode`` (0600 unless a public file such as a
    certificate asks for more) from creation."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), mode)
    data = text.encode("utf-8") if isinstance(text, str) else text
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def read_secret(path: Path) -> str:
    """A secret file's text, stripped of surrounding whitespace (OSError if unreadable)."""
    return path.read_text(encoding="utf-8").strip()
