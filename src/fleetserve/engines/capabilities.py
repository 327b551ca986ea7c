"""Engine capability rules as data: one row per engine, keyed by ``EngineKind``.

Why the refusals (design.md, Engines): for vLLM an omitted device class would turn a typo into
a replica placed on a machine with no hardware; llama.cpp splits across local GPUs by its own
mechanism, which the adapter does not drive, so tensor parallel and multi-node are refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from types import MappingProxyType

from fleetserve.drivers import Driver, RuntimeVariant


class EngineKind(StrEnum):
    """An inference engine fleetserve can run."""

    VLLM = "vllm"
    LLAMACPP = "llama.cpp"


@dataclass(frozen=True)
class EngineCapabilities:
    """What one engine can serve: its runtime variants and the shapes it accepts."""

    # Runtime variant → the driver whose devices it computes on.
    variants: Mapping[RuntimeVariant, Driver]
    # The variant a profile gets when it names a device class but no runtime.
    default_variant: Mapping[Driver, RuntimeVariant]
    # Whether a profile may omit its device class, meaning "run on the CPU".
    cpu_without_class: bool
    tensor_parallel: bool
    multi_node: bool
    why_no_cpu: str = ""
    why_no_split: str = ""
    # Engine flags a profile's engineArgs may carry. Anything else is refused at apply time, so
    # no flag that changes host, port, model or served name can be smuggled in.
    allowed_args: frozenset[str] = frozenset()
    # Requests one replica serves at once before the gateway queues the next (llama.cpp: its
    # parallel slots; vLLM batches many sequences).
    concurrency_per_replica: int = 8

    def drivers(self) -> frozenset[Driver]:
        """Every driver this engine has a variant for."""
        return frozenset(self.variants.values())


ENGINES: Mapping[EngineKind, EngineCapabilities] = MappingProxyType(
    {
        EngineKind.VLLM: EngineCapabilities(
            variants=MappingProxyType({RuntimeVariant.CUDA: Driver.NVIDIA, RuntimeVariant.ROCM: Driver.AMD}),
            default_variant=MappingProxyType(
                {Driver.NVIDIA: RuntimeVariant.CUDA, Driver.AMD: RuntimeVariant.ROCM}
            ),
            cpu_without_class=False,
            concurrency_per_replica=64,
            tensor_parallel=True,
            multi_node=True,
            allowed_args=frozenset(
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
            ),
            why_no_cpu=(
                "vllm needs a deviceClass: an omitted class would place the replica on a "
                "machine with no GPU and fail minutes later while loading; name a GPU class, "
                "or use engine llama.cpp to serve on the CPU"
            ),
        ),
        EngineKind.LLAMACPP: EngineCapabilities(
            variants=MappingProxyType(
                {
                    RuntimeVariant.CPU: Driver.CPU,
                    RuntimeVariant.CUDA: Driver.NVIDIA,
                    RuntimeVariant.VULKAN: Driver.AMD,
                    RuntimeVariant.ROCM: Driver.AMD,
                }
            ),
            # Vulkan is the AMD default; ROCm is a per-profile opt-in (runtime: rocm).
            default_variant=MappingProxyType(
                {
                    Driver.CPU: RuntimeVariant.CPU,
                    Driver.NVIDIA: RuntimeVariant.CUDA,
                    Driver.AMD: RuntimeVariant.VULKAN,
                }
            ),
            cpu_without_class=True,
            concurrency_per_replica=4,
            tensor_parallel=False,
            multi_node=False,
            allowed_args=frozenset(
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
                }
            ),
            why_no_split=(
                "llama.cpp splits across local GPUs by its own mechanism, which fleetserve does "
                "not drive; the replica would serve from one device while the catalog believed "
                "it had several. Use devicesPerNode: 1 and nodes: 1, or engine vllm"
            ),
        ),
    }
)


def serving_drivers() -> frozenset[Driver]:
    """Every driver at least one engine has a runtime variant for."""
    out: set[Driver] = set()
    for caps in ENGINES.values():
        out |= caps.drivers()
    return frozenset(out)
