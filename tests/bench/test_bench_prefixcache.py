"""bench/prefixcache.py runs as a script and prints its two rows and their difference (its figures
are not judged here: the machine is shared)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_bench_prints_the_baseline_and_the_cache_aware_cost() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "prefixcache.py"), "--requests", "20", "--rounds", "1"],
        capture_output=True, text=True, timeout=60, env=env, check=True,
    )  # fmt: skip
    assert "125 blocks" in out.stdout
    rows = (
        "serialise only (baseline)",
        "cut + look up + learn (cache-aware)",
        "over the baseline",
        "report checked, alone",
        "vLLM held blocks",
        "llama.cpp 4 slots applied",
    )
    for row in rows:
        assert row in out.stdout, out.stdout
