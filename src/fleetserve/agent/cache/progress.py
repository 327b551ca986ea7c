"""A download's progress: the throttled meter transfers report to, and ``rich`` bars for the CLI.

A transfer calls its ``Meter`` after every chunk; the meter keeps the model's live status (bytes
done, total, rate) and hands a report to every listener at most every ``PROGRESS_INTERVAL``
seconds, the last count always. ``rich_progress`` is one such listener: a bar per model, for
``fleetserve up``.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from fleetserve.agent.cache.status import CacheState, ModelStatus, ProgressCallback
from fleetserve.spec.resources import Model

if TYPE_CHECKING:
    from rich.console import Console

log = logging.getLogger("fleetserve.agent.cache")

# Seconds between two progress reports of one transfer (the last one is always reported).
PROGRESS_INTERVAL = 0.1


class Meter:
    """Turns per-chunk byte counts into throttled progress reports and the model's live status.

    ``listeners`` is read at every report, so a caller that joins a download in flight (appending
    to it) gets the reports from then on; ``set_status`` records the model's live status.
    """

    def __init__(
        self,
        model: Model,
        listeners: list[ProgressCallback],
        set_status: Callable[[ModelStatus], None],
    ) -> None:
        self._model = model
        self._listeners = listeners
        self._set_status = set_status
        self._start = time.monotonic()
        self._start_bytes: int | None = None
        self._last_report = float("-inf")
        self._last: tuple[int, int | None] = (0, None)
        self._reported: tuple[int, int | None] | None = None

    def begin(self) -> None:
        """Say the download has started: nothing done yet, the model's size (if known) to come."""
        model = self._model
        self._set_status(
            ModelStatus(model.name, CacheState.DOWNLOADING, 0, model.size, 0.0, source=model.source)
        )

    def __call__(self, done: int, total: int | None) -> None:
        now = time.monotonic()
        if self._start_bytes is None or done < self._last[0]:
            # A new transfer (or a restart from zero): the rate counts this transfer's bytes only.
            self._start, self._start_bytes = now, done
        self._last = (done, total)
        elapsed = now - self._start
        rate = (done - self._start_bytes) / elapsed if elapsed > 0 else 0.0
        self._set_status(
            ModelStatus(
                self._model.name, CacheState.DOWNLOADING, done, total, rate, source=self._model.source
            )
        )
        if now - self._last_report >= PROGRESS_INTERVAL:
            self._last_report = now
            self._report(done, total, rate)

    def finish(self, size: int) -> None:
        """Report the final count, which the throttle may have held back."""
        if self._reported != (size, size):
            elapsed = time.monotonic() - self._start
            rate = (size - (self._start_bytes or 0)) / elapsed if elapsed > 0 else 0.0
            self._report(size, size, rate)

    def _report(self, done: int, total: int | None, rate: float) -> None:
        self._reported = (done, total)
        for listener in list(self._listeners):
            try:
                listener(self._model, done, total, rate)
            except Exception:
                log.exception("a progress callback for model %s failed", self._model.name)


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
