"""The web dashboard at ``/ui``: its pages, its static files, and the login that opens a session.

The pages are static files of this package (``fleetserve/ui``): vanilla JavaScript and CSS, no
build step, nothing fetched from elsewhere. They read and change the fleet through the same admin
API as the CLI, with the session cookie and the CSRF header (``server/auth.py``). Every page but
the login page (and the static files, which hold no data) needs a session: without one it
redirects to ``/ui/login``. Every answer here carries a strict Content-Security-Policy: scripts
and styles from this origin only, no inline script, no framing.
"""

from __future__ import annotations

import json
import time
import urllib.parse
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from importlib import resources
from types import MappingProxyType
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse, RedirectResponse
from starlette.concurrency import run_in_threadpool

from fleetserve.server.admin.loginthrottle import LoginThrottle
from fleetserve.server.auth import CSRF_COOKIE, CSRF_HEADER, SESSION_COOKIE
from fleetserve.store.credentials import TokenKind
from fleetserve.store.protocols import AdminAuth

UI = "/ui"
LOGIN = f"{UI}/login"
LOGOUT = f"{UI}/logout"
HOME = f"{UI}/fleet"
# The pages of the one-page shell (index.html); its script draws the page its path names.
PAGES = ("fleet", "deployments", "replica", "playground", "keys", "usage", "events")
SESSION_TTL = timedelta(hours=12)
# A login body holds one token (~50 characters); anything much longer is not one.
LOGIN_BODY_LIMIT = 4096

CSP = "; ".join(
    (
        "default-src 'none'",
        "script-src 'self'",
        "style-src 'self'",
        "img-src 'self'",
        "connect-src 'self'",
        "form-action 'self'",
        "frame-ancestors 'none'",
        "base-uri 'none'",
    )
)
SECURITY_HEADERS: Mapping[str, str] = MappingProxyType(
    {
        "Content-Security-Policy": CSP,
        "X-Content-Type-Options": "nosniff",
        "X-Frame-Options": "DENY",
        "Referrer-Policy": "no-referrer",
    }
)
CONTENT_TYPES: Mapping[str, str] = MappingProxyType(
    {
        ".js": "text/javascript; charset=utf-8",
        ".css": "text/css; charset=utf-8",
        ".svg": "image/svg+xml",
        ".html": "text/html; charset=utf-8",
    }
)
ERROR_MARK = "<!--error-->"


def load_assets() -> tuple[dict[str, bytes], dict[str, str]]:
    """The static files (by name) and the two HTML pages (index, login) of the package, read once:
    only these names are ever served, so no path can leave the directory."""
    root = resources.files("fleetserve.ui")
    static = {
        f.name: f.read_bytes()
        for f in (root / "static").iterdir()
        if f.is_file() and any(f.name.endswith(ext) for ext in CONTENT_TYPES)
    }
    pages = {name: (root / f"{name}.html").read_text(encoding="utf-8") for name in ("index", "login")}
    return static, pages


def _secured(response: Response, cache: bool = False) -> Response:
    response.headers.update(SECURITY_HEADERS)
    response.headers["Cache-Control"] = "private, max-age=300" if cache else "no-store"
    return response


def _html(body: str, status: int = 200) -> Response:
    return _secured(Response(body, status_code=status, media_type="text/html; charset=utf-8"))


def _to_login() -> Response:
    return _secured(RedirectResponse(LOGIN, status_code=303))


async def _bounded_body(request: Request) -> bytes | None:
    """The request's body, or None when it is over ``LOGIN_BODY_LIMIT``."""
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > LOGIN_BODY_LIMIT:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


def _token_of(body: bytes, content_type: str) -> str | None:
    """The ``token`` field of a login form or JSON body; None when there is none."""
    value: Any = None
    if content_type.startswith("application/json"):
        try:
            data = json.loads(body)
        except ValueError:
            return None
        value = data.get("token") if isinstance(data, dict) else None
    elif content_type.startswith("application/x-www-form-urlencoded"):
        fields = urllib.parse.parse_qs(body.decode("utf-8", "replace"), max_num_fields=4)
        value = next(iter(fields.get("token", [])), None)
    return value.strip() if isinstance(value, str) and value.strip() else None


