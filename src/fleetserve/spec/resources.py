"""Resource documents: device classes, fabrics, nodes, models, deployments and replicas.

Every document is immutable once parsed. Field names are camelCase in YAML and JSON
(``devicesPerNode``) and snake_case in Python (``spec.base``). A node's parts live in
``spec.nodeparts``, a deployment's policies in ``spec.policies``, the Kubernetes ``Cluster`` in
``spec.cluster``. Cross-document rules (a profile's class exists, its runtime matches the
class's driver) live in ``fleetserve.validation``.
"""

from __future__ import annotations

import hashlib
import json
import re
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, field_validator, model_validator

from fleetserve.drivers import RuntimeVariant
from fleetserve.engines.spec import EngineKind, Task
from fleetserve.spec.base import MAX_BYTES, MAX_CORES, MAX_REPLICAS, Bytes, Name, Spec
from fleetserve.spec.nodeparts import (
    MAX_ENGINES,
    Cordon,
    CpuCapacity,
    Device,
    DeviceGroup,
    EngineFingerprint,
    Hca,
)
from fleetserve.spec.policies import (
    AdmissionPolicy,
    AutoscalePolicy,
    ReplicaRange,
    RolloutPolicy,
    RoutingPolicy,
)

# How long a stopping replica waits for its in-flight requests unless its deployment says otherwise.
DEFAULT_DRAIN_SECONDS = 30.0


# --- hardware -------------------------------------------------------------------------------


class DeviceMatch(Spec):
    """How discovery recognises a device of a class: a product-name regex and/or PCI IDs."""

    product_name: str | None = None
    pci_vendor_id: str | None = None
    pci_device_ids: tuple[str, ...] = ()
    gfx_target: str | None = None


class DeviceClass(Spec):
    """A named kind of device with exactly one driver and a memory size per device."""

    kind: Literal["DeviceClass"] = "DeviceClass"
    name: Name
    # A plain string, not the Driver enum: a mistyped driver must load and be gated with
    # UnsupportedDevices rather than tear down what already runs (design.md, gating).
    driver: str
    memory: Bytes
    match: DeviceMatch = DeviceMatch()


class FabricType(StrEnum):
    """The kind of high-speed network a fabric is."""

    INFINIBAND = "infiniband"
    ROCE = "roce"


class Fabric(Spec):
    """A high-speed network (InfiniBand or RoCE) that nodes attach to through HCAs."""

    kind: Literal["Fabric"] = "Fabric"
    name: Name
    type: FabricType = FabricType.INFINIBAND


class NodeState(StrEnum):
    """Whether the node's agent is heard from."""

    READY = "Ready"
    NOT_READY = "NotReady"
    LOST = "Lost"


