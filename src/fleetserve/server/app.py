"""The control plane's HTTP apps (FastAPI), assembled from the operators' admin API
(``server/admin/``), the agents' API (``server/agents/``) and the gateway's /v1.

Admin routes need an admin token (or the dashboard's session, see ``server/auth.py``); agent
routes a node's credential (the join token only enrols). The control plane also serves the web
dashboard at /ui over that admin API (``server/admin/ui.py``). ``create_gateway_app`` is the app of an
extra gateway process; both apps answer ``/healthz``, ``/metrics`` and /v1 over one ``Serving``
(fleetserve.server.process assembles the processes). Every error is JSON in one shape
(``fleetserve.server.problems``); bad input is a 4xx naming the field.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from fastapi import APIRouter, FastAPI, Request, Response

from fleetserve import __version__
from fleetserve.endpointkeys import EndpointKeys
from fleetserve.gateway.app import Gateway
from fleetserve.gateway.asgi import OpenAIApi, ServingApp
from fleetserve.gateway.bodylimits import DEFAULT_GATEWAY_LIMITS, GatewayLimits
from fleetserve.gateway.cors import Cors
from fleetserve.gateway.windows import RedisWindows, Windows
from fleetserve.metrics.exposition import FleetMetrics
from fleetserve.server import auth, problems
from fleetserve.server.admin.records import build_records_router
from fleetserve.server.admin.routes import build_admin_router
from fleetserve.server.admin.ui import build_ui_router
from fleetserve.server.agents import limits, openapi
from fleetserve.server.agents.assignwatch import AssignmentWatch
from fleetserve.server.agents.callcpu import CallCpu, CallKind
from fleetserve.server.agents.credcache import DEFAULT_TTL
from fleetserve.server.agents.door import REGISTER, AgentDoor
from fleetserve.server.agents.enrolment import EnrolmentPolicy
from fleetserve.server.agents.modelfiles import ModelFiles
from fleetserve.server.agents.routes import build_agent_router
from fleetserve.server.endpointprobe import EndpointProber
from fleetserve.server.gpu_exporters import ExporterScrape
from fleetserve.server.observer import Observer
from fleetserve.store.sql import SqlStore
from fleetserve.tls import CA_PATH

Lifespan = Callable[[FastAPI], AbstractAsyncContextManager[None]]


@dataclass(frozen=True)
class Serving:
    """What every serving process shares: its metrics, the observer scraping engines into them,
    the gateway (if any) whose picker reads the observer's engine load, and the origins whose
    web pages may call its /v1 (None: no CORS)."""

    metrics: FleetMetrics
    observer: Observer
    gateway: Gateway | None
    cors: Cors | None = None
    # The control plane's health checks of Endpoints (None in an extra gateway: one checker, the
    # server's, records what every gateway routes by).
    prober: EndpointProber | None = None

    @classmethod
    def build(
        cls,
        store: SqlStore,
        gateway: bool = True,
        redis_url: str | None = None,
        redis_namespace: str = "fleetserve",
        cors: Cors | None = None,
        limits: GatewayLimits = DEFAULT_GATEWAY_LIMITS,
        exporters: ExporterScrape | None = None,
        endpoint_keys: EndpointKeys | None = None,
        probe_endpoints: bool = False,
    ) -> Serving:
        """Metrics, an observer over ``store`` and, unless told not, a gateway fed by the observer;
        with ``redis_url``, its rate-limit windows are shared in that Redis; with ``cors``, its
        /v1 answers browsers of those origins; ``limits``: what its gateway takes and holds;
        ``exporters``: GPU metrics exporters the observer scrapes too; ``endpoint_keys``: where
        Endpoints' keys are read; ``probe_endpoints``: check their health (the control plane's)."""
        keys = endpoint_keys or EndpointKeys()
        metrics = FleetMetrics()
        observer = Observer(store, metrics, exporters=exporters)

        def engine_waiting(replica: str) -> tuple[float, float] | None:
            load = observer.loads.get(replica)
            return None if load is None else (load.waiting, time.monotonic() - load.at)

        def engine_cache(replica: str) -> tuple[int, float | None]:
            load = observer.loads.get(replica)
            return observer.epochs.get(replica, 0), None if load is None else load.kv_usage

        windows: Windows | None = None
        if gateway and redis_url:
            windows = RedisWindows(
                redis_url, namespace=redis_namespace, on_shared=metrics.set_ratelimit_shared
            )
        gw = (
            Gateway(
                store,
                metrics=metrics,
                engine_waiting=engine_waiting,
                engine_cache=engine_cache,
                engine_report=observer.reports.get,
                windows=windows,
                usage=store,
                limits=limits,
                endpoint_keys=keys,
            )
            if gateway
            else None
        )
        if gw is not None:
            observer.on_report = gw.caches.correct
        prober = EndpointProber(store, keys) if probe_endpoints else None
        return cls(metrics, observer, gw, cors, prober)


def _assemble(
    app: ServingApp, store: SqlStore, serving: Serving, ca_pem: bytes | None, *routers: APIRouter
) -> None:
    """What every serving process answers: health, ``/metrics``, the CA it generated (if it did),
    its own ``routers`` and the gateway's /v1 (if it has one)."""
    app.state.store = store
    app.state.metrics = serving.metrics
    app.state.observer = serving.observer
    app.state.gateway = serving.gateway

    @app.get("/healthz", tags=["health"], summary="Liveness; no credentials needed")
    def healthz() -> dict[str, str]:
        return {"status": "ok", "version": __version__}

    @app.get("/metrics", tags=["health"], summary="Prometheus metrics: engines, GPUs, fleetserve itself")
    def prometheus(request: Request) -> Response:
        body, content_type = serving.metrics.render(request.headers.get("accept", ""))
        return Response(body, media_type=content_type)

    if ca_pem is not None:  # only a server that generated its CA has one to publish

        @app.get(CA_PATH, tags=["health"], summary="The generated CA (PEM); no credentials: clients pin it")
        def ca_certificate() -> Response:
            return Response(ca_pem, media_type="application/x-pem-file")

    for router in routers:
        app.include_router(router)
    if serving.gateway is not None:
        # /v1/ is served before FastAPI sees it
        app.openai_api = OpenAIApi(serving.gateway, serving.cors)


