"""Engine adapters: (profile, model file, shard, port) → launch spec, one table row per variant.

The expected values are spelled out here from design.md (the driver table and the Engines
section), not read back from the code's own tables, so a changed row shows as a failure.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from builders import deployment as build_deployment
from fleetserve.drivers import Driver, RuntimeVariant
from fleetserve.engines.launch import LaunchContext, LaunchSpec
from fleetserve.engines.registry import ENGINES
from fleetserve.engines.spec import EngineKind
from fleetserve.spec.resources import Deployment, DeviceClass, Profile, Replica, Shard
from fleetserve.validation import validate_deployment

MODEL = Path("/var/lib/fleetserve/models/tiny.gguf")
HOST = "127.0.0.1"
PORT = 18431
LLAMA_BINARY = "/opt/llama/bin/llama-server"
VLLM_BINARY = "/opt/vllm/bin/vllm"
DEPLOYMENT = "chat"


def launch(
    engine: EngineKind,
    variant: RuntimeVariant,
    driver: Driver,
    shards: tuple[tuple[int, ...], ...] = ((),),
    *,
    shard_index: int = 0,
    cpu_cores: int = 0,
    context: int | None = None,
    engine_args: tuple[str, ...] = (),
    peers: tuple[str, ...] = (),
    engine_key: str | None = None,
    memory: int = 0,
    binary: str | None = None,
    model: Path = MODEL,
) -> LaunchSpec:
    """The launch spec the engine's adapter builds for one shard of a replica of ``chat``."""
    replica = Replica(
        name="chat-0",
        deployment=DEPLOYMENT,
        profile="p",
        device_class=None if driver is Driver.CPU else "gpu",
        shards=tuple(
            Shard(node=f"node-{i}", devices=devices, cpu_cores=cpu_cores, memory=memory)
            for i, devices in enumerate(shards)
        ),
    )
    profile = Profile(
        name="p",
        engine=engine,
        runtime=variant,
        device_class=None if driver is Driver.CPU else "gpu",
        devices_per_node=max(1, len(shards[0])),
        nodes=len(shards),
        engine_args=engine_args,
        context=context,
    )
    ctx = LaunchContext(
        replica=replica,
        shard_index=shard_index,
        profile=profile,
        variant=variant,
        driver=driver,
        model_path=model,
        binary=binary or (LLAMA_BINARY if engine is EngineKind.LLAMACPP else VLLM_BINARY),
        host=HOST,
        port=PORT,
        context=context,
        peer_addresses=peers,
        engine_key=engine_key,
    )
    return ENGINES[engine].adapter.launch(ctx)


def value_of(argv: tuple[str, ...], flag: str) -> str:
    """The value after ``flag``, which must occur exactly once."""
    assert argv.count(flag) == 1, f"{flag} occurs {argv.count(flag)} times in {argv}"
    return argv[argv.index(flag) + 1]


# --- llama.cpp ---------------------------------------------------------------------------------

# (variant, driver, the shard's devices, the environment it must get)
LLAMA_VARIANTS = [
    pytest.param(RuntimeVariant.CPU, Driver.CPU, (), {}, id="cpu"),
    pytest.param(RuntimeVariant.CUDA, Driver.NVIDIA, (2,), {"CUDA_VISIBLE_DEVICES": "2"}, id="cuda"),
    pytest.param(RuntimeVariant.VULKAN, Driver.AMD, (1,), {"GGML_VK_VISIBLE_DEVICES": "1"}, id="vulkan"),
    pytest.param(
        RuntimeVariant.ROCM,
        Driver.AMD,
        (3,),
        {"HIP_VISIBLE_DEVICES": "3", "ROCR_VISIBLE_DEVICES": "3"},
        id="rocm",
    ),
    # A Mac has one GPU and Metal no visible-devices variable: the environment stays empty.
    pytest.param(RuntimeVariant.METAL, Driver.APPLE, (0,), {}, id="metal"),
]


@pytest.mark.parametrize(("variant", "driver", "devices", "env"), LLAMA_VARIANTS)
def test_llama_server_argv_is_a_tuple_of_strings_that_starts_with_the_binary(variant, driver, devices, env):
    spec = launch(EngineKind.LLAMACPP, variant, driver, (devices,), cpu_cores=2, context=4096)
    assert isinstance(spec.argv, tuple)
    assert all(isinstance(arg, str) for arg in spec.argv)
    assert spec.argv[0] == LLAMA_BINARY


