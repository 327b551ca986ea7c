"""The llama.cpp adapter: ``llama-server`` for the cpu, cuda, vulkan and rocm variants.

``llama-server`` answers ``GET /health`` with 503 while loading and 200 when ready, serves the
OpenAI API, and exposes ``/metrics`` with ``--metrics`` and per-slot state with ``--slots``. It
ignores the request's model name; fleetserve's gateway checks names itself.
"""

from __future__ import annotations

from types import MappingProxyType

from fleetserve.drivers import Driver
from fleetserve.engines.capabilities import ENGINES, EngineKind
from fleetserve.engines.launch import LaunchContext, LaunchSpec, url_host, visible_devices_env

# Parallel slots: as many as the gateway sends a replica at once (engineArgs cannot change it).
DEFAULT_SLOTS = ENGINES[EngineKind.LLAMACPP].concurrency_per_replica
# Offload every layer on GPU variants; llama.cpp caps it at the model's layer count.
ALL_LAYERS = "999"


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
        if ctx.driver is Driver.CPU:
            argv += ["--threads", str(max(1, shard.cpu_cores)), "--n-gpu-layers", "0"]
        else:
            argv += ["--n-gpu-layers", ALL_LAYERS]
        argv += list(ctx.profile.engine_args)
        base = f"http://{url_host(ctx.host)}:{ctx.port}"
        return LaunchSpec(
            argv=tuple(argv),
            env=MappingProxyType(dict(visible_devices_env(ctx.driver, ctx.variant, ctx.devices))),
            health_url=f"{base}/health",
            metrics_url=f"{base}/metrics",
            served_name=served,
            port=ctx.port,
        )
