"""Credentials: admin tokens for the admin API, join tokens for agents, both Bearer tokens stored hashed.

A middleware checks them before anything else — the request body included — so a caller
without a token gets a 401 and the server never reads what it sent.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from fleetserve.errors import StoreError
from fleetserve.server.problems import Unauthorized, error_body
from fleetserve.store.credentials import TokenKind
from fleetserve.store.protocols import Tokens
from fleetserve.store.sql import SqlStore

_bearer = HTTPBearer(auto_error=False, description="An admin token (admin API) or a join token (agent API).")


def store_of(request: Request) -> SqlStore:
    """The store the app was created with."""
    store: SqlStore = request.app.state.store
    return store


def kind_for(path: str) -> TokenKind | None:
    """Which token a path needs: agent routes a join token, other API routes an admin token."""
    if path == "/api/v1/agent" or path.startswith("/api/v1/agent/"):
        return TokenKind.JOIN
    if path.startswith("/api/"):
        return TokenKind.ADMIN
    return None


def check_bearer(store: Tokens, authorization: str | None, kind: TokenKind) -> None:
    """Raise Unauthorized unless ``authorization`` carries a valid, unrevoked token of ``kind``."""
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise Unauthorized(f"this API needs an {kind.value} token as 'Authorization: Bearer TOKEN'")
    if not store.verify_token(token.strip(), kind):
        raise Unauthorized(
            f"the token is not a valid {kind.value} token (wrong, revoked, or of another kind)"
        )


class TokenMiddleware:
    """Pure ASGI middleware that checks an API request's token before anything else runs.

    Pure ASGI, not Starlette's BaseHTTPMiddleware: that one wraps ``receive`` in a way that hides
    a client's disconnect from the route, which the gateway needs to cancel upstream requests.
    """

    def __init__(self, app: ASGIApp, store: Callable[[], Tokens]) -> None:
        self.app = app
        self.store = store

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = kind_for(scope.get("path", "")) if scope["type"] == "http" else None
        if kind is not None:
            header = Headers(scope=scope).get("authorization")
            response: JSONResponse | None = None
            try:
                await run_in_threadpool(check_bearer, self.store(), header, kind)
            except Unauthorized as exc:
                response = JSONResponse(
                    error_body("unauthorized", str(exc)),
                    status_code=401,
                    headers={"WWW-Authenticate": "Bearer"},
                )
            except StoreError as exc:
                response = JSONResponse(error_body("store_unavailable", str(exc)), status_code=503)
            if response is not None:
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def install(app: FastAPI) -> None:
    """Check every API request's token first (see ``TokenMiddleware``)."""
    app.add_middleware(TokenMiddleware, store=lambda: app.state.store)


def _declare(
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> None:
    """Declares the Bearer scheme in the OpenAPI document; the middleware has checked it already."""


admin = Depends(_declare)
agent = Depends(_declare)
