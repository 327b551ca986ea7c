"""The server↔agent protocol, defined once: every body that crosses between the control plane and
a node agent, imported by the server's agent routes (``server/agents/routes.py``), the agent's client
(``agent/client.py``) and its runtime (``agent/runtime.py``); the store keeps the statuses typed.

    agent → server   NodeReport (register), HeartbeatRequest, StatusReport (ReplicaReport, Download,
                     GpuSample)
    server → agent   Registered, AssignmentSet (Assignment), HeartbeatReply, StatusReply

Every input is bounded (lengths, counts, ranges: the ``MAX_*`` caps below, named in every 422) and
free text may not hold NUL; the server also bounds each route's body (``server/agents/limits.py``). Field
names on the wire are camelCase where they were (``stderrTail``, ``modelCache``, ``gpuMetrics``).
An answer never tells a node's epoch to anyone but the agent that just registered.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from fleetserve.drivers import Driver, RuntimeVariant
from fleetserve.engines.spec import Task
from fleetserve.inventory.approval import HardwareHeld
from fleetserve.spec.base import NAME_PATTERN
from fleetserve.spec.nodeparts import Device, Hca
from fleetserve.spec.resources import Model, Node, Profile, Replica, ReplicaState

# Free text from an agent may hold newlines (stderr), never NUL.
TEXT_PATTERN = r"^[^\x00]*$"

# The caps on what one agent may say about its node and in one report.
MAX_LABELS = 64
MAX_DEVICES = 256
MAX_HCAS = 64
MAX_CACHED_MODELS = 10_000
MAX_GPU_SAMPLES = 4096  # MAX_DEVICES × the canonical GPU metrics, with room
MAX_REPLICA_REPORTS = 1000

NodeName = Annotated[str, Field(min_length=1, max_length=63, pattern=NAME_PATTERN)]
ReplicaName = Annotated[str, Field(max_length=63, pattern=NAME_PATTERN)]
Epoch = Annotated[int, Field(ge=1, le=2**31 - 1)]


class NodeReport(Node):
    """A node as its agent describes it (register): a ``Node`` with every list capped.

    Its ``engines`` (the builds the agent found) are capped in their own types
    (``spec/nodeparts.py``: MAX_ENGINES, MAX_ENGINE_DEVICES, lengths, no NUL)."""

    labels: dict[
        Annotated[str, Field(min_length=1, max_length=317, pattern=TEXT_PATTERN)],
        Annotated[str, Field(max_length=253, pattern=TEXT_PATTERN)],
    ] = Field(default_factory=dict, max_length=MAX_LABELS)
    devices: tuple[Device, ...] = Field(default=(), max_length=MAX_DEVICES)
    hcas: tuple[Hca, ...] = Field(default=(), max_length=MAX_HCAS)
    nvlink_domains: tuple[tuple[int, ...], ...] = Field(default=(), max_length=MAX_DEVICES)
    model_cache: tuple[str, ...] = Field(default=(), max_length=MAX_CACHED_MODELS)

    def node(self) -> Node:
        """The plain ``Node`` the store keeps."""
        return Node.model_validate(self.model_dump(mode="json", by_alias=True))


class HeartbeatRequest(BaseModel):
    """An agent saying its node is alive, for the registration (epoch) it speaks for."""

    model_config = ConfigDict(extra="forbid")
    node: NodeName
    epoch: Epoch


class HeartbeatReply(BaseModel):
    """The heartbeat was recorded (the node's epoch is never in an answer)."""

    node: str
    ok: bool = True


MAX_COUNT = 2**63 - 1


class KvCacheSummary(BaseModel):
    """What a replica's engine said of its KV cache through its KV events (vLLM's
    ``--kv-events-config``, consumed by the agent on the node's loopback, ``agent/kvevents.py``):
    the blocks it holds now and their size in tokens, how many it stored and removed in all, how
    often it dropped its whole cache (``clears``: AllBlocksCleared; a change moves the store's
    change counter, so every gateway's model of the replica is cleared within a route refresh),
    and how many event batches the agent missed or dropped over its bounds (``gaps``: the counts
    are then approximate)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    blocks: int = Field(ge=0, le=2**31 - 1)
    block_tokens: int = Field(ge=1, le=1 << 16, alias="blockTokens")
    stored: int = Field(default=0, ge=0, le=MAX_COUNT)
    removed: int = Field(default=0, ge=0, le=MAX_COUNT)
    clears: int = Field(default=0, ge=0, le=2**31 - 1)
    gaps: int = Field(default=0, ge=0, le=2**31 - 1)


class ReplicaStatus(BaseModel):
    """What the agent last reported about one replica beyond its state; the store keeps it."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    message: str = Field(default="", max_length=4000, pattern=TEXT_PATTERN)
    restarts: int = Field(default=0, ge=0, le=2**31 - 1)
    stderr_tail: list[Annotated[str, Field(max_length=2000, pattern=TEXT_PATTERN)]] = Field(
        default_factory=list, max_length=100, alias="stderrTail"
    )
    port: int | None = Field(default=None, ge=1, le=65535)
    # Requests the engine is processing or holding (its own metrics), when the agent could read them.
    in_flight: int | None = Field(default=None, ge=0, le=2**31 - 1, alias="inFlight")
    # How old that count was when the report was sent, in seconds.
    in_flight_age: float | None = Field(default=None, ge=0, le=1e6, alias="inFlightAge")
    # The LoRA adapters its engine has loaded, in load order (llama.cpp's adapter ids); None for a
    # replica that serves none. The gateway routes an adapter's requests to the replicas listing it.
    adapters: list[ReplicaName] | None = Field(default=None, max_length=64)
    # What its engine's KV events said (an engine that publishes them: vLLM); None: no events.
    kv_cache: KvCacheSummary | None = Field(default=None, alias="kvCache")

    def stored(self) -> dict[str, object]:
        """The JSON the store keeps: the fields the agent sent (an unreported status is ``{}``)."""
        return self.model_dump(mode="json", by_alias=True, exclude_unset=True)


class ReplicaReport(ReplicaStatus):
    """What the agent knows about one replica it runs: its state and its status."""

    state: ReplicaState

    def status(self) -> ReplicaStatus:
        """The report without its state, every field set: what the store keeps of it."""
        return ReplicaStatus(
            message=self.message,
            restarts=self.restarts,
            stderrTail=self.stderr_tail,
            port=self.port,
            inFlight=self.in_flight,
            inFlightAge=self.in_flight_age,
            adapters=self.adapters,
            kvCache=self.kv_cache,
        )


class Download(BaseModel):
    """A model in the node's cache: ready, downloading (bytes done of total, rate) or failed (why)."""

    model_config = ConfigDict(extra="forbid")
    model: str = Field(max_length=63, pattern=NAME_PATTERN)
    state: str = Field(max_length=32, pattern=TEXT_PATTERN)
    done: int = Field(ge=0)
    total: int | None = Field(default=None, ge=0)
    rate: float = Field(default=0.0, ge=0)
    # What is fetched, and why the last attempt failed (a failed download), for the node's status.
    source: str = Field(default="", max_length=2000, pattern=TEXT_PATTERN)
    error: str | None = Field(default=None, max_length=4000, pattern=TEXT_PATTERN)


class GpuSample(BaseModel):
    """One canonical GPU sample (``fleetserve_gpu_*``) with its node/device/driver/class labels."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(max_length=64, pattern=r"^fleetserve_gpu_[a-z_]+$")
    labels: dict[
        Annotated[str, Field(max_length=16, pattern=r"^(node|device|driver|class)$")],
        Annotated[str, Field(max_length=253, pattern=TEXT_PATTERN)],
    ] = Field(max_length=4)
    value: float = Field(allow_inf_nan=False)


class StatusReport(BaseModel):
    """An agent's periodic report: replica states, cache contents, downloads."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    node: NodeName
    epoch: Epoch
    replicas: dict[ReplicaName, ReplicaReport] = Field(default_factory=dict, max_length=MAX_REPLICA_REPORTS)
    model_cache: list[ReplicaName] | None = Field(
        default=None, alias="modelCache", max_length=MAX_CACHED_MODELS
    )
    downloads: list[Download] = Field(default_factory=list, max_length=1000)
    problems: list[Annotated[str, Field(max_length=2000, pattern=TEXT_PATTERN)]] = Field(
        default_factory=list, max_length=100
    )
    # Canonical GPU samples the agent read itself (NVML, sysfs) where no exporter runs.
    gpu_metrics: list[GpuSample] = Field(default_factory=list, max_length=MAX_GPU_SAMPLES, alias="gpuMetrics")


class AgentStatus(BaseModel):
    """What a node's agent last reported beyond replica states; the store keeps it per node."""

    model_config = ConfigDict(populate_by_name=True)
    downloads: list[Download] = Field(default_factory=list)
    problems: list[str] = Field(default_factory=list)
    gpu_metrics: list[GpuSample] = Field(default_factory=list, alias="gpuMetrics")
    reported_at: str = Field(default="", alias="reportedAt")

    def stored(self) -> dict[str, object]:
        """The JSON the store keeps and the API shows (a node never reported is ``{}``)."""
        return self.model_dump(mode="json", by_alias=True, exclude_unset=True)


class StatusReply(BaseModel):
    """The replicas the agent reported that are not its node's: it must stop them."""

    stop: list[str]


class Assignment(BaseModel):
    """What an agent needs to run one replica: the replica, its profile with the runtime variant
    and driver worked out, the weights its engine serves (the model document reduced to the copy
    ``engines.registry.weights_for`` chose), the addresses of the replica's nodes, and the API
    key its engine must demand."""

    replica: Replica
    profile: Profile
    runtime: RuntimeVariant
    driver: Driver
    model: Model
    context: int | None = None
    # Addresses of the replica's nodes, shard order ("" for a node not known any more).
    peers: list[str] = Field(default_factory=list)
    # The engine's API key: the engine refuses requests without it (None: placed before keys).
    engine_key: str | None = Field(default=None, max_length=64, repr=False)
    # What the deployment serves, which the engine is started for (``EngineSpec.tasks``); omitted
    # when generate, so an assignment without it reads (and revisions) as before tasks existed.
    task: Task = Field(default=Task.GENERATE, exclude_if=lambda v: v is Task.GENERATE)
    # A speculative profile's draft model, reduced to the weights its engine serves like ``model``
    # (fetched into the node's cache the same way); omitted when none.
    draft: Model | None = Field(default=None, exclude_if=lambda v: v is None)
    # The deployment's LoRA adapters, each as the model cache fetches it (``Adapter.as_model``), in
    # the deployment's order; omitted when none.
    adapters: list[Model] = Field(default_factory=list, exclude_if=lambda v: not v)


class AssignmentSet(BaseModel):
    """The replicas a node must run, with the revision the server computed for the set."""

    epoch: int
    revision: str
    assignments: list[Assignment] = Field(default_factory=list)
    # Replicas still the node's that it must keep running if it runs them, but never start: those
    # of a deleted deployment, draining until the reconciler releases them.
    keep: list[str] = Field(default_factory=list)


class Registered(AssignmentSet):
    """A registration's answer: the node as stored, whether it is new, its assignments, on
    enrolment (join token) the node's credential, shown this once, and the hardware claim held
    for an operator's approval (the node is placed with the approved facts meanwhile)."""

    node: Node
    created: bool
    credential: str | None = None
    held: HardwareHeld | None = None
