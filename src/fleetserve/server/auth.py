"""Credentials: admin tokens for the admin API, join tokens for agents, both Bearer tokens stored hashed.

A middleware checks them before anything else — the request body included — so a caller
without a token gets a 401 and the server never reads what it sent.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated

from fastapi import Depends, FastAPI, Request, Response
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.concurrency import run_in_threadpool

from fleetserve.errors import StoreError
from fleetserve.server.problems import Unauthorized, error_body
from fleetserve.store.sql import SqlStore, TokenKind

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


def check_bearer(store: SqlStore, authorization: str | None, kind: TokenKind) -> None:
    """Raise Unauthorized unless ``authorization`` carries a valid, unrevoked token of ``kind``."""
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise Unauthorized(f"this API needs an {kind.value} token as 'Authorization: Bearer TOKEN'")
    if not store.verify_token(token.strip(), kind):
        raise Unauthorized(
            f"the token is not a valid {kind.value} token (wrong, revoked, or of another kind)"
        )


def install(app: FastAPI) -> None:
    """Register the middleware that checks every API request's token first."""

    @app.middleware("http")
    async def _authenticate(
        request: Request, call_next: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        kind = kind_for(request.url.path)
        if kind is not None:
            header = request.headers.get("authorization")
            try:
                await run_in_threadpool(check_bearer, store_of(request), header, kind)
            except Unauthorized as exc:
                return JSONResponse(
                    error_body("unauthorized", str(exc)),
                    status_code=401,
                    headers={"WWW-Authenticate": "Bearer"},
                )
            except StoreError as exc:
                return JSONResponse(error_body("store_unavailable", str(exc)), status_code=503)
        return await call_next(request)


def _declare(
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> None:
    """Declares the Bearer scheme in the OpenAPI document; the middleware has checked it already."""


admin = Depends(_declare)
agent = Depends(_declare)
