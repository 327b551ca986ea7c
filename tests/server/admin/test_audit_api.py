"""The audit log and usage through the admin API, in process (the real app over the real store,
SQLite and PostgreSQL): every admin action leaves one event naming its actor; ``/usage`` and
``/events`` are admin-only, bounded, and name the field they refuse."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from fleetserve.server.agents.enrolment import EnrolmentPolicy
from fleetserve.server.app import create_app
from fleetserve.store import SqlStore, TokenKind
from fleetserve.store.tables import AuditEventRow
from fleetserve.store.usage import UsageCounts, UsageRecord

T0 = datetime(2026, 6, 1, 12, 0, tzinfo=UTC)

MODEL = {"kind": "Model", "name": "tiny", "source": "/models/tiny.gguf", "format": "gguf", "size": "1MB"}
CLASS = {"kind": "DeviceClass", "name": "h100", "driver": "gpu.nvidia.com", "memory": "80GiB"}


def deployment(cores: int) -> dict[str, Any]:
    return {
        "kind": "Deployment", "name": "tiny", "model": "tiny", "replicas": 1,
        "profiles": [{"name": "cpu", "engine": "llama.cpp", "cpu": {"cores": cores}}],
    }  # fmt: skip


def node(name: str) -> dict[str, Any]:
    return {"kind": "Node", "name": name, "cpu": {"cores": 16, "memory": "64GiB"}}


@dataclass
class Admin:
    """The app in a TestClient with its store and one admin token (id and header)."""

    client: TestClient
    store: SqlStore
    token_id: int
    headers: dict[str, str]

    def call(self, method: str, path: str, headers: dict[str, str] | None = None, **kwargs: Any) -> Any:
        response = self.client.request(method, "/api/v1" + path, headers=headers or self.headers, **kwargs)
        assert response.status_code == 200, response.text
        return response.json()


@pytest.fixture
def admin(store: SqlStore, tmp_path: Path) -> Iterator[Admin]:
    issued = store.create_token(TokenKind.ADMIN, T0)
    app = create_app(store, models_dir=tmp_path / "models", enrolment=EnrolmentPolicy(approve_new=True))
    with TestClient(app, raise_server_exceptions=False) as client:
        yield Admin(client, store, issued.id, {"Authorization": f"Bearer {issued.plaintext}"})


def events(admin: Admin) -> list[dict[str, Any]]:
    """Every recorded event, oldest first."""
    got: list[dict[str, Any]] = admin.call("GET", "/events", params={"limit": 1000})
    return got[::-1]


def test_every_admin_action_leaves_one_event_with_its_actor_target_and_source(admin: Admin) -> None:
    me = f"admin token {admin.token_id}"
    steps: list[tuple[str, str, dict[str, Any], list[tuple[str, str]]]] = [
        ("POST", "/apply", {"json": {"documents": [CLASS, node("n1"), node("n2"), MODEL, deployment(1)]}},
         [("apply", "DeviceClass/h100"), ("apply", "Node/n1"), ("apply", "Node/n2"), ("apply", "Model/tiny"),
          ("apply", "Deployment/tiny")]),
        ("POST", "/apply", {"json": {"documents": [deployment(2)]}}, [("apply", "Deployment/tiny")]),
        ("POST", "/deployments/tiny/undo", {}, [("rollout.undo", "Deployment/tiny")]),
        ("POST", "/apply", {"json": {"documents": [{**MODEL, "sha256": "a" * 64}]}}, [("apply", "Model/tiny")]),
        ("POST", "/models/tiny/undo", {}, [("rollout.undo", "Model/tiny")]),
        ("POST", "/nodes/n1/cordon", {"json": {"reason": "fan noise"}}, [("cordon", "Node/n1")]),
        ("POST", "/nodes/n1/uncordon", {}, [("uncordon", "Node/n1")]),
        ("POST", "/nodes/n1/drain", {"json": {"reason": "new disk"}}, [("drain", "Node/n1")]),
        ("POST", "/nodes/n3/approve", {}, [("node.approve", "Node/n3")]),
        ("PUT", "/models/tiny/file", {"content": b"GGUF weights"}, [("model.upload", "Model/tiny")]),
        ("POST", "/keys", {"json": {"name": "alice", "models": ["*"]}}, [("key.create", "ApiKey/{key}")]),
        ("DELETE", "/keys/{key}", {}, [("key.revoke", "ApiKey/{key}")]),
        ("POST", "/tokens", {"json": {"kind": "join"}}, [("token.create", "Token/{join}")]),
        ("DELETE", "/tokens/{join}", {}, [("token.revoke", "Token/{join}")]),
        ("DELETE", "/deployments/tiny", {}, [("delete", "Deployment/tiny")]),
        ("DELETE", "/models/tiny", {}, [("delete", "Model/tiny")]),
        ("DELETE", "/nodes/n2", {}, [("delete", "Node/n2")]),
        ("DELETE", "/classes/h100", {}, [("delete", "DeviceClass/h100")]),
    ]  # fmt: skip
    ids = {"join": "", "key": ""}  # ids the store gives (sequences are not reset between tests)
    for method, path, kwargs, expected in steps:
        before = len(events(admin))
        answer = admin.call(method, path.format(**ids), **kwargs)
        if path in ("/tokens", "/keys"):
            ids["join" if path == "/tokens" else "key"] = str(answer["id"])
        new = events(admin)[before:]
        assert [(e["action"], e["target"]) for e in new] == [(a, t.format(**ids)) for a, t in expected], (
            f"{method} {path}"
        )
        assert {(e["actor"], e["source"]) for e in new} == {(me, "testclient")}, f"{method} {path}"
    applied = [e for e in events(admin) if e["action"] == "apply"]
    assert [e["detail"]["result"] for e in applied] == ["created"] * 5 + ["configured"] * 2
    assert next(e for e in events(admin) if e["action"] == "cordon")["detail"] == {"reason": "fan noise"}


def test_a_refused_action_records_nothing(admin: Admin) -> None:
    assert admin.client.delete("/api/v1/nodes/nowhere", headers=admin.headers).status_code == 404
    bad = admin.client.post("/api/v1/apply", json={"documents": [{"kind": "Model", "name": "Bad_Name"}]},
                            headers=admin.headers)  # fmt: skip
    assert bad.status_code == 422
    assert events(admin) == []


def test_a_second_admin_token_is_a_different_actor(admin: Admin) -> None:
    second = admin.call("POST", "/tokens", json={"kind": "admin"})
    other = {"Authorization": f"Bearer {second['token']}"}
    admin.call("POST", "/apply", headers=other, json={"documents": [node("n1")]})
    admin.call("POST", "/nodes/n1/cordon", json={"reason": "mine"})
    assert [(e["action"], e["actor"]) for e in events(admin)] == [
        ("token.create", f"admin token {admin.token_id}"),
        ("apply", f"admin token {second['id']}"),
        ("cordon", f"admin token {admin.token_id}"),
    ]


def test_no_secret_reaches_the_audit_log(admin: Admin) -> None:
    key = admin.call("POST", "/keys", json={"name": "alice", "models": ["*"]})["key"]
    token = admin.call("POST", "/tokens", json={"kind": "admin"})["token"]
    join = admin.call("POST", "/tokens", json={"kind": "join", "expiresIn": 60})["token"]
    with admin.store.engine.connect() as conn:
        rows = [" ".join(str(v) for v in row) for row in conn.execute(select(AuditEventRow.__table__))]
    assert len(rows) == 3
    text = "\n".join(rows)
    for secret in (key, token, join, admin.headers["Authorization"].removeprefix("Bearer ")):
        assert secret not in text
        assert secret[-12:] not in text  # not a piece of it either


@pytest.mark.parametrize("path", ["/api/v1/usage", "/api/v1/events"])
@pytest.mark.parametrize("who", ["nobody", "join token", "revoked admin token"])
def test_usage_and_events_need_an_admin_token(admin: Admin, path: str, who: str) -> None:
    headers: dict[str, str] = {}
    if who == "join token":
        headers = {"Authorization": f"Bearer {admin.store.create_token(TokenKind.JOIN, T0).plaintext}"}
    elif who == "revoked admin token":
        issued = admin.store.create_token(TokenKind.ADMIN, T0)
        admin.store.revoke_token(issued.id)
        headers = {"Authorization": f"Bearer {issued.plaintext}"}
    response = admin.client.get(path, headers=headers)
    assert response.status_code == 401, response.text
    assert response.json()["error"]["type"] == "unauthorized"


@pytest.mark.parametrize("who", ["nobody", "join token", "revoked admin token"])
def test_undoing_a_models_change_needs_an_admin_token_and_changes_nothing_without(
    admin: Admin, who: str
) -> None:
    admin.call("POST", "/apply", json={"documents": [MODEL]})
    admin.call("POST", "/apply", json={"documents": [{**MODEL, "sha256": "a" * 64}]})
    headers: dict[str, str] = {}
    if who == "join token":
        headers = {"Authorization": f"Bearer {admin.store.create_token(TokenKind.JOIN, T0).plaintext}"}
    elif who == "revoked admin token":
        issued = admin.store.create_token(TokenKind.ADMIN, T0)
        admin.store.revoke_token(issued.id)
        headers = {"Authorization": f"Bearer {issued.plaintext}"}
    response = admin.client.post("/api/v1/models/tiny/undo", headers=headers)
    assert response.status_code == 401, response.text
    assert admin.store.get_model("tiny").sha256 == "a" * 64, "the change stands"
    assert admin.call("POST", "/models/tiny/undo")["sha256"] is None


def test_usage_has_rows_per_step_and_totals_per_key_with_names_and_per_model(admin: Admin) -> None:
    alice, _ = admin.store.create_api_key("alice", ["*"], None, None, T0)
    bob, _ = admin.store.create_api_key("bob", ["*"], None, None, T0)
    admin.store.add_usage(
        [
            UsageRecord(T0, alice.id, "chat", UsageCounts(2, 1, 20, 10)),
            UsageRecord(T0 + timedelta(minutes=5), alice.id, "chat", UsageCounts(1, 0, 5, 5)),
            UsageRecord(T0 + timedelta(hours=1), alice.id, "embed", UsageCounts(4, 0, 40, 0)),
            UsageRecord(T0, bob.id, "chat", UsageCounts(1, 0, 1, 1)),
        ],
        T0 + timedelta(hours=2),
    )
    window = {"since": T0.isoformat(), "until": (T0 + timedelta(hours=2)).isoformat()}
    got = admin.call("GET", "/usage", params={**window, "step": "hour"})
    assert [(r["start"], r["key"], r["model"], r["requests"]) for r in got["rows"]] == [
        (T0.isoformat(), "alice", "chat", 3),
        (T0.isoformat(), "bob", "chat", 1),
        ((T0 + timedelta(hours=1)).isoformat(), "alice", "embed", 4),
    ]
    assert got["rows"][0] == {
        "start": T0.isoformat(), "keyId": alice.id, "key": "alice", "model": "chat", "requests": 3,
        "errors": 1, "promptTokens": 25, "completionTokens": 15, "totalTokens": 40,
    }  # fmt: skip
    assert [(k["key"], k["requests"], k["totalTokens"]) for k in got["totals"]["keys"]] == [
        ("alice", 7, 80),
        ("bob", 1, 2),
    ]
    assert [(m["model"], m["requests"]) for m in got["totals"]["models"]] == [("chat", 4), ("embed", 4)]
    assert got["totals"]["all"]["requests"] == 8 and got["truncated"] is False
    only_bob = admin.call("GET", "/usage", params={**window, "key": bob.id, "step": "minute"})
    assert [(r["key"], r["requests"]) for r in only_bob["rows"]] == [("bob", 1)]
    assert [k["key"] for k in only_bob["totals"]["keys"]] == ["bob"]
    chat = admin.call("GET", "/usage", params={**window, "model": "embed", "limit": 1})
    assert [r["model"] for r in chat["rows"]] == ["embed"] and chat["truncated"] is True


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"since": "2026-06-02T00:00:00Z", "until": "2026-06-01T00:00:00Z"}, "since"),
        ({"since": "2024-01-01T00:00:00Z", "until": "2026-01-01T00:00:00Z", "step": "day"}, "since"),
        ({"since": "2026-05-01T00:00:00Z", "until": "2026-06-01T00:00:00Z", "step": "minute"}, "step"),
        ({"step": "week"}, "step"),
        ({"limit": 0}, "limit"),
        ({"limit": 100_001}, "limit"),
        ({"key": -1}, "key"),
        ({"model": "Not_A_Name"}, "model"),
        ({"since": "yesterday"}, "since"),
    ],
    ids=["an inverted window", "a window of two years", "a month of minutes", "an unknown step",
         "a zero limit", "a limit past the most rows", "a negative key", "a bad model name", "a since not a time"],
)  # fmt: skip
def test_a_usage_query_out_of_bounds_is_a_422_naming_the_field(
    admin: Admin, params: dict[str, Any], field: str
) -> None:
    response = admin.client.get("/api/v1/usage", params=params, headers=admin.headers)
    assert response.status_code == 422, response.text
    assert [p["field"] for p in response.json()["error"]["problems"]] == [field]


@pytest.mark.parametrize(
    ("params", "field"),
    [({"limit": 0}, "limit"), ({"limit": 1001}, "limit"), ({"action": "reboot"}, "action")],
    ids=["a zero limit", "a limit past the most events", "an unknown action"],
)
def test_an_events_query_out_of_bounds_is_a_422_naming_the_field(
    admin: Admin, params: dict[str, Any], field: str
) -> None:
    response = admin.client.get("/api/v1/events", params=params, headers=admin.headers)
    assert response.status_code == 422, response.text
    assert [p["field"] for p in response.json()["error"]["problems"]] == [field]


def test_events_filter_by_action_and_time(admin: Admin) -> None:
    admin.call("POST", "/apply", json={"documents": [node("n1")]})
    admin.call("POST", "/nodes/n1/cordon", json={"reason": "a"})
    admin.call("POST", "/nodes/n1/uncordon")
    assert [e["action"] for e in admin.call("GET", "/events", params={"action": "cordon"})] == ["cordon"]
    later = (datetime.now(UTC) + timedelta(minutes=1)).isoformat()
    assert admin.call("GET", "/events", params={"since": later}) == []
    assert [e["action"] for e in admin.call("GET", "/events", params={"limit": 2})] == ["uncordon", "cordon"]


def test_the_servers_own_gateway_counts_usage_into_the_store(sqlite_store: SqlStore) -> None:
    gateway = create_app(sqlite_store).state.gateway
    assert gateway.usage is not None and gateway.usage_flusher is not None
    assert gateway.usage_flusher.sink is sqlite_store
