"""The adapter table: one launch-spec builder per engine, keyed like the capability table."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from fleetserve.engines.capabilities import EngineKind
from fleetserve.engines.launch import EngineAdapter
from fleetserve.engines.llamacpp import LlamaCppAdapter
from fleetserve.engines.vllm import VllmAdapter

ADAPTERS: Mapping[EngineKind, EngineAdapter] = MappingProxyType(
    {EngineKind.LLAMACPP: LlamaCppAdapter(), EngineKind.VLLM: VllmAdapter()}
)