@pytest.mark.parametrize(("variant", "driver", "devices", "env"), LLAMA_VARIANTS)
def test_llama_server_is_told_its_model_address_alias_and_to_serve_metrics_and_slots(
    variant, driver, devices, env
):
    spec = launch(EngineKind.LLAMACPP, variant, driver, (devices,), cpu_cores=2)
    assert value_of(spec.argv, "--model") == str(MODEL)
    assert value_of(spec.argv, "--host") == HOST
    assert value_of(spec.argv, "--port") == str(PORT)
    assert value_of(spec.argv, "--alias") == DEPLOYMENT
    assert "--metrics" in spec.argv
    assert "--slots" in spec.argv
    assert spec.served_name == DEPLOYMENT
    assert spec.port == PORT


@pytest.mark.parametrize(("variant", "driver", "devices", "env"), LLAMA_VARIANTS)
@pytest.mark.parametrize("context", [4096, None], ids=["with-context", "without-context"])
def test_llama_server_gets_a_context_size_only_when_the_replica_has_a_context(
    variant, driver, devices, env, context
):
    spec = launch(EngineKind.LLAMACPP, variant, driver, (devices,), cpu_cores=2, context=context)
    if context is None:
        assert "--ctx-size" not in spec.argv
    else:
        assert value_of(spec.argv, "--ctx-size") == str(context)


@pytest.mark.parametrize("cores", [1, 6, 32])
def test_llama_server_on_the_cpu_runs_one_thread_per_claimed_core_and_offloads_no_layer(cores):
    spec = launch(EngineKind.LLAMACPP, RuntimeVariant.CPU, Driver.CPU, ((),), cpu_cores=cores)
    assert value_of(spec.argv, "--threads") == str(cores)
    assert value_of(spec.argv, "--n-gpu-layers") == "0"


@pytest.mark.parametrize(("variant", "driver", "devices", "env"), LLAMA_VARIANTS[1:])
def test_llama_server_on_a_gpu_variant_offloads_its_layers(variant, driver, devices, env):
    spec = launch(EngineKind.LLAMACPP, variant, driver, (devices,))
    layers = value_of(spec.argv, "--n-gpu-layers")
    assert int(layers) > 0


def test_llama_server_on_metal_offloads_every_layer_to_the_apple_gpu_and_sets_no_threads():
    spec = launch(EngineKind.LLAMACPP, RuntimeVariant.METAL, Driver.APPLE, ((0,),), context=32768)
    assert value_of(spec.argv, "--n-gpu-layers") == "999"
    assert "--threads" not in spec.argv
    assert value_of(spec.argv, "--ctx-size") == "32768"
    assert dict(spec.env) == {}


@pytest.mark.parametrize(("variant", "driver", "devices", "env"), LLAMA_VARIANTS)
def test_llama_server_env_holds_exactly_the_visible_devices_variables_of_its_variant(
    variant, driver, devices, env
):
    spec = launch(EngineKind.LLAMACPP, variant, driver, (devices,), cpu_cores=2)
    assert dict(spec.env) == env


@pytest.mark.parametrize(("variant", "driver", "devices", "env"), LLAMA_VARIANTS)
def test_llama_server_health_and_metrics_urls_point_at_its_host_and_port(variant, driver, devices, env):
    spec = launch(EngineKind.LLAMACPP, variant, driver, (devices,), cpu_cores=2)
    assert spec.health_url == f"http://{HOST}:{PORT}/health"
    assert spec.metrics_url == f"http://{HOST}:{PORT}/metrics"
    assert spec.sidecars == ()


# --- vLLM ----------------------------------------------------------------------------------------

# (variant, driver, visible-devices variables)
VLLM_VARIANTS = [
    pytest.param(RuntimeVariant.CUDA, Driver.NVIDIA, ("CUDA_VISIBLE_DEVICES",), id="cuda"),
    pytest.param(RuntimeVariant.ROCM, Driver.AMD, ("HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES"), id="rocm"),
]


