"""The gateway's API as raw ASGI, and the app that sends its paths to it before FastAPI.

FastAPI's routing, dependency injection and request objects cost more CPU than a proxied request
may (design.md, "Gateway": 0.3 CPU-seconds per 1,000 requests). The gateway's routes are the
engines' own (``EngineSpec.routes``, ``engines/routes.py``), indexed once here (``ApiIndex``) and
dispatched by exact path (a few by prefix: ``/slots/ID``): everything under ``/v1/``, and the
engines' paths outside it (``/completion``, ``/infill``, ``/tokenize``, ``/chat/completions``,
``/props``, ``/health`` ...). Everything else (admin API under ``/api/v1``, the agents' API, the
dashboard under ``/ui``, ``/metrics``, ``/healthz``, the lifespan) stays on FastAPI, in the same app
and on the same listener; an engine path that is one of the server's (``SERVER_PATHS``,
``SERVER_PREFIXES``: the engines' ``/metrics``) is never taken from it.

Health: the control plane's own is ``/healthz`` (unchanged); ``GET /health`` and ``/v1/health``
relay an engine's health for one model, named by ``?model=NAME`` (or the key's one model), from one
Ready replica, with an API key, as every relayed route needs one.

Routes that change an engine's state (admin rows) and those the gateway cannot relay faithfully
are answered here, before any API key is read: 403 (admin) or 404, in OpenAI's error shape, with
the row's reason. A path served by only some engines is checked per deployment once its model is
known (``Gateway.proxy``).

With CORS origins configured (``gateway.cors``), a browser's preflight is answered here before
any route or API key, and every answer to an allowed origin gets its CORS headers on the way out
(``_adding``); without (the default), an answer costs one check more.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Any

from fastapi import FastAPI

from fleetserve.engines.registry import ENGINES
from fleetserve.engines.routes import ApiRoute, RouteKind, find
from fleetserve.engines.spec import EngineSpec
from fleetserve.gateway.app import EngineRoutes, Gateway
from fleetserve.gateway.cors import REFUSALS, Cors, Preflight
from fleetserve.gateway.openai_errors import send_error
from fleetserve.rawasgi.headers import header
from fleetserve.rawasgi.types import App, Header, Message, Receive, Scope, Send

SERVER_PATHS = frozenset({"/metrics", "/healthz", "/"})
"""The server's own paths, never taken by an engine route of the same name."""

SERVER_PREFIXES = ("/api/", "/ui", "/docs", "/openapi", "/redoc", "/static")
"""The server's own path prefixes (admin and agents' API, dashboard, API docs)."""


def _server_owns(path: str) -> bool:
    return path in SERVER_PATHS or path.startswith(SERVER_PREFIXES)


class ApiIndex:
    """Every route of every engine, by method and path, each with what it is for each engine that
    serves it: built once from the engine rows (exact paths), with the prefix rows looked up on a
    miss."""

    def __init__(self, engines: Iterable[EngineSpec]) -> None:
        self.engines = tuple(engines)
        exact = {at for e in self.engines for at, r in e.routes.items() if not r.prefix}
        self.exact: dict[tuple[str, str], EngineRoutes] = {
            (method, path): self._each(method, path) for method, path in exact if not _server_owns(path)
        }
        self.prefixes = tuple(
            sorted(
                {
                    r.path
                    for e in self.engines
                    for r in e.routes.values()
                    if r.prefix and not _server_owns(r.path)
                }
            )
        )
        # The paths outside /v1/ that the gateway answers: the engines' own ones.
        self.native = frozenset(p for _, p in self.exact if not p.startswith("/v1/"))
        self.methods: dict[str, tuple[str, ...]] = {}
        for method, path in sorted(self.exact):
            self.methods[path] = (*self.methods.get(path, ()), method)

    def _each(self, method: str, path: str) -> EngineRoutes:
        found = {e.kind: find(e.routes, method, path) for e in self.engines}
        return MappingProxyType({k: r for k, r in found.items() if r is not None})

    def owns(self, path: str) -> bool:
        """Whether ``path`` is the gateway's: under ``/v1/``, or one of the engines' own paths."""
        return (
            path.startswith("/v1/")
            or path in self.native
            or (bool(self.prefixes) and path.startswith(self.prefixes))
        )

    def lookup(self, method: str, path: str) -> EngineRoutes | None:
        """What ``method path`` is for each engine that serves it; None where none does."""
        found = self.exact.get((method, path))
        if found is not None:
            return found
        if not path.startswith(self.prefixes) or _server_owns(path):
            return None
        return self._each(method, path) or None


