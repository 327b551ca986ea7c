"""The shape of one engine's row: every fact fleetserve knows about an engine, in one value.

Why the refusals (design.md, Engines): for vLLM an omitted device class would turn a typo into
a replica placed on a machine with no hardware; llama.cpp splits across local GPUs by its own
mechanism, which the adapter does not drive, so tensor parallel and multi-node are refused.

Each engine module (``engines/llamacpp.py``, ``engines/vllm.py``) builds its ``EngineSpec``; the
registry (``engines/registry.py``) lists them. Nothing outside ``engines/`` branches on an engine.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType
from typing import TYPE_CHECKING

from fleetserve.drivers import Driver, RuntimeVariant
from fleetserve.metrics.mapping import MetricMapping

if TYPE_CHECKING:
    from fleetserve.cachereport import SlotState
    from fleetserve.engines.launch import EngineAdapter
    from fleetserve.engines.routes import ApiRoute
    from fleetserve.spec.adapter import AdapterFormat
    from fleetserve.spec.nodeparts import EngineFingerprint
    from fleetserve.spec.resources import ModelFormat


class EngineKind(StrEnum):
    """An inference engine fleetserve can run."""

    VLLM = "vllm"
    LLAMACPP = "llama.cpp"


class Task(StrEnum):
    """What a deployment serves (its ``task``): generated text, embeddings, or reranking scores."""

    GENERATE = "generate"
    EMBED = "embed"
    RERANK = "rerank"


@dataclass(frozen=True)
class TaskStart:
    """How an engine starts a replica of one task: the flags it adds to the argv, and the runtime
    variants that serve the task (None: every variant of the engine). A variant left out is
    refused at apply with ``why_not``, which names what to change."""

    args: tuple[str, ...] = ()
    variants: frozenset[RuntimeVariant] | None = None
    why_not: str = ""
    # Other spellings of ``args``' flags the engine accepts: refused in engineArgs as they are.
    aliases: tuple[str, ...] = ()

    def flags(self) -> frozenset[str]:
        """The flags the task sets: a profile's engineArgs may not set them itself."""
        return frozenset(a for a in (*self.args, *self.aliases) if a.startswith("-"))

    def serves(self, variant: RuntimeVariant) -> bool:
        """Whether ``variant`` serves the task."""
        return self.variants is None or variant in self.variants


GENERATE_ONLY: Mapping[Task, TaskStart] = MappingProxyType({Task.GENERATE: TaskStart()})


@dataclass(frozen=True)
class PodFacts:
    """How an engine runs in a Kubernetes pod: the binary in its image, port, images, start-up time."""

    binary: str
    port: int
    # The image per runtime variant; a Cluster overrides them per ``ENGINE/VARIANT``.
    images: Mapping[RuntimeVariant, str]
    # How long the engine may take to load a model before the startup probe gives up.
    startup_seconds: int
    # Whether the pod needs a memory-backed /dev/shm (vLLM's tensor-parallel workers share it).
    shared_memory: bool = False


@dataclass(frozen=True)
class CapFields:
    """How an engine reads a request's completion cap and its number of choices (the gateway
    reserves a key's tokens from them, ``gateway/accounting.py``).

    Each is a tuple of groups of fields: the first group holding a value the engine reads wins;
    within a group, where the engine's own order is not pinned, the largest (never less than the
    engine generates). ``strings``: the engine reads a numeric string as a number. The Responses
    API's ``max_output_tokens`` is read on that API's route only: elsewhere engines ignore it.
    ``usage_per_sequence``: for a request of several sequences (choices, prompts) the engine's
    usage is one sequence's (a whole answer's) or one usage event per sequence (a stream's), not
    the request's; the gateway settles such a request from every event, or at its reservation.
    """

    cap: tuple[tuple[str, ...], ...]
    choices: tuple[tuple[str, ...], ...]
    strings: bool
    usage_per_sequence: bool = False


@dataclass(frozen=True)
class Probe:
    """How an agent asks an engine binary what it is (its fingerprint): the commands it runs and
    how their answers are read. Nothing is guessed: a variant is listed only where the binary's
    own answer shows it."""

    # The arguments after the binary, per query, for a binary (its path) resolved for a variant.
    queries: Callable[[RuntimeVariant, str], tuple[tuple[str, ...], ...]]
    # (the variants this binary was resolved for, each query's output or None where it failed or
    # timed out) → the fingerprint (version, variants it runs here, devices), or None: no answer.
    read: Callable[[frozenset[RuntimeVariant], tuple[str | None, ...]], EngineFingerprint | None]
    # How long one query may take (importing vLLM takes long).
    timeout: float = 10.0


@dataclass(frozen=True)
class AdapterSupport:
    """How an engine serves LoRA adapters (``kind: Adapter``): the format it loads, whether it
    loads and unloads them while it runs (``live``: through ``load_path``/``unload_path``, so adding
    one restarts nothing; otherwise they are loaded at start and part of the revision), and the
    fields the gateway sets in a request's body to choose one (``request_fields``: the adapters the
    replica loaded, in load order, and the one the request names or None for the base model)."""

    format: AdapterFormat
    live: bool
    request_fields: Callable[[tuple[str, ...], str | None], Mapping[str, object]]
    load_path: str = ""
    unload_path: str = ""


