"""The filter chain: small checks, each answering one question about one node.

A check passes (None) or rejects with a reason and an optional amount; it never just says no.
The chain runs in a fixed order, cheap and static checks first, so the first failure is the
one an operator can act on, and the counts agree with the index-based explanation.
"""

from __future__ import annotations

from collections.abc import Callable

from fleetserve.placement.demand import Demand
from fleetserve.placement.report import Reason
from fleetserve.placement.state import NodeWork

Rejection = tuple[Reason, int | None]
Check = Callable[[NodeWork, Demand], Rejection | None]


def node_ready(node: NodeWork, demand: Demand) -> Rejection | None:
    """Only Ready nodes take replicas: their agent is heard from."""
    return None if node.ready else (Reason.NOT_READY, None)


def not_cordoned(node: NodeWork, demand: Demand) -> Rejection | None:
    """An operator's cordon keeps new replicas off."""
    return (Reason.CORDONED, None) if node.cordoned else None


def has_class(node: NodeWork, demand: Demand) -> Rejection | None:
    """Only devices of the profile's class are ever considered."""
    if demand.device_class is None or demand.device_class in node.devices_of:
        return None
    return (Reason.NO_DEVICE_OF_CLASS, None)


def tolerates_taint(node: NodeWork, demand: Demand) -> Rejection | None:
    """A node's driver taints must be tolerated by the profile's driver."""
    return None if node.tolerates(demand.driver) else (Reason.TAINT_NOT_TOLERATED, None)


def runs_engine(node: NodeWork, demand: Demand) -> Rejection | None:
    """The node's agent found the profile's engine build for its variant (a node that never
    reported engines, a YAML fleet's or a Kubernetes one, is not filtered)."""
    return (Reason.ENGINE_NOT_INSTALLED, None) if node.lacks(demand.engine, demand.variant) else None


def device_memory(node: NodeWork, demand: Demand) -> Rejection | None:
    """Each device must hold its share of weights and KV cache."""
    if demand.device_class is None or demand.device_memory <= demand.class_memory:
        return None
    return (Reason.DEVICE_MEMORY_TOO_SMALL, None)


def on_a_fabric(node: NodeWork, demand: Demand) -> Rejection | None:
    """A multi-node replica's shards talk over a fabric: the node needs an HCA on one."""
    if demand.nodes > 1 and not node.fabrics:
        return (Reason.NO_FABRIC, None)
    return None


def free_devices(node: NodeWork, demand: Demand) -> Rejection | None:
    """Enough healthy, unallocated devices of the class (exhausted, not filtered)."""
    if demand.device_class is None:
        return None
    have = node.free_count(demand.device_class)
    return None if have >= demand.devices_per_node else (Reason.INSUFFICIENT_FREE_DEVICES, have)


def free_cores(node: NodeWork, demand: Demand) -> Rejection | None:
    """Enough unclaimed CPU cores."""
    return None if node.free_cores >= demand.cpu_cores else (Reason.INSUFFICIENT_CPU, None)


def free_memory(node: NodeWork, demand: Demand) -> Rejection | None:
    """Enough unclaimed host memory."""
    return None if node.free_memory >= demand.host_memory else (Reason.INSUFFICIENT_MEMORY, None)


# The chain, in order. Static state first (never changes within a cycle), then what the
# profile can never fit (filtered), then what is full right now (exhausted).
CHAIN: tuple[tuple[str, Check], ...] = (
    ("ready", node_ready),  # a node not heard from cannot start anything
    ("cordon", not_cordoned),  # the operator's word beats any fit
    ("class", has_class),  # only the profile's class is ever considered
    ("taint", tolerates_taint),  # pools are separated by driver taints
    ("engine", runs_engine),  # no such build on the node: filtered until its agent finds one
    ("device-memory", device_memory),  # a class too small stays too small: filtered
    ("fabric", on_a_fabric),  # multi-node shards need a fabric attachment
    ("free-devices", free_devices),  # exhausted: may free up later
    ("cpu", free_cores),  # exhausted
    ("memory", free_memory),  # exhausted
)


def first_failure(node: NodeWork, demand: Demand) -> Rejection | None:
    """The first check in the chain that ``node`` fails for ``demand``, or None if it fits."""
    for _, check in CHAIN:
        rejection = check(node, demand)
        if rejection is not None:
            return rejection
    return None
