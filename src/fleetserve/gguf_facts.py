"""Model facts read at the edge: a local GGUF file's header, before placement runs.

The header is read with the ``gguf`` package (memory-mapped: tensor data is never loaded): weight
bytes from the tensor table, KV-cache bytes per token from the architecture's layer count, KV
heads and head size. A model that is not a local GGUF file gets the facts its document declares
(``fleetserve.modelfacts.declared_facts``). A model with alternates is measured per copy of its
weights, and each engine gets the facts of the copy it serves (``engines.registry.weights_for``).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

from fleetserve.engines.registry import ENGINES, weights_for
from fleetserve.engines.spec import EngineKind
from fleetserve.errors import ConfigError, Problem, SourceError
from fleetserve.modelfacts import DEFAULT_CONTEXT, DEFAULT_KV_DTYPE_BYTES, ModelFacts, declared_facts
from fleetserve.sources import LocalSource, parse_source
from fleetserve.spec.adapter import Adapter
from fleetserve.spec.resources import Model


def _field(reader: Any, key: str) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return None
    # A scalar field's value sits in the last part; strings are byte arrays.
    value = f.parts[f.data[0]]
    if getattr(value, "dtype", None) is not None and value.dtype.kind == "u" and value.dtype.itemsize == 1:
        return bytes(value).decode("utf-8", errors="replace")
    return value.tolist()[0] if hasattr(value, "tolist") else value


def read_gguf_facts(path: Path, name: str) -> ModelFacts:
    """Read weight size and KV shape from a GGUF header without loading tensor data."""
    import gguf  # imported here: only the edge needs it, and it pulls in numpy

    try:
        reader = gguf.GGUFReader(str(path), "r")
    except (OSError, ValueError) as exc:
        raise ConfigError(
            [Problem(f"Model {name}", "source", f"cannot read GGUF file {path}: {exc}")]
        ) from exc
    arch = _field(reader, "general.architecture") or "llama"
    layers = int(_field(reader, f"{arch}.block_count") or 0)
    heads = int(_field(reader, f"{arch}.attention.head_count") or 1)
    kv_heads = int(_field(reader, f"{arch}.attention.head_count_kv") or heads)
    embed = int(_field(reader, f"{arch}.embedding_length") or 0)
    key_len = _field(reader, f"{arch}.attention.key_length")
    value_len = _field(reader, f"{arch}.attention.value_length")
    head_dim = embed // heads if heads else 0
    k = int(key_len) if key_len else head_dim
    v = int(value_len) if value_len else head_dim
    context = int(_field(reader, f"{arch}.context_length") or DEFAULT_CONTEXT)
    weights = sum(int(t.n_bytes) for t in reader.tensors)
    return ModelFacts(
        name=name,
        weight_bytes=weights or path.stat().st_size,
        kv_bytes_per_token=layers * kv_heads * (k + v) * DEFAULT_KV_DTYPE_BYTES,
        context_length=context,
    )


def local_path(source: str) -> Path | None:
    """The local file a model source names, if it is one: the agents' own rule (``parse_source``)."""
    try:
        parsed = parse_source(source)
    except SourceError:
        return None
    return parsed.path if isinstance(parsed, LocalSource) else None


def weights_facts(weights: Model, base_dir: Path | None = None) -> ModelFacts:
    """Facts for one copy of the weights: from its GGUF header when the file is local, else from
    the document."""
    path = local_path(weights.source)
    if path is not None and base_dir is not None and not path.is_absolute():
        path = base_dir / path
    if path is not None and path.suffix == ".gguf" and path.is_file():
        return read_gguf_facts(path, weights.name)
    return declared_facts(weights)


def model_facts(model: Model, base_dir: Path | None = None) -> ModelFacts:
    """Facts for one model: its primary weights', with, per engine that serves other weights (an
    alternate) or none, what it serves (``engines.registry.weights_for``). Every copy of the weights
    is measured, so a broken alternate is refused even before an engine needs it; problems name the
    document's field (``alternates[0].size``)."""
    measured: dict[str, ModelFacts] = {}
    problems: list[Problem] = []
    for i, weights in enumerate(model.weights()):
        try:
            measured[weights.name] = weights_facts(weights, base_dir)
        except ConfigError as err:
            problems += [
                Problem(f"Model {model.name}", Model.weights_field(i, p.field), p.message)
                for p in err.problems
            ]
    if problems:
        raise ConfigError(problems)
    primary = measured[model.name]
    engines: dict[EngineKind, ModelFacts | None] = {}
    for engine in ENGINES:
        chosen = weights_for(model, engine)
        if chosen is None or chosen.name != model.name:
            engines[engine] = None if chosen is None else measured[chosen.name]
    return replace(
        primary,
        engines=MappingProxyType(engines) if engines else primary.engines,
        weights=model.weights_digest(),
    )


def adapter_facts(adapter: Adapter, base_dir: Path | None = None) -> ModelFacts:
    """What an adapter adds to a replica's memory: its declared ``size``, else the bytes of its
    local file or directory (a PEFT adapter's files); no KV cache of its own."""
    size = adapter.size
    path = local_path(adapter.source)
    if size is None and path is not None:
        if base_dir is not None and not path.is_absolute():
            path = base_dir / path
        files = path.rglob("*") if path.is_dir() else iter((path,) if path.is_file() else ())
        measured = sum(f.stat().st_size for f in files if f.is_file())
        size = measured or None
    if size is None:
        raise ConfigError(
            [
                Problem(
                    f"Adapter {adapter.name}",
                    "size",
                    "give size (e.g. 80MB) or a local source whose files can be measured",
                )
            ]
        )
    return ModelFacts(
        name=adapter.name, weight_bytes=size, kv_bytes_per_token=0, context_length=DEFAULT_CONTEXT
    )
