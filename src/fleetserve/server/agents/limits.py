"""Body-size limits of the agents' API, one per call, checked before anything is parsed.

A body over its call's limit is answered 413 naming the limit (``refusals.too_large``), from its
Content-Length before a byte is read, or as soon as a chunked body passes the limit. The agents'
door (``door.py``) checks its three calls itself; ``BodyLimitMiddleware`` checks the FastAPI
routes (registration, classes, model files) and hands them the body it read, which is small. The
per-document caps (labels, devices, HCAs, samples) are in ``fleetserve.protocol`` and answer 422.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from fastapi import FastAPI
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from fleetserve.rawasgi.body import Unread, read_body
from fleetserve.rawasgi.headers import header
from fleetserve.server.agents.refusals import refuse, too_large
from fleetserve.server.auth import AGENT_PREFIX

KiB = 1024
MiB = 1024 * KiB

# Per agent call (path after the prefix), the largest body it takes. A node document with every
# cap filled (256 devices, 64 HCAs, 64 labels) is under 128 KiB; a status report of a busy node
# (replicas with stderr tails, 4096 GPU samples) under 2 MiB.
BODY_LIMITS: Mapping[str, int] = MappingProxyType(
    {
        "/register": 256 * KiB,
        "/heartbeat": 4 * KiB,
        "/status": 4 * MiB,
    }
)
# Every other agent call is a GET: a body has no business there.
DEFAULT_LIMIT = 4 * KiB


def limit_for(path: str) -> int | None:
    """The body limit of ``path`` (None: not an agent call, no limit here)."""
    if path != AGENT_PREFIX and not path.startswith(AGENT_PREFIX + "/"):
        return None
    return BODY_LIMITS.get(path.removeprefix(AGENT_PREFIX), DEFAULT_LIMIT)


class BodyLimitMiddleware:
    """Pure ASGI middleware enforcing ``BODY_LIMITS`` on the agents' FastAPI routes."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        limit = limit_for(scope.get("path", "")) if scope["type"] == "http" else None
        if limit is None:
            await self.app(scope, receive, send)
            return
        method, path = scope.get("method", ""), scope.get("path", "")
        declared = header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await refuse(send, too_large(method, path, limit))
            return
        body = await read_body(receive, limit)
        if body is Unread.GONE:
            return  # the client went away before its body was complete
        if body is Unread.OVER_LIMIT:
            await refuse(send, too_large(method, path, limit))
            return
        await self.app(scope, _read_already(body, receive), send)


def _read_already(body: bytes, receive: Receive) -> Receive:
    """The route's ``receive``: the body read here, then whatever follows (its disconnect)."""
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