class Node(Spec):
    """A machine: labels, devices, CPU capacity, fabric attachments, NVLink domains, state."""

    kind: Literal["Node"] = "Node"
    name: Name
    labels: dict[str, str] = Field(default_factory=dict)
    state: NodeState = NodeState.READY
    cordon: Cordon | None = None
    cpu: CpuCapacity
    devices: tuple[Device, ...] = ()
    hcas: tuple[Hca, ...] = ()
    # Groups of device indices joined by NVLink; a tensor-parallel group prefers one domain.
    nvlink_domains: tuple[tuple[int, ...], ...] = ()
    # Names of models already held in the node's local model cache.
    model_cache: tuple[str, ...] = ()
    # Where peers and the gateway reach this node's engines (an IP or DNS name); the agent sets it.
    address: str = Field(default="", max_length=253, pattern=r"^[A-Za-z0-9.:\-\[\]]*$")
    # The engine builds the node's agent found, each with the variants it runs here. None: never
    # reported (a YAML fleet, a Kubernetes node): placement does not filter on engines. A tuple,
    # even empty: the node runs exactly the variants listed.
    engines: tuple[EngineFingerprint, ...] | None = Field(default=None, max_length=MAX_ENGINES)

    def runs(self, engine: EngineKind, variant: RuntimeVariant) -> bool:
        """Whether the node can run ``engine``'s ``variant``: unknown engines (None) say yes."""
        if self.engines is None:
            return True
        return any(f.engine is engine and variant in f.variants for f in self.engines)

    @model_validator(mode="before")
    @classmethod
    def _expand_gpus(cls, data: Any) -> Any:
        """Expand ``gpus: [{class, count}]`` into explicit devices numbered after ``devices``."""
        if not isinstance(data, dict) or "gpus" not in data:
            return data
        data = dict(data)
        groups = data.pop("gpus")
        if not isinstance(groups, list):
            raise ValueError("gpus must be a list of {class: NAME, count: N}")
        devices = list(data.get("devices") or [])
        next_index = 1 + max((int(d.get("index", -1)) for d in devices if isinstance(d, dict)), default=-1)
        name = data.get("name", "node")
        for raw in groups:
            group = DeviceGroup.model_validate(raw)
            for _ in range(group.count):
                devices.append(
                    {"index": next_index, "uuid": f"{name}-gpu-{next_index}", "class": group.device_class}
                )
                next_index += 1
        data["devices"] = devices
        return data

    @model_validator(mode="after")
    def _check_devices(self) -> Node:
        indices = [d.index for d in self.devices]
        dupes = sorted({i for i in indices if indices.count(i) > 1})
        if dupes:
            raise ValueError(f"device indices must be unique on a node; repeated: {dupes}")
        known = set(indices)
        seen: set[int] = set()
        for domain in self.nvlink_domains:
            unknown = sorted(set(domain) - known)
            if unknown:
                raise ValueError(f"nvlinkDomains names device indices the node does not have: {unknown}")
            if seen & set(domain):
                raise ValueError("nvlinkDomains must not overlap: a device sits in one NVLink domain")
            seen |= set(domain)
        return self


# --- workloads ------------------------------------------------------------------------------


class Architecture(Spec):
    """What the KV-cache estimate needs when the weights are not a readable GGUF file."""

    layers: int = Field(ge=1, le=100_000)
    kv_heads: int = Field(ge=1, le=100_000)
    head_dim: int = Field(ge=1, le=100_000)
    context_length: int = Field(default=4096, ge=1, le=100_000_000)
    kv_dtype_bytes: int = Field(default=2, ge=1, le=8)


class ModelFormat(StrEnum):
    """The on-disk format of a model's weights."""

    GGUF = "gguf"
    SAFETENSORS = "safetensors"


def _check_sha256(v: str | None) -> str | None:
    if v is not None and not re.fullmatch(r"[0-9a-f]{64}", v):
        raise ValueError("sha256 must be 64 lower-case hex digits")
    return v


Sha256 = Annotated[str | None, AfterValidator(_check_sha256)]
# Alternate weights a model may carry beside its primary ones (one per other format).
MAX_ALTERNATES = 4
# The fields of a Model, and of each of its alternates, that say which bytes a replica loads: a
# change of one is a new revision of every deployment serving the model (a rollout). ``size`` and
# ``architecture`` are declared facts about those bytes (placement's estimate), not other bytes.
# A source's revision (``hf://REPO/FILE@REV``) is part of ``source``.
WEIGHT_FIELDS: tuple[str, ...] = ("source", "format", "sha256", "alternates")
ALTERNATE_WEIGHT_FIELDS: tuple[str, ...] = ("source", "format", "sha256")


class Weights(Spec):
    """The same model's weights in another format (a Model's ``alternates``): where they are, their
    size, checksum and shape, with the same rules as the model's own fields."""

    format: ModelFormat
    source: str = Field(min_length=1)
    size: Bytes | None = None
    sha256: Sha256 = None
    architecture: Architecture | None = None


