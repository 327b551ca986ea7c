"""A download's progress: throttled reports with increasing bytes, live status, and ``rich`` bars."""

from __future__ import annotations

import io
import time
from pathlib import Path

from cache_support import FileServer, Recorder, payload
from rich.console import Console

from fleetserve.agent.cache import CacheState, ModelCache
from fleetserve.agent.cache.progress import rich_progress
from fleetserve.spec.resources import Model


def test_progress_is_reported_with_increasing_bytes_at_most_ten_times_a_second(
    tmp_path: Path, server: FileServer
) -> None:
    big = payload(1_000_000, seed=7)
    server.files["/models/big.gguf"] = big
    server.delay = 0.008  # 16 KiB every 8 ms: about half a second
    cache = ModelCache(tmp_path / "cache")
    record = Recorder(cache=cache)

    started = time.monotonic()
    cache.ensure(Model(name="big", source=server.url("/models/big.gguf")), on_progress=record)
    elapsed = time.monotonic() - started

    done = [c[1] for c in record.calls]
    assert done == sorted(set(done)), "bytes strictly increase"
    assert done[-1] == len(big)
    assert {c[2] for c in record.calls} == {len(big)}
    assert 3 <= len(record.calls) <= elapsed * 10 + 2
    gaps = [b[4] - a[4] for a, b in zip(record.calls, record.calls[1:-1], strict=False)]
    assert all(gap >= 0.09 for gap in gaps)
    assert all(c[3] > 0 for c in record.calls[1:])
    assert ("big", CacheState.DOWNLOADING) in record.statuses[1]
    assert [(s.model, s.state) for s in cache.status()] == [("big", CacheState.READY)]


def test_the_rich_progress_helper_draws_a_bar_per_model(tmp_path: Path, server: FileServer) -> None:
    out = io.StringIO()
    cache = ModelCache(tmp_path / "cache")

    with rich_progress(Console(file=out, force_terminal=True, width=120)) as on_progress:
        cache.ensure(Model(name="tiny", source=server.url("/models/tiny.gguf")), on_progress)

    text = out.getvalue()
    assert "tiny" in text
    assert "300.0/300.0 kB" in text
