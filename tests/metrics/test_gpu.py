"""GPU metrics mapped to canonical names (design.md, Metrics; fixtures: tests/fixtures/metrics/README.md).

The ``dcgm_*`` and ``amd_exporter_*`` fixtures are published exporter output. The AMD ones are
idle or partial, so the AMD unit conversions are also checked on lines made up here on the label
set of a recorded MI300X row; those are marked where they appear.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fleetserve.agent.discovery.amd import AmdSysfsDiscoverer
from fleetserve.drivers import Driver
from fleetserve.inventory.hardware import GpuFacts
from fleetserve.metrics.gpu import (
    GPU_CANONICAL,
    SOURCES,
    AmdSysfsReading,
    GpuContext,
    GpuSignal,
    GpuSource,
    NvmlReading,
    from_amd_sysfs,
    from_nvml,
    normalize_gpu,
)
from fleetserve.metrics.promtext import COUNTER, Sample

FIXTURES = Path(__file__).parents[1] / "fixtures"

UTIL = "fleetserve_gpu_utilization_ratio"
MEMORY = "fleetserve_gpu_memory_used_bytes"
POWER = "fleetserve_gpu_power_watts"
ENERGY = "fleetserve_gpu_energy_joules_total"
TEMP = "fleetserve_gpu_temperature_celsius"
TENSOR = "fleetserve_gpu_tensor_active_ratio"

# The label set of a recorded MI300X row (ROCm/device-metrics-exporter#236), for made-up values.
MI300X = (
    'card_model="102-G30211-0C",card_series="AMD Instinct MI300X OAM",card_vendor="AMD",'
    'cluster_name="amdgpu-k8s-metrics-exporter",container="",driver_version="6.14.14",'
    'gpu_compute_partition_type="spx",gpu_id="0",gpu_memory_partition_type="nps1",gpu_partition_id="NA",'
    'gpu_uuid="a8ff74a1-0000-1000-807e-843c9b9a1d73",hostname="smc300x-clt-r4c3-18",job_id="",'
    'job_partition="",job_user="",namespace="",pod="",serial_number="692407004236",'
    'vbios_version="022.040.003.042.000001"'
)


def read(name: str) -> str:
    return (FIXTURES / "metrics" / name).read_text(encoding="utf-8")


def by_name(samples: tuple[Sample, ...]) -> dict[str, float]:
    names = [s.name for s in samples]
    assert len(names) == len(set(names)), "one device expected"
    return {s.name: s.value for s in samples}


@pytest.mark.parametrize(
    ("fixture", "source", "expected", "labels"),
    [
        (
            "dcgm_exporter_nvidia_l4.prom",
            GpuSource.DCGM,
            {UTIL: 0.0, MEMORY: 0.0, POWER: 16.365, ENERGY: 4742.776, TEMP: 31.0, TENSOR: 0.0},
            {"node": "i-030791dc5a37cd257", "device": "0", "driver": "gpu.nvidia.com", "class": "NVIDIA L4"},
        ),
        (
            "dcgm_exporter_nvidia_a100_mig.prom",
            GpuSource.DCGM,
            # FB_USED 4845 MiB; 319159391 mJ; no GPU_UTIL in MIG mode; the MIG row's 0.930433 is not the GPU's.
            {MEMORY: 4845 * 2**20, POWER: 409.692, ENERGY: 319159.391, TEMP: 61.0, TENSOR: 0.92926},
            {"node": "ub20-a100-k8s", "device": "0", "driver": "gpu.nvidia.com", "class": ""},
        ),
        (
            "amd_exporter_issue259_excerpt.prom",
            GpuSource.AMD_EXPORTER,
            {MEMORY: 26 * 2**20, ENERGY: 0.0},
            {"node": "cb76105c40d0", "device": "0", "driver": "gpu.amd.com", "class": ""},
        ),
        (
            "amd_exporter_mi300x_vf_issue171_excerpt.prom",
            GpuSource.AMD_EXPORTER,
            {TEMP: 0.0},
            {
                "node": "master-1",
                "device": "0",
                "driver": "gpu.amd.com",
                "class": "Aqua Vanjaram [Instinct MI300X VF]",
            },
        ),
        (
            "amd_exporter_mi300x_pr236_excerpt.prom",
            GpuSource.AMD_EXPORTER,
            {UTIL: 0.0},
            {"node": "smc300x-clt-r4c3-18", "device": "0", "driver": "gpu.amd.com", "class": "102-G30211-0C"},
        ),
    ],
    ids=[
        "an L4's full DCGM scrape converts %, MiB and mJ and keeps tensor-active",
        "an A100's DCGM output converts MiB and mJ and leaves the MIG instance row out",
        "an AMD exporter's used VRAM in MiB becomes bytes",
        "an MI300X VF's edge temperature is taken when no junction temperature is exported",
        "an MI300X's gfx activity becomes a utilization ratio",
    ],
)
def test_recorded_exporter_output_normalises_with_unit_conversions(
    fixture: str, source: GpuSource, expected: dict[str, float], labels: dict[str, str]
) -> None:
    samples = normalize_gpu(read(fixture), source)
    assert by_name(samples) == expected
    assert all(dict(s.labels) == labels for s in samples)


@pytest.mark.parametrize(
    ("lines", "expected"),
    [
        ("gpu_gfx_activity{%s} 57", {UTIL: 0.57}),
        ("gpu_used_vram{%s} 183265", {MEMORY: 183265 * 2**20}),
        ("gpu_power_usage{%s} 748", {POWER: 748.0}),
        ("gpu_energy_consumed{%s} 1.4e13", {ENERGY: 1.4e7}),
        ("gpu_junction_temperature{%s} 76\ngpu_edge_temperature{%s} 0", {TEMP: 76.0}),
        ("gpu_edge_temperature{%s} 41", {TEMP: 41.0}),
        ("gpu_gfx_activity{%s} NaN", {}),
    ],
    ids=[
        "gfx activity in percent becomes a ratio",
        "used VRAM in MiB becomes bytes",
        "power stays in watts",
        "energy in microjoules becomes joules",
        "junction temperature wins over an MI3xx's zero edge reading",
        "edge temperature is the fallback",
        "a NaN reading is absent",
    ],
)
def test_amd_exporter_units_convert_as_the_design_table_says(lines: str, expected: dict[str, float]) -> None:
    # Made-up values on a recorded MI300X label set.
    text = lines.replace("%s", MI300X) + "\n"
    assert by_name(normalize_gpu(text, GpuSource.AMD_EXPORTER)) == expected


AMD_METRICS = (
    "gpu_gfx_activity",
    "gpu_used_vram",
    "gpu_power_usage",
    "gpu_energy_consumed",
    "gpu_edge_temperature",
)


def test_tensor_active_is_absent_for_amd_not_zero() -> None:
    # Made up: every AMD metric the table reads, and a tensor-active line that is not AMD's to read.
    text = "".join(f"{m}{{{MI300X}}} 50\n" for m in AMD_METRICS)
    text += f"DCGM_FI_PROF_PIPE_TENSOR_ACTIVE{{{MI300X}}} 0.9\n"
    names = {s.name for s in normalize_gpu(text, GpuSource.AMD_EXPORTER)}
    assert names == {UTIL, MEMORY, POWER, ENERGY, TEMP}
    assert [src for src, spec in SOURCES.items() if GpuSignal.TENSOR_ACTIVE in spec.readings] == [
        GpuSource.DCGM
    ]


def test_the_caller_names_the_node_and_each_devices_class() -> None:
    context = GpuContext(node="gpu-node-7", classes={"0": "l4-24g"})
    samples = normalize_gpu(read("dcgm_exporter_nvidia_l4.prom"), GpuSource.DCGM, context)
    assert {(s.labels["node"], s.labels["class"]) for s in samples} == {("gpu-node-7", "l4-24g")}


def test_devices_come_out_in_ordinal_order_each_with_its_own_readings() -> None:
    text = "".join(
        f'DCGM_FI_DEV_GPU_TEMP{{gpu="{g}",UUID="GPU-{g}",Hostname="h"}} {t}\n'
        for g, t in (("10", 50), ("2", 40))
    )
    samples = normalize_gpu(text, GpuSource.DCGM)
    assert [(s.labels["device"], s.value) for s in samples] == [("2", 40.0), ("10", 50.0)]


def test_a_row_without_a_device_label_is_not_a_device() -> None:
    assert normalize_gpu("DCGM_FI_DEV_GPU_TEMP 40\n", GpuSource.DCGM) == ()


NVML = NvmlReading(
    index=0,
    name="NVIDIA H100 80GB HBM3",
    utilization_gpu=57,
    memory_used=4845 * 2**20,
    power_usage=409692,
    total_energy_consumption=319159391,
    temperature_gpu=61,
)
SYSFS = AmdSysfsReading(
    index=0,
    name="AMD gfx942",
    gpu_busy_percent=57,
    mem_info_vram_used=297771008,
    power1_average=748_000_000,
    energy1_input=14_000_000,
    temp1_input=0,
    temp2_input=76_000,
)


@pytest.mark.parametrize(
    ("collected", "expected"),
    [
        (
            from_nvml([NVML], GpuContext(node="n")),
            {UTIL: 0.57, MEMORY: 4845 * 2**20, POWER: 409.692, ENERGY: 319159.391, TEMP: 61.0},
        ),
        (
            from_amd_sysfs([SYSFS], GpuContext(node="n")),
            {UTIL: 0.57, MEMORY: 297771008, POWER: 748.0, ENERGY: 14.0, TEMP: 76.0},
        ),
    ],
    ids=[
        "NVML's percent, bytes, milliwatts, millijoules and degrees convert to the canonical units",
        "sysfs's percent, bytes, microwatts, microjoules and millidegrees convert, junction first",
    ],
)
def test_the_agents_own_collectors_convert_their_units(
    collected: tuple[Sample, ...], expected: dict[str, float]
) -> None:
    assert by_name(collected) == expected


def test_the_agents_collectors_give_the_same_canonical_names_as_the_exporters() -> None:
    dcgm = normalize_gpu(read("dcgm_exporter_nvidia_l4.prom"), GpuSource.DCGM)
    amd = normalize_gpu("".join(f"{m}{{{MI300X}}} 1\n" for m in AMD_METRICS), GpuSource.AMD_EXPORTER)
    nvml = from_nvml([NVML])
    sysfs = from_amd_sysfs([SYSFS])
    # NVML has no tensor-pipe counter (that needs DCGM profiling), so it is the only name missing.
    assert {s.name for s in nvml} == {s.name for s in dcgm} - {TENSOR}
    assert {s.name for s in sysfs} == {s.name for s in amd}
    for collected, exporter in ((nvml, dcgm), (sysfs, amd)):
        assert {(s.name, s.family, s.kind) for s in collected} <= {
            (s.name, s.family, s.kind) for s in exporter
        }
        assert {(tuple(s.labels), s.labels["driver"]) for s in collected} == {
            (tuple(s.labels), s.labels["driver"]) for s in exporter
        }
        assert {tuple(s.labels) for s in collected} == {("node", "device", "driver", "class")}


def test_discovery_facts_feed_the_sysfs_collector() -> None:
    root = FIXTURES / "discovery" / "sysfs" / "linux_amd_1_strix_halo_gfx1151"
    (facts,) = AmdSysfsDiscoverer(root).discover().gpus
    assert (facts.busy_percent, facts.memory_used) == (3, 1342177280)
    samples = from_amd_sysfs([facts], GpuContext(node="halo", classes={"0": "strix-halo"}))
    assert by_name(samples) == {UTIL: 0.03, MEMORY: 1342177280}
    assert dict(samples[0].labels) == {
        "node": "halo",
        "device": "0",
        "driver": "gpu.amd.com",
        "class": "strix-halo",
    }


def test_an_nvidia_gpu_is_refused_by_the_amd_sysfs_collector() -> None:
    nvidia = GpuFacts(
        driver=Driver.NVIDIA,
        index=0,
        uuid="GPU-0",
        name="NVIDIA L4",
        memory=24 * 2**30,
        pci_vendor_id="0x10de",
        pci_device_id="0x27b8",
        gfx_target=None,
        ecc_uncorrected=0,
        compute_pids=(),
        render_node=None,
        nvlink_peers=(),
        source="nvml",
    )
    with pytest.raises(ValueError, match="not an AMD GPU"):
        from_amd_sysfs([nvidia])


def test_energy_is_a_counter_and_every_other_gpu_metric_a_gauge() -> None:
    assert {s: m.kind for s, m in GPU_CANONICAL.items() if m.kind == COUNTER} == {GpuSignal.ENERGY: COUNTER}
    assert GPU_CANONICAL[GpuSignal.ENERGY].family == "fleetserve_gpu_energy_joules"
    assert set(SOURCES) == set(GpuSource)
