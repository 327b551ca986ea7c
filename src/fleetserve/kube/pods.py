"""What a pod of an engine needs beyond the engine's row (``ENGINES[kind].pod``): the model
volume, the images a Cluster chose, and how the engine names the model it downloads.

Images are the rows' defaults a Cluster overrides per ``ENGINE/VARIANT`` (``images:`` in its
document). The engine downloads its model itself into the pod's model volume (``cache_env``
points its cache there), so a replica needs nothing but its volume and the network.
"""

from __future__ import annotations

from fleetserve.drivers import DRIVERS, RuntimeVariant
from fleetserve.engines.registry import ENGINES, formats_text, weights_for
from fleetserve.engines.spec import EngineKind
from fleetserve.errors import ConfigError, InternalError, Problem, SourceError
from fleetserve.sources import HfRepo, HttpSource, parse_hf_repo, parse_source
from fleetserve.spec.cluster import Cluster
from fleetserve.spec.resources import Model

MODEL_MOUNT = "/models"


def image_key(engine: EngineKind, variant: RuntimeVariant) -> str:
    """The key a Cluster's ``images`` uses for an engine variant, e.g. ``llama.cpp/vulkan``."""
    return f"{engine.value}/{variant.value}"


def image_keys() -> list[str]:
    """Every valid key of a Cluster's ``images``: the variants whose driver Kubernetes can serve."""
    return [
        image_key(e, v)
        for e, caps in ENGINES.items()
        for v, d in caps.variants.items()
        if DRIVERS[d].kube_supported
    ]


def image_problems(cluster: Cluster) -> list[Problem]:
    """A Cluster's ``images`` entries that name no engine variant, or name an empty image."""
    valid = image_keys()
    out = []
    for key, image in cluster.images.items():
        if key not in valid:
            out.append(
                Problem(
                    f"Cluster {cluster.name}",
                    f"images.{key}",
                    f"no engine variant is called {key!r}; valid keys: {', '.join(valid)}",
                )
            )
        elif not image.strip():
            out.append(Problem(f"Cluster {cluster.name}", f"images.{key}", "the image must not be empty"))
    return out


def image_for(cluster: Cluster, engine: EngineKind, variant: RuntimeVariant) -> str:
    """The image a cluster runs ``engine`` built for ``variant`` with: its override, else the default."""
    return cluster.images.get(image_key(engine, variant)) or ENGINES[engine].pod.images[variant]


def served_weights(engine: EngineKind, model: Model) -> tuple[Model, str]:
    """The weights ``engine`` serves of ``model`` (``weights_for``) and the document field of their
    source (``source``, ``alternates[0].source``); a ConfigError when it loads none of its formats."""
    weights = weights_for(model, engine)
    if weights is None:
        raise ConfigError(
            [
                Problem(
                    f"Model {model.name}",
                    "alternates",
                    f"engine {engine.value} loads {formats_text(engine)} weights and the model has none: "
                    f"add an alternate of format {formats_text(engine)}",
                )
            ]
        )
    index = next(i for i, w in enumerate(model.weights()) if w.name == weights.name)
    return weights, Model.weights_field(index, "source")


def model_args(engine: EngineKind, model: Model) -> tuple[str, ...]:
    """How ``engine`` names ``model`` in a pod: a source it downloads itself into the model volume.

    The weights are those the engine serves (``weights_for``: the model's primary ones or an
    alternate). The engine's row says what it accepts (vLLM a Hugging Face repository of
    safetensors, llama-server one GGUF file of a repository or an https URL). A path on this
    machine, or the control plane's copy, is not reachable from a cluster: that is a ConfigError
    naming the model's source field.
    """
    where = f"Model {model.name}"
    weights, field = served_weights(engine, model)
    text = weights.source.strip()
    scheme = text.partition("://")[0].lower() if "://" in text else ""
    try:
        source: HfRepo | HttpSource
        if scheme == "hf":
            source = parse_hf_repo(text)
        elif scheme in ("http", "https"):
            parsed = parse_source(text)
            if not isinstance(parsed, HttpSource):
                raise InternalError(f"{text}: an http(s) source parsed as {type(parsed).__name__}")
            source = parsed
        else:
            raise SourceError(
                f"{text}: a cluster cannot read a file on this machine or the control plane's copy; "
                "publish the model to Hugging Face (hf://) or an https URL"
            )
        return ENGINES[engine].adapter.pod_model_args(text, source, weights.format)
    except SourceError as exc:
        raise ConfigError([Problem(where, field, str(exc))]) from exc


def cache_env(engine: EngineKind) -> dict[str, str]:
    """The engine's download-cache variables, pointed into the pod's model volume."""
    return {name: f"{MODEL_MOUNT}/{sub}" for name, sub in ENGINES[engine].cache_env.items()}
