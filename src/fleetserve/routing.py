"""One rule, one place: which replicas can be sent requests (and scraped), at which URL, with
which key.

A replica is routable when it is Running (a Draining replica is not: that is how a drain takes it
out of every gateway's routes), its agent reported the port its engine listens on, and
its first shard's node has an address; its URL is ``http://ADDRESS:PORT`` with an IPv6 address in
brackets (``url_host``). The gateway's endpoint table and the observer's scrape targets both ask
``routable``.

Every replica's engine has its own API key (``new_engine_key``, made when the store allocates the
replica): the agent starts the engine with it, and the engine refuses any request without it, so
only the gateway and the observer, which read it from the store, reach the engine
(``engine_auth`` is the header they send).
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable
from dataclasses import dataclass, field

from fleetserve.engines.launch import url_host
from fleetserve.protocol import ReplicaStatus
from fleetserve.spec.resources import Replica, ReplicaState

# How often a gateway reads the routes from the store: a change reaches every gateway within it.
ROUTE_REFRESH_SECONDS = 1.0


def new_engine_key() -> str:
    """A new engine API key: 256 random bits, URL-safe (43 characters)."""
    return secrets.token_urlsafe(32)


def engine_auth(key: str | None) -> dict[str, str]:
    """The header that opens a replica's engine (none for a replica placed before engine keys)."""
    return {"Authorization": f"Bearer {key}"} if key else {}


@dataclass(frozen=True)
class ReplicaEndpoint:
    """A replica as the store holds it: the address of its first shard's node, its last status,
    and its engine's API key."""

    replica: Replica
    address: str
    status: ReplicaStatus
    engine_key: str | None = field(default=None, repr=False)


@dataclass(frozen=True)
class Routable:
    """A replica that serves: its engine's base URL (no trailing slash) and API key."""

    replica: Replica
    url: str
    engine_key: str | None = field(default=None, repr=False)


def routable(endpoints: Iterable[ReplicaEndpoint]) -> list[Routable]:
    """The endpoints of Running replicas with a reported port on a node with an address."""
    out = []
    for e in endpoints:
        port = e.status.port
        if e.replica.state is not ReplicaState.RUNNING or not port or not e.address:
            continue
        out.append(Routable(e.replica, f"http://{url_host(e.address)}:{port}", e.engine_key))
    return out
