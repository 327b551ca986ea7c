"""vLLM, whole: ``vllm serve`` for the cuda and rocm variants.

Single node: tensor parallel over the shard's devices. Multi-node, as vLLM documents it: a Ray
cluster (``ray start --head`` on the first shard's node, ``ray start --address`` on the others)
and one ``vllm serve`` on the head with tensor parallel = devices per node and pipeline
parallel = nodes, over the Ray executor. The rocm variant gets the ROCm visible-devices variables
from the driver table. In a pod vLLM downloads a Hugging Face repository itself into ``HF_HOME``.
"""

from __future__ import annotations

from types import MappingProxyType

from fleetserve.drivers import Driver, RuntimeVariant
from fleetserve.engines.launch import LaunchContext, LaunchSpec, url_host, visible_devices_env
from fleetserve.engines.spec import EngineKind, EngineSpec, PodFacts
from fleetserve.errors import SourceError
from fleetserve.metrics.mapping import MetricMapping
from fleetserve.sources import HfRepo, HttpSource
from fleetserve.spec.resources import ModelFormat

# The share of each GPU's memory vLLM may take (weights, activations, KV cache).
GPU_MEMORY_UTILIZATION = "0.90"
RAY_PORT = 6379
HEALTH_PATH = "/health"
METRICS_PATH = "/metrics"
# vllm serve's --api-key from its environment: the OpenAI routes (/v1/...) then need
# "Authorization: Bearer KEY"; /health and /metrics stay open (the observer sends the key anyway).
API_KEY_ENV = "VLLM_API_KEY"

ALLOWED_ARGS = frozenset(
    {
        "--max-model-len",
        "--max-num-seqs",
        "--max-num-batched-tokens",
        "--dtype",
        "--quantization",
        "--kv-cache-dtype",
        "--enable-prefix-caching",
        "--no-enable-prefix-caching",
        "--enable-chunked-prefill",
        "--enforce-eager",
        "--trust-remote-code",
        "--tokenizer-mode",
        "--swap-space",
        "--block-size",
        "--seed",
        "--generation-config",
        "--enable-expert-parallel",
        "--reasoning-parser",
        "--tool-call-parser",
        "--enable-auto-tool-choice",
        "--chat-template",
        "--revision",
    }
)

METRICS = MetricMapping(
    running="vllm:num_requests_running",
    waiting="vllm:num_requests_waiting",
    kv_cache_usage="vllm:kv_cache_usage_perc",
    # Renamed in vLLM 0.10 (vllm-project/vllm#18354); older images still export only this one.
    kv_cache_usage_fallbacks=("vllm:gpu_cache_usage_perc",),
    prompt_tokens="vllm:prompt_tokens_total",
    generation_tokens="vllm:generation_tokens_total",
    ttft="vllm:time_to_first_token_seconds",
)


class VllmAdapter:
    """Builds ``vllm serve`` command lines (and Ray sidecars for multi-node replicas)."""

    def launch(self, ctx: LaunchContext) -> LaunchSpec:
        served = ctx.replica.deployment
        nodes = len(ctx.replica.shards)
        env = dict(visible_devices_env(ctx.driver, ctx.variant, ctx.devices))
        head = ctx.peer_addresses[0] if ctx.peer_addresses else ctx.host
        ray = ctx.binary.rsplit("/", 1)[0] + "/ray" if "/" in ctx.binary else "ray"
        if nodes > 1 and not ctx.is_head:
            # A worker shard runs only its Ray worker; the head's vllm serve drives its GPUs.
            return LaunchSpec(
                argv=(ray, "start", "--block", f"--address={url_host(head)}:{RAY_PORT}"),
                env=MappingProxyType(env),
                health_url=None,
                metrics_url=None,
                served_name=served,
            )
        argv: list[str] = [
            ctx.binary, "serve", *(ctx.model_args or (str(ctx.model_path),)),
            "--host", ctx.host,
            "--port", str(ctx.port),
            "--served-model-name", served,
            "--tensor-parallel-size", str(len(ctx.devices)),
            "--gpu-memory-utilization", GPU_MEMORY_UTILIZATION,
        ]  # fmt: skip
        if ctx.context is not None:
            argv += ["--max-model-len", str(ctx.context)]
        sidecars: tuple[tuple[str, ...], ...] = ()
        if nodes > 1:
            argv += ["--pipeline-parallel-size", str(nodes), "--distributed-executor-backend", "ray"]
            sidecars = ((ray, "start", "--block", "--head", f"--port={RAY_PORT}"),)
        argv += list(ctx.profile.engine_args)
        if ctx.engine_key:
            env[API_KEY_ENV] = ctx.engine_key
        base = f"http://{url_host(ctx.host)}:{ctx.port}"
        return LaunchSpec(
            argv=tuple(argv),
            env=MappingProxyType(env),
            health_url=f"{base}{HEALTH_PATH}",
            metrics_url=f"{base}{METRICS_PATH}",
            sidecars=sidecars,
            served_name=served,
            port=ctx.port,
        )

    def pod_model_args(self, text: str, source: HfRepo | HttpSource, fmt: ModelFormat) -> tuple[str, ...]:
        """The repository (and ``--revision``) of a safetensors model on Hugging Face."""
        if isinstance(source, HttpSource):
            raise SourceError(f"{text}: vLLM downloads from Hugging Face repositories: use hf://ORG/REPO")
        if fmt is ModelFormat.GGUF:
            raise SourceError(
                f"{text}: vLLM serves safetensors repositories in Kubernetes; "
                "serve this GGUF file with engine llama.cpp"
            )
        return (source.repo_id, *(("--revision", source.revision) if source.revision else ()))


VLLM = EngineSpec(
    kind=EngineKind.VLLM,
    serves_directory=True,
    variants=MappingProxyType({RuntimeVariant.CUDA: Driver.NVIDIA, RuntimeVariant.ROCM: Driver.AMD}),
    default_variant=MappingProxyType({Driver.NVIDIA: RuntimeVariant.CUDA, Driver.AMD: RuntimeVariant.ROCM}),
    cpu_without_class=False,
    concurrency_per_replica=64,
    tensor_parallel=True,
    multi_node=True,
    allowed_args=ALLOWED_ARGS,
    why_no_cpu=(
        "vllm needs a deviceClass: an omitted class would place the replica on a "
        "machine with no GPU and fail minutes later while loading; name a GPU class, "
        "or use engine llama.cpp to serve on the CPU"
    ),
    binary="vllm",
    health_path=HEALTH_PATH,
    metrics_path=METRICS_PATH,
    cache_env=MappingProxyType({"HF_HOME": "huggingface"}),
    pod=PodFacts(
        binary="vllm",
        port=8000,
        images=MappingProxyType(
            {
                RuntimeVariant.CUDA: "docker.io/vllm/vllm-openai:v0.23.0",
                RuntimeVariant.ROCM: (
                    "docker.io/rocm/vllm:rocm7.14.0_cdna_ubuntu24.04_py3.14_pytorch_2.11.0_vllm_0.23.0"
                ),
            }
        ),
        # Multi-hundred-GB weights download on first start: allow an hour.
        startup_seconds=3600,
        shared_memory=True,
    ),
    metrics=METRICS,
    adapter=VllmAdapter(),
)
