"""What one replica of a profile needs, worked out once before any node is looked at.

Memory must fit: weights plus KV cache for the context, spread over the replica's devices, plus
a runtime overhead per device — against device memory, or host RAM for a CPU replica. A
speculative replica's draft model adds its own weights and its KV cache for the same context (both
engines run the draft with the replica's context, on the replica's devices). A deployment's LoRA
adapters add their bytes (every replica loads every one; an adapter has no KV cache of its own).
"""

from __future__ import annotations

from dataclasses import dataclass

from fleetserve.drivers import Driver, RuntimeVariant, host_driver
from fleetserve.engines.spec import EngineKind
from fleetserve.modelfacts import ModelFacts
from fleetserve.spec.resources import DeviceClass
from fleetserve.validation import ResolvedProfile

# Per-device memory an engine takes beyond weights and KV cache (CUDA/HIP context, activations).
GPU_RUNTIME_OVERHEAD = 1 << 30
# Host memory a CPU engine process takes beyond weights and KV cache.
CPU_RUNTIME_OVERHEAD = 256 << 20


@dataclass(frozen=True)
class Demand:
    """One replica's needs under one profile: devices of a class per node, nodes, memory, cores."""

    profile: str
    driver: Driver
    device_class: str | None
    devices_per_node: int
    nodes: int
    device_memory: int  # bytes needed on each device
    class_memory: int  # bytes each device of the class has
    cpu_cores: int  # per node
    host_memory: int  # per node
    model: str
    # The engine and its runtime variant: a node must run them (its agent found that build).
    engine: EngineKind
    variant: RuntimeVariant

    @property
    def on_cpu(self) -> bool:
        return self.device_class is None

    @property
    def devices(self) -> int:
        """Devices of the class across the whole replica."""
        return self.devices_per_node * self.nodes


def model_bytes(facts: ModelFacts, context: int | None) -> int:
    """Weights plus KV cache for ``context`` tokens (the model's own context when not given)."""
    ctx = context or facts.context_length
    return facts.weight_bytes + facts.kv_bytes_per_token * ctx


def demand_for(
    profile: ResolvedProfile,
    facts: ModelFacts,
    cls: DeviceClass | None,
    draft: ModelFacts | None = None,
    adapter_bytes: int = 0,
) -> Demand:
    """The demand of one replica of ``profile`` serving the model ``facts`` describes, drafting with
    the model ``draft`` describes (its weights and KV cache for the served model's context), with
    LoRA adapters of ``adapter_bytes`` loaded."""
    total = model_bytes(facts, profile.context) + adapter_bytes
    if draft is not None:
        total += model_bytes(draft, profile.context or facts.context_length)
    if not profile.on_cpu and cls is None:
        raise ValueError(
            f"profile {profile.name}: device class {profile.device_class} is not in the snapshot"
        )
    if profile.on_cpu or cls is None:
        cpu = profile.host_request()
        # An explicit claim may add headroom, never go below what the model needs.
        host = max(cpu.memory or 0, total + CPU_RUNTIME_OVERHEAD)
        return Demand(
            profile=profile.name,
            driver=host_driver(),
            device_class=None,
            devices_per_node=0,
            nodes=1,
            device_memory=0,
            class_memory=0,
            cpu_cores=cpu.cores,
            host_memory=host,
            model=facts.name,
            engine=profile.engine,
            variant=profile.variant,
        )
    n = profile.devices_per_node * profile.nodes
    per_device = -(-total // n) + GPU_RUNTIME_OVERHEAD
    # A GPU profile claims host CPU only when it says so.
    explicit_cpu = profile.cpu
    return Demand(
        profile=profile.name,
        driver=profile.driver,
        device_class=cls.name,
        devices_per_node=profile.devices_per_node,
        nodes=profile.nodes,
        device_memory=per_device,
        class_memory=cls.memory,
        cpu_cores=explicit_cpu.cores if explicit_cpu else 0,
        host_memory=(explicit_cpu.memory or 0) if explicit_cpu else 0,
        model=facts.name,
        engine=profile.engine,
        variant=profile.variant,
    )
