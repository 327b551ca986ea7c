"""A model download's progress as ``rich`` bars, for the command line (``fleetserve up``)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

from fleetserve.agent.cache import ProgressCallback
from fleetserve.spec.resources import Model

if TYPE_CHECKING:
    from rich.console import Console


@contextlib.contextmanager
def rich_progress(console: Console | None = None) -> Iterator[ProgressCallback]:
    """A progress callback drawing one ``rich`` bar per model, for the CLI::

    with rich_progress() as on_progress:
        cache.ensure(model, on_progress)
    """
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TaskID,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    lock = threading.Lock()
    tasks: dict[str, TaskID] = {}
    with Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=console,
    ) as progress:

        def on_progress(model: Model, done: int, total: int | None, rate: float) -> None:
            with lock:
                task = tasks.get(model.name)
                if task is None:
                    task = tasks[model.name] = progress.add_task(model.name, total=total)
                progress.update(task, completed=done, total=total)

        yield on_progress
