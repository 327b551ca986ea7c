"""Credentials: admin tokens for the admin API; for agents, the join token (which only enrols)
and each node's own credential. All are Bearer tokens stored hashed.

A middleware checks them before anything else — the request body included — so a caller
without a token gets a 401 and the server never reads what it sent. On the agents' FastAPI
routes it records who called (``Caller``) in the request's state: the routes authorise against
it (a node speaks only for itself). The join token is accepted on ``ENROL_PATHS`` only. The
agents' heartbeat, status report and assignments poll never reach it: the agents' door
(``server/agents/door.py``) checks their credentials itself, in the same words.

The admin API also takes the dashboard's session cookie (``SESSION_COOKIE``), only when no
Authorization header is sent, and then, for every change (not GET or HEAD), the session's CSRF
token in ``CSRF_HEADER``: the same admin API, no second one. The agents' API and the gateway never
take the cookie.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers
from starlette.requests import cookie_parser
from starlette.types import ASGIApp, Receive, Scope, Send

from fleetserve.errors import StoreError
from fleetserve.rawasgi.headers import bearer
from fleetserve.server.agents.callcpu import charged
from fleetserve.server.agents.refusals import Reason, Refusal
from fleetserve.server.problems import Forbidden, Unauthorized, error_body
from fleetserve.store.credentials import TokenKind
from fleetserve.store.protocols import AdminAuth, Sessions, Tokens
from fleetserve.store.sql import SqlStore

_bearer = HTTPBearer(
    auto_error=False,
    description="An admin token (admin API); a node credential, or a join token to enrol (agent API).",
)

AGENT_PREFIX = "/api/v1/agent"
# The dashboard's session cookie (HttpOnly), the cookie the page reads its CSRF token from (not
# HttpOnly), and the header it sends that token back in.
SESSION_COOKIE = "fs_session"
CSRF_COOKIE = "fs_csrf"
CSRF_HEADER = "X-CSRF-Token"
# Methods that change nothing, so need no CSRF token.
SAFE_METHODS = frozenset({"GET", "HEAD"})
# The agent routes a join token may call: enrolment, and the classes it describes the node with.
ENROL_PATHS = frozenset({f"{AGENT_PREFIX}/register", f"{AGENT_PREFIX}/classes"})


@dataclass(frozen=True)
class Caller:
    """Who called the agents' API: a node (by its credential) or a holder of the join token."""

    node: str | None  # None: the join token


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


def check_agent(store: Tokens, authorization: str | None, path: str) -> Caller:
    """The caller of an agent route: a node by its credential, or (on ``ENROL_PATHS`` only) a
    holder of a valid join token. Unauthorized otherwise, in the words of the agents' door
    (``server/agents/refusals.py``), which checks its own calls the same way."""
    token = bearer(authorization.encode("latin-1")) if authorization is not None else None
    if token is None:
        raise Unauthorized(Refusal(Reason.NO_CREDENTIAL).message())
    node = store.node_for_credential(token)
    if node is not None:
        return Caller(node)
    if store.verify_token(token, TokenKind.JOIN):
        if path in ENROL_PATHS:
            return Caller(None)
        raise Unauthorized(Refusal(Reason.JOIN_TOKEN).message())
    raise Unauthorized(Refusal(Reason.NOT_A_CREDENTIAL).message())


@dataclass(frozen=True)
class Admin:
    """Who called the admin API: the admin token's id, and how it was presented. ``actor`` is the
    name the audit log records."""

    token_id: int
    via: str = "bearer"  # "bearer", or "ui session" for the dashboard's cookie

    @property
    def actor(self) -> str:
        suffix = "" if self.via == "bearer" else f" ({self.via})"
        return f"admin token {self.token_id}{suffix}"


