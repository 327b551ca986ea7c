"""What the control plane keeps about a deployment beyond its spec, typed: its status (conditions,
replica failures, rollout progress, the autoscaler's log) and the placement decisions recorded for
it. The reconciler builds them, the store keeps them as JSON and hands them back, and the admin API
serves them (``adminapi``):

    DeploymentStatus     conditions (StatusCondition), failures (FailureStatus), rollout
                         (RolloutStatus), autoscaler (AutoscalerEntry), replicas, counts
    DecisionRecord       conditions, placed (PlacedReplica), unplaced (UnplacedReplica), both
                         explained by ProfileAttempt (ReasonTally)

The JSON is what the store held before these types existed: camelCase names, only the fields that
were set (``stored()``), unknown fields kept, so no row needs a migration and an old row reads
back unchanged. Each value also reads as that JSON (``status["replicas"]``), as the store's plain
mappings did.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from fleetserve.spec.resources import Shard


class StoredJson(BaseModel):
    """Base of every stored value: camelCase on the wire, unknown fields kept, read as its JSON."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="allow")

    def stored(self) -> dict[str, Any]:
        """The JSON the store keeps and the API shows: the fields that were set."""
        return self.model_dump(mode="json", by_alias=True, exclude_unset=True)

    # The read-only mapping view of ``stored()``: what readers of the untyped store saw.
    def keys(self) -> Iterator[str]:
        return iter(self.stored())

    def __getitem__(self, key: str) -> Any:
        return self.stored()[key]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Mapping):
            return self.stored() == dict(other)
        return super().__eq__(other)

    __hash__ = None  # type: ignore[assignment]


class StatusCondition(StoredJson):
    """One condition as stored: its type, whether it holds, a machine-readable reason, a message."""

    type: str = Field(description="A ConditionType: Accepted, ModelKnown, Scheduled, ...")
    status: bool
    reason: str = Field(default="", description="A ConditionReason: Placed, Unschedulable, ...")
    message: str = ""


class FailureStatus(StoredJson):
    """A deployment's replica failures since it last ran whole (empty: none seen)."""

    count: int = 0
    last_error: str = ""
    last_replica: str = ""
    seen: list[str] = Field(default_factory=list)
    retry_at: str | None = Field(default=None, description="When failed replicas are replaced (ISO 8601).")


class RolloutStatus(StoredJson):
    """Where the replicas stand against the current template revision (empty: not reconciled)."""

    revision: str = ""
    desired: int = 0
    updated: int = 0
    ready: int = 0
    old: int = 0
    draining: int = 0
    complete: bool = False
    # What changed while replicas of another revision live: "deployment", "model" (the weights its
    # Model names), "deployment and model"; "" when none (``reconcile.lifecycle.RolloutCause``).
    cause: str = ""


class AutoscalerEntry(StoredJson):
    """One decision of the autoscaler's log (``autoscale.Decision.as_dict``), repeats folded in."""

    # The log's names are its own (``last_at``): no camelCase here.
    model_config = ConfigDict(alias_generator=None, extra="allow")
    deployment: str = ""
    at: float = 0.0
    previous: int = 0
    desired: int = 0
    changed: bool = False
    reason: str = ""
    load: float = 0.0
    wanted: int = 0
    ready: int = 0
    reported: int = 0
    bounds: list[int] = Field(default_factory=list)
    timer: str | None = None
    waited: float | None = None
    detail: str = ""
    repeats: int = 1
    last_at: float | None = None


class DeploymentStatus(StoredJson):
    """What the reconciler last saw and decided for a deployment (empty: never reconciled)."""

    failures: FailureStatus = Field(default_factory=FailureStatus)
    rollout: RolloutStatus = Field(default_factory=RolloutStatus)
    previous_revision: str | None = None
    autoscaler: list[AutoscalerEntry] = Field(default_factory=list)
    observed_generation: int | None = None
    conditions: list[StatusCondition] = Field(default_factory=list)
    desired_replicas: int = 0
    replicas: list[str] = Field(default_factory=list)
    unschedulable: int = 0

    def condition(self, kind: str) -> StatusCondition | None:
        """The condition of that type, if the status has one."""
        return next((c for c in self.conditions if c.type == kind), None)


class ReasonTally(StoredJson):
    """How many nodes one reason ruled out (``have``: what the node had, where it says)."""

    reason: str
    count: int
    have: int | None = None
    exhausted: bool = False


class ProfileAttempt(StoredJson):
    """One profile's attempt for one replica (``placement.report.ProfileReport.to_dict``)."""

    profile: str = ""
    device_class: str | None = None
    devices_needed: int = 0
    nodes_needed: int = 0
    nodes_evaluated: int = 0
    nodes_fit: int = 0
    reasons: list[ReasonTally] = Field(default_factory=list)
    fabric_fit: dict[str, int] = Field(default_factory=dict)
    message: str = ""


class PlacedReplica(StoredJson):
    """A replica placed by the decision: where, its scores, and the profiles tried before."""

    replica: str
    profile: str
    device_class: str | None = None
    fabric: str | None = None
    shards: list[Shard] = Field(default_factory=list)
    scores: dict[str, float] = Field(default_factory=dict)
    skipped: list[ProfileAttempt] = Field(default_factory=list)


class UnplacedReplica(StoredJson):
    """A replica that fit nowhere, with every profile's explanation."""

    replica: str
    reports: list[ProfileAttempt] = Field(default_factory=list)


class DecisionRecord(StoredJson):
    """A recorded placement decision (``DeploymentDecision.to_record``): what was kept, placed,
    left unplaced (the first ones explained, ``unplacedTotal`` counting all), lost and surplus."""

    deployment: str = ""
    desired: int = 0
    conditions: list[StatusCondition] = Field(default_factory=list)
    kept: list[str] = Field(default_factory=list)
    lost: list[str] = Field(default_factory=list)
    surplus: list[str] = Field(default_factory=list)
    placed: list[PlacedReplica] = Field(default_factory=list)
    unplaced: list[UnplacedReplica] = Field(default_factory=list)
    unplaced_total: int | None = None
