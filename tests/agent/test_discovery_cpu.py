"""Host discovery: this machine for real, and NUMA and core counting on small recorded-style trees."""

from __future__ import annotations

import socket
from pathlib import Path

import psutil  # type: ignore[import-untyped]
import pytest

from fleetserve.agent.discovery import discover
from fleetserve.agent.discovery.cpu import CpuDiscoverer


def test_this_machine_has_plausible_cores_memory_and_numa_nodes() -> None:
    found = CpuDiscoverer().discover()
    host = found.host
    assert host is not None
    assert found.gpus == () and found.hcas == ()
    assert host.hostname == socket.gethostname()
    assert 1 <= host.physical_cores <= host.logical_cpus
    assert host.memory_total == psutil.virtual_memory().total
    assert 0 < host.memory_available <= host.memory_total
    assert host.numa_nodes >= 1


@pytest.mark.parametrize(
    ("entries", "nodes"),
    [
        pytest.param(["node0", "node1", "has_cpu", "online"], 2, id="two-numa-nodes"),
        pytest.param(["node0", "possible"], 1, id="one-numa-node"),
        pytest.param([], 1, id="a-kernel-without-numa-is-one-node"),
    ],
)
def test_numa_nodes_are_the_node_directories_under_sysfs(
    tmp_path: Path, entries: list[str], nodes: int
) -> None:
    base = tmp_path / "sys/devices/system/node"
    base.mkdir(parents=True)
    for entry in entries:
        (base / entry).mkdir() if entry.startswith("node") else (base / entry).write_text("0\n")
    host = CpuDiscoverer(tmp_path).discover().host
    assert host is not None and host.numa_nodes == nodes


CPUINFO_2_SOCKETS_2_CORES_HT = "\n\n".join(
    f"processor\t: {cpu}\nphysical id\t: {cpu // 4}\ncore id\t\t: {(cpu // 2) % 2}\nsiblings\t: 4"
    for cpu in range(8)
)


@pytest.mark.parametrize(
    ("cpuinfo", "logical", "cores", "problems"),
    [
        pytest.param(CPUINFO_2_SOCKETS_2_CORES_HT, 8, 4, (), id="distinct-socket-and-core-ids"),
        pytest.param(
            "processor\t: 0\nprocessor\t: 1",
            2,
            2,
            ("cpu: cannot tell physical cores from logical CPUs here; counting the 2 logical CPUs",),
            id="no-core-ids-counts-logical-cpus",
        ),
    ],
)
def test_without_psutil_core_counts_proc_cpuinfo_is_read(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    cpuinfo: str,
    logical: int,
    cores: int,
    problems: tuple[str, ...],
) -> None:
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc/cpuinfo").write_text(cpuinfo + "\n")

    def cpu_count(logical: bool = True) -> int | None:  # psutil answers None where it cannot tell
        return logical_cpus if logical else None

    logical_cpus = logical
    monkeypatch.setattr(psutil, "cpu_count", cpu_count)
    found = CpuDiscoverer(tmp_path).discover()
    assert found.host is not None
    assert (found.host.physical_cores, found.host.logical_cpus) == (cores, logical)
    assert found.problems == problems


def test_the_whole_discovery_runs_on_this_machine_without_raising() -> None:
    discovery = discover()
    assert discovery.host.memory_total == psutil.virtual_memory().total
    # This machine has no NVIDIA driver, no amdgpu and no RDMA: at most NVML's one problem.
    assert all(p.startswith("nvidia: ") for p in discovery.problems)


def test_discovery_needs_exactly_one_source_of_host_facts() -> None:
    with pytest.raises(ValueError, match="exactly one discovery source must report the host; 0 did"):
        discover([])
