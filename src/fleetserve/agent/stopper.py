"""Stopping replicas apart from the agent's report (heartbeat) and watch threads.

A stop waits out its engine's grace (SIGTERM, up to ``Supervisor.grace``, SIGKILL): done on the
thread that reports, it paused the heartbeat for that long, once per replica stopped, which is a
path to a false NotReady when a node stops many at once. Here each stop gets a thread of its own,
so any number proceed together, each with its own grace; a stop asked for again while one of that
replica is in flight starts nothing. When a stop is done (its processes gone, its model's pin
dropped) ``done`` is told, after the replica no longer counts as stopping: the agent then starts
what is assigned under that name, never while the old engine still runs.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger("fleetserve.agent")


class Stopper:
    """Runs each replica's stop on a thread of its own, at most one per replica at a time."""

    def __init__(self, stop: Callable[[str], None], done: Callable[[str], None]) -> None:
        self._stop = stop
        self._done = done
        self._lock = threading.Lock()
        self._threads: dict[str, threading.Thread] = {}

    def stop(self, name: str) -> bool:
        """Start stopping ``name`` unless a stop of it is in flight; whether one started now."""
        with self._lock:
            if name in self._threads:
                return False
            thread = threading.Thread(target=self._run, args=(name,), name=f"stop-{name}", daemon=True)
            self._threads[name] = thread
        thread.start()
        return True

    def stopping(self) -> frozenset[str]:
        """The replicas whose stops are in flight."""
        with self._lock:
            return frozenset(self._threads)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for every stop in flight, and for any started meanwhile; whether all are done."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                threads = list(self._threads.values())
            if not threads:
                return True
            for thread in threads:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                thread.join(left)

    def _run(self, name: str) -> None:
        try:
            self._stop(name)
        except Exception:  # one stop's trouble must not end the others, nor the agent
            log.exception("stopping %s failed", name)
        finally:
            with self._lock:
                del self._threads[name]
        try:
            self._done(name)
        except Exception:
            log.exception("after stopping %s", name)
