"""Which engine builds this node can run: each engine's binaries asked what they are.

For every engine and runtime variant the agent resolves the binary exactly as it would to start
a replica (``engines.binaries.resolve``: override, PATH, the build installed with fleetserve),
asks each binary once what it is (the engine row's ``Probe``: ``llama-server --version`` and
``--list-devices``; vLLM's import in its interpreter), and keeps the answer per (path, size,
mtime): a binary replaced or upgraded is asked again, one unchanged never is. Every query is
bounded (the probe's timeout, ``MAX_OUTPUT`` bytes read); a binary that does not answer runs no
variant. The result is the node's ``engines`` at registration (``agent/runtime.py``).
"""

from __future__ import annotations

import logging
import os
import subprocess
import tempfile
from collections.abc import Callable, Mapping

from fleetserve.drivers import RuntimeVariant
from fleetserve.engines.binaries import EngineUnavailable, resolve
from fleetserve.engines.registry import ENGINES
from fleetserve.engines.spec import EngineKind, EngineSpec
from fleetserve.spec.nodeparts import MAX_ENGINES, EngineFingerprint

log = logging.getLogger("fleetserve.agent")

# The most of one answer read (a build's device list is a few lines).
MAX_OUTPUT = 64 * 1024

# Runs argv with a timeout; its output (stdout and stderr), or None where it failed.
Runner = Callable[[tuple[str, ...], float], str | None]


def run_bounded(argv: tuple[str, ...], timeout: float) -> str | None:
    """Run ``argv`` for at most ``timeout`` seconds; the first ``MAX_OUTPUT`` bytes of what it
    wrote, or None when it could not start, timed out or exited non-zero."""
    with tempfile.TemporaryFile() as out:
        try:
            proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        except OSError:
            return None
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            return None
        if code != 0:
            return None
        out.seek(0)
        return out.read(MAX_OUTPUT).decode("utf-8", errors="replace").replace("\x00", "")


def _stamp(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_size, st.st_mtime_ns)


class EngineProbe:
    """This node's engine fingerprints, each binary asked once per (path, size, mtime)."""

    def __init__(
        self,
        overrides: Mapping[tuple[EngineKind, RuntimeVariant], str],
        run: Runner = run_bounded,
    ) -> None:
        self.overrides = overrides
        self.run = run
        self._seen: dict[
            tuple[str, frozenset[RuntimeVariant], tuple[int, int]], EngineFingerprint | None
        ] = {}

    def _ask(
        self, spec: EngineSpec, path: str, variants: frozenset[RuntimeVariant]
    ) -> EngineFingerprint | None:
        probe = spec.probe
        stamp = _stamp(path)
        if probe is None or stamp is None:
            return None
        key = (path, variants, stamp)
        if key not in self._seen:
            first = min(variants)
            answers = tuple(self.run((path, *q), probe.timeout) for q in probe.queries(first, path))
            found = probe.read(variants, answers)
            self._seen[key] = None if found is None else found.model_copy(update={"binary": path})
            log.info("engines: %s at %s: %s", spec.kind.value, path, self._seen[key] or "no answer")
        return self._seen[key]

    def fingerprints(self) -> tuple[EngineFingerprint, ...]:
        """Every engine binary this node has, with the variants its build runs here."""
        out: list[EngineFingerprint] = []
        for engine, spec in ENGINES.items():
            by_path: dict[str, set[RuntimeVariant]] = {}
            for variant in spec.variants:
                try:
                    path = resolve(engine, variant, self.overrides)
                except EngineUnavailable:
                    continue
                by_path.setdefault(path, set()).add(variant)
            for path, variants in sorted(by_path.items()):
                found = self._ask(spec, path, frozenset(variants))
                if found is not None:
                    out.append(found)
        return tuple(out[:MAX_ENGINES])