@dataclass(frozen=True)
class CacheState:
    """How the observer asks an engine what its prompt cache holds, beside its metrics and with
    the same key (``cachereport``): the path it GETs, the reader of the answer (None: unreadable)
    and the largest answer read (a bigger one is dropped, as a metrics body over its bound is)."""

    path: str
    read: Callable[[bytes], tuple[SlotState, ...] | None]
    max_bytes: int = 256 << 10


@dataclass(frozen=True)
class KvEvents:
    """How an engine publishes its KV cache events to its agent (``agent/kvevents.py``): the flags
    that make it publish on ``endpoint`` (a ZMQ endpoint of the node's loopback the agent bound,
    which the engine connects to) under ``topic``. The events socket has no authentication: it is
    never bound off loopback, and the agent relays what it learns over its own authenticated calls."""

    args: Callable[[str, str], tuple[str, ...]]
    topic: str = "kv-events"


def _none_bundled(_variant: RuntimeVariant) -> str | None:
    return None


def _tokens_bound(_engine_args: Sequence[str]) -> int | None:
    return None


@dataclass(frozen=True)
class EngineSpec:
    """One engine: what it serves and refuses, how it is launched, probed, scraped and packaged."""

    kind: EngineKind
    # Runtime variant → the driver whose devices it computes on.
    variants: Mapping[RuntimeVariant, Driver]
    # The variant a profile gets when it names a device class but no runtime.
    default_variant: Mapping[Driver, RuntimeVariant]
    # Whether a profile may omit its device class, meaning "run on the CPU".
    cpu_without_class: bool
    tensor_parallel: bool
    multi_node: bool
    # The weight formats the engine loads. A replica serves the first of its model's weights (the
    # primary, then the alternates) in one of them (``registry.weights_for``); a profile whose
    # engine loads none of its model's formats is refused at apply time.
    formats: frozenset[ModelFormat]
    # Engine flags a profile's engineArgs may carry. Anything else is refused at apply time, so
    # no flag that changes host, port, model or served name can be smuggled in.
    allowed_args: frozenset[str]
    # Requests one replica serves at once before the gateway queues the next (llama.cpp: its
    # parallel slots; vLLM batches many sequences).
    concurrency_per_replica: int
    # The executable looked up on PATH when the agent is not told where the binary is.
    binary: str
    health_path: str
    metrics_path: str
    # Environment variable → subdirectory of the model volume: where the engine's own download
    # cache goes when it fetches its model itself (in a pod).
    cache_env: Mapping[str, str]
    pod: PodFacts
    metrics: MetricMapping
    # Builds the engine's argv for an agent and for a pod.
    adapter: EngineAdapter
    # How it reads a request's completion cap and choices (the gateway's token reservation).
    cap_fields: CapFields
    # A binary that ships with fleetserve's own install for a variant, if any.
    bundled_binary: Callable[[RuntimeVariant], str | None] = _none_bundled
    why_no_cpu: str = ""
    why_no_split: str = ""
    # Whether the engine loads a model from a directory (a whole repository: weights, config,
    # tokenizer), not only from one file.
    serves_directory: bool = False
    # The variants whose binary may be the ``binary`` found on PATH (None: every variant).
    path_lookup: frozenset[RuntimeVariant] | None = None
    # What to install when a variant's binary is missing, where there is more to say than PATH.
    install_hint: Mapping[RuntimeVariant, str] = field(default_factory=dict)
    # The engineArgs flag that sets the context it starts with over the profile's ``context``
    # (None: the profile's ``context`` is the only word, as llama.cpp's --ctx-size is fleetserve's).
    context_arg: str | None = None
    # How many prompts its cache holds at once under a profile's engineArgs, where that and not
    # its KV's tokens bounds it (llama.cpp without its host-memory prompt cache: one a slot);
    # None: its KV's tokens alone (the gateway's cache model, ``gateway.prefixcache``).
    held_prompts: Callable[[Sequence[str]], int | None] = _tokens_bound
    # Every HTTP route its server registers, by (method, path): what it is, how the gateway relays
    # it or why it refuses it (``engines/routes.py``).
    routes: Mapping[tuple[str, str], ApiRoute] = field(default_factory=dict)
    # How an agent fingerprints a binary of this engine (None: it is never probed).
    probe: Probe | None = None
    # How it starts each task a deployment may declare (``Deployment.task``); a task missing here,
    # or a variant its row leaves out, is refused at apply time.
    tasks: Mapping[Task, TaskStart] = field(default_factory=lambda: GENERATE_ONLY)
    # How it serves LoRA adapters (None: it serves none, and a deployment listing one is refused).
    adapters: AdapterSupport | None = None
    # How the observer reads its cache's state from the engine (None: it cannot: llama.cpp's slots).
    cache_state: CacheState | None = None
    # How it publishes KV cache events to its agent (None: it publishes none: vLLM's).
    kv_events: KvEvents | None = None

    def drivers(self) -> frozenset[Driver]:
        """Every driver this engine has a variant for."""
        return frozenset(self.variants.values())