class Model(Spec):
    """What a client names in ``"model"``: its source, format, size, checksum and shape, and the
    same model's weights in other formats (``alternates``) for engines that load none of these.

    Which weights a replica serves is the engine table's choice (``engines.registry.weights_for``):
    the first of the primary and the alternates, in order, whose format the engine loads.
    """

    kind: Literal["Model"] = "Model"
    name: Name
    source: str = ""
    format: ModelFormat = ModelFormat.GGUF
    # Weight bytes; optional when ``source`` is a local GGUF file whose header can be read.
    size: Bytes | None = None
    sha256: Sha256 = None
    architecture: Architecture | None = None
    # Omitted when empty: a model without alternates serialises exactly as before they existed
    # (stored rows stay "unchanged" when applied again; agents that predate them read assignments).
    alternates: tuple[Weights, ...] = Field(default=(), max_length=MAX_ALTERNATES, exclude_if=lambda v: not v)

    @model_validator(mode="after")
    def _distinct_formats(self) -> Model:
        seen = {self.format}
        for i, alt in enumerate(self.alternates):
            if alt.format in seen:
                raise ValueError(
                    f"alternates[{i}].format: the model already has {alt.format.value} weights; "
                    "each alternate is another format than the primary and the other alternates"
                )
            seen.add(alt.format)
        if self.alternates:
            most = 63 - 1 - max(len(a.format.value) for a in self.alternates)
            if len(self.name) > most:
                raise ValueError(
                    f"name: a model with alternates has a name of at most {most} characters, since "
                    f"its alternate weights are cached and placed as NAME.FORMAT"
                )
        return self

    def weights_digest(self) -> str:
        """A short digest of the weights the model names (``WEIGHT_FIELDS``): part of the revision
        of every deployment serving it, so that new weights roll its replicas and nothing else does."""
        spec = {f: getattr(self, f) for f in WEIGHT_FIELDS if f != "alternates"}
        spec["alternates"] = [{f: getattr(a, f) for f in ALTERNATE_WEIGHT_FIELDS} for a in self.alternates]
        return hashlib.sha256(json.dumps(spec, sort_keys=True, default=str).encode()).hexdigest()[:8]

    def weights_name(self, fmt: ModelFormat) -> str:
        """The name the weights of format ``fmt`` are cached and placed under: the model's own for
        its primary weights, ``NAME.FORMAT`` for an alternate (two formats never share a cache entry)."""
        return self.name if fmt is self.format else f"{self.name}.{fmt.value}"

    def weights(self) -> tuple[Model, ...]:
        """Each copy of the weights as a Model of its own without alternates, primary first: what
        a replica is given to fetch, measure and serve (``engines.registry.weights_for`` picks one)."""
        primary = self.model_copy(update={"alternates": ()})
        alternates = (
            Model(
                name=self.weights_name(alt.format),
                source=alt.source,
                format=alt.format,
                size=alt.size,
                sha256=alt.sha256,
                architecture=alt.architecture,
            )
            for alt in self.alternates
        )
        return (primary, *alternates)

    @staticmethod
    def weights_field(index: int, field: str) -> str:
        """The document field of ``weights()[index]``'s ``field``: ``size``, ``alternates[0].size``."""
        return field if index == 0 else f"alternates[{index - 1}].{field}"


class CpuRequest(Spec):
    """CPU cores and host memory one replica claims on each of its nodes."""

    cores: int = Field(ge=1, le=MAX_CORES)
    memory: Bytes | None = None


class SpeculativeMethod(StrEnum):
    """Where a speculative replica's guessed tokens come from."""

    DRAFT = "draft"  # a smaller model sharing the served model's vocabulary
    NGRAM = "ngram"  # n-grams looked up in the prompt and what was generated, no second model


# Most tokens a draft may guess ahead in one step (both engines verify them in one batch).
MAX_SPECULATIVE_TOKENS = 32


