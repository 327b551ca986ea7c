"""The base of every resource document and the field types they share: names, byte sizes, bounds.

``Spec`` makes a document part frozen, camelCase in YAML and JSON (snake_case in Python), closed to
unknown fields and free of NUL characters. ``Name`` is the 1-63 character name every resource and
reference carries (``NAME_PATTERN`` is its pattern for API parameters); ``Bytes`` a size such as
``80GiB``. The bounds keep every number storable in a signed 64-bit column.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel

from fleetserve.units import parse_bytes

# A name as a pattern for API parameters and bodies (their lengths are bounded apart).
NAME_PATTERN = r"^[a-z0-9]([a-z0-9.-]*[a-z0-9])?$"
# One line of printable text: no NUL or other control characters a database column would refuse
# (an operator's cordon reason, say).
LINE_PATTERN = r"^[^\x00-\x1f\x7f]*$"
_NAME = re.compile(r"^[a-z0-9]([a-z0-9.-]{0,61}[a-z0-9])?$")


def _check_name(value: str) -> str:
    if not _NAME.match(value):
        raise ValueError(
            f"{value!r} is not a valid name: use 1-63 lower-case letters, digits, '-' or '.', "
            "starting and ending with a letter or digit"
        )
    return value


Name = Annotated[str, BeforeValidator(lambda v: _check_name(v) if isinstance(v, str) else v)]
# Bounds keep every number storable (a signed 64-bit column) and catch typos early.
MAX_BYTES = 2**62
MAX_CORES = 1 << 20
MAX_REPLICAS = 10_000
Bytes = Annotated[int, BeforeValidator(parse_bytes), Field(ge=0, le=MAX_BYTES)]


def _nul_path(value: Any, path: str = "") -> str | None:
    """The path of the first string holding a NUL character: no database column can store one."""
    if isinstance(value, str):
        return path if "\x00" in value else None
    if isinstance(value, dict):
        for key, item in value.items():
            if isinstance(key, str) and "\x00" in key:
                return f"{path}.{key!r}".lstrip(".")
            found = _nul_path(item, f"{path}.{key}".lstrip("."))
            if found is not None:
                return found
    if isinstance(value, list | tuple):
        for i, item in enumerate(value):
            found = _nul_path(item, f"{path}[{i}]")
            if found is not None:
                return found
    return None


class Spec(BaseModel):
    """Base of every document part: frozen, camelCase aliases, unknown fields refused."""

    model_config = ConfigDict(
        frozen=True,
        extra="forbid",
        alias_generator=to_camel,
        populate_by_name=True,
        use_enum_values=False,
    )

    @model_validator(mode="before")
    @classmethod
    def _no_nul(cls, data: Any) -> Any:
        where = _nul_path(data)
        if where is not None:
            raise ValueError(f"text must not contain NUL characters (at {where or 'the value'})")
        return data
