"""Typed path and query parameters shared by the API's routers."""

from __future__ import annotations

from typing import Annotated

from fastapi import Path, Query

from fleetserve.spec.base import NAME_PATTERN

# Printable text only: no NUL or other control characters a database column would refuse.
TEXT_PATTERN = r"^[^\x00-\x1f\x7f]*$"

NameParam = Annotated[str, Path(min_length=1, max_length=63, pattern=NAME_PATTERN)]
NameQuery = Annotated[str | None, Query(min_length=1, max_length=63, pattern=NAME_PATTERN)]
