"""Which replicas can serve each deployment, refreshed from the state store.

Every gateway process reads the same store, so a replica that starts, stops or moves reaches all
of them within one refresh, without a restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from starlette.concurrency import run_in_threadpool

from fleetserve.engines.registry import ENGINES
from fleetserve.errors import FleetserveError
from fleetserve.gateway.picker import Endpoint
from fleetserve.routing import ROUTE_REFRESH_SECONDS, routable
from fleetserve.spec.resources import AdmissionPolicy, Deployment
from fleetserve.store.protocols import RouteSource

log = logging.getLogger("fleetserve.gateway")


@dataclass(frozen=True)
class Route:
    """One deployment as the gateway sees it: its Ready endpoints and admission policy."""

    deployment: str
    endpoints: tuple[Endpoint, ...]
    policy: AdmissionPolicy
    scales_from_zero: bool
    prefix_affinity: bool = False
    concurrency_per_replica: int = 8
    created: int = 0
    # replica → its engine's name, for metrics labels
    engines: Mapping[str, str] = field(default_factory=dict, compare=False)


@dataclass
class EndpointTable:
    """The routes, refreshed every ``refresh_seconds`` from the store."""

    store: RouteSource
    refresh_seconds: float = ROUTE_REFRESH_SECONDS
    routes: dict[str, Route] = field(default_factory=dict)
    on_change: Callable[[str], None] | None = None
    _task: asyncio.Task[None] | None = None

    def load(self) -> dict[str, Route]:
        """Read the routes from the store now (blocking)."""
        deployments: dict[str, Deployment] = {
            d.deployment.name: d.deployment for d in self.store.list_deployments()
        }
        endpoints: dict[str, list[Endpoint]] = {name: [] for name in deployments}
        engines: dict[str, dict[str, str]] = {name: {} for name in deployments}
        for served in routable(self.store.replica_endpoints()):
            replica = served.replica
            dep = deployments.get(replica.deployment)
            profile = next((p for p in dep.profiles if p.name == replica.profile), None) if dep else None
            if profile is not None:
                engines[replica.deployment][replica.name] = profile.engine.value
            # Capacity across mixed hardware: a replica on more devices serves more at once.
            weight = float(max(1, sum(len(s.devices) for s in replica.shards)))
            endpoints.setdefault(replica.deployment, []).append(
                Endpoint(replica=replica.name, url=served.url, weight=weight, engine_key=served.engine_key)
            )
        return {
            name: Route(
                deployment=name,
                endpoints=tuple(endpoints.get(name, ())),
                policy=dep.admission,
                scales_from_zero=not isinstance(dep.replicas, int) and dep.replicas.min == 0,
                prefix_affinity=dep.routing.prefix_affinity,
                concurrency_per_replica=min(ENGINES[p.engine].concurrency_per_replica for p in dep.profiles),
                engines=engines.get(name, {}),
            )
            for name, dep in deployments.items()
        }

    async def refresh(self) -> None:
        """Reload the routes; tell ``on_change`` which deployments' endpoints changed."""
        fresh = await run_in_threadpool(self.load)

        def endpoints(routes: dict[str, Route], name: str) -> tuple[Endpoint, ...]:
            route = routes.get(name)
            return route.endpoints if route else ()

        changed = [
            n for n in set(fresh) | set(self.routes) if endpoints(fresh, n) != endpoints(self.routes, n)
        ]
        self.routes = fresh
        if self.on_change is not None:
            for name in changed:
                self.on_change(name)

    async def _loop(self) -> None:
        while True:
            try:
                await self.refresh()
            except FleetserveError as exc:
                log.warning("refreshing the routes failed: %s", exc)
            await asyncio.sleep(self.refresh_seconds)

    def start(self) -> None:
        """Refresh in the background of the running event loop."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        """Stop refreshing."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