@pytest.mark.parametrize(("variant", "driver", "names"), VLLM_VARIANTS)
@pytest.mark.parametrize("devices", [(0,), (4, 5), (0, 1, 2, 3)], ids=["1-gpu", "2-gpus", "4-gpus"])
def test_vllm_on_one_node_serves_the_model_tensor_parallel_over_the_shards_devices(
    variant, driver, names, devices
):
    spec = launch(EngineKind.VLLM, variant, driver, (devices,), context=8192)
    assert isinstance(spec.argv, tuple)
    assert all(isinstance(arg, str) for arg in spec.argv)
    assert spec.argv[:3] == (VLLM_BINARY, "serve", str(MODEL))
    assert value_of(spec.argv, "--host") == HOST
    assert value_of(spec.argv, "--port") == str(PORT)
    assert value_of(spec.argv, "--served-model-name") == DEPLOYMENT
    assert value_of(spec.argv, "--tensor-parallel-size") == str(len(devices))
    assert 0.0 < float(value_of(spec.argv, "--gpu-memory-utilization")) <= 1.0
    assert value_of(spec.argv, "--max-model-len") == "8192"
    assert "--pipeline-parallel-size" not in spec.argv
    assert "--distributed-executor-backend" not in spec.argv
    assert spec.sidecars == ()
    assert dict(spec.env) == dict.fromkeys(names, ",".join(map(str, devices)))
    assert spec.health_url == f"http://{HOST}:{PORT}/health"
    assert spec.metrics_url == f"http://{HOST}:{PORT}/metrics"
    assert spec.served_name == DEPLOYMENT
    assert spec.port == PORT


def test_vllm_without_a_context_leaves_the_model_length_to_the_model():
    spec = launch(EngineKind.VLLM, RuntimeVariant.CUDA, Driver.NVIDIA, ((0,),))
    assert "--max-model-len" not in spec.argv


MULTI_NODE_SHARDS = ((0, 1, 2, 3), (4, 5, 6, 7), (0, 1, 2, 3))
PEERS = ("10.0.0.1", "10.0.0.2", "10.0.0.3")


@pytest.mark.parametrize(("variant", "driver", "names"), VLLM_VARIANTS)
def test_vllm_multi_node_head_runs_a_ray_head_and_serves_pipeline_parallel_over_the_nodes(
    variant, driver, names
):
    spec = launch(EngineKind.VLLM, variant, driver, MULTI_NODE_SHARDS, shard_index=0, peers=PEERS)
    assert spec.argv[:3] == (VLLM_BINARY, "serve", str(MODEL))
    assert value_of(spec.argv, "--tensor-parallel-size") == "4"
    assert value_of(spec.argv, "--pipeline-parallel-size") == "3"
    assert value_of(spec.argv, "--distributed-executor-backend") == "ray"
    assert value_of(spec.argv, "--served-model-name") == DEPLOYMENT
    assert len(spec.sidecars) == 1
    ray_head = spec.sidecars[0]
    assert all(isinstance(arg, str) for arg in ray_head)
    assert Path(ray_head[0]).name == "ray"
    assert ray_head[1] == "start"
    assert "--head" in ray_head
    assert dict(spec.env) == dict.fromkeys(names, "0,1,2,3")
    assert spec.health_url == f"http://{HOST}:{PORT}/health"


@pytest.mark.parametrize(("variant", "driver", "names"), VLLM_VARIANTS)
@pytest.mark.parametrize("shard_index", [1, 2])
def test_vllm_multi_node_worker_shard_runs_only_a_ray_worker_pointing_at_the_head(
    variant, driver, names, shard_index
):
    head = launch(EngineKind.VLLM, variant, driver, MULTI_NODE_SHARDS, shard_index=0, peers=PEERS)
    head_port = next(a.split("=", 1)[1] for a in head.sidecars[0] if a.startswith("--port="))
    spec = launch(EngineKind.VLLM, variant, driver, MULTI_NODE_SHARDS, shard_index=shard_index, peers=PEERS)
    assert Path(spec.argv[0]).name == "ray"
    assert spec.argv[1] == "start"
    assert f"--address={PEERS[0]}:{head_port}" in spec.argv
    assert "--head" not in spec.argv
    assert "serve" not in spec.argv
    assert spec.sidecars == ()
    assert spec.health_url is None
    assert spec.metrics_url is None
    devices = ",".join(map(str, MULTI_NODE_SHARDS[shard_index]))
    assert dict(spec.env) == dict.fromkeys(names, devices)


