"""Apple Silicon on macOS: the chip, its GPU cores and the share of unified memory the GPU may use.

Where each fact comes from (every command runs without root):

- ``sysctl -n machdep.cpu.brand_string``: the chip (``Apple M2 Ultra``); an Intel Mac names an Intel
  CPU here, and its GPUs are not this driver's.
- ``sysctl -n hw.memsize``: the unified memory in bytes; ``hw.perflevel0.physicalcpu`` and
  ``hw.perflevel1.physicalcpu``: performance and efficiency cores; ``hw.ncpu``: logical CPUs.
- ``sysctl -n iogpu.wired_limit_mb``: how much memory the GPU may wire (MiB); 0 means macOS's own
  default, and older macOS has no such name (the default then, too).
- ``system_profiler SPDisplaysDataType -json``: the GPU entry whose ``spdisplays_vendor`` is
  ``sppci_vendor_Apple``: ``sppci_model`` (the chip again), ``sppci_cores`` (GPU cores, a string),
  ``spdisplays_mtlgpufamilysupport`` (``spdisplays_metal3``: the Metal version).
- ``ioreg -r -d 1 -w 0 -c IOAccelerator``: the GPU's ``PerformanceStatistics``, whose
  ``"Device Utilization %"`` is its busy percent and ``"In use system memory"`` the bytes it holds
  now. Both are read where present; where the line is missing they are absent, never 0.

Unified memory. The CPU and GPU share one pool: nothing is the GPU's own. Metal lets the GPU keep
(wire) only part of it, ``recommendedMaxWorkingSetSize``: by default 2/3 of the RAM on a Mac with
32 GiB or less and 3/4 above (llama.cpp logs it at start: 10922.67 MiB on 16 GiB, 21845.34 MiB on
32 GiB, 49152 MiB on 64 GiB, 73728 MiB on 96 GiB; ggml-org/llama.cpp#1870 and #3213,
ollama/ollama#434, abetlen/llama-cpp-python#687). ``iogpu.wired_limit_mb`` set to a non-zero value
replaces the default (macOS 14 and later). That share is the GPU's memory here, and the rest is
the host's: ``GpuFacts.host_memory_shared`` says the GPU's memory is taken out of the host's, so
the node offers CPU replicas only what the GPU cannot wire, and no byte is counted twice.

Not readable without root, so not reported: the processes using the GPU (a Mac's GPU is never
taken from fleetserve's count by a foreign process) and ECC (Apple's memory reports none).
On any other system than macOS this source finds nothing and says nothing.
"""

from __future__ import annotations

import json
import platform
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fleetserve.agent.discovery.base import Findings
from fleetserve.agent.fingerprint import run_bounded
from fleetserve.drivers import Driver
from fleetserve.inventory.hardware import GpuFacts

# Runs argv; its output, or None where the command is missing, failed or timed out.
Run = Callable[[tuple[str, ...]], str | None]

GIB = 1 << 30
MIB = 1 << 20
# At or below this much RAM macOS lets the GPU wire 2/3 of it; above, 3/4.
SMALL_MAC = 32 * GIB
# Apple's vendor id, as system_profiler's text output writes it ("Vendor: Apple (0x106b)").
APPLE_VENDOR_ID = "0x106b"
APPLE_VENDOR = "sppci_vendor_Apple"
COMMAND_TIMEOUT = 20.0

SYSCTL_KEYS = (
    "machdep.cpu.brand_string",
    "hw.memsize",
    "hw.perflevel0.physicalcpu",
    "hw.perflevel1.physicalcpu",
    "hw.ncpu",
    "iogpu.wired_limit_mb",
)
PROFILER = ("system_profiler", "SPDisplaysDataType", "-json")
IOREG = ("ioreg", "-r", "-d", "1", "-w", "0", "-c", "IOAccelerator")
_STATISTICS = re.compile(r'"PerformanceStatistics"\s*=\s*\{([^}]*)\}')


def sysctl(key: str) -> tuple[str, ...]:
    return ("sysctl", "-n", key)


@dataclass(frozen=True)
class UnifiedMemory:
    """How one Mac's unified memory splits: what the GPU may wire, what is left to the host, and
    the rule that decided it (for the node's facts)."""

    total: int
    gpu: int
    rule: str

    @property
    def host(self) -> int:
        return self.total - self.gpu


