"""The ``Adapter`` kind: a LoRA adapter on a base model, chosen per request by name.

An Adapter names its ``base`` (the Model whose weights it was trained on), where its files are
(``source``: a local path, an https URL or ``hf://``, with the same source policy as a model's) and
its ``format``: ``gguf`` (one GGUF LoRA file, llama.cpp's ``--lora``) or ``peft`` (a PEFT directory
of ``adapter_config.json`` and ``adapter_model.safetensors``, vLLM's ``--lora-modules``). It is
fetched into the node's model cache like a model (``as_model``: digests, resume, source policy)
under its own name, which is also what a client sends as its ``"model"``.

A Deployment lists the adapters it serves (``Deployment.adapters``); the engine row says how it
loads each format (``EngineSpec.adapters``, ``engines/spec.py``).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

from pydantic import Field

from fleetserve.spec.base import Bytes, Name, Spec
from fleetserve.spec.resources import Model, ModelFormat, Sha256

# Most adapters one deployment serves (vLLM's --max-loras defaults far below this).
MAX_DEPLOYMENT_ADAPTERS = 32


class AdapterFormat(StrEnum):
    """How an adapter's weights are stored."""

    GGUF = "gguf"  # one GGUF LoRA file (llama.cpp's convert_lora_to_gguf.py)
    PEFT = "peft"  # a PEFT directory: adapter_config.json + adapter_model.safetensors


# The model-cache format an adapter's files are fetched as (one file, or a directory of safetensors).
CACHE_FORMAT = {AdapterFormat.GGUF: ModelFormat.GGUF, AdapterFormat.PEFT: ModelFormat.SAFETENSORS}


class Adapter(Spec):
    """A LoRA adapter on the Model ``base``: its source, format, size and checksum."""

    kind: Literal["Adapter"] = "Adapter"
    name: Name
    base: Name
    source: str = Field(min_length=1, max_length=2048)
    format: AdapterFormat = AdapterFormat.GGUF
    # Bytes of the adapter's weights (placement counts them in the replica's memory); optional
    # when the source is a local file or directory, which is measured.
    size: Bytes | None = None
    sha256: Sha256 = None

    def as_model(self) -> Model:
        """The adapter as the model cache fetches it: a Model of its name, source and checksum."""
        return Model(
            name=self.name,
            source=self.source,
            format=CACHE_FORMAT[self.format],
            size=self.size,
            sha256=self.sha256,
        )
