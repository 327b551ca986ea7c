"""What placement needs to know about a model's size: the ``ModelFacts`` value, and the facts a
model document declares (``size`` and ``architecture``).

Reading a local GGUF file's header is the edge's job (``fleetserve.gguf_facts``); nothing here
opens a file.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from fleetserve.engines.spec import EngineKind
from fleetserve.errors import ConfigError, Problem
from fleetserve.spec.resources import Model

# Context assumed when neither the file nor the document says.
DEFAULT_CONTEXT = 4096
# KV cache kept as f16 unless told otherwise.
DEFAULT_KV_DTYPE_BYTES = 2


def _no_engines() -> Mapping[EngineKind, ModelFacts | None]:
    return MappingProxyType({})


@dataclass(frozen=True)
class ModelFacts:
    """A model's weight bytes, KV-cache bytes per token of context, and native context.

    ``name`` is the name the weights are cached under (``Model.weights_name``): the model's own for
    its primary weights. A model with alternates, or whose primary format some engine does not
    load, says per engine what that engine serves instead (``engines``, filled at the edge from
    ``engines.registry.weights_for``): the facts of an alternate, or None where the engine loads
    none of the model's formats. An engine not named there serves these weights.
    """

    name: str
    weight_bytes: int
    kv_bytes_per_token: int
    context_length: int
    engines: Mapping[EngineKind, ModelFacts | None] = field(default_factory=_no_engines)
    # The document's ``Model.weights_digest`` (set at the edge; "" when unknown): what the revision
    # of a deployment serving the model includes (``ClusterSnapshot.revision_of``).
    weights: str = ""

    def for_engine(self, engine: EngineKind) -> ModelFacts | None:
        """The facts of the weights a replica of ``engine`` serves; None when it can serve none."""
        return self.engines.get(engine, self)


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
