"""Credentials: admin tokens for the admin API, join tokens for agents, both Bearer tokens stored hashed."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from fleetserve.server.problems import Unauthorized
from fleetserve.store.sql import SqlStore, TokenKind

_bearer = HTTPBearer(auto_error=False, description="An admin token (admin API) or a join token (agent API).")


def store_of(request: Request) -> SqlStore:
    """The store the app was created with."""
    store: SqlStore = request.app.state.store
    return store


def require(kind: TokenKind) -> Callable[..., None]:
    """A dependency that lets a request through only with a valid, unrevoked token of ``kind``."""

    def check(
        request: Request,
        credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
    ) -> None:
        if credentials is None or credentials.scheme.lower() != "bearer":
            raise Unauthorized(f"this API needs an {kind.value} token as 'Authorization: Bearer TOKEN'")
        if not store_of(request).verify_token(credentials.credentials, kind):
            raise Unauthorized(
                f"the token is not a valid {kind.value} token (wrong, revoked, or of another kind)"
            )

    return check


admin = Depends(require(TokenKind.ADMIN))
agent = Depends(require(TokenKind.JOIN))
