"""The admin API's fleet: nodes (with what the server knows of them), models, deployments (with
their status and decisions), replicas, and the batch of documents ``apply`` takes.

A node, deployment or replica is answered as its document (``spec/resources.py``) with the
server's fields added, so these views extend the documents' models.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from fleetserve.adminapi.values import IsoTime, View
from fleetserve.protocol import AgentStatus, ReplicaStatus
from fleetserve.spec.base import LINE_PATTERN
from fleetserve.spec.resources import Deployment, Model, Node, Replica, ReplicaState
from fleetserve.spec.status import DecisionRecord, DeploymentStatus


class ApplyRequest(BaseModel):
    """A batch of documents (the YAML documents of `fleetserve apply -f`), applied all or nothing."""

    model_config = ConfigDict(extra="forbid")
    documents: list[dict[str, Any]] = Field(min_length=1, max_length=10_000)


class AppliedDocument(View):
    """What applying one document did: ``result`` is created, configured or unchanged."""

    kind: str
    name: str
    result: str


class ApplyResult(View):
    """Every document of an applied batch, in order."""

    applied: list[AppliedDocument]


class CordonRequest(BaseModel):
    """Why the node is cordoned; shown to every operator who looks at it."""

    model_config = ConfigDict(extra="forbid")
    reason: str = Field(min_length=1, max_length=1000, pattern=LINE_PATTERN)


class NodeStatus(View):
    """What the server knows of a node beyond its document: its agent's registration (``epoch``)
    and last heartbeat, the devices and replicas placed on it, and its agent's last report."""

    epoch: int
    last_heartbeat: IsoTime | None
    allocated_devices: list[int]
    replicas: list[str]
    agent: AgentStatus


class FleetCondition(View):
    """A condition of the fleet as a whole, in the Kubernetes style: ``DisruptionMode`` is True
    while so large a share of the nodes is silent that the control plane suspects itself or the
    network (nodes marked NotReady, none judged Lost, nothing re-placed)."""

    type: str
    status: str  # "True" / "False"
    reason: str
    message: str
    since: IsoTime | None = None


class FleetView(View):
    """The fleet's conditions, as the reconciler last judged them (``GET /api/v1/fleet``; the
    server that runs the reconciler, in its thread or its process, knows them)."""

    conditions: list[FleetCondition]


class NodeView(Node):
    """A node: its document and its status."""

    status: NodeStatus


class DrainedNode(Node):
    """A node just drained: its document, the replicas released at once and those draining."""

    released: list[str]
    draining: list[str]


class DeploymentView(Deployment):
    """A deployment: its document, the generation of that spec, and its status."""

    generation: int
    status: DeploymentStatus


class DeploymentDetail(Deployment):
    """One deployment in full: its document, generation, template revision, status and replicas.

    On the wire ``replicas`` is the replicas themselves, not the document's count (``GET
    /deployments`` has the count)."""

    generation: int
    revision: str
    status: DeploymentStatus
    replicas: list[Replica]  # type: ignore[assignment]


class UndoneDeployment(Deployment):
    """A deployment after ``rollout undo``: its previous spec, applied again as a new generation."""

    generation: int
    revision: str


class UndoneModel(Model):
    """A model after ``rollout undo model/NAME``: its previous spec, applied again; ``weights_revision``
    is its ``weights_digest``, the weights part of the revision its deployments roll to."""

    weights_revision: str


class Explanation(View):
    """Why a deployment's replicas are where they are: its status and its latest decision (None:
    the reconciler has not decided for it yet)."""

    deployment: str
    generation: int
    status: DeploymentStatus
    decision: DecisionRecord | None
    decided_at: IsoTime | None


class DecisionView(View):
    """One recorded decision."""

    id: int
    deployment: str
    created_at: IsoTime
    decision: DecisionRecord


class ReplicaView(Replica):
    """A replica: its document and what its agent last reported of it (``{}``: nothing yet)."""

    status: ReplicaStatus


class ReplicaLogs(View):
    """The last lines of a replica's engine output, as its agent last reported them."""

    replica: str
    state: ReplicaState
    message: str
    restarts: int
    lines: list[str]


class ReplicaMetrics(View):
    """A replica's latest engine metrics as this server scraped them, by canonical name."""

    replica: str
    metrics: dict[str, float]


class UploadedFile(View):
    """A model's file as the server stored it."""

    model: str
    sha256: str
    size: int