def build_ui_router(store: AdminAuth, throttle: LoginThrottle | None = None) -> APIRouter:
    """The dashboard's routes: pages, static files, login and logout."""
    static, pages = load_assets()
    throttle = throttle or LoginThrottle()
    ui = APIRouter(include_in_schema=False)

    def wants_json(request: Request) -> bool:
        return request.headers.get("content-type", "").startswith("application/json")

    def refused(
        request: Request, status: int, message: str, headers: dict[str, str] | None = None
    ) -> Response:
        if wants_json(request):
            kind = "unauthorized" if status == 401 else "too_many_requests"
            body = {"error": {"type": kind, "message": message, "problems": []}}
            return _secured(JSONResponse(body, status_code=status, headers=headers))
        page = pages["login"].replace(ERROR_MARK, f'<p class="error" role="alert">{message}</p>')
        response = _html(page, status)
        response.headers.update(headers or {})
        return response

    async def has_session(request: Request) -> bool:
        cookie = request.cookies.get(SESSION_COOKIE)
        return cookie is not None and await run_in_threadpool(store.check_session, cookie) is not None

    @ui.get(UI)
    @ui.get(f"{UI}/")
    def root() -> Response:
        return _secured(RedirectResponse(HOME, status_code=303))

    @ui.get(LOGIN)
    def login_page() -> Response:
        return _html(pages["login"])

    @ui.post(LOGIN)
    async def login(request: Request) -> Response:
        address = request.client.host if request.client else "unknown"
        wait = throttle.retry_after(address, time.monotonic())
        if wait is not None:
            seconds = max(1, round(wait))
            message = f"Too many failed logins: try again in {seconds} s."
            return refused(request, 429, message, {"Retry-After": str(seconds)})
        body = await _bounded_body(request)
        token = _token_of(body, request.headers.get("content-type", "")) if body is not None else None
        token_id = None
        if token is not None:
            token_id = await run_in_threadpool(store.token_id_for, token, TokenKind.ADMIN)
        if token_id is None:
            throttle.failed(address, time.monotonic())
            return refused(request, 401, "Login failed: that is not a valid admin token.")
        throttle.succeeded(address)
        now = datetime.now(UTC)
        await run_in_threadpool(store.prune_sessions, now)
        opened = await run_in_threadpool(store.open_session, token_id, now, SESSION_TTL)
        response: Response
        if wants_json(request):
            response = JSONResponse({"csrf": opened.csrf, "expiresAt": opened.expires_at.isoformat()})
        else:
            response = RedirectResponse(HOME, status_code=303)
        secure = request.url.scheme == "https"
        age = int(SESSION_TTL.total_seconds())
        # The session cookie is HttpOnly; the page reads the CSRF token from its own cookie.
        for name, value, httponly in (
            (SESSION_COOKIE, opened.cookie, True),
            (CSRF_COOKIE, opened.csrf, False),
        ):
            response.set_cookie(
                name, value, max_age=age, path="/", secure=secure, httponly=httponly, samesite="strict"
            )
        return _secured(response)

    @ui.post(LOGOUT)
    async def logout(request: Request) -> Response:
        cookie = request.cookies.get(SESSION_COOKIE)
        if cookie:
            session = await run_in_threadpool(store.check_session, cookie)
            if session is not None and not session.csrf_matches(request.headers.get(CSRF_HEADER)):
                body = {
                    "error": {
                        "type": "forbidden",
                        "message": f"logging out needs header {CSRF_HEADER} with the session's CSRF token",
                        "problems": [],
                    }
                }
                return _secured(JSONResponse(body, status_code=403))
            await run_in_threadpool(store.end_session, cookie)
        response = JSONResponse({"loggedOut": True})
        for name in (SESSION_COOKIE, CSRF_COOKIE):
            response.delete_cookie(name, path="/", httponly=name == SESSION_COOKIE, samesite="strict")
        return _secured(response)

    @ui.get(f"{UI}/static/{{name}}")
    def asset(name: str) -> Response:
        data = static.get(name)
        if data is None:
            return _secured(Response("not found", status_code=404, media_type="text/plain"))
        suffix = name[name.rfind(".") :]
        return _secured(Response(data, media_type=CONTENT_TYPES[suffix]), cache=False)

    @ui.get(f"{UI}/{{page}}")
    async def page(page: str, request: Request) -> Response:
        if not await has_session(request):
            return _to_login()
        if page not in PAGES:
            return _html(pages["index"], 404)
        return _html(pages["index"])

    return ui