def check_bearer(store: Tokens, authorization: str | None, kind: TokenKind) -> int:
    """The id of the valid, unrevoked token of ``kind`` that ``authorization`` carries;
    Unauthorized otherwise."""
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise Unauthorized(f"this API needs an {kind.value} token as 'Authorization: Bearer TOKEN'")
    token_id = store.token_id_for(token.strip(), kind)
    if token_id is None:
        raise Unauthorized(
            f"the token is not a valid {kind.value} token (wrong, revoked, or of another kind)"
        )
    return token_id


def check_session(store: Sessions, cookie: str, method: str, csrf: str | None) -> Admin:
    """The admin behind a dashboard session cookie: Unauthorized unless the session is open and its
    admin token valid; Forbidden when a change (not GET/HEAD) lacks the session's CSRF token."""
    session = store.check_session(cookie)
    if session is None:
        raise Unauthorized(
            "the dashboard session is not valid (logged out, expired, or its admin token was "
            "revoked): log in again at /ui/login, or send 'Authorization: Bearer TOKEN'"
        )
    if method not in SAFE_METHODS and not session.csrf_matches(csrf):
        raise Forbidden(
            f"a change through a dashboard session needs header {CSRF_HEADER} with the session's "
            f"CSRF token (the {CSRF_COOKIE} cookie)"
        )
    return Admin(session.token_id, via="ui session")


def session_cookie(headers: Headers) -> str | None:
    """The dashboard's session cookie a request carries, if any."""
    value = cookie_parser(headers.get("cookie", "")).get(SESSION_COOKIE)
    return value or None


def check_admin(store: AdminAuth, headers: Headers, method: str) -> Admin:
    """The caller of an admin route: an admin token in the Authorization header or, without that
    header, a dashboard session (see ``check_session``)."""
    authorization = headers.get("authorization")
    cookie = session_cookie(headers) if authorization is None else None
    if cookie is not None:
        return check_session(store, cookie, method, headers.get(CSRF_HEADER))
    return Admin(check_bearer(store, authorization, TokenKind.ADMIN))


class TokenMiddleware:
    """Pure ASGI middleware that checks an API request's token before anything else runs.

    Pure ASGI, not Starlette's BaseHTTPMiddleware: that one wraps ``receive`` in a way that hides
    a client's disconnect from the route, which the gateway needs to cancel upstream requests.
    """

    def __init__(self, app: ASGIApp, store: Callable[[], AdminAuth]) -> None:
        self.app = app
        self.store = store

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        kind = kind_for(path) if scope["type"] == "http" else None
        if kind is not None:
            headers = Headers(scope=scope)
            response: JSONResponse | None = None
            try:
                if kind is TokenKind.JOIN:
                    header = headers.get("authorization")
                    caller = await run_in_threadpool(charged(check_agent), self.store(), header, path)
                    scope.setdefault("state", {})["caller"] = caller
                else:
                    method = scope.get("method", "GET")
                    who = await run_in_threadpool(check_admin, self.store(), headers, method)
                    scope.setdefault("state", {})["admin"] = who
            except Forbidden as exc:
                response = JSONResponse(error_body("forbidden", str(exc)), status_code=403)
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


def admin_of(request: Request) -> Admin:
    """The admin-route caller the middleware recorded (its token, for the audit log)."""
    who = getattr(request.state, "admin", None)
    if not isinstance(who, Admin):
        raise Unauthorized("this API needs an admin token")
    return who


def caller_of(request: Request) -> Caller:
    """The agent-route caller the middleware recorded."""
    caller = getattr(request.state, "caller", None)
    if not isinstance(caller, Caller):
        raise Unauthorized("this API needs a node credential")
    return caller


def node_of(request: Request) -> str:
    """The node whose credential called; Forbidden for the join token (it only enrols)."""
    caller = caller_of(request)
    if caller.node is None:
        raise Forbidden("the join token only enrols; use the node's credential")
    return caller.node


def speaks_for(request: Request, node: str) -> str:
    """The calling node, refused (403) unless it is ``node``: a node speaks only for itself."""
    own = node_of(request)
    if own != node:
        raise Forbidden(f"this credential is node {own}'s; it cannot speak for node {node}")
    return own


admin = Depends(_declare)
agent = Depends(_declare)
