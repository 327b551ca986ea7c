"""The admin API's nodes: listed and read with their status (heartbeat, devices and replicas held,
the agent's last report), cordoned, uncordoned, drained and forgotten."""

from __future__ import annotations

from collections.abc import Mapping

from fastapi import APIRouter, Request

from fleetserve.adminapi.fleet import (
    CordonRequest,
    DrainedNode,
    FleetCondition,
    FleetView,
    NodeStatus,
    NodeView,
)
from fleetserve.adminapi.values import Deleted, extend
from fleetserve.conditions import ConditionReason, ConditionType
from fleetserve.reconcile.disruption import Disruption
from fleetserve.server.admin import audit
from fleetserve.server.params import NameParam
from fleetserve.spec.resources import Node, Replica
from fleetserve.store.audit import AuditAction
from fleetserve.store.reports import NodeHeartbeat
from fleetserve.store.sql import SqlStore


def _replicas_by_node(replicas: list[Replica]) -> dict[str, list[Replica]]:
    out: dict[str, list[Replica]] = {}
    for replica in replicas:
        for shard in replica.shards:
            out.setdefault(shard.node, []).append(replica)
    return out


def node_view(
    node: Node, store: SqlStore, replicas: list[Replica], beats: Mapping[str, NodeHeartbeat]
) -> NodeView:
    """A node with its status: ``replicas`` are those with a shard on it."""
    beat = beats.get(node.name)
    held = sorted({d for r in replicas for s in r.shards if s.node == node.name for d in s.devices})
    status = NodeStatus(
        epoch=beat.epoch if beat else 0,
        last_heartbeat=beat.last_heartbeat if beat else None,
        allocated_devices=held,
        replicas=sorted({r.name for r in replicas}),
        agent=store.agent_status(node.name),
    )
    return extend(NodeView, node, status=status)


def fleet_view(disruption: Disruption | None) -> FleetView:
    """The fleet's conditions: disruption mode as the reconciler last judged it."""
    if disruption is None:
        mode = FleetCondition(
            type=ConditionType.DISRUPTION_MODE,
            status="False",
            reason=ConditionReason.HEARTBEATS_HEARD,
            message="nodes are judged by their heartbeats",
        )
    else:
        mode = FleetCondition(
            type=ConditionType.DISRUPTION_MODE,
            status="True",
            reason=ConditionReason.NODES_SILENT,
            message=disruption.message(),
            since=disruption.since,
        )
    return FleetView(conditions=[mode])


def build_nodes_router(store: SqlStore) -> APIRouter:
    """``/nodes``: a node's agent registers it; operators read, cordon, drain and forget it."""
    api = APIRouter()

    # A node's status nests its agent's report as reported: only the fields it sent.
    @api.get("/nodes", tags=["nodes"], response_model_exclude_unset=True)
    def list_nodes() -> list[NodeView]:
        by_node = _replicas_by_node(store.replicas())
        beats = {h.name: h for h in store.node_heartbeats()}
        return [node_view(n, store, by_node.get(n.name, []), beats) for n in store.nodes()]

    @api.get("/fleet", tags=["nodes"], summary="The fleet's conditions (disruption mode)")
    def fleet(request: Request) -> FleetView:
        return fleet_view(request.app.state.metrics.disruption)

    @api.get("/nodes/{name}", tags=["nodes"], response_model_exclude_unset=True)
    def get_node(name: NameParam) -> NodeView:
        node = store.get_node(name)
        beats = {h.name: h for h in store.node_heartbeats()}
        return node_view(node, store, _replicas_by_node(store.replicas()).get(name, []), beats)

    @api.post("/nodes/{name}/cordon", tags=["nodes"], summary="Keep new replicas off a node")
    def cordon(name: NameParam, body: CordonRequest, request: Request) -> Node:
        node = store.cordon(name, body.reason)
        audit.record(store, request, AuditAction.CORDON, f"Node/{name}", {"reason": body.reason})
        return node

    @api.post("/nodes/{name}/uncordon", tags=["nodes"])
    def uncordon(name: NameParam, request: Request) -> Node:
        node = store.uncordon(name)
        audit.record(store, request, AuditAction.UNCORDON, f"Node/{name}")
        return node

    @api.post("/nodes/{name}/drain", tags=["nodes"], summary="Cordon a node and move its replicas away")
    def drain(name: NameParam, body: CordonRequest, request: Request) -> DrainedNode:
        # One transaction: serving replicas turn Draining (out of every route, released once their
        # requests are done), the others are released; the reconciler places replacements elsewhere.
        node, released, draining = store.drain(name, body.reason)
        audit.record(
            store, request, AuditAction.DRAIN, f"Node/{name}",
            {"reason": body.reason, "released": [r.name for r in released], "draining": list(draining)},
        )  # fmt: skip
        return DrainedNode(**dict(node), released=[r.name for r in released], draining=list(draining))

    @api.delete("/nodes/{name}", tags=["nodes"], summary="Forget a node that holds no replica")
    def delete_node(name: NameParam, request: Request) -> Deleted:
        store.delete_node(name)
        audit.record(store, request, AuditAction.DELETE, f"Node/{name}")
        return Deleted(deleted=name)

    return api
