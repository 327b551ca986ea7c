"""Byte quantities as operators write them: ``80GiB``, ``96Gi``, ``512MB``, ``1.5T`` or a plain int."""

from __future__ import annotations

import math
import re

_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "ki": 2**10,
    "kib": 2**10,
    "mi": 2**20,
    "mib": 2**20,
    "gi": 2**30,
    "gib": 2**30,
    "ti": 2**40,
    "tib": 2**40,
}
_QUANTITY = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")

GiB = 2**30


def parse_bytes(value: int | float | str) -> int:
    """Return the number of bytes ``value`` denotes; raise ValueError naming the valid suffixes."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError(
            f"expected a byte quantity such as 80GiB or a number of bytes, not {type(value).__name__}"
        )
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("a byte quantity must be a finite number")
    if isinstance(value, int | float):
        if value < 0:
            raise ValueError("a byte quantity cannot be negative")
        return int(value)
    match = _QUANTITY.match(value)
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(
            f"{value!r} is not a byte quantity; write a number with an optional suffix "
            "(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB, or Ki/Mi/Gi/Ti), e.g. 80GiB"
        )
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def format_bytes(n: int) -> str:
    """Render a byte count in binary units, e.g. ``80.0GiB``."""
    for suffix, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f}{suffix}"
    return f"{n}B"
