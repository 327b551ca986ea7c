"""Which replicas (and Endpoints, servers fleetserve did not start) can serve each deployment,
refreshed from the state store.

An Endpoint is routed when the control plane's last health check of it passed (Ready) and this
process can read its key (``endpointkeys``): beside the replicas of each deployment that lists it,
and on its own for each of its models that no deployment serves.

Every gateway process reads the same store, so a replica that starts, stops or moves reaches all
of them within one refresh, without a restart; so does a node judged NotReady, and an engine whose
health check failed (``routing.routable`` leaves both out). A request for a model the table does
not hold reads again at once if the store changed (``EndpointTable.lookup``): a deployment is
served from its apply on, not from the next refresh.

Between refreshes, each gateway ejects on its own (outlier ejection, as Envoy does) an endpoint
it could not connect to: out of its picks at once, for a backoff that doubles with each ejection
in a row (``Ejections``), so a host that dropped off the network costs one connect failure per
gateway, not one per request until the control plane notices.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field, replace

from starlette.concurrency import run_in_threadpool

from fleetserve.changegate import ChangeGate
from fleetserve.endpointkeys import EndpointKeys, KeyUnreadable
from fleetserve.engines.registry import ENGINES
from fleetserve.engines.spec import EngineKind, Task
from fleetserve.errors import FleetserveError
from fleetserve.gateway.picker import Endpoint
from fleetserve.httpclient import ConnectFailed
from fleetserve.routing import ROUTE_REFRESH_SECONDS, routable
from fleetserve.spec.endpoint import Endpoint as EndpointSpec
from fleetserve.spec.endpoint import EndpointState, upstream_id
from fleetserve.spec.policies import AdmissionPolicy, RoutePolicy
from fleetserve.spec.resources import Deployment, Profile
from fleetserve.store.endpoints import StoredEndpoint
from fleetserve.store.protocols import RouteSource

log = logging.getLogger("fleetserve.gateway")


@dataclass(frozen=True)
class Route:
    """One deployment as the gateway sees it: its Ready endpoints and admission policy."""

    deployment: str
    endpoints: tuple[Endpoint, ...]
    policy: AdmissionPolicy
    scales_from_zero: bool
    # How a replica is picked (``routing.policy``); the Endpoints of a model no deployment
    # serves (servers fleetserve did not start) by least outstanding work.
    routing: RoutePolicy = "least-load"
    concurrency_per_replica: int = 8
    created: int = 0
    # replica → its engine's name, for metrics labels
    engines: Mapping[str, str] = field(default_factory=dict, compare=False)
    # What one request may generate here, for token reservations: the engines its profiles run
    # (each reads a request's cap its own way) and the largest context a replica starts with
    # (None when a profile leaves it to the model's own, which the gateway does not read).
    engine_kinds: frozenset[EngineKind] = frozenset()
    context: int | None = None
    # The fleet's default deployment (``routing.default``): serves requests naming no model, or
    # one no deployment serves.
    default: bool = False
    # What the deployment serves (``Deployment.task``): routes of another task are refused with a
    # 400 (``engines.routes.task_refusal``). None: a model only Endpoints serve, whose servers say.
    task: Task | None = None
    # For a LoRA adapter's route (its name is ``deployment``): the deployment of its base model,
    # whose replicas that loaded the adapter are its endpoints.
    base: str | None = None


def adapter_routes(route: Route, adapters: Iterable[str]) -> dict[str, Route]:
    """The routes of a deployment's LoRA adapters: each with the deployment's replicas that loaded
    it (adapter affinity: a replica without it cannot serve it), each endpoint's body fields naming
    the adapter its engine's way (``AdapterSupport.request_fields``), the deployment's policies."""
    out: dict[str, Route] = {}
    for name in adapters:
        endpoints = tuple(
            replace(e, fields=_fields(route.engines.get(e.replica), e.adapters, name))
            for e in route.endpoints
            if name in e.adapters
        )
        out[name] = replace(route, deployment=name, endpoints=endpoints, default=False, base=route.deployment)
    return out


def _fields(engine: str | None, loaded: tuple[str, ...], chosen: str | None) -> Mapping[str, object] | None:
    """What a request to a replica of ``engine`` that loaded ``loaded`` carries to choose ``chosen``
    (None: the base model); None where nothing is set."""
    support = ENGINES[EngineKind(engine)].adapters if engine is not None else None
    if support is None or not loaded:
        return None
    return support.request_fields(loaded, chosen) or None


def as_upstream(endpoint: EndpointSpec, key: str | None, model: str) -> Endpoint:
    """An Endpoint as the picker sees it for ``model``: its URL, weight, key and upstream name."""
    return Endpoint(
        replica=upstream_id(endpoint.name),
        url=endpoint.url,
        weight=endpoint.weight,
        engine_key=key,
        upstream_model=endpoint.upstream_name(model),
        redact=True,
    )


def endpoint_routes(
    declared: Iterable[EndpointSpec],
    upstreams: Mapping[str, tuple[EndpointSpec, str | None]],
    deployments: Collection[str],
) -> dict[str, Route]:
    """The routes of models no deployment serves: each with the Ready Endpoints that serve it (in
    name order), the default admission policy, and the route tables of every Endpoint declaring it."""
    served: dict[str, list[EndpointSpec]] = {}
    for endpoint in sorted(declared, key=lambda e: e.name):
        for model in endpoint.models:
            if model.name not in deployments:
                served.setdefault(model.name, []).append(endpoint)
    return {
        name: Route(
            deployment=name,
            endpoints=tuple(as_upstream(*upstreams[e.name], name) for e in these if e.name in upstreams),
            policy=AdmissionPolicy(),
            scales_from_zero=False,
            concurrency_per_replica=min(ENGINES[e.engine].concurrency_per_replica for e in these),
            engines={upstream_id(e.name): e.engine.value for e in these},
            engine_kinds=frozenset(e.engine for e in these),
        )
        for name, these in served.items()
    }


def profile_context(profile: Profile) -> int | None:
    """The context a replica of ``profile`` starts with: its ``context``, or the engine's flag in
    its engineArgs (the engine row's ``context_arg``; the last one wins, as the engine reads them);
    None where the gateway cannot tell."""
    context = profile.context
    flag = ENGINES[profile.engine].context_arg
    if flag is None:
        return context
    args = profile.engine_args
    for i, arg in enumerate(args):
        if arg == flag:
            value = args[i + 1] if i + 1 < len(args) else ""
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
        else:
            continue
        context = int(value) if value.isascii() and value.isdigit() and int(value) > 0 else None
    return context


def deployment_context(profiles: Iterable[Profile]) -> int | None:
    """The largest context a replica of any of ``profiles`` starts with; None if one is unknown."""
    contexts = [profile_context(p) for p in profiles]
    known = [c for c in contexts if c is not None]
    return max(known) if known and len(known) == len(contexts) else None


EJECT_SECONDS = 5.0
"""How long an endpoint that refused a connection stays out of a gateway's picks the first time."""

EJECT_MAX_SECONDS = 60.0
"""The longest ejection: each ejection in a row doubles the backoff up to this."""

# Failures that mean nothing reached the engine: its host is unreachable or nothing listens.
CONNECT_FAILURES = (ConnectFailed,)


@dataclass
class Ejections:
    """Endpoints one gateway could not connect to, each kept out of its picks until a deadline.

    The backoff doubles with every ejection that follows the previous one within
    ``EJECT_MAX_SECONDS`` of its end (``strikes``), and starts over after a quiet spell. When every
    endpoint of a route is ejected none is: trying one beats refusing the request outright.
    """

    base_seconds: float = EJECT_SECONDS
    max_seconds: float = EJECT_MAX_SECONDS
    clock: Callable[[], float] = time.monotonic
    until: dict[str, float] = field(default_factory=dict)
    strikes: dict[str, int] = field(default_factory=dict)

    def eject(self, replica: str) -> float:
        """Keep ``replica`` out of the picks from now on for its backoff; that backoff, in seconds."""
        now = self.clock()
        previous = self.until.get(replica)
        quiet = previous is None or now - previous > self.max_seconds
        strikes = 1 if quiet else self.strikes.get(replica, 0) + 1
        backoff = min(self.max_seconds, self.base_seconds * 2.0 ** (strikes - 1))
        self.strikes[replica] = strikes
        self.until[replica] = now + backoff
        return backoff

    def ejected(self, replicas: Iterable[str]) -> frozenset[str]:
        """Those of ``replicas`` ejected now; none when that would be every one of them."""
        now = self.clock()
        names = list(replicas)
        out = frozenset(name for name in names if self.until.get(name, -1.0) > now)
        return frozenset() if len(out) == len(names) else out

    def keep_only(self, replicas: Iterable[str]) -> None:
        """Forget replicas that are no longer routed (their names are never reused)."""
        live = set(replicas)
        for name in [n for n in self.until if n not in live]:
            self.until.pop(name, None)
            self.strikes.pop(name, None)


@dataclass
class EndpointTable:
    """The routes, refreshed every ``refresh_seconds`` from the store when it changed."""

    store: RouteSource
    refresh_seconds: float = ROUTE_REFRESH_SECONDS
    # Where this process reads the Endpoints' API keys (``endpointkeys``).
    keys: EndpointKeys = field(default_factory=EndpointKeys)
    routes: dict[str, Route] = field(default_factory=dict)
    on_change: Callable[[str], None] | None = None
    ejections: Ejections = field(default_factory=Ejections)
    # Routes are read again only when the fleet changed (``changegate``).
    gate: ChangeGate = field(default_factory=ChangeGate)
    reads: int = 0  # whole-fleet reads made by ``refresh``, for tests and the curious
    _task: asyncio.Task[None] | None = None
    _refreshing: asyncio.Future[None] | None = None  # the refresh running now, shared by its callers

    def load(self) -> dict[str, Route]:
        """Read the routes from the store now (blocking): each deployment's Ready replicas and
        Ready Endpoints it lists, then each model no deployment serves with the Ready Endpoints
        that serve it alone (``endpoint_routes``)."""
        deployments: dict[str, Deployment] = {
            d.deployment.name: d.deployment for d in self.store.list_deployments()
        }
        endpoints: dict[str, list[Endpoint]] = {name: [] for name in deployments}
        engines: dict[str, dict[str, str]] = {name: {} for name in deployments}
        replicas = self.store.replica_endpoints()
        # What each replica's agent reported loaded: the adapters it serves.
        loaded = {e.replica.name: tuple(e.status.adapters or ()) for e in replicas}
        for served in routable(replicas):
            replica = served.replica
            dep = deployments.get(replica.deployment)
            profile = next((p for p in dep.profiles if p.name == replica.profile), None) if dep else None
            if profile is not None:
                engines[replica.deployment][replica.name] = profile.engine.value
            # The tokens placement sized its KV cache for: its profile's context (the cache-aware
            # picker's capacity for it); unknown when left to the model's own.
            kv_tokens = profile_context(profile) if profile is not None else None
            # An engine caching per slot holds at most that many prompts whatever its tokens.
            kv_prompts = (
                ENGINES[profile.engine].held_prompts(profile.engine_args) if profile is not None else None
            )
            # Capacity across mixed hardware: a replica on more devices serves more at once.
            weight = float(max(1, sum(len(s.devices) for s in replica.shards)))
            endpoints.setdefault(replica.deployment, []).append(
                Endpoint(
                    replica=replica.name,
                    url=served.url,
                    weight=weight,
                    engine_key=served.engine_key,
                    kv_tokens=kv_tokens,
                    adapters=loaded.get(replica.name, ()),
                    # A request for the base model turns every adapter off (llama.cpp's scales).
                    fields=_fields(
                        profile.engine.value if profile else None, loaded.get(replica.name, ()), None
                    ),
                    kv_prompts=kv_prompts,
                )
            )
        declared = {e.endpoint.name: e for e in self.store.list_endpoints()}
        upstreams = self._upstreams(declared.values())
        routes = {
            name: Route(
                deployment=name,
                endpoints=(*endpoints.get(name, ()), *self._listed(upstreams, dep.endpoints, name)),
                policy=dep.admission,
                scales_from_zero=not isinstance(dep.replicas, int) and dep.replicas.min == 0,
                routing=dep.routing.effective_policy,
                concurrency_per_replica=min(ENGINES[p.engine].concurrency_per_replica for p in dep.profiles),
                engines={
                    **engines.get(name, {}),
                    **{
                        upstream_id(e): declared[e].endpoint.engine.value
                        for e in dep.endpoints
                        if e in declared
                    },
                },
                engine_kinds=frozenset(p.engine for p in dep.profiles)
                | {declared[e].endpoint.engine for e in dep.endpoints if e in declared},
                context=deployment_context(dep.profiles),
                default=dep.routing.default,
                task=dep.task,
            )
            for name, dep in deployments.items()
        }
        for name, dep in deployments.items():
            routes.update(adapter_routes(routes[name], dep.adapters))
        routes.update(endpoint_routes([e.endpoint for e in declared.values()], upstreams, set(deployments)))
        return routes

    def _upstreams(self, declared: Iterable[StoredEndpoint]) -> dict[str, tuple[EndpointSpec, str | None]]:
        """Each Ready Endpoint whose key this process can read, with its key."""
        out: dict[str, tuple[EndpointSpec, str | None]] = {}
        for stored in declared:
            if stored.state is not EndpointState.READY:
                continue
            key = self.keys.read(stored.endpoint.key_file)
            if isinstance(key, KeyUnreadable):
                log.warning(
                    "endpoint %s is not routed from this gateway: %s", stored.endpoint.name, key.reason
                )
                continue
            out[stored.endpoint.name] = (stored.endpoint, key)
        return out

    @staticmethod
    def _listed(
        upstreams: Mapping[str, tuple[EndpointSpec, str | None]], names: Iterable[str], model: str
    ) -> list[Endpoint]:
        return [as_upstream(*upstreams[n], model) for n in names if n in upstreams]

    def load_if_changed(self) -> dict[str, Route] | None:
        """The routes read from the store now, or None when its change counter has not moved since
        the last read and no full read is due (blocking)."""
        counter = self.store.fleet_changes()
        if not self.gate.due(counter):
            return None
        began = self.gate.clock()
        fresh = self.load()
        self.gate.read(counter, began)
        self.reads += 1
        return fresh

    async def refresh(self) -> None:
        """Reload the routes if the fleet changed; tell ``on_change`` which deployments' endpoints
        changed. One refresh at a time: a call while one runs waits for that one."""
        if self._refreshing is None:
            self._refreshing = asyncio.ensure_future(self._refresh())
            self._refreshing.add_done_callback(self._refreshed)
        # Shielded: a caller cancelled while it waits (a client gone) leaves the read to finish.
        await asyncio.shield(self._refreshing)

    def _refreshed(self, done: asyncio.Future[None]) -> None:
        if self._refreshing is done:
            self._refreshing = None
        if not done.cancelled():
            done.exception()  # retrieved here too: a failure no caller waited for is not "never retrieved"

    async def lookup(self, name: str) -> Route | None:
        """``name``'s route. When there is none, the routes are read again first if the store's
        change counter moved, so a deployment applied a moment ago is served rather than refused
        until the next refresh (a replica can be Running within a second of the apply). Misses at
        the same time share one read; a refresh already running when the miss came is waited for
        and then followed by one of its own, since it may have begun before the apply. A store
        that cannot be read leaves the miss a miss."""
        route = self.routes.get(name)
        if route is not None:
            return route
        try:
            if self._refreshing is not None:
                await self.refresh()
                if name in self.routes:
                    return self.routes[name]
            await self.refresh()
        except FleetserveError as exc:
            log.warning("reading the routes for %r failed: %s", name, exc)
        return self.routes.get(name)

    async def _refresh(self) -> None:
        fresh = await run_in_threadpool(self.load_if_changed)
        if fresh is None:
            return

        def endpoints(routes: dict[str, Route], name: str) -> tuple[Endpoint, ...]:
            route = routes.get(name)
            return route.endpoints if route else ()

        changed = [
            n for n in set(fresh) | set(self.routes) if endpoints(fresh, n) != endpoints(self.routes, n)
        ]
        self.routes = fresh
        self.ejections.keep_only(e.replica for route in fresh.values() for e in route.endpoints)
        if self.on_change is not None:
            for name in changed:
                self.on_change(name)

    def default(self) -> Route | None:
        """The fleet's default deployment's route (``routing.default``; of several, which apply
        refuses, the first by name), or None."""
        return next((r for _, r in sorted(self.routes.items()) if r.default), None)

    def ejected(self, model: str) -> frozenset[str]:
        """The replicas of ``model``'s route this gateway keeps out of its picks right now."""
        route = self.routes.get(model)
        return self.ejections.ejected(e.replica for e in route.endpoints) if route else frozenset()

    def failed(self, replica: str, error: BaseException) -> None:
        """A request to ``replica`` failed with ``error``: a connect failure ejects it at once."""
        if isinstance(error, CONNECT_FAILURES):
            backoff = self.ejections.eject(replica)
            log.warning("ejected %s for %.0f s: cannot connect (%s)", replica, backoff, type(error).__name__)

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
        refreshing = self._refreshing
        if refreshing is not None:  # a lookup's read, left running by a cancelled caller
            refreshing.cancel()
            with contextlib.suppress(asyncio.CancelledError, FleetserveError):
                await refreshing
