"""Reading sysfs-style trees: small text files under a root that tests point at a recorded copy.

Every reader returns None for a file that is missing or unreadable: on real machines attributes come
and go with kernel versions, and a source reports what it could not read instead of failing.
"""

from __future__ import annotations

import re
from pathlib import Path

_BUS_ID = re.compile(r"^([0-9a-fA-F]{1,8}):([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\.([0-7])$")


def read_text(path: Path) -> str | None:
    """The file's text without surrounding whitespace, or None when it cannot be read."""
    try:
        return path.read_text(encoding="utf-8", errors="replace").strip()
    except OSError:
        return None


def read_int(path: Path, base: int = 10) -> int | None:
    """The file's integer (``base`` 16 accepts a ``0x`` prefix), or None when absent or not a number."""
    text = read_text(path)
    if text is None:
        return None
    try:
        return int(text, base)
    except ValueError:
        return None


def read_key_values(path: Path) -> dict[str, str]:
    """A ``key value`` or ``KEY=value`` per line file (KFD ``properties``, ``uevent``) as a dict."""
    text = read_text(path)
    if not text:
        return {}
    out: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if not sep:
            key, _, value = line.strip().partition(" ")
        if key.strip():
            out[key.strip()] = value.strip()
    return out


def subdirs(path: Path) -> list[Path]:
    """The directories (or links to directories) directly under ``path``, sorted by name."""
    try:
        return sorted((p for p in path.iterdir() if p.is_dir()), key=lambda p: p.name)
    except OSError:
        return []


def normalize_bus_id(bus_id: str | bytes) -> str:
    """A PCI address as ``dddd:bb:dd.f`` in lower case (NVML writes an 8-digit domain, sysfs 4)."""
    text = bus_id.decode(errors="replace") if isinstance(bus_id, bytes) else bus_id
    text = text.strip().rstrip("\x00")
    match = _BUS_ID.match(text)
    if not match:
        return text.lower()
    domain, bus, device, function = match.groups()
    return f"{int(domain, 16):04x}:{bus.lower()}:{device.lower()}.{function}"


def hex_id(value: int) -> str:
    """A 16-bit PCI id as lower-case ``0x`` hex: ``0x10de``."""
    return f"0x{value:04x}"
