"""What placement needs to know about a model's size: the ``ModelFacts`` value, and the facts a
model document declares (``size`` and ``architecture``).

Reading a local GGUF file's header is the edge's job (``fleetserve.gguf_facts``); nothing here
opens a file.
"""

from __future__ import annotations

from dataclasses import dataclass

from fleetserve.errors import ConfigError, Problem
from fleetserve.spec.resources import Model

# Context assumed when neither the file nor the document says.
DEFAULT_CONTEXT = 4096
# KV cache kept as f16 unless told otherwise.
DEFAULT_KV_DTYPE_BYTES = 2


@dataclass(frozen=True)
class ModelFacts:
    """A model's weight bytes, KV-cache bytes per token of context, and native context."""

    name: str
    weight_bytes: int
    kv_bytes_per_token: int
    context_length: int


def declared_facts(model: Model) -> ModelFacts:
    """Facts from the model document alone: its ``size`` and, if given, its ``architecture``."""
    if model.size is None:
        raise ConfigError(
            [
                Problem(
                    f"Model {model.name}",
                    "size",
                    "give size (e.g. 140GB) or a local GGUF source whose header can be read",
                )
            ]
        )
    arch = model.architecture
    if arch is None:
        return ModelFacts(model.name, model.size, 0, DEFAULT_CONTEXT)
    return ModelFacts(
        name=model.name,
        weight_bytes=model.size,
        kv_bytes_per_token=2 * arch.layers * arch.kv_heads * arch.head_dim * arch.kv_dtype_bytes,
        context_length=arch.context_length,
    )
