"""Body-size limits of the agents' API, one per route, checked before a route parses anything.

A body over its route's limit is answered 413 naming the limit, from its Content-Length before a
byte is read, or as soon as a chunked body passes the limit; a body within it is buffered (it is
small) and handed on. The per-document caps (labels, devices, HCAs, samples) are in
``fleetserve.protocol`` and answer 422.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from fleetserve.server.auth import AGENT_PREFIX
from fleetserve.server.problems import error_body

KiB = 1024
MiB = 1024 * KiB

# Per agent route (path after the prefix), the largest body it takes. A node document with every
# cap filled (256 devices, 64 HCAs, 64 labels) is under 128 KiB; a status report of a busy node
# (replicas with stderr tails, 4096 GPU samples) under 2 MiB.
BODY_LIMITS: Mapping[str, int] = MappingProxyType(
    {
        "/register": 256 * KiB,
        "/heartbeat": 4 * KiB,
        "/status": 4 * MiB,
    }
)
# Every other agent route is a GET: a body has no business there.
DEFAULT_LIMIT = 4 * KiB


def limit_for(path: str) -> int | None:
    """The body limit of ``path`` (None: not an agent route, no limit here)."""
    if path != AGENT_PREFIX and not path.startswith(AGENT_PREFIX + "/"):
        return None
    return BODY_LIMITS.get(path.removeprefix(AGENT_PREFIX), DEFAULT_LIMIT)


def _size(n: int) -> str:
    return f"{n // MiB} MiB" if n % MiB == 0 else f"{n // KiB} KiB" if n % KiB == 0 else f"{n} B"


def _too_large(method: str, path: str, limit: int) -> JSONResponse:
    message = f"the body of {method} {path} is over its limit of {_size(limit)} ({limit} bytes)"
    return JSONResponse(error_body("body_too_large", message), status_code=413)


class BodyLimitMiddleware:
    """Pure ASGI middleware enforcing ``BODY_LIMITS`` on the agents' API."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        limit = limit_for(scope.get("path", "")) if scope["type"] == "http" else None
        if limit is None:
            await self.app(scope, receive, send)
            return
        method, path = scope.get("method", ""), scope.get("path", "")
        declared = Headers(scope=scope).get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await _too_large(method, path, limit)(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away before its body was complete
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await _too_large(method, path, limit)(scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        await self.app(scope, replay(b"".join(chunks), receive), send)


def replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that hands on ``body`` (read already), then whatever follows."""
    sent = False

    async def again() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return again


def install(app: FastAPI) -> None:
    """Enforce the agents' API body limits (inside the token check: a caller without a valid
    token is refused before its body is read)."""
    app.add_middleware(BodyLimitMiddleware)
