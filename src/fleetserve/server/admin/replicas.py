"""The admin API's replicas: listed (all, or one deployment's) and read with what their agent last
reported, their engine's last output lines, and the engine metrics this server scraped."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from fastapi import APIRouter

from fleetserve.adminapi.fleet import ReplicaLogs, ReplicaMetrics, ReplicaView
from fleetserve.adminapi.values import extend
from fleetserve.server.params import NameParam, NameQuery
from fleetserve.spec.resources import Replica
from fleetserve.store.sql import SqlStore


def build_replicas_router(
    store: SqlStore, engine_values: Callable[[], Mapping[str, Mapping[str, float]]] | None
) -> APIRouter:
    """``/replicas``; ``engine_values``: per replica, the latest canonical engine samples this
    process scraped (the observer's)."""
    api = APIRouter()

    @api.get("/replicas", tags=["replicas"])
    def list_replicas(deployment: NameQuery = None) -> list[Replica]:
        return store.replicas(deployment=deployment)

    @api.get(
        "/replicas/{name}/logs", tags=["replicas"], summary="The last lines of a replica's engine output"
    )
    def replica_logs(name: NameParam) -> ReplicaLogs:
        replica = store.get_replica(name)
        status = store.replica_status(name)
        return ReplicaLogs(
            replica=name,
            state=replica.state,
            message=status.message,
            restarts=status.restarts,
            lines=status.stderr_tail,
        )

    @api.get(
        "/replicas/{name}/metrics",
        tags=["replicas"],
        summary="The replica's latest engine metrics as this server scraped them (canonical names)",
    )
    def replica_metrics(name: NameParam) -> ReplicaMetrics:
        store.get_replica(name)  # 404 for an unknown replica
        values = engine_values() if engine_values is not None else {}
        return ReplicaMetrics(replica=name, metrics=dict(sorted(values.get(name, {}).items())))

    # The status is the agent's report as stored: only the fields it sent.
    @api.get("/replicas/{name}", tags=["replicas"], response_model_exclude_unset=True)
    def get_replica(name: NameParam) -> ReplicaView:
        return extend(ReplicaView, store.get_replica(name), status=store.replica_status(name))

    return api
