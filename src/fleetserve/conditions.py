"""Status conditions in the Kubernetes style: the closed sets of condition types and reasons, and
the ``Condition`` value every deployment and cluster stack reports.

Both sets are ``StrEnum``: a member is its text, so JSON, YAML-bound dicts (via ``.value``) and
CLI output read exactly as the plain strings did.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class ConditionType(StrEnum):
    """What a condition is about."""

    ACCEPTED = "Accepted"  # every profile of a deployment may be used (the multi-accelerator gate)
    MODEL_KNOWN = "ModelKnown"  # the deployment's model is defined and its size known
    SCHEDULED = "Scheduled"  # every desired replica of the deployment is placed
    STACK_READY = "StackReady"  # a cluster's serving stack provides every driver its classes claim
    REPLICA_FAILURE = "ReplicaFailure"  # a replica of the deployment failed; it is being replaced
    PROGRESSING = "Progressing"  # every replica runs the deployment's current template revision
    DISRUPTION_MODE = "DisruptionMode"  # so much of the fleet is silent that nothing is re-placed


class ConditionReason(StrEnum):
    """Why a condition has its status: one machine-readable word."""

    ACCEPTED = "Accepted"
    INVALID_PROFILE = "InvalidProfile"
    UNSUPPORTED_DEVICES = "UnsupportedDevices"
    UNKNOWN_MODEL = "UnknownModel"
    # A profile's engine loads none of the model's formats (primary or alternates).
    NO_LOADABLE_WEIGHTS = "NoLoadableWeights"
    PLACED = "Placed"
    UNSCHEDULABLE = "Unschedulable"
    COMPOSED = "Composed"
    REPLICA_FAILED = "ReplicaFailed"
    NO_FAILURE = "NoFailure"
    ROLLING_OUT = "RollingOut"
    NODES_SILENT = "NodesSilent"  # DisruptionMode: the share of silent nodes is over the threshold
    HEARTBEATS_HEARD = "HeartbeatsHeard"  # DisruptionMode off
    COMPLETE = "Complete"


@dataclass(frozen=True)
class Condition:
    """A status condition in the Kubernetes style: type, status, machine reason, human message."""

    type: ConditionType
    status: bool
    reason: ConditionReason
    message: str = ""
