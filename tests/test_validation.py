"""Engine capability refusals and the multi-accelerator gate, one case per rule."""

from __future__ import annotations

import pytest

from builders import deployment as build_deployment
from fleetserve.drivers import Driver, RuntimeVariant
from fleetserve.engines.spec import EngineKind
from fleetserve.spec.resources import Deployment, DeviceClass
from fleetserve.validation import gate, resolve_profile, validate_deployment

CLASSES = {
    "nvidia-h100-80gb": DeviceClass(name="nvidia-h100-80gb", driver="gpu.nvidia.com", memory=80 << 30),
    "amd-mi325x": DeviceClass(name="amd-mi325x", driver="gpu.amd.com", memory=256 << 30),
    "amd-gfx1151": DeviceClass(name="amd-gfx1151", driver="gpu.amd.com", memory=96 << 30),
    "intel-gaudi3": DeviceClass(name="intel-gaudi3", driver="gaudi.intel.com", memory=128 << 30),
    "apple-m2-ultra": DeviceClass(name="apple-m2-ultra", driver="gpu.apple.com", memory=144 << 30),
}


def deployment(**profile: object) -> Deployment:
    return build_deployment("d", 1, {"name": "p", **profile})


@pytest.mark.parametrize(
    ("profile", "field", "words"),
    [
        pytest.param(
            {"engine": "vllm"}, "profiles.p.deviceClass", "vllm needs a deviceClass", id="vllm-without-class"
        ),
        pytest.param(
            {"engine": "llama.cpp", "deviceClass": "nvidia-h100-80gb", "devicesPerNode": 2},
            "profiles.p.devicesPerNode",
            "refuses tensor parallel",
            id="llamacpp-tensor-parallel",
        ),
        pytest.param(
            {"engine": "llama.cpp", "deviceClass": "nvidia-h100-80gb", "nodes": 2},
            "profiles.p.nodes",
            "refuses multi-node",
            id="llamacpp-multi-node",
        ),
        pytest.param(
            {"engine": "vllm", "runtime": "cuda", "deviceClass": "amd-mi325x"},
            "profiles.p.runtime",
            "runtime cuda computes on gpu.nvidia.com, but class amd-mi325x is driven by gpu.amd.com; use runtime rocm",
            id="runtime-driver-mismatch",
        ),
        pytest.param(
            {"engine": "vllm", "runtime": "vulkan", "deviceClass": "amd-mi325x"},
            "profiles.p.runtime",
            "engine vllm has no runtime 'vulkan'",
            id="runtime-the-engine-lacks",
        ),
        pytest.param(
            {"engine": "llama.cpp", "runtime": "cuda"},
            "profiles.p.runtime",
            "a profile without a deviceClass runs on the CPU",
            id="gpu-runtime-without-class",
        ),
        pytest.param(
            {"engine": "llama.cpp", "runtime": "metal", "deviceClass": "amd-gfx1151"},
            "profiles.p.runtime",
            "runtime metal computes on gpu.apple.com, but class amd-gfx1151 is driven by gpu.amd.com",
            id="metal-on-an-amd-class",
        ),
        pytest.param(
            {"engine": "vllm", "deviceClass": "nvidia-h100"},
            "profiles.p.deviceClass",
            "unknown device class 'nvidia-h100'",
            id="unknown-class",
        ),
    ],
)
def test_a_refused_profile_names_the_field_and_says_why(profile, field, words):
    problems = validate_deployment(deployment(**profile), CLASSES)
    assert [p.field for p in problems] == [field]
    assert words in problems[0].message


@pytest.mark.parametrize(
    ("profile", "variant", "driver"),
    [
        ({"engine": "llama.cpp"}, RuntimeVariant.CPU, Driver.CPU),
        ({"engine": "llama.cpp", "deviceClass": "amd-gfx1151"}, RuntimeVariant.VULKAN, Driver.AMD),
        (
            {"engine": "llama.cpp", "deviceClass": "amd-gfx1151", "runtime": "rocm"},
            RuntimeVariant.ROCM,
            Driver.AMD,
        ),
        ({"engine": "llama.cpp", "deviceClass": "nvidia-h100-80gb"}, RuntimeVariant.CUDA, Driver.NVIDIA),
        ({"engine": "llama.cpp", "deviceClass": "apple-m2-ultra"}, RuntimeVariant.METAL, Driver.APPLE),
        ({"engine": "vllm", "deviceClass": "amd-mi325x"}, RuntimeVariant.ROCM, Driver.AMD),
        (
            {"engine": "vllm", "deviceClass": "nvidia-h100-80gb", "devicesPerNode": 8, "nodes": 2},
            RuntimeVariant.CUDA,
            Driver.NVIDIA,
        ),
    ],
)
def test_an_accepted_profile_resolves_to_the_engine_default_variant(profile, variant, driver):
    dep = deployment(**profile)
    assert validate_deployment(dep, CLASSES) == []
    resolved = resolve_profile(dep.profiles[0], CLASSES)
    assert (resolved.variant, resolved.driver) == (variant, driver)