# --- engineArgs ----------------------------------------------------------------------------------

CLASSES = {
    "nvidia-h100-80gb": DeviceClass(name="nvidia-h100-80gb", driver="gpu.nvidia.com", memory=80 << 30),
}

# (engine, variant, driver, devices, engineArgs validation accepts)
ENGINE_ARGS = [
    pytest.param(EngineKind.LLAMACPP, RuntimeVariant.CPU, Driver.CPU, (), ("--flash-attn",), id="llama.cpp"),
    pytest.param(
        EngineKind.LLAMACPP,
        RuntimeVariant.CUDA,
        Driver.NVIDIA,
        (0,),
        ("--flash-attn", "on", "--cache-type-k", "q8_0"),
        id="llama.cpp-cuda",
    ),
    pytest.param(
        EngineKind.VLLM, RuntimeVariant.CUDA, Driver.NVIDIA, (0, 1), ("--max-num-seqs=8",), id="vllm"
    ),
]


@pytest.mark.parametrize(("engine", "variant", "driver", "devices", "args"), ENGINE_ARGS)
def test_profile_engine_args_are_appended_after_fleetserves_own_flags(engine, variant, driver, devices, args):
    spec = launch(engine, variant, driver, (devices,), cpu_cores=2, context=2048, engine_args=args)
    assert spec.argv[-len(args) :] == args
    assert spec.argv.count(args[0]) == 1


def deployment(engine: EngineKind, engine_args: tuple[str, ...]) -> Deployment:
    profile: dict[str, object] = {"name": "p", "engine": engine.value, "engineArgs": list(engine_args)}
    if engine is EngineKind.VLLM:
        profile["deviceClass"] = "nvidia-h100-80gb"
    return build_deployment("d", 1, profile)


REFUSED_FLAGS = ["--host", "--port", "--model", "-m", "--alias", "--served-model-name", "--api-key"]


@pytest.mark.parametrize("engine", list(EngineKind), ids=lambda e: e.value)
@pytest.mark.parametrize("flag", REFUSED_FLAGS)
@pytest.mark.parametrize("form", ["separate", "equals"])
def test_validation_refuses_engine_args_that_would_change_host_port_model_name_or_key(engine, flag, form):
    args = (flag, "x") if form == "separate" else (f"{flag}=x",)
    problems = validate_deployment(deployment(engine, args), CLASSES)
    assert [p.field for p in problems] == ["profiles.p.engineArgs"], problems
    assert problems[0].message.startswith(f"{flag} is not an allowed {engine.value} argument"), problems[0]


def test_a_negative_number_is_a_flags_value_not_a_flag():
    args = ("--n-predict", "-1", "--rope-freq-scale", "-0.5")
    assert validate_deployment(deployment(EngineKind.LLAMACPP, args), CLASSES) == []
    problems = validate_deployment(deployment(EngineKind.LLAMACPP, ("--n-predict", "-1x")), CLASSES)
    assert [p.field for p in problems] == ["profiles.p.engineArgs"]


@pytest.mark.parametrize(
    ("engine", "args"),
    [
        pytest.param(EngineKind.LLAMACPP, ("--flash-attn",), id="llama.cpp-flash-attn"),
        pytest.param(EngineKind.LLAMACPP, ("--flash-attn", "on", "--jinja"), id="llama.cpp-with-values"),
        pytest.param(EngineKind.VLLM, ("--max-num-seqs=8",), id="vllm-max-num-seqs"),
        pytest.param(EngineKind.VLLM, ("--max-num-seqs", "8", "--enforce-eager"), id="vllm-with-values"),
    ],
)
def test_validation_accepts_allowed_engine_args(engine, args):
    assert validate_deployment(deployment(engine, args), CLASSES) == []


