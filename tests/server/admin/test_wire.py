"""The typed admin API answers the JSON it answered before its models: what the store kept as it
was reported (nothing is filled with defaults), keys in the same order, times as ``isoformat``
writes them."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pytest
from fastapi.testclient import TestClient

from fleetserve.server.app import create_app
from fleetserve.store import SqlStore, TokenKind

T0 = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
NODE = {"kind": "Node", "name": "c1", "cpu": {"cores": 8, "memory": "16GiB"}}
MODEL = {"kind": "Model", "name": "tiny", "source": "/models/tiny.gguf", "size": "1GiB"}
DEPLOYMENT = {
    "kind": "Deployment",
    "name": "chat",
    "model": "tiny",
    "replicas": 1,
    "profiles": [{"name": "cpu", "engine": "llama.cpp", "cpu": {"cores": 2}}],
}


@pytest.fixture
def admin(store: SqlStore) -> Iterator[tuple[TestClient, dict[str, str]]]:
    token = store.create_token(TokenKind.ADMIN, T0).plaintext
    with TestClient(create_app(store, gateway=False)) as client:
        yield client, {"Authorization": f"Bearer {token}"}


def get(admin: tuple[TestClient, dict[str, str]], path: str) -> Any:
    client, headers = admin
    response = client.get(f"/api/v1{path}", headers=headers)
    assert response.status_code == 200, response.text
    return response.json()


def test_what_was_never_reported_or_reconciled_is_an_empty_object(
    admin: tuple[TestClient, dict[str, str]],
) -> None:
    client, headers = admin
    applied = client.post("/api/v1/apply", json={"documents": [NODE, MODEL, DEPLOYMENT]}, headers=headers)
    assert applied.status_code == 200, applied.text

    assert get(admin, "/nodes/c1")["status"]["agent"] == {}
    assert get(admin, "/deployments")[0]["status"] == {}
    explained = get(admin, "/deployments/chat/explain")
    assert (explained["status"], explained["decision"], explained["decidedAt"]) == ({}, None, None)


def test_a_deployments_detail_keeps_its_key_order_with_its_replicas_in_place_of_the_count(
    admin: tuple[TestClient, dict[str, str]],
) -> None:
    client, headers = admin
    client.post("/api/v1/apply", json={"documents": [MODEL, DEPLOYMENT]}, headers=headers)
    detail = get(admin, "/deployments/chat")
    assert list(detail)[:4] == ["kind", "name", "model", "replicas"]
    assert list(detail)[-3:] == ["generation", "revision", "status"]
    assert detail["replicas"] == []


def test_times_are_iso_8601_with_their_utc_offset(admin: tuple[TestClient, dict[str, str]]) -> None:
    [token] = get(admin, "/tokens")
    assert token["createdAt"] == T0.isoformat() and token["expiresAt"] is None