def test_a_cpu_profile_claims_four_cores_unless_it_says_otherwise():
    resolved = resolve_profile(deployment(engine="llama.cpp").profiles[0], CLASSES)
    assert resolved.cpu is not None and resolved.cpu.cores == 4
    gpu = resolve_profile(deployment(engine="vllm", deviceClass="amd-mi325x").profiles[0], CLASSES)
    assert gpu.cpu is None


def test_a_class_claiming_a_driver_no_engine_serves_is_gated_as_unsupported_devices():
    result = gate(deployment(engine="vllm", deviceClass="intel-gaudi3"), CLASSES, set(Driver))
    assert (result.accepted.status, result.accepted.reason) == (False, "UnsupportedDevices")
    assert "gaudi.intel.com" in result.accepted.message
    assert result.usable == ()


def test_a_driver_no_node_serves_is_gated_and_the_served_profiles_stay_usable():
    dep = Deployment.model_validate(
        {
            "name": "d",
            "model": "m",
            "profiles": [
                {"name": "amd", "engine": "vllm", "deviceClass": "amd-mi325x", "priority": 10},
                {"name": "nv", "engine": "vllm", "deviceClass": "nvidia-h100-80gb"},
            ],
        }
    )
    result = gate(dep, CLASSES, [Driver.NVIDIA])
    assert result.accepted.reason == "UnsupportedDevices"
    assert dict(result.unsupported) == {"amd": "gpu.amd.com"}
    assert [p.name for p in result.usable] == ["nv"]


def test_an_absent_list_of_served_drivers_is_empty_not_everything():
    result = gate(deployment(engine="llama.cpp"), CLASSES, [])
    assert result.accepted.reason == "UnsupportedDevices"
    assert "dra.cpu" in result.accepted.message


def test_vllm_runs_on_a_cpu_class_only_when_its_runtime_says_cpu():
    classes = {**CLASSES, "cpu-class": DeviceClass(name="cpu-class", driver="dra.cpu", memory=0)}
    problems = validate_deployment(deployment(engine="vllm", deviceClass="cpu-class"), classes)
    assert [(p.field, p.message) for p in problems] == [
        (
            "profiles.p.runtime",
            "engine vllm runs on class cpu-class (dra.cpu) only when asked: say runtime: cpu",
        )
    ]
    dep = deployment(engine="vllm", deviceClass="cpu-class", runtime="cpu")
    assert validate_deployment(dep, classes) == []
    resolved = resolve_profile(dep.profiles[0], classes)
    assert (resolved.variant, resolved.driver) == (RuntimeVariant.CPU, Driver.CPU)


def test_vllm_without_a_class_runs_on_the_cpu_when_its_runtime_says_cpu():
    dep = deployment(engine="vllm", runtime="cpu", cpu={"cores": 2})
    assert validate_deployment(dep, CLASSES) == []
    resolved = resolve_profile(dep.profiles[0], CLASSES)
    assert (resolved.variant, resolved.driver, resolved.on_cpu) == (RuntimeVariant.CPU, Driver.CPU, True)
    assert resolved.cpu is not None and resolved.cpu.cores == 2


@pytest.mark.parametrize(
    ("profile", "field", "words"),
    [
        pytest.param(
            {"devicesPerNode": 2},
            "profiles.p.devicesPerNode",
            "a profile without a deviceClass runs on one node's CPU: vllm refuses tensor parallel there (devicesPerNode=2)",
            id="tensor-parallel",
        ),
        pytest.param(
            {"nodes": 3},
            "profiles.p.nodes",
            "a profile without a deviceClass runs on one node's CPU: vllm refuses multi-node there (nodes=3)",
            id="multi-node",
        ),
    ],
)
def test_vllm_on_the_cpu_refuses_tensor_parallel_and_multi_node(profile, field, words):
    problems = validate_deployment(deployment(engine="vllm", runtime="cpu", **profile), CLASSES)
    assert [p.field for p in problems] == [field]
    assert words in problems[0].message


def test_vllm_without_a_class_and_with_a_gpu_runtime_is_still_refused_as_a_typo():
    problems = validate_deployment(deployment(engine="vllm", runtime="cuda"), CLASSES)
    assert [p.field for p in problems] == ["profiles.p.deviceClass"]
    assert "say runtime: cpu to run vLLM's CPU build" in problems[0].message


def test_profiles_are_tried_by_priority_then_as_written():
    dep = Deployment.model_validate(
        {
            "name": "d",
            "model": "m",
            "profiles": [
                {"name": "a", "engine": "llama.cpp"},
                {"name": "b", "engine": "llama.cpp", "priority": 5},
                {"name": "c", "engine": "llama.cpp"},
            ],
        }
    )
    assert [p.name for p in dep.profiles_by_priority()] == ["b", "a", "c"]
    assert EngineKind("llama.cpp") is EngineKind.LLAMACPP


def test_vllm_on_an_apple_class_is_gated_as_unsupported_devices_naming_the_apple_driver():
    # vLLM has no Metal build: its row has no variant for gpu.apple.com, whoever serves the driver.
    dep = deployment(engine="vllm", deviceClass="apple-m2-ultra")
    assert validate_deployment(dep, CLASSES) == []
    result = gate(dep, CLASSES, set(Driver))
    assert (result.accepted.status, result.accepted.reason) == (False, "UnsupportedDevices")
    assert result.unsupported == {"p": "gpu.apple.com"}