def unified_memory(total: int, wired_limit_mb: int | None) -> UnifiedMemory:
    """The GPU's share of ``total`` bytes: ``iogpu.wired_limit_mb`` where set (non-zero, at most the
    whole memory), else macOS's default of 2/3 up to 32 GiB and 3/4 above."""
    if wired_limit_mb:
        gpu = min(total, wired_limit_mb * MIB)
        return UnifiedMemory(total, gpu, f"iogpu.wired_limit_mb={wired_limit_mb}")
    if total <= SMALL_MAC:
        return UnifiedMemory(total, total * 2 // 3, "macOS default: 2/3 of 32 GiB or less")
    return UnifiedMemory(total, total * 3 // 4, "macOS default: 3/4 above 32 GiB")


@dataclass(frozen=True)
class GpuStatistics:
    """The GPU's ``PerformanceStatistics`` in ``ioreg``: busy percent and bytes in use, where shown."""

    busy_percent: int | None
    memory_used: int | None


def read_statistics(text: str | None) -> GpuStatistics:
    """The first accelerator's statistics in ``ioreg -c IOAccelerator`` output (a Mac has one GPU);
    a value missing or out of range is None."""
    match = _STATISTICS.search(text or "")
    if match is None:
        return GpuStatistics(None, None)
    values = dict(re.findall(r'"([^"]+)"\s*=\s*(\d+)', match.group(1)))
    busy = _int(values.get("Device Utilization %"))
    used = _int(values.get("In use system memory"))
    return GpuStatistics(busy if busy is not None and busy <= 100 else None, used)


def _int(text: str | None) -> int | None:
    try:
        return int(text.strip()) if text is not None else None
    except ValueError:
        return None


def _json(text: str | None) -> Any:
    """The JSON document in ``text`` (system_profiler may print warnings before it)."""
    if not text or "{" not in text:
        return None
    try:
        return json.JSONDecoder().raw_decode(text[text.index("{") :])[0]
    except ValueError:
        return None


def _apple_gpu(profile: Any) -> dict[str, Any] | None:
    entries = profile.get("SPDisplaysDataType") if isinstance(profile, dict) else None
    for entry in entries if isinstance(entries, list) else ():
        if isinstance(entry, dict) and entry.get("spdisplays_vendor") == APPLE_VENDOR:
            return entry
    return None


def _metal(entry: dict[str, Any]) -> str:
    """``spdisplays_metal3`` → ``Metal 3``; empty where system_profiler names no Metal support."""
    raw = str(entry.get("spdisplays_mtlgpufamilysupport") or entry.get("spdisplays_metal") or "")
    match = re.search(r"metal(\d+)", raw)
    return f"Metal {match.group(1)}" if match else ""


def default_run(argv: tuple[str, ...]) -> str | None:
    return run_bounded(argv, COMMAND_TIMEOUT)


class MacDiscoverer:
    """Finds the Apple GPU of a Mac through ``sysctl``, ``system_profiler`` and ``ioreg``.

    ``run`` runs one command (tests replay recorded output); ``system`` is ``platform.system()``:
    anything but ``Darwin`` finds nothing."""

    source = "system_profiler+sysctl"

    def __init__(self, run: Run = default_run, system: str | None = None) -> None:
        self.run = run
        self.system = platform.system() if system is None else system

    def statistics(self) -> GpuStatistics | None:
        """The GPU's utilisation and memory in use now (``ioreg`` only: cheap enough for every
        sample); None off macOS."""
        if self.system != "Darwin":
            return None
        return read_statistics(self.run(IOREG))

    def discover(self) -> Findings:
        if self.system != "Darwin":
            return Findings()
        values = {key: (self.run(sysctl(key)) or "").strip() for key in SYSCTL_KEYS}
        chip = values["machdep.cpu.brand_string"]
        total = _int(values["hw.memsize"])
        if not chip.startswith("Apple"):
            return Findings(facts=(f"apple: this Mac's CPU is {chip or 'unknown'}, not Apple Silicon",))
        entry = _apple_gpu(_json(self.run(PROFILER)))
        if entry is None:
            return Findings(
                problems=(
                    f"apple: {chip}: system_profiler SPDisplaysDataType lists no Apple GPU; "
                    "no GPU is reported",
                )
            )
        if not total:
            return Findings(
                problems=(f"apple: {chip}: sysctl hw.memsize cannot be read; its GPU is not reported",)
            )
        memory = unified_memory(total, _int(values["iogpu.wired_limit_mb"]))
        cores = _int(str(entry.get("sppci_cores", "")))
        name = str(entry.get("sppci_model") or chip)
        stats = read_statistics(self.run(IOREG))
        gpu = GpuFacts(
            driver=Driver.APPLE,
            index=0,
            uuid="",
            name=name,
            memory=memory.gpu,
            pci_vendor_id=APPLE_VENDOR_ID,
            pci_device_id="",
            gfx_target=None,
            ecc_uncorrected=0,
            compute_pids=(),
            render_node=None,
            nvlink_peers=(),
            source=self.source,
            memory_used=stats.memory_used,
            busy_percent=stats.busy_percent,
            integrated=True,
            gpu_cores=cores,
            host_memory_shared=memory.gpu,
        )
        performance = _int(values["hw.perflevel0.physicalcpu"])
        efficiency = _int(values["hw.perflevel1.physicalcpu"])
        cpu = (
            f"{performance} performance + {efficiency} efficiency cores"
            if performance is not None and efficiency is not None
            else f"{values['hw.ncpu'] or '?'} CPUs"
        )
        metal = _metal(entry)
        fact = (
            f"apple: {name}, {cpu}, {cores if cores is not None else '?'} GPU cores"
            f"{', ' + metal if metal else ''}; {memory.total / GIB:.0f} GiB unified memory, of which the "
            f"GPU may wire {memory.gpu / GIB:.1f} GiB ({memory.rule}) and the host keeps "
            f"{memory.host / GIB:.1f} GiB"
        )
        problems = () if metal else (f"apple: {name}: system_profiler reports no Metal support",)
        return Findings(gpus=(gpu,), facts=(fact,), problems=problems)
