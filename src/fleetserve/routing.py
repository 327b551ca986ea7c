"""One rule, one place: which replicas can be sent requests (and scraped), and at which URL.

A replica is routable when it is Running (a Draining replica is not: that is how a drain takes it
out of every gateway's routes), its agent reported the port its engine listens on, and
its first shard's node has an address; its URL is ``http://ADDRESS:PORT`` with an IPv6 address in
brackets (``url_host``). The gateway's endpoint table and the observer's scrape targets both ask
``routable``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from fleetserve.engines.launch import url_host
from fleetserve.protocol import ReplicaStatus
from fleetserve.spec.resources import Replica, ReplicaState

# How often a gateway reads the routes from the store: a change reaches every gateway within it.
ROUTE_REFRESH_SECONDS = 1.0


@dataclass(frozen=True)
class ReplicaEndpoint:
    """A replica as the store holds it: the address of its first shard's node, its last status."""

    replica: Replica
    address: str
    status: ReplicaStatus


@dataclass(frozen=True)
class Routable:
    """A replica that serves: its engine's base URL (no trailing slash)."""

    replica: Replica
    url: str


def routable(endpoints: Iterable[ReplicaEndpoint]) -> list[Routable]:
    """The endpoints of Running replicas with a reported port on a node with an address."""
    out = []
    for e in endpoints:
        port = e.status.port
        if e.replica.state is not ReplicaState.RUNNING or not port or not e.address:
            continue
        out.append(Routable(e.replica, f"http://{url_host(e.address)}:{port}"))
    return out
