"""Preferences shared by every search strategy, so the index and the full scan agree exactly.

- GPUs are bin packed: the node with the fewest free devices that still fit (partly used
  nodes first, so whole nodes stay free for models that cannot be split).
- Multi-node replicas take the emptiest machines (they are the least movable thing), on the
  fabric whose chosen machines are emptiest together.
- CPU replicas spread: the node with the most free cores.
- Among equals, a node whose model cache holds the model; then the node name.
- Within a node, a tensor-parallel group stays inside one NVLink domain (the tightest that
  fits) where topology is known; otherwise the lowest free indices.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from fleetserve.errors import InternalError
from fleetserve.placement.demand import Demand
from fleetserve.placement.state import NodeWork
from fleetserve.spec.resources import Shard


@dataclass(frozen=True)
class Found:
    """Where a replica fits: one shard per node, the fabric for multi-node, named scores."""

    shards: tuple[Shard, ...]
    fabric: str | None
    scores: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}))


def device_class_of(demand: Demand) -> str:
    """The device class of a GPU demand; only GPU placement asks, so a CPU demand here is a bug."""
    if demand.device_class is None:
        raise InternalError(f"profile {demand.profile}: a CPU demand was placed as a GPU one")
    return demand.device_class


def gpu_key(node: NodeWork, demand: Demand) -> tuple[int, int, str]:
    """Sort key for single-node GPU placement: fewest free devices, cached first, then name."""
    return (node.free_count(device_class_of(demand)), 0 if demand.model in node.cache else 1, node.name)


def cpu_key(node: NodeWork, demand: Demand) -> tuple[int, int, str]:
    """Sort key for CPU placement: most free cores, cached first, then name."""
    return (-node.free_cores, 0 if demand.model in node.cache else 1, node.name)


def emptiest_key(node: NodeWork, demand: Demand) -> tuple[int, str]:
    """Sort key for multi-node members: most free devices first, then name."""
    return (-node.free_count(device_class_of(demand)), node.name)


def choose_devices(node: NodeWork, device_class: str, k: int) -> tuple[tuple[int, ...], bool]:
    """``k`` free devices of a class on a node, and whether they share one NVLink domain."""
    free = node.free[device_class]
    best: tuple[int, int, tuple[int, ...]] | None = None
    for domain in node.domains:
        in_domain = sorted(free & domain)
        if len(in_domain) >= k:
            # The tightest domain that fits, so larger groups keep their room.
            candidate = (len(in_domain), in_domain[0], tuple(in_domain[:k]))
            if best is None or candidate < best:
                best = candidate
    if best is not None:
        return best[2], True
    return tuple(sorted(free)[:k]), k == 1


def shard_on(node: NodeWork, demand: Demand, fabric: str | None) -> tuple[Shard, bool]:
    """The shard a replica takes on ``node``, and whether its devices share an NVLink domain."""
    devices: tuple[int, ...] = ()
    one_domain = True
    if demand.device_class is not None:
        devices, one_domain = choose_devices(node, demand.device_class, demand.devices_per_node)
    hcas = node.fabrics.get(fabric, ()) if fabric is not None else ()
    shard = Shard(
        node=node.name, devices=devices, hcas=hcas, cpu_cores=demand.cpu_cores, memory=demand.host_memory
    )
    return shard, one_domain


def found_single(node: NodeWork, demand: Demand) -> Found:
    """The placement on one chosen node, with its scores."""
    shard, one_domain = shard_on(node, demand, None)
    cached = 1.0 if demand.model in node.cache else 0.0
    if demand.device_class is None:
        spread = (node.free_cores - demand.cpu_cores) / node.cores if node.cores else 0.0
        return Found((shard,), None, MappingProxyType({"spread": round(spread, 4), "cache": cached}))
    total = len(node.devices_of.get(demand.device_class, ()))
    left = node.free_count(demand.device_class) - demand.devices_per_node
    binpack = 1.0 - left / total if total else 0.0
    return Found(
        (shard,),
        None,
        MappingProxyType(
            {"binpack": round(binpack, 4), "cache": cached, "nvlink": 1.0 if one_domain else 0.0}
        ),
    )


def found_group(members: Sequence[NodeWork], demand: Demand, fabric: str) -> Found:
    """The placement across ``members`` on ``fabric``, with its scores."""
    device_class = device_class_of(demand)
    shards = []
    domains = 0
    for node in members:
        shard, one_domain = shard_on(node, demand, fabric)
        shards.append(shard)
        domains += one_domain
    free = sum(n.free_count(device_class) for n in members)
    total = sum(len(n.devices_of[device_class]) for n in members)
    return Found(
        tuple(shards),
        fabric,
        MappingProxyType(
            {"emptiest": round(free / total, 4) if total else 0.0, "nvlink": round(domains / len(members), 4)}
        ),
    )


def group_score(members: Sequence[NodeWork], demand: Demand, fabric: str) -> tuple[int, str]:
    """Sort key among fabrics: the most free devices across the chosen machines, then name."""
    device_class = device_class_of(demand)
    return (-sum(n.free_count(device_class) for n in members), fabric)
