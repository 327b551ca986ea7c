"""The dashboard's login, session cookie and CSRF check, in process over a real store (SQLite and
PostgreSQL), including the attacker's side: a cookie without the CSRF header, another session's
CSRF token, the cookie on the agents' API or the gateway, a logged-out cookie, a cookie whose
admin token was revoked, a join token at the login, and a guesser at the login."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from starlette.datastructures import Headers

from fleetserve.server.admin.ui import PAGES
from fleetserve.server.app import create_app
from fleetserve.server.auth import CSRF_HEADER, Admin, check_admin
from fleetserve.server.reconciler.loop import Reconciler
from fleetserve.store import SqlStore, TokenKind

T0 = datetime(2025, 6, 1, 12, 0, tzinfo=UTC)
UI_DIR = Path(__file__).resolve().parents[3] / "src" / "fleetserve" / "ui"
NODE = {"kind": "Node", "name": "n1", "cpu": {"cores": 8, "memory": "32GiB"}}


@dataclass(frozen=True)
class Session:
    """A logged-in dashboard session: the cookie's value and the CSRF token."""

    cookie: str
    csrf: str

    def headers(self, csrf: str | None = None) -> dict[str, str]:
        out = {"Cookie": f"fs_session={self.cookie}"}
        if csrf is not None:
            out[CSRF_HEADER] = csrf
        return out


@dataclass
class Ui:
    client: TestClient
    store: SqlStore
    admin_token: str
    admin_id: int
    join_token: str

    def login(self, token: str | None = None) -> Session:
        response = self.client.post("/ui/login", json={"token": token or self.admin_token})
        assert response.status_code == 200, response.text
        self.client.cookies.clear()  # every test sends its cookies by hand
        return Session(response.cookies["fs_session"], response.json()["csrf"])

    @property
    def bearer(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.admin_token}"}

    def cordon(self) -> str | None:
        node = self.client.get("/api/v1/nodes/n1", headers=self.bearer).json()
        return node["cordon"]["reason"] if node["cordon"] else None


@pytest.fixture
def ui(store: SqlStore) -> Iterator[Ui]:
    admin = store.create_token(TokenKind.ADMIN, T0)
    join = store.create_token(TokenKind.JOIN, T0).plaintext
    app = create_app(store)
    with TestClient(app, raise_server_exceptions=False, follow_redirects=False) as client:
        applied = client.post(
            "/api/v1/apply",
            json={"documents": [NODE]},
            headers={"Authorization": f"Bearer {admin.plaintext}"},
        )
        assert applied.status_code == 200, applied.text
        yield Ui(client, store, admin.plaintext, admin.id, join)


def set_cookies(response: object) -> dict[str, str]:
    """Each Set-Cookie header of ``response`` by cookie name (the whole header, lowercased)."""
    headers = response.headers.get_list("set-cookie")  # type: ignore[attr-defined]
    return {h.split("=", 1)[0]: h.lower() for h in headers}


# --- login -------------------------------------------------------------------------------------


def test_a_form_login_sets_an_httponly_strict_session_cookie_and_a_readable_csrf_cookie(ui: Ui) -> None:
    response = ui.client.post("/ui/login", data={"token": ui.admin_token})
    assert response.status_code == 303 and response.headers["location"] == "/ui/fleet"
    cookies = set_cookies(response)
    session, csrf = cookies["fs_session"], cookies["fs_csrf"]
    for header in (session, csrf):
        assert "samesite=strict" in header and "path=/" in header and "max-age=43200" in header
        assert "secure" not in header  # plain HTTP here
    assert "httponly" in session and "httponly" not in csrf
    assert ui.admin_token.lower() not in session + csrf


def test_under_tls_the_cookies_are_secure(store: SqlStore) -> None:
    admin = store.create_token(TokenKind.ADMIN, T0).plaintext
    with TestClient(create_app(store), base_url="https://testserver", follow_redirects=False) as client:
        response = client.post("/ui/login", data={"token": admin})
    assert response.status_code == 303
    assert all("; secure" in h for h in set_cookies(response).values())


@pytest.mark.parametrize("which", ["join", "wrong", "empty", "missing"])
def test_a_login_with_anything_but_an_admin_token_is_a_401_page_without_a_hint(ui: Ui, which: str) -> None:
    data = {
        "join": {"token": ui.join_token},
        "wrong": {"token": "fs_admin_never-issued"},
        "empty": {"token": ""},
        "missing": {"user": "admin"},
    }[which]
    response = ui.client.post("/ui/login", data=data)
    assert response.status_code == 401
    assert "fs_session" not in set_cookies(response)
    assert response.headers["content-type"].startswith("text/html")
    assert "Login failed: that is not a valid admin token." in response.text
    as_json = ui.client.post("/ui/login", json=data)
    assert as_json.status_code == 401 and as_json.json()["error"]["type"] == "unauthorized"


def test_a_login_body_over_its_limit_is_refused(ui: Ui) -> None:
    response = ui.client.post("/ui/login", data={"token": "x" * 5000})
    assert response.status_code == 401


