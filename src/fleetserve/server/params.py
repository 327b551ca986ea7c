"""Typed path and query parameters shared by the API's routers."""

from __future__ import annotations

from typing import Annotated

from fastapi import Path, Query

from fleetserve.spec.base import NAME_PATTERN

NameParam = Annotated[str, Path(min_length=1, max_length=63, pattern=NAME_PATTERN)]
NameQuery = Annotated[str | None, Query(min_length=1, max_length=63, pattern=NAME_PATTERN)]
