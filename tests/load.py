"""Request load against an OpenAI-compatible endpoint, counted: sent, completed, failed, truncated.

``run_load(url, model, stop)`` sends chat completions from a few threads until ``stop`` is set
and returns the ``LoadCounts``. A non-streamed answer is *completed* when it is HTTP 200 with a
choice that finished (``finish_reason`` set); *truncated* when it is 200 without one or cut
mid-body; *failed* otherwise (any other status, or no answer). A streamed answer is *completed*
when it ends with ``data: [DONE]`` and carries no error event; *truncated* when it ends without
``[DONE]`` or with an error event (a broken upstream must be signalled, never a clean end).
Lifecycle tests (drains, rollouts, failures) assert ``failed == truncated == 0``.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx


@dataclass
class LoadCounts:
    """What a load run sent and how each request ended; thread-safe."""

    sent: int = 0
    completed: int = 0
    failed: int = 0
    truncated: int = 0
    errors: list[str] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, outcome: str, detail: str = "") -> None:
        with self._lock:
            self.sent += 1
            setattr(self, outcome, getattr(self, outcome) + 1)
            if detail and len(self.errors) < 50:
                self.errors.append(detail)

    def summary(self) -> str:
        return (
            f"sent {self.sent}, completed {self.completed}, failed {self.failed}, truncated {self.truncated}"
        )


def _body(model: str, stream: bool, max_tokens: int, extra: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": max_tokens,
        "stream": stream,
        **extra,
    }


def one_request(
    client: httpx.Client,
    url: str,
    model: str,
    counts: LoadCounts,
    *,
    stream: bool = False,
    max_tokens: int = 8,
    headers: Mapping[str, str] | None = None,
    extra: Mapping[str, Any] | None = None,
) -> None:
    """Send one chat completion to ``url`` (the /v1 base) and count how it ended."""
    body = _body(model, stream, max_tokens, extra or {})
    try:
        if not stream:
            response = client.post(f"{url}/chat/completions", json=body, headers=dict(headers or {}))
            if response.status_code != 200:
                counts.add("failed", f"{response.status_code}: {response.text[:200]}")
                return
            choice = (response.json().get("choices") or [{}])[0]
            if choice.get("finish_reason"):
                counts.add("completed")
            else:
                counts.add("truncated", f"no finish_reason: {response.text[:200]}")
            return
        with client.stream("POST", f"{url}/chat/completions", json=body, headers=dict(headers or {})) as r:
            if r.status_code != 200:
                counts.add("failed", f"{r.status_code}: {r.read()[:200]!r}")
                return
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        errors = [e for e in events if e != "[DONE]" and "error" in json.loads(e)]
        if events and events[-1] == "[DONE]" and not errors:
            counts.add("completed")
        else:
            counts.add("truncated", f"stream ended {events[-1:] if events else 'empty'}; errors {errors[:1]}")
    except httpx.HTTPError as exc:
        # A non-streamed request cut mid-body is truncated; one never answered has failed.
        kind = "truncated" if isinstance(exc, httpx.RemoteProtocolError) else "failed"
        counts.add(kind, f"{type(exc).__name__}: {exc}")


def run_load(
    url: str,
    model: str,
    stop: threading.Event,
    *,
    workers: int = 2,
    stream: bool = False,
    max_tokens: int = 8,
    headers: Mapping[str, str] | None = None,
    extra: Mapping[str, Any] | None = None,
    timeout: float = 60.0,
) -> LoadCounts:
    """Send requests from ``workers`` threads, back to back, until ``stop`` is set; the counts."""
    counts = LoadCounts()

    def work() -> None:
        with httpx.Client(timeout=timeout) as client:
            while not stop.is_set():
                one_request(
                    client,
                    url,
                    model,
                    counts,
                    stream=stream,
                    max_tokens=max_tokens,
                    headers=headers,
                    extra=extra,
                )

    threads = [threading.Thread(target=work, name=f"load-{i}", daemon=True) for i in range(workers)]
    for thread in threads:
        thread.start()
    stop.wait()
    for thread in threads:
        thread.join(timeout + 5)
    return counts
