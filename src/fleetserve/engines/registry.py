"""The engine registry: one row per engine, each built whole in its own module.

Adding an engine is one module (its ``EngineSpec``: capabilities, formats, adapter, binary,
probes, pod facts, cache variables, metric mapping) and one entry here. ``weights_for`` is the one
rule for which of a model's weights an engine serves.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from fleetserve.drivers import Driver
from fleetserve.engines.llamacpp import LLAMACPP
from fleetserve.engines.spec import EngineKind, EngineSpec
from fleetserve.engines.vllm import VLLM
from fleetserve.metrics.mapping import MetricMapping
from fleetserve.spec.resources import Model

ENGINES: Mapping[EngineKind, EngineSpec] = MappingProxyType({VLLM.kind: VLLM, LLAMACPP.kind: LLAMACPP})

# The names an engine configured without a mapping is read by: vLLM's, which most
# OpenAI-compatible servers copy.
DEFAULT_MAPPING: MetricMapping = VLLM.metrics


def serving_drivers() -> frozenset[Driver]:
    """Every driver at least one engine has a runtime variant for."""
    out: set[Driver] = set()
    for spec in ENGINES.values():
        out |= spec.drivers()
    return frozenset(out)


def weights_for(model: Model, engine: EngineKind) -> Model | None:
    """The weights a replica of ``engine`` serves: the first of the model's primary weights and its
    alternates, in order, whose format the engine loads, as a Model without alternates (named as it
    is cached: ``Model.weights_name``); None when the engine loads none of the model's formats.

    Placement's memory estimate, the agent's fetch and argv, the Kubernetes render and validation
    all ask this. It is idempotent: the weights it returns choose themselves.
    """
    loads = ENGINES[engine].formats
    return next((w for w in model.weights() if w.format in loads), None)


def formats_text(engine: EngineKind) -> str:
    """The formats an engine loads, for messages: ``gguf`` or ``gguf or safetensors``."""
    return " or ".join(sorted(f.value for f in ENGINES[engine].formats))