class Speculative(Spec):
    """A profile's speculative decoding: ``{draft: MODEL, tokens: N}`` or ``{method: ngram, tokens: N}``.

    The draft is a Model document by name: fetched into the node's cache like the served model,
    and its weights and KV cache placed with the replica (``placement.demand``). Each engine's
    adapter starts it (``speculative_args`` in ``engines/llamacpp.py`` and ``engines/vllm.py``).
    """

    method: SpeculativeMethod = SpeculativeMethod.DRAFT
    draft: Name | None = None
    tokens: int = Field(default=3, ge=1, le=MAX_SPECULATIVE_TOKENS)

    @model_validator(mode="after")
    def _draft_matches_method(self) -> Speculative:
        if self.method is SpeculativeMethod.DRAFT and self.draft is None:
            raise ValueError(
                "speculative.draft: name the draft Model (a smaller model with the same vocabulary), "
                "or write method: ngram for n-gram lookup without a draft"
            )
        if self.method is SpeculativeMethod.NGRAM and self.draft is not None:
            raise ValueError(
                "speculative.draft: method ngram looks tokens up in the text and takes no draft model; "
                "drop draft or drop method: ngram"
            )
        return self


class Profile(Spec):
    """One way to serve a model: engine, runtime variant, device class, shape, priority."""

    name: Name
    engine: EngineKind
    runtime: RuntimeVariant | None = None
    # Omitted means the CPU; only engines that can serve without a card may omit it.
    device_class: str | None = None
    devices_per_node: int = Field(default=1, ge=1, le=64)
    nodes: int = Field(default=1, ge=1, le=256)
    priority: int = Field(default=0, ge=-1_000_000, le=1_000_000)
    engine_args: tuple[str, ...] = ()
    cpu: CpuRequest | None = None
    context: int | None = Field(default=None, ge=1, le=100_000_000)
    # Omitted when unset, so a profile without it serialises (and its revision digests) as before.
    speculative: Speculative | None = Field(default=None, exclude_if=lambda v: v is None)


class Deployment(Spec):
    """A model, its ordered profiles, replica count, routing and admission policy."""

    kind: Literal["Deployment"] = "Deployment"
    name: Name
    model: Name
    replicas: int | ReplicaRange = 1
    profiles: tuple[Profile, ...] = Field(min_length=1)
    routing: RoutingPolicy = RoutingPolicy()
    admission: AdmissionPolicy = AdmissionPolicy()
    # Only with ``replicas: {min, max}``; a range without it follows the default policy.
    autoscale: AutoscalePolicy | None = None
    rollout: RolloutPolicy = RolloutPolicy()
    # The longest a stopping replica waits for its in-flight requests before its engine stops.
    drain_seconds: float = Field(default=DEFAULT_DRAIN_SECONDS, ge=0, le=86_400)
    # Endpoints (``kind: Endpoint``, servers fleetserve did not start) routed beside its replicas;
    # omitted when empty, so a deployment without them serialises as before they existed.
    endpoints: tuple[Name, ...] = Field(default=(), max_length=64, exclude_if=lambda v: not v)
    # What it serves: generated text, embeddings (/v1/embeddings) or reranking (/v1/rerank); each
    # engine row says how it starts each (``EngineSpec.tasks``). Omitted when generate, so a
    # deployment that says nothing serialises (and revisions) as before tasks existed.
    task: Task = Field(default=Task.GENERATE, exclude_if=lambda v: v is Task.GENERATE)
    # LoRA adapters (``kind: Adapter``, each on this deployment's model) its replicas load; a
    # client names one as its model. Omitted when empty, so a deployment without them serialises
    # as before they existed. Where an engine loads adapters only at start, they are part of the
    # revision (``template_revision``): a change rolls those replicas; vLLM loads them at run time.
    adapters: tuple[Name, ...] = Field(default=(), max_length=32, exclude_if=lambda v: not v)

    @field_validator("adapters")
    @classmethod
    def _distinct_adapters(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        dupes = sorted({n for n in v if v.count(n) > 1})
        if dupes:
            raise ValueError(f"adapters are listed once each; repeated: {dupes}")
        return v

    @field_validator("replicas")
    @classmethod
    def _non_negative(cls, v: int | ReplicaRange) -> int | ReplicaRange:
        if isinstance(v, int) and not 0 <= v <= MAX_REPLICAS:
            raise ValueError(f"replicas must be between 0 and {MAX_REPLICAS}")
        return v

    @model_validator(mode="after")
    def _unique_profiles(self) -> Deployment:
        names = [p.name for p in self.profiles]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"profile names must be unique within a deployment; repeated: {dupes}")
        return self

    @model_validator(mode="after")
    def _autoscale_needs_range(self) -> Deployment:
        if self.autoscale is not None and isinstance(self.replicas, int):
            raise ValueError("autoscale needs replicas: {min, max}; a fixed replica count is never scaled")
        return self

    @property
    def desired_replicas(self) -> int:
        """Replicas to place now: the fixed count, or the autoscaler's minimum."""
        return self.replicas if isinstance(self.replicas, int) else self.replicas.min

    def template_revision(self, weights: str = "") -> str:
        """What a replica runs, as ``TEMPLATE.WEIGHTS``: a digest of the deployment's model name
        and profiles, then the model's ``weights_digest`` (omitted when unknown). It changes
        exactly when a change must replace the replicas (a rollout), not with the replica count or
        policy; ``revision_parts`` splits it. A revision without the weights part is also what
        replicas placed before the weights counted carry (``reconcile.lifecycle`` stamps them).
        The task counts where it is not generate: another task starts the engine otherwise."""
        spec = self.model_dump(mode="json", by_alias=True, include={"model", "profiles", "task"})
        # Adapters an engine loads only at start are part of what its replicas run; one that loads
        # them at run time starts with them enabled (vLLM's --enable-lora) once there is one.
        if self.adapters:
            live = [_loads_adapters_live(p.engine) for p in self.profiles]
            spec["adapters"] = True if all(live) else list(self.adapters)
        template = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:10]
        return f"{template}.{weights}" if weights else template

    def profiles_by_priority(self) -> tuple[Profile, ...]:
        """Profiles in the order placement tries them: higher priority first, then as written."""
        order = sorted(enumerate(self.profiles), key=lambda ip: (-ip[1].priority, ip[0]))
        return tuple(p for _, p in order)


