"""Apple Silicon discovery on macOS, replayed from the recorded output shapes of sysctl,
system_profiler and ioreg (tests/fixtures/discovery/README.md says what is recorded and derived)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fleetserve.agent.discovery.macos import (
    GIB as GiB,
)
from fleetserve.agent.discovery.macos import (
    IOREG,
    PROFILER,
    MacDiscoverer,
    Run,
    read_statistics,
    unified_memory,
)
from fleetserve.drivers import Driver
from fleetserve.inventory.hardware import Discovery, HostFacts
from fleetserve.inventory.matching import FabricMap, Mismatch, UnmatchedReason, to_node
from fleetserve.spec.resources import DeviceClass

MACOS = Path(__file__).parent.parent / "fixtures/discovery/macos"
M2_ULTRA = MACOS / "darwin_apple_1_m2_ultra_192g.json"
M4_MAX = MACOS / "darwin_apple_1_m4_max_128g.json"
MiB = 2**20


def recorded(path: Path, drop: tuple[str, ...] = (), replace: dict[str, str] | None = None) -> Run:
    """A command runner answering from a recording: a command it lacks failed (None)."""
    commands = dict(json.loads(path.read_text())["commands"])
    for key in drop:
        commands.pop(key)
    commands.update(replace or {})
    return lambda argv: commands.get(" ".join(argv))


def host(memory: int) -> HostFacts:
    # What the CPU source (psutil) reports on such a Mac: hw.memsize, hw.physicalcpu.
    return HostFacts(
        "studio",
        physical_cores=24,
        logical_cpus=24,
        numa_nodes=1,
        memory_total=memory,
        memory_available=memory // 2,
    )


def apple_class(name: str, memory: str, product: str) -> DeviceClass:
    return DeviceClass.model_validate(
        {"name": name, "driver": "gpu.apple.com", "memory": memory, "match": {"productName": product}}
    )


def test_the_m2_ultra_is_one_apple_gpu_with_76_cores_and_three_quarters_of_192_gib() -> None:
    found = MacDiscoverer(recorded(M2_ULTRA), system="Darwin").discover()
    assert found.problems == ()
    (gpu,) = found.gpus
    assert (gpu.driver, gpu.index, gpu.name, gpu.gpu_cores) == (Driver.APPLE, 0, "Apple M2 Ultra", 76)
    # 3/4 of 192 GiB: the 147456 MiB llama.cpp logs as recommendedMaxWorkingSetSize on such a Mac.
    assert gpu.memory == 144 * GiB == 147456 * MiB
    assert (gpu.integrated, gpu.host_memory_shared) == (True, 144 * GiB)
    assert (gpu.busy_percent, gpu.memory_used, gpu.pci_vendor_id) == (0, 1447395328, "0x106b")
    (fact,) = found.facts
    assert fact == (
        "apple: Apple M2 Ultra, 16 performance + 8 efficiency cores, 76 GPU cores, Metal 3; 192 GiB "
        "unified memory, of which the GPU may wire 144.0 GiB (macOS default: 3/4 above 32 GiB) and "
        "the host keeps 48.0 GiB"
    )


def test_an_operators_wired_limit_decides_the_m4_max_gpu_memory_and_ioreg_its_utilisation() -> None:
    found = MacDiscoverer(recorded(M4_MAX), system="Darwin").discover()
    (gpu,) = found.gpus
    assert (gpu.name, gpu.gpu_cores) == ("Apple M4 Max", 40)
    assert gpu.memory == 112640 * MiB  # iogpu.wired_limit_mb=112640, not the default 96 GiB
    assert (gpu.busy_percent, gpu.memory_used) == (87, 61203578880)
    assert "Metal 4" in found.facts[0] and "iogpu.wired_limit_mb=112640" in found.facts[0]


def test_without_iogpu_wired_limit_mb_older_macos_gets_the_default_share() -> None:
    run = recorded(M4_MAX, drop=("sysctl -n iogpu.wired_limit_mb",))
    (gpu,) = MacDiscoverer(run, system="Darwin").discover().gpus
    assert gpu.memory == 96 * GiB


def test_without_ioreg_statistics_utilisation_is_absent_not_zero() -> None:
    run = recorded(M2_ULTRA, drop=(" ".join(IOREG),))
    (gpu,) = MacDiscoverer(run, system="Darwin").discover().gpus
    assert (gpu.busy_percent, gpu.memory_used) == (None, None)


@pytest.mark.parametrize(
    ("total", "limit_mb", "gpu"),
    [
        pytest.param(16 * GiB, None, 16 * GiB * 2 // 3, id="16GiB-two-thirds"),  # 10922.67 MiB logged
        pytest.param(32 * GiB, 0, 32 * GiB * 2 // 3, id="32GiB-two-thirds"),  # 21845.34 MiB logged
        pytest.param(64 * GiB, None, 48 * GiB, id="64GiB-three-quarters"),  # 49152 MiB logged
        pytest.param(96 * GiB, 0, 72 * GiB, id="96GiB-three-quarters"),  # 73728 MiB logged
        pytest.param(128 * GiB, 120000, 120000 * MiB, id="override"),
        pytest.param(16 * GiB, 999999, 16 * GiB, id="override-capped-at-the-whole-memory"),
    ],
)
def test_the_gpu_share_of_unified_memory(total: int, limit_mb: int | None, gpu: int) -> None:
    share = unified_memory(total, limit_mb)
    assert (share.gpu, share.host) == (gpu, total - gpu)


def test_on_linux_the_source_finds_nothing_and_runs_nothing() -> None:
    asked: list[tuple[str, ...]] = []

    def run(argv: tuple[str, ...]) -> str | None:
        asked.append(argv)
        return None

    found = MacDiscoverer(run, system="Linux").discover()
    assert (found.gpus, found.problems, found.facts, asked) == ((), (), (), [])


def test_an_intel_mac_has_no_apple_gpu_and_that_is_a_fact_not_a_problem() -> None:
    run = recorded(M2_ULTRA, replace={"sysctl -n machdep.cpu.brand_string": "Intel(R) Core(TM) i9-9980HK\n"})
    found = MacDiscoverer(run, system="Darwin").discover()
    assert (found.gpus, found.problems) == ((), ())
    assert found.facts == ("apple: this Mac's CPU is Intel(R) Core(TM) i9-9980HK, not Apple Silicon",)


def test_a_system_profiler_that_fails_is_a_problem_naming_the_chip() -> None:
    found = MacDiscoverer(recorded(M2_ULTRA, drop=(" ".join(PROFILER),)), system="Darwin").discover()
    assert found.gpus == ()
    assert found.problems == (
        "apple: Apple M2 Ultra: system_profiler SPDisplaysDataType lists no Apple GPU; no GPU is reported",
    )


def test_ioreg_statistics_out_of_range_are_absent() -> None:
    text = '"PerformanceStatistics" = {"Device Utilization %"=101,"In use system memory"=5}'
    stats = read_statistics(text)
    assert (stats.busy_percent, stats.memory_used) == (None, 5)
    assert read_statistics("") == read_statistics(None)


def test_the_node_offers_the_gpu_its_share_and_the_host_only_the_rest() -> None:
    gpus = MacDiscoverer(recorded(M2_ULTRA), system="Darwin").discover().gpus
    classes = {"apple-m2-ultra": apple_class("apple-m2-ultra", "144GiB", "Apple M2 Ultra")}
    node, unmatched = to_node(
        Discovery(host(192 * GiB), gpus, (), ()), classes, FabricMap(), "studio", {}, frozenset()
    )
    assert unmatched == ()
    (device,) = node.devices
    assert (device.index, device.device_class, device.health.healthy) == (0, "apple-m2-ultra", True)
    # 192 GiB of RAM: 144 GiB the GPU may wire, 48 GiB left for CPU replicas; never 192 + 144.
    assert node.cpu.memory == 48 * GiB


def test_a_class_claiming_more_than_the_gpu_may_wire_does_not_match_it() -> None:
    gpus = MacDiscoverer(recorded(M2_ULTRA), system="Darwin").discover().gpus
    classes = {"apple-m2-ultra-192gb": apple_class("apple-m2-ultra-192gb", "192GiB", "Apple M2 Ultra")}
    node, (miss,) = to_node(
        Discovery(host(192 * GiB), gpus, (), ()), classes, FabricMap(), "studio", {}, frozenset()
    )
    assert node.devices == ()
    assert node.cpu.memory == 192 * GiB, "a GPU left off the node takes none of the host's memory"
    assert miss.reason is UnmatchedReason.NO_MATCHING_CLASS
    (rejection,) = miss.rejections
    assert rejection.mismatch is Mismatch.MEMORY
    assert rejection.detail == (
        "memory 192.0GiB is more than the 144.0GiB of unified memory this GPU may use; "
        "declare memory: 147456MiB or less"
    )