def _serving_lifespan(serving: Serving, lifespan: Lifespan | None) -> Lifespan:
    """The observer and the gateway run with the app, around ``lifespan`` (the process's own work)."""

    @asynccontextmanager
    async def combined(app: FastAPI) -> AsyncIterator[None]:
        stop = asyncio.Event()
        observing = asyncio.create_task(serving.observer.run(stop))
        probing = asyncio.create_task(serving.prober.run(stop)) if serving.prober is not None else None
        if serving.gateway is not None:
            await serving.gateway.start()
        try:
            if lifespan is None:
                yield
            else:
                async with lifespan(app):
                    yield
        finally:
            stop.set()
            await observing
            if probing is not None:
                await probing
            if serving.gateway is not None:
                await serving.gateway.stop()

    return combined


def create_app(
    store: SqlStore,
    lifespan: Lifespan | None = None,
    models_dir: Path | None = None,
    gateway: bool = True,
    serving: Serving | None = None,
    ca_pem: bytes | None = None,
    enrolment: EnrolmentPolicy | None = None,
    credential_ttl: float = DEFAULT_TTL,
) -> FastAPI:
    """The control plane's ASGI app over ``store``: admin API, agents' API and, unless told not,
    the OpenAI-compatible gateway. ``lifespan`` runs background work with it; ``models_dir``
    holds the model files it serves to agents (default ./fleetserve-models); ``serving`` is the
    metrics, observer and gateway to use (default: built here, with a gateway if ``gateway``);
    ``ca_pem`` the generated CA it publishes at ``CA_PATH``; ``enrolment`` the policy for
    join-token enrolments (default: new names need an approval); ``credential_ttl`` how long the
    agents' door keeps a credential's node for its checks before a call is judged (``credcache``)."""
    files = ModelFiles(models_dir or Path("fleetserve-models"))
    if serving is None:
        serving = Serving.build(store, gateway, probe_endpoints=True)
    gw = serving.gateway
    app = ServingApp(
        lifespan=_serving_lifespan(serving, lifespan),
        title="fleetserve control plane",
        version=__version__,
        description="Admin API: device classes, nodes, models, deployments, replicas and placement "
        "explanations (`Authorization: Bearer <admin token>`). Agents' API (a node's credential; "
        "the join token only enrols). The "
        "OpenAI-compatible API under /v1 (gateway API keys).",
    )

    def stopping() -> bool:  # set by the server on SIGTERM: held polls answer at once
        return bool(getattr(app.state, "stopping", False))

    # The agents' heartbeat, status report and assignments poll: answered by the door alone,
    # before FastAPI (its polls held on the process's one watch), and described in the OpenAPI.
    cpu = CallCpu(serving.metrics)
    app.state.agent_door = AgentDoor(
        store, AssignmentWatch(store, stopping=stopping), stopping, cpu, credential_ttl
    )
    # Registrations stay FastAPI's; they are timed as they enter it (``callcpu``).
    register = cpu.app(CallKind.REGISTER, functools.partial(FastAPI.__call__, app))
    app.raw_routes = {**app.state.agent_door.routes(), REGISTER: register}
    openapi.document(app)
    problems.install(app)
    limits.install(app)
    auth.install(app)  # added last, so it runs first: no body is read before the token is checked
    _assemble(
        app,
        store,
        serving,
        ca_pem,
        build_admin_router(
            store,
            files,
            gw.forget_keys if gw is not None else None,
            lambda: serving.observer.engine_values,
        ),
        build_records_router(store),
        build_agent_router(store, files, enrolment or EnrolmentPolicy()),
        build_ui_router(store),
    )
    return app


def create_gateway_app(
    store: SqlStore,
    lifespan: Lifespan | None = None,
    serving: Serving | None = None,
    ca_pem: bytes | None = None,
) -> FastAPI:
    """A gateway process on its own (``fleetserve gateway``): the OpenAI API over a shared store,
    with the same observer, engine load and ``/metrics`` as the control plane's gateway."""
    if serving is None:
        serving = Serving.build(store)
    app = ServingApp(
        lifespan=_serving_lifespan(serving, lifespan), title="fleetserve gateway", version=__version__
    )
    _assemble(app, store, serving, ca_pem)
    return app
