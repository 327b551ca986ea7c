"""What the model cache tells its callers: a model's state, the models it holds, progress reports."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from pathlib import Path

from fleetserve.spec.resources import Model

# (model, done bytes, total bytes or None, bytes per second), at most ~10 times a second.
ProgressCallback = Callable[[Model, int, int | None, float], None]


class CacheState(StrEnum):
    """Where a model stands in the cache, as the agent reports it."""

    DOWNLOADING = "downloading"
    READY = "ready"
    FAILED = "failed"


@dataclass(frozen=True)
class CachedModel:
    """A model the cache holds, ready to serve."""

    name: str
    digest: str
    size: int
    last_used: datetime
    path: Path
    file_name: str
    format: str
    source: str
    pinned: bool
    # A whole repository: the file names in ``path`` (a directory); empty for a single file.
    files: tuple[str, ...] = ()
    # The source pinned to what it resolved to (hf://…@COMMIT), when it differs from ``source``.
    resolved: str = ""


@dataclass(frozen=True)
class ModelStatus:
    """One model's cache state for the node's status: bytes done, total (None = unknown), rate."""

    model: str
    state: CacheState
    done: int
    total: int | None
    rate: float
    error: str | None = None
    # What is being fetched (the source), for a status that names it.
    source: str = ""
