"""The vLLM adapter: ``vllm serve`` for the cuda and rocm variants.

Single node: tensor parallel over the shard's devices. Multi-node, as vLLM documents it: a Ray
cluster (``ray start --head`` on the first shard's node, ``ray start --address`` on the others)
and one ``vllm serve`` on the head with tensor parallel = devices per node and pipeline
parallel = nodes, over the Ray executor. The rocm variant gets the ROCm visible-devices variables
from the driver table.
"""

from __future__ import annotations

from types import MappingProxyType

from fleetserve.engines.launch import LaunchContext, LaunchSpec, url_host, visible_devices_env

# The share of each GPU's memory vLLM may take (weights, activations, KV cache).
GPU_MEMORY_UTILIZATION = "0.90"
RAY_PORT = 6379


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
        base = f"http://{url_host(ctx.host)}:{ctx.port}"
        return LaunchSpec(
            argv=tuple(argv),
            env=MappingProxyType(env),
            health_url=f"{base}/health",
            metrics_url=f"{base}/metrics",
            sidecars=sidecars,
            served_name=served,
            port=ctx.port,
        )