@pytest.mark.parametrize(
    ("engine", "variant", "driver", "devices", "variable"),
    [
        pytest.param(
            EngineKind.LLAMACPP, RuntimeVariant.CPU, Driver.CPU, (), "LLAMA_API_KEY", id="llama.cpp"
        ),
        pytest.param(EngineKind.VLLM, RuntimeVariant.CUDA, Driver.NVIDIA, (0, 1), "VLLM_API_KEY", id="vllm"),
        pytest.param(EngineKind.VLLM, RuntimeVariant.CPU, Driver.CPU, (), "VLLM_API_KEY", id="vllm-cpu"),
    ],
)
def test_the_replicas_engine_key_is_in_the_engines_environment_never_on_its_argv(
    engine, variant, driver, devices, variable
):
    key = "replica-key-" + "x" * 31
    spec = launch(engine, variant, driver, (devices,), engine_key=key)
    assert spec.env[variable] == key
    assert not [arg for arg in spec.argv if key in arg] and "--api-key" not in spec.argv
    assert key not in repr(spec)
    assert variable not in launch(engine, variant, driver, (devices,)).env  # placed before engine keys


# --- vLLM's CPU build ----------------------------------------------------------------------------

PYTHON = "/opt/fleetserve/.venv/bin/python3.11"
GIB = 1 << 30
MIB = 1 << 20


def test_vllm_cpu_runs_the_module_entry_point_of_the_python_it_is_installed_in():
    spec = launch(
        EngineKind.VLLM,
        RuntimeVariant.CPU,
        Driver.CPU,
        cpu_cores=3,
        context=256,
        memory=4 * GIB,
        binary=PYTHON,
    )
    assert spec.argv == (
        PYTHON, "-m", "vllm.entrypoints.openai.api_server", "--model", str(MODEL),
        "--host", HOST, "--port", str(PORT), "--served-model-name", DEPLOYMENT,
        "--kv-cache-memory-bytes", str(2 * GIB), "--max-model-len", "256",
    )  # fmt: skip
    assert "--gpu-memory-utilization" not in spec.argv  # on the CPU it reserves the machine's memory
    assert spec.sidecars == ()
    assert (spec.health_url, spec.metrics_url) == (
        f"http://{HOST}:{PORT}/health",
        f"http://{HOST}:{PORT}/metrics",
    )


def test_vllm_cpu_given_a_vllm_executable_runs_vllm_serve():
    spec = launch(EngineKind.VLLM, RuntimeVariant.CPU, Driver.CPU, cpu_cores=1, binary="/usr/local/bin/vllm")
    assert spec.argv[:3] == ("/usr/local/bin/vllm", "serve", str(MODEL))
    assert "-m" not in spec.argv and "--max-model-len" not in spec.argv


@pytest.mark.parametrize("cores", [1, 2, 7])
def test_vllm_cpu_threads_are_the_placed_cores_unbound(cores):
    env = launch(EngineKind.VLLM, RuntimeVariant.CPU, Driver.CPU, cpu_cores=cores, binary=PYTHON).env
    assert env["OMP_NUM_THREADS"] == str(cores)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    assert "--tensor-parallel-size" not in launch(EngineKind.VLLM, RuntimeVariant.CPU, Driver.CPU).argv


@pytest.mark.parametrize(
    ("memory", "weights", "kv"),
    [
        pytest.param(6 * GIB, 0, 3 * GIB, id="half-of-6-GiB"),
        pytest.param(9 * GIB, 3 * GIB, 3 * GIB, id="half-of-what-the-weights-leave"),
        pytest.param(300 * MIB + 3 * MIB - 1, 0, 151 * MIB, id="whole-MiB-rounded-down"),
        pytest.param(100 * MIB, 0, 64 * MIB, id="at-least-64-MiB"),
        pytest.param(1 * GIB, 2 * GIB, 64 * MIB, id="weights-over-the-placement"),
    ],
)
def test_vllm_cpu_kv_cache_size_comes_from_the_placed_memory_less_the_weights(tmp_path, memory, weights, kv):
    model = tmp_path / "tiny"
    model.mkdir()
    with open(model / "model.safetensors", "wb") as f:
        f.truncate(weights)  # a sparse file: its size is what counts
    (model / "config.json").write_text("{}")  # 2 bytes
    argv = launch(
        EngineKind.VLLM, RuntimeVariant.CPU, Driver.CPU, cpu_cores=1, memory=memory + 2, model=model
    ).argv
    assert value_of(argv, "--kv-cache-memory-bytes") == str(kv)
