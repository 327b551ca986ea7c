"""A deployment's policies: its replica range, routing, admission queue, rollout and autoscaling.

Each is a part of the ``Deployment`` document (``replicas: {min, max}``, ``routing``,
``admission``, ``rollout``, ``autoscale``), checked on its own; the rules that join them (an
``autoscale`` needs a range) live on the deployment.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from fleetserve.spec.base import MAX_REPLICAS, Spec


class ReplicaRange(Spec):
    """Autoscaled replica bounds."""

    min: int = Field(ge=0, le=MAX_REPLICAS)
    max: int = Field(ge=1, le=MAX_REPLICAS)

    @model_validator(mode="after")
    def _ordered(self) -> ReplicaRange:
        if self.min > self.max:
            raise ValueError(f"replicas.min ({self.min}) must not exceed replicas.max ({self.max})")
        return self


RoutePolicy = Literal["cache-aware", "least-load", "prefix-hash", "round-robin"]
"""How the gateway picks among a deployment's replicas (``gateway.picker``): by what each replica's
prompt cache is believed to hold against its load, by least outstanding work alone, by a
consistent-hash ring of the prompt's prefix (bounded load), or in turn (a benchmark's baseline)."""


class RoutingPolicy(Spec):
    """How the gateway picks a replica for a request."""

    # None: cache-aware (``prefixAffinity: true``, the older spelling, means prefix-hash).
    policy: RoutePolicy | None = None
    prefix_affinity: bool = False
    # The fleet's default deployment: it serves requests that name no model, or a model no
    # deployment serves, as a lone llama-server serves whatever name it is sent (clients with a
    # model name built in). At most one deployment of a fleet; none by default, where such a
    # request gets 400 (no model) or 404 (an unknown one).
    default: bool = False

    @model_validator(mode="after")
    def _one_policy(self) -> RoutingPolicy:
        if self.prefix_affinity and self.policy not in (None, "prefix-hash"):
            raise ValueError(
                f"routing.prefixAffinity: true means policy prefix-hash, not {self.policy}: set one of them"
            )
        return self

    @property
    def effective_policy(self) -> RoutePolicy:
        """The policy the gateway uses: ``policy``, else prefix-hash for ``prefixAffinity``, else
        cache-aware."""
        if self.policy is not None:
            return self.policy
        return "prefix-hash" if self.prefix_affinity else "cache-aware"


class AdmissionPolicy(Spec):
    """The bounded queue in front of a deployment."""

    max_waiting: int = Field(default=64, ge=0, le=1_000_000)
    max_wait_seconds: float = Field(default=30.0, gt=0)


class RolloutPolicy(Spec):
    """How a changed deployment replaces its replicas: new ones Ready before old ones drain."""

    # Replicas beyond the desired count while a rollout or a failure replacement runs.
    max_surge: int = Field(default=1, ge=0, le=MAX_REPLICAS)
    # Desired replicas that may be not Ready while old ones drain.
    max_unavailable: int = Field(default=0, ge=0, le=MAX_REPLICAS)

    @model_validator(mode="after")
    def _can_progress(self) -> RolloutPolicy:
        if self.max_surge == 0 and self.max_unavailable == 0:
            raise ValueError(
                "rollout.maxSurge and rollout.maxUnavailable cannot both be 0: nothing could move"
            )
        return self


LoadMetric = Literal["in_flight", "waiting", "outstanding"]
"""Which per-replica number the autoscaler compares with its target: running, waiting, or both."""

_MAX_SECONDS = 7 * 24 * 3600.0  # a week: longer waits are typos, and the bound keeps values finite


class AutoscalePolicy(Spec):
    """How an autoscaled deployment follows its load between ``replicas.min`` and ``replicas.max``."""

    # Requests per replica the deployment aims for, counted by ``metric``.
    target: float = Field(default=4.0, gt=0, le=1_000_000)
    metric: LoadMetric = "outstanding"
    # Load must stay above target this long before scaling up (0: at once).
    scale_up_stabilization_seconds: float = Field(default=0.0, ge=0, le=_MAX_SECONDS)
    # Load must stay below what fewer replicas serve this long before scaling down.
    scale_down_cooldown_seconds: float = Field(default=120.0, ge=0, le=_MAX_SECONDS)
    # With ``replicas.min == 0``: no request for this long scales the deployment to zero.
    scale_to_zero_after_seconds: float = Field(default=300.0, ge=0, le=_MAX_SECONDS)
