"""The gateway's ``/v1`` as raw ASGI, and the app that sends ``/v1/`` to it before FastAPI.

FastAPI's routing, dependency injection and request objects cost more CPU than a proxied request
may (design.md, "Gateway": 0.3 CPU-seconds per 1,000 requests). The OpenAI API has four routes,
dispatched here by exact path; everything else (admin API, agents' API, ``/metrics``,
``/healthz``, the lifespan) stays on FastAPI, in the same app and on the same listener.

With CORS origins configured (``gateway.cors``), a browser's preflight is answered here before
any route or API key, and every answer to an allowed origin gets its CORS headers on the way out
(``_adding``); without (the default), an answer costs one check more.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI

from fleetserve.gateway.app import Gateway
from fleetserve.gateway.cors import REFUSALS, Cors, Preflight
from fleetserve.gateway.openai_errors import send_error
from fleetserve.rawasgi.headers import header
from fleetserve.rawasgi.types import App, Header, Message, Receive, Scope, Send

PROXIED: dict[str, bytes] = {
    "/v1/chat/completions": b"/v1/chat/completions",
    "/v1/completions": b"/v1/completions",
    "/v1/embeddings": b"/v1/embeddings",
}
"""The OpenAI routes forwarded to engines, with the path sent upstream."""


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

    def __init__(self, gateway: Gateway, cors: Cors | None = None) -> None:
        self.gateway = gateway
        self.cors = cors

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
        upstream = PROXIED.get(path)
        if upstream is not None:
            if method == "POST":
                await self.gateway.proxy(scope, receive, send, upstream)
            else:
                await send_error(
                    send, 405, f"Use POST for {path}.", "invalid_request_error", "method_not_allowed"
                )
        elif path == "/v1/models":
            if method == "GET":
                await self.gateway.models(scope, send)
            else:
                await send_error(
                    send, 405, "Use GET for /v1/models.", "invalid_request_error", "method_not_allowed"
                )
        else:
            await send_error(send, 404, f"Unknown API route {path}.", "invalid_request_error", "unknown_url")


class ServingApp(FastAPI):
    """A FastAPI app whose ``/v1/`` requests go to the OpenAI API's raw ASGI app first, and whose
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
            if api is not None and scope["path"].startswith("/v1/"):
                await api(scope, receive, send)
                return
            route = self.raw_routes.get(scope["path"])
            if route is not None:
                await route(scope, receive, send)
                return
        await super().__call__(scope, receive, send)
