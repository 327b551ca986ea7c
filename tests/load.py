"""A small load generator for the OpenAI gateway, shared by the lab tests and bench/chaos.py.

``run_load(url, key, model, stop)`` keeps ``concurrency`` chat completions in flight until
``stop`` is set and counts every request it sent as exactly one of:

- **completed**: 200 and a whole answer (non-streamed: a JSON body with choices; streamed: the
  events end with ``data: [DONE]``);
- **truncated**: 200, but the answer broke off (the body or the stream ended early, or the
  connection dropped after the status line);
- **failed**: no 200 (an error status, a connect or read failure, the client's timeout).

``slowest`` is the longest a completed request took: a request that paid a connect timeout to a
host that dropped off the network shows there.

``BackgroundLoad`` runs it in a thread for the span of a ``with`` block.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx

SLOW = 1.0


@dataclass
class LoadCounts:
    """What a load run sent and how each request ended."""

    sent: int = 0
    completed: int = 0
    failed: int = 0
    truncated: int = 0
    slowest: float = 0.0
    reasons: Counter[str] = field(default_factory=Counter)
    # (monotonic start, seconds, outcome) of every request that took over SLOW seconds
    slow: list[tuple[float, float, str]] = field(default_factory=list)

    def __str__(self) -> str:
        why = ", ".join(f"{n} {r}" for r, n in self.reasons.most_common(3))
        return (
            f"sent {self.sent}, completed {self.completed}, failed {self.failed}, "
            f"truncated {self.truncated}, slowest {self.slowest:.2f} s" + (f" ({why})" if why else "")
        )


def _one(http: httpx.Client, model: str, stream: bool, max_tokens: int) -> tuple[str, str]:
    """Send one request; (outcome, reason)."""
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": max_tokens,
        "stream": stream,
    }
    try:
        with http.stream("POST", "/chat/completions", json=body) as response:
            if response.status_code != 200:
                response.read()
                return "failed", f"HTTP {response.status_code}"
            try:
                text = response.read().decode("utf-8", errors="replace")
            except httpx.HTTPError as exc:
                return "truncated", type(exc).__name__
    except httpx.HTTPError as exc:
        return "failed", type(exc).__name__
    if stream:
        events = [line for line in text.splitlines() if line.startswith("data: ")]
        ended = bool(events) and events[-1] == "data: [DONE]"
        return ("completed", "") if ended else ("truncated", "stream ended without [DONE]")
    try:
        ok = bool(json.loads(text).get("choices"))
    except ValueError:
        ok = False
    return ("completed", "") if ok else ("truncated", "incomplete JSON body")


def run_load(
    url: str,
    key: str,
    model: str,
    stop: threading.Event,
    *,
    concurrency: int = 4,
    stream: bool = False,
    max_tokens: int = 8,
    timeout: float = 15.0,
) -> LoadCounts:
    """Keep ``concurrency`` requests in flight to ``url`` (the gateway's ``…/v1``) until ``stop``."""
    counts = LoadCounts()
    lock = threading.Lock()

    def worker() -> None:
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=timeout) as http:
            while not stop.is_set():
                with lock:
                    counts.sent += 1
                started = time.monotonic()
                outcome, reason = _one(http, model, stream, max_tokens)
                took = time.monotonic() - started
                with lock:
                    setattr(counts, outcome, getattr(counts, outcome) + 1)
                    if outcome == "completed":
                        counts.slowest = max(counts.slowest, took)
                    if took > SLOW:
                        counts.slow.append((started, took, outcome))
                    if reason:
                        counts.reasons[reason] += 1

    threads = [threading.Thread(target=worker, name=f"load-{i}", daemon=True) for i in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return counts


class BackgroundLoad:
    """``run_load`` in a thread while a ``with`` block runs; ``counts`` once the block ends."""

    def __init__(self, url: str, key: str, model: str, **options: Any) -> None:
        self._stop = threading.Event()
        self._result: list[LoadCounts] = []
        self._thread = threading.Thread(
            target=lambda: self._result.append(run_load(url, key, model, self._stop, **options)),
            name="load",
            daemon=True,
        )

    def __enter__(self) -> BackgroundLoad:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def counts(self) -> LoadCounts:
        return self._result[0] if self._result else LoadCounts()
