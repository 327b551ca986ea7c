"""What running an engine in a Kubernetes pod needs, one row per engine.

Images are defaults a Cluster overrides per ``ENGINE/VARIANT`` (``images:`` in its document).
The engine downloads its model itself into the pod's model volume (``cache_env`` points its
cache there), so a replica needs nothing but its volume and the network.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from fleetserve.drivers import RuntimeVariant
from fleetserve.engines.capabilities import ENGINES, EngineKind
from fleetserve.errors import ConfigError, Problem, SourceError
from fleetserve.sources import HttpSource, parse_source
from fleetserve.spec.resources import Cluster, Model, ModelFormat

MODEL_MOUNT = "/models"


@dataclass(frozen=True)
class KubeEngine:
    """One engine's container facts: binary, port, health path, cache variable, images."""

    binary: str
    port: int
    health_path: str
    metrics_path: str
    # The environment variables that put the engine's download cache on the model volume.
    cache_env: Mapping[str, str]
    images: Mapping[RuntimeVariant, str]
    # How long the engine may take to load a model before the startup probe gives up.
    startup_seconds: int
    # Whether the pod needs a memory-backed /dev/shm (vLLM's tensor-parallel workers share it).
    shared_memory: bool = False


KUBE_ENGINES: Mapping[EngineKind, KubeEngine] = MappingProxyType(
    {
        EngineKind.VLLM: KubeEngine(
            binary="vllm",
            port=8000,
            health_path="/health",
            metrics_path="/metrics",
            cache_env=MappingProxyType({"HF_HOME": f"{MODEL_MOUNT}/huggingface"}),
            images=MappingProxyType(
                {
                    RuntimeVariant.CUDA: "docker.io/vllm/vllm-openai:v0.23.0",
                    RuntimeVariant.ROCM: (
                        "docker.io/rocm/vllm:rocm7.14.0_cdna_ubuntu24.04_py3.14_pytorch_2.11.0_vllm_0.23.0"
                    ),
                }
            ),
            # Multi-hundred-GB weights download on first start: allow an hour.
            startup_seconds=3600,
            shared_memory=True,
        ),
        EngineKind.LLAMACPP: KubeEngine(
            binary="/app/llama-server",
            port=8080,
            health_path="/health",
            metrics_path="/metrics",
            cache_env=MappingProxyType({"LLAMA_CACHE": f"{MODEL_MOUNT}/llama.cpp"}),
            # llama.cpp's own server images at the build fleetserve tests against (b11434).
            images=MappingProxyType(
                {
                    RuntimeVariant.CPU: "ghcr.io/ggml-org/llama.cpp:server-b11434",
                    RuntimeVariant.CUDA: "ghcr.io/ggml-org/llama.cpp:server-cuda-b11434",
                    RuntimeVariant.VULKAN: "ghcr.io/ggml-org/llama.cpp:server-vulkan-b11434",
                    RuntimeVariant.ROCM: "ghcr.io/ggml-org/llama.cpp:server-rocm-b11434",
                }
            ),
            startup_seconds=1800,
        ),
    }
)


def image_key(engine: EngineKind, variant: RuntimeVariant) -> str:
    """The key a Cluster's ``images`` uses for an engine variant, e.g. ``llama.cpp/vulkan``."""
    return f"{engine.value}/{variant.value}"


def image_keys() -> list[str]:
    """Every valid key of a Cluster's ``images``."""
    return [image_key(e, v) for e, caps in ENGINES.items() for v in caps.variants]


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
    return cluster.images.get(image_key(engine, variant)) or KUBE_ENGINES[engine].images[variant]


def _hf_repo(source: str) -> tuple[str, str, str | None]:
    """``hf://ORG/REPO[/PATH][@REV]`` → (repo id, path in repo, revision)."""
    rest = source.strip().partition("://")[2]
    path, _, revision = rest.partition("@")
    segments = [s for s in path.split("/") if s]
    if len(segments) < 2:
        raise SourceError(f"{source}: expected hf://ORG/REPO[/FILE][@REVISION]")
    return f"{segments[0]}/{segments[1]}", "/".join(segments[2:]), revision or None


def model_args(engine: EngineKind, model: Model) -> tuple[str, ...]:
    """How ``engine`` names ``model`` in a pod: a source it downloads itself into the model volume.

    vLLM takes a Hugging Face repository (safetensors); llama-server a GGUF file of a repository
    or an https URL. A path on this machine, or the control plane's copy, is not reachable from a
    cluster: that is a ConfigError naming the model's source.
    """
    where = f"Model {model.name}"
    text = model.source.strip()
    scheme = text.partition("://")[0].lower() if "://" in text else ""
    try:
        if scheme == "hf":
            repo, path, revision = _hf_repo(text)
            if engine is EngineKind.VLLM:
                if model.format is ModelFormat.GGUF:
                    raise SourceError(
                        f"{text}: vLLM serves safetensors repositories in Kubernetes; "
                        "serve this GGUF file with engine llama.cpp"
                    )
                return (repo, *(("--revision", revision) if revision else ()))
            if not path:
                raise SourceError(f"{text}: llama.cpp needs one GGUF file: hf://ORG/REPO/FILE.gguf")
            if revision:
                raise SourceError(
                    f"{text}: llama-server downloads from a repository's main branch only; "
                    "drop @{revision} or publish the file at an https URL"
                )
            return ("--hf-repo", repo, "--hf-file", path)
        if scheme in ("http", "https"):
            src_http = parse_source(text)
            assert isinstance(src_http, HttpSource)
            if engine is EngineKind.LLAMACPP:
                return ("--model-url", src_http.url)
            raise SourceError(f"{text}: vLLM downloads from Hugging Face repositories: use hf://ORG/REPO")
        raise SourceError(
            f"{text}: a cluster cannot read a file on this machine or the control plane's copy; "
            "publish the model to Hugging Face (hf://) or an https URL"
        )
    except SourceError as exc:
        raise ConfigError([Problem(where, "source", str(exc))]) from exc