def _loads_adapters_live(engine: EngineKind) -> bool:
    """Whether ``engine`` loads and unloads adapters while it runs (its row's ``adapters``)."""
    from fleetserve.engines.registry import ENGINES  # the engine rows import these documents

    support = ENGINES[engine].adapters
    return support is not None and support.live


def revision_parts(revision: str) -> tuple[str, str]:
    """A revision's (template, weights) digests; weights is "" for a revision without it."""
    template, _, weights = revision.partition(".")
    return template, weights


class Shard(Spec):
    """The part of a replica on one node: its devices (or CPU claim) and fabric HCAs."""

    node: Name
    devices: tuple[Annotated[int, Field(ge=0, le=4095)], ...] = ()
    hcas: tuple[str, ...] = ()
    cpu_cores: int = Field(default=0, ge=0, le=MAX_CORES)
    memory: int = Field(default=0, ge=0, le=MAX_BYTES)


class ReplicaState(StrEnum):
    """Where a replica is in its life."""

    PENDING = "Pending"
    STARTING = "Starting"
    RUNNING = "Running"
    CRASH_LOOP = "CrashLoop"  # the engine keeps exiting; restarts back off
    FAILED = "Failed"
    # Set by the control plane, never by an agent: out of every route, finishing its in-flight
    # requests; released (and its engine stopped) when they are done or drainSeconds passed.
    DRAINING = "Draining"


class Replica(Spec):
    """One running copy of a deployment placed under one profile, whole across its shards."""

    kind: Literal["Replica"] = "Replica"
    name: Name
    deployment: Name
    profile: Name
    device_class: str | None = None
    shards: tuple[Shard, ...] = Field(min_length=1)
    state: ReplicaState = ReplicaState.RUNNING
    fabric: str | None = None
    # The deployment's template revision the replica was placed for (None: placed before rollouts).
    revision: str | None = None