def test_failed_logins_are_bounded_per_address_even_for_the_right_token_after(ui: Ui) -> None:
    for _ in range(10):
        assert ui.client.post("/ui/login", data={"token": "fs_admin_guess"}).status_code == 401
    held = ui.client.post("/ui/login", data={"token": ui.admin_token})
    assert held.status_code == 429
    assert int(held.headers["retry-after"]) > 0
    assert "fs_session" not in set_cookies(held)


def test_failed_logins_from_rotating_addresses_never_lock_out_a_valid_token_from_another(
    store: SqlStore,
) -> None:
    """The audit's attack: 158 failures (here 250, past the overall cap of 200) from rotating
    addresses; an admin with a valid token from an address that has not failed still logs in."""
    admin = store.create_token(TokenKind.ADMIN, T0)
    app = create_app(store)
    for i in range(250):
        with TestClient(app, client=(f"198.51.{i // 250}.{i % 250}", 40000)) as attacker:
            assert attacker.post("/ui/login", data={"token": "fs_admin_guess"}).status_code == 401
    with TestClient(app, client=("198.51.0.7", 40000)) as attacker:  # one that failed: held
        assert attacker.post("/ui/login", data={"token": "fs_admin_guess"}).status_code == 429
    with TestClient(app, client=("192.0.2.10", 40000), follow_redirects=False) as admin_client:
        response = admin_client.post("/ui/login", json={"token": admin.plaintext})
        assert response.status_code == 200, response.text
        assert "fs_session" in set_cookies(response)


# --- the session on the admin API ---------------------------------------------------------------


def test_the_session_reads_the_admin_api_and_changes_it_with_its_csrf_token(ui: Ui) -> None:
    session = ui.login()
    assert ui.client.get("/api/v1/nodes", headers=session.headers()).status_code == 200
    response = ui.client.post(
        "/api/v1/nodes/n1/cordon", json={"reason": "from the UI"}, headers=session.headers(session.csrf)
    )
    assert response.status_code == 200, response.text
    assert ui.cordon() == "from the UI"


def test_the_session_is_recorded_as_the_admin_token_via_the_ui(ui: Ui) -> None:
    session = ui.login()
    headers = Headers({"cookie": f"fs_session={session.cookie}"})
    assert check_admin(ui.store, headers, "GET") == Admin(ui.admin_id, via="ui session")
    assert Admin(ui.admin_id, via="ui session").actor == f"admin token {ui.admin_id} (ui session)"


def test_a_change_with_the_cookie_but_without_the_csrf_header_is_a_403_naming_the_header(ui: Ui) -> None:
    session = ui.login()
    for method, path, body in [
        ("POST", "/api/v1/nodes/n1/cordon", {"reason": "csrf"}),
        ("POST", "/api/v1/keys", {"name": "k", "models": ["*"]}),
        ("DELETE", "/api/v1/nodes/n1", None),
    ]:
        response = ui.client.request(method, path, json=body, headers=session.headers())
        assert response.status_code == 403, (method, path, response.text)
        assert CSRF_HEADER in response.json()["error"]["message"]
    assert ui.cordon() is None
    assert ui.client.get("/api/v1/keys", headers=ui.bearer).json() == []


def test_the_csrf_token_of_another_session_is_a_403(ui: Ui) -> None:
    mine, other = ui.login(), ui.login()
    response = ui.client.post(
        "/api/v1/nodes/n1/cordon", json={"reason": "csrf"}, headers=mine.headers(other.csrf)
    )
    assert response.status_code == 403
    assert ui.cordon() is None


def test_the_cookie_is_refused_on_the_agents_api_and_by_the_gateway(ui: Ui) -> None:
    session = ui.login()
    headers = session.headers(session.csrf)
    for path in ("/api/v1/agent/register", "/api/v1/agent/heartbeat"):
        assert ui.client.post(path, json={}, headers=headers).status_code == 401
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert ui.client.post("/v1/chat/completions", json=chat, headers=headers).status_code == 401


def test_a_logged_out_cookie_is_a_401(ui: Ui) -> None:
    session = ui.login()
    assert ui.client.post("/ui/logout", headers=session.headers()).status_code == 403  # no CSRF token
    response = ui.client.post("/ui/logout", headers=session.headers(session.csrf))
    assert response.status_code == 200
    assert all("max-age=0" in h for h in set_cookies(response).values())
    refused = ui.client.get("/api/v1/nodes", headers=session.headers())
    assert refused.status_code == 401 and "log in again" in refused.json()["error"]["message"]


def test_a_cookie_whose_admin_token_was_revoked_is_a_401(ui: Ui) -> None:
    session = ui.login()
    other = ui.client.post("/api/v1/tokens", json={"kind": "admin"}, headers=ui.bearer).json()["token"]
    revoked = ui.client.delete(f"/api/v1/tokens/{ui.admin_id}", headers={"Authorization": f"Bearer {other}"})
    assert revoked.status_code == 200, revoked.text
    assert ui.client.get("/api/v1/nodes", headers=session.headers()).status_code == 401
    assert ui.client.get("/ui/fleet", headers=session.headers()).status_code == 303


