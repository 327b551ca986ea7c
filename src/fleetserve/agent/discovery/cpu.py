"""The host itself: CPU cores (psutil, else ``/proc/cpuinfo``), host memory, NUMA nodes (sysfs)."""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path

import psutil  # type: ignore[import-untyped]

from fleetserve.agent.discovery.base import Findings
from fleetserve.agent.discovery.sysfs import read_text, subdirs
from fleetserve.inventory.hardware import HostFacts

_NUMA_NODE = re.compile(r"^node\d+$")


class CpuDiscoverer:
    """Reads the host's cores, memory and NUMA nodes; ``root`` lets tests point at a recorded tree."""

    source = "cpu"

    def __init__(self, root: Path | str = "/") -> None:
        self.root = Path(root)

    def discover(self) -> Findings:
        problems: list[str] = []
        logical = _int_or_none(psutil.cpu_count(logical=True)) or os.cpu_count() or 1
        physical = _int_or_none(psutil.cpu_count(logical=False))
        if not physical:
            physical = self._physical_cores_from_cpuinfo()
        if not physical:
            problems.append(
                f"cpu: cannot tell physical cores from logical CPUs here; counting the {logical} logical CPUs"
            )
            physical = logical
        memory = psutil.virtual_memory()
        host = HostFacts(
            hostname=socket.gethostname(),
            physical_cores=physical,
            logical_cpus=logical,
            numa_nodes=self._numa_nodes(),
            memory_total=int(memory.total),
            memory_available=int(memory.available),
        )
        return Findings(host=host, problems=tuple(problems))

    def _numa_nodes(self) -> int:
        # A kernel without NUMA support has no node directories: the whole machine is one node.
        nodes = [d for d in subdirs(self.root / "sys/devices/system/node") if _NUMA_NODE.match(d.name)]
        return max(1, len(nodes))

    def _physical_cores_from_cpuinfo(self) -> int | None:
        # One core per distinct (physical id, core id) pair; absent on some architectures.
        text = read_text(self.root / "proc/cpuinfo")
        if not text:
            return None
        cores: set[tuple[str, str]] = set()
        for block in text.split("\n\n"):
            fields = dict(
                (k.strip(), v.strip())
                for k, sep, v in (line.partition(":") for line in block.splitlines())
                if sep
            )
            if "core id" in fields:
                cores.add((fields.get("physical id", "0"), fields["core id"]))
        return len(cores) or None


def _int_or_none(value: object) -> int | None:
    return value if isinstance(value, int) and value > 0 else None