INDEX = ApiIndex(ENGINES.values())
"""The routes of fleetserve's engines."""


def refusal(routes: EngineRoutes) -> ApiRoute | None:
    """The route to refuse by, when no engine that serves a path relays it to API keys."""
    rows = list(routes.values())
    if any(r.keys for r in rows):
        return None
    return next((r for r in rows if r.kind is RouteKind.ADMIN), rows[0])


async def send_refusal(send: Send, method: str, path: str, route: ApiRoute) -> None:
    """A route no API key may call: 403 for one that changes the engine's state, 404 for one the
    gateway cannot relay, each with its reason."""
    message = f"{method} {path} is not relayed to API keys: {route.why}."
    if route.kind is RouteKind.ADMIN:
        await send_error(send, 403, message, "permission_error", "route_not_allowed")
    else:
        await send_error(send, 404, message, "invalid_request_error", "route_not_relayed")


def _adding(send: Send, added: tuple[Header, ...]) -> Send:
    """``send``, with ``added`` appended to the response's headers."""

    async def sending(message: Message) -> None:
        if message["type"] == "http.response.start":
            message["headers"] = [*message.get("headers", ()), *added]
        await send(message)

    return sending


async def _answer_preflight(send: Send, preflight: Preflight) -> None:
    """A preflight's answer: 204 with its headers and no body, or its refusal in OpenAI's shape."""
    if preflight.refusal is not None:
        code = preflight.refusal.value
        await send_error(send, preflight.status, REFUSALS[preflight.refusal], "invalid_request_error", code)
        return
    await send({"type": "http.response.start", "status": preflight.status, "headers": preflight.headers})
    await send({"type": "http.response.body", "body": b""})


class OpenAIApi:
    """The OpenAI-compatible API over one ``Gateway``, as a raw ASGI app; with ``cors``, callable
    from web pages of its origins."""

    def __init__(self, gateway: Gateway, cors: Cors | None = None, index: ApiIndex = INDEX) -> None:
        self.gateway = gateway
        self.cors = cors
        self.index = index

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        cors = self.cors
        if cors is not None:
            origin = header(scope, b"origin")
            if origin is not None:
                if scope["method"] == "OPTIONS":
                    asked = header(scope, b"access-control-request-method")
                    if asked is not None:  # a preflight: no API key, no route
                        requested = header(scope, b"access-control-request-headers")
                        await _answer_preflight(send, cors.preflight(origin, asked, requested))
                        return
                added = cors.actual(origin)
                if added is not None:
                    send = _adding(send, added)
        path: str = scope["path"]
        method: str = scope["method"]
        routes = self.index.lookup(method, path)
        if routes is None:
            allowed = self.index.methods.get(path)
            if allowed:
                await send_error(
                    send,
                    405,
                    f"Use {' or '.join(allowed)} for {path}.",
                    "invalid_request_error",
                    "method_not_allowed",
                )
            else:
                await send_error(
                    send, 404, f"Unknown API route {path}.", "invalid_request_error", "unknown_url"
                )
            return
        refused = refusal(routes)
        if refused is not None:
            await send_refusal(send, method, path, refused)
        elif any(r.by_gateway for r in routes.values()):
            await self.gateway.models(scope, send)
        else:
            await self.gateway.proxy(scope, receive, send, routes)


class ServingApp(FastAPI):
    """A FastAPI app whose ``/v1/`` requests and engine paths go to the gateway's raw ASGI app
    first (``ApiIndex.owns``), and whose
    ``raw_routes`` (by exact path: plain ASGI apps, each the only handler of its path) are
    answered before FastAPI (the agents' hot calls, ``server/agents/door.py``)."""

    def __init__(
        self,
        *args: Any,
        openai_api: OpenAIApi | None = None,
        raw_routes: Mapping[str, App] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.openai_api = openai_api
        self.raw_routes: Mapping[str, App] = raw_routes or {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            api = self.openai_api
            if api is not None and api.index.owns(scope["path"]):
                await api(scope, receive, send)
                return
            route = self.raw_routes.get(scope["path"])
            if route is not None:
                await route(scope, receive, send)
                return
        await super().__call__(scope, receive, send)