def test_an_authorization_header_wins_over_the_cookie(ui: Ui) -> None:
    session = ui.login()
    headers = {**session.headers(session.csrf), "Authorization": "Bearer fs_admin_wrong"}
    assert ui.client.get("/api/v1/nodes", headers=headers).status_code == 401


# --- pages -------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/ui/fleet", "/ui/keys", "/ui/replica?name=x", "/ui/nothing-here"])
def test_no_page_without_a_session(ui: Ui, path: str) -> None:
    response = ui.client.get(path)
    assert response.status_code == 303 and response.headers["location"] == "/ui/login"
    assert ui.client.get(path, headers={"Cookie": "fs_session=forged"}).status_code == 303


def test_every_page_with_a_session_is_the_shell_under_a_strict_csp(ui: Ui) -> None:
    session = ui.login()
    for page in PAGES:
        response = ui.client.get(f"/ui/{page}", headers=session.headers())
        assert response.status_code == 200, page
        csp = response.headers["content-security-policy"]
        assert "script-src 'self'" in csp and "unsafe" not in csp and "default-src 'none'" in csp
        assert response.headers["x-frame-options"] == "DENY"
        assert response.headers["cache-control"] == "no-store"
        assert '<script type="module" src="/ui/static/main.js">' in response.text
    assert ui.client.get("/ui/", headers=session.headers()).headers["location"] == "/ui/fleet"
    assert ui.client.get("/ui/nothing-here", headers=session.headers()).status_code == 404


def test_the_login_page_and_static_files_need_no_session_and_nothing_else_is_served(ui: Ui) -> None:
    page = ui.client.get("/ui/login")
    assert page.status_code == 200 and 'action="/ui/login"' in page.text
    assert "content-security-policy" in page.headers
    script = ui.client.get("/ui/static/main.js")
    assert script.status_code == 200 and script.headers["content-type"].startswith("text/javascript")
    assert ui.client.get("/ui/static/app.css").headers["content-type"].startswith("text/css")
    for path in (
        "/ui/static/..%2Fui.py",
        "/ui/static/index.html",
        "/ui/static/__init__.py",
        "/ui/static/nope.js",
    ):
        assert ui.client.get(path).status_code == 404, path


def test_the_dashboard_routes_are_not_in_the_openapi_document(ui: Ui) -> None:
    paths = ui.client.get("/openapi.json").json()["paths"]
    assert not [p for p in paths if p.startswith("/ui")]


# --- built to last: no inline script, nothing from elsewhere, data set as text -------------------

ASSETS = sorted(UI_DIR.rglob("*.html")) + sorted(UI_DIR.rglob("*.js")) + sorted(UI_DIR.rglob("*.css"))


@pytest.mark.parametrize("path", ASSETS, ids=lambda p: p.name)
def test_the_front_end_has_no_inline_script_no_remote_asset_and_no_html_from_data(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    assert not re.search(r"https?://(?!www\.w3\.org/2000/svg)", text), "an asset from elsewhere"
    if path.suffix == ".html":
        for tag in re.findall(r"<script\b[^>]*>", text):
            assert "src=" in tag, f"inline script: {tag}"
        assert not re.search(r"\son[a-z]+\s*=", text), "an inline event handler"
        assert "style=" not in text
    if path.suffix == ".js":
        for sink in (
            "innerHTML",
            "outerHTML",
            "insertAdjacentHTML",
            "document.write",
            "eval(",
            "new Function",
        ):
            assert sink not in text, f"{sink} in {path.name}"


def test_the_replica_metrics_route_shows_what_the_observer_scraped_for_known_replicas_only(ui: Ui) -> None:
    docs = [
        {"kind": "Model", "name": "m", "format": "gguf", "size": "1GB",
         "architecture": {"layers": 2, "kvHeads": 1, "headDim": 8, "contextLength": 256}},
        {"kind": "Deployment", "name": "d", "model": "m",
         "profiles": [{"name": "cpu", "engine": "llama.cpp", "cpu": {"cores": 1}}]},
    ]  # fmt: skip
    assert ui.client.post("/api/v1/apply", json={"documents": docs}, headers=ui.bearer).status_code == 200
    assert Reconciler(ui.store).run_once().leader
    (replica,) = ui.client.get("/api/v1/replicas", headers=ui.bearer).json()
    path = f"/api/v1/replicas/{replica['name']}/metrics"
    assert ui.client.get(path, headers=ui.bearer).json() == {"replica": replica["name"], "metrics": {}}
    observer = ui.client.app.state.observer  # type: ignore[attr-defined]
    observer.engine_values = {replica["name"]: {"fleetserve_requests_running": 2.0}, "other-0": {"x": 1.0}}
    shown = ui.client.get(path, headers=ui.bearer).json()
    assert shown == {"replica": replica["name"], "metrics": {"fleetserve_requests_running": 2.0}}
    assert ui.client.get("/api/v1/replicas/nope-0/metrics", headers=ui.bearer).status_code == 404
