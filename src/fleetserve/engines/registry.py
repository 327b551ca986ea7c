"""The engine registry: one row per engine, each built whole in its own module.

Adding an engine is one module (its ``EngineSpec``: capabilities, adapter, binary, probes, pod
facts, cache variables, metric mapping) and one entry here.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from fleetserve.drivers import Driver
from fleetserve.engines.llamacpp import LLAMACPP
from fleetserve.engines.spec import EngineKind, EngineSpec
from fleetserve.engines.vllm import VLLM
from fleetserve.metrics.mapping import MetricMapping

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
