"""An attacker's look for an Endpoint's key: every admin route, the OpenAPI document, /metrics,
/v1 (models, answers, errors, a server that repeats the key it was sent), the apply answers and
their refusals, the log and the database file. The key is in none of them; apply refuses a key
file outside --endpoint-keys or a key written into the document.
"""

from __future__ import annotations

import logging
import re
import secrets
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from fake_engine import fake_upstream
from fleetserve.dev.fake_openai import FakeEngine
from fleetserve.endpointkeys import EndpointKeys
from fleetserve.secretfile import write_secret
from fleetserve.server.app import Serving, create_app
from fleetserve.store import SqlStore, TokenKind


class Seen:
    """Every answer the attacker got, to search for the key."""

    def __init__(self, client: TestClient) -> None:
        self.client = client
        self.texts: list[str] = []

    def call(self, method: str, path: str, **kwargs: Any) -> Any:
        response = self.client.request(method, path, **kwargs)
        self.texts.append(f"{response.status_code} {response.headers} {response.text}")
        return response


@pytest.fixture
def world(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> Iterator[tuple[Seen, str, FakeEngine, SqlStore, dict[str, str]]]:
    caplog.set_level(logging.DEBUG)
    key = "sk-secret-" + secrets.token_urlsafe(24)
    write_secret(tmp_path / "keys" / "box.key", key)
    with fake_upstream(key, models=("up-chat",)) as upstream, SqlStore.open(tmp_path / "state.db") as store:
        admin = {
            "Authorization": f"Bearer {store.create_token(TokenKind.ADMIN, datetime.now(UTC)).plaintext}"
        }
        serving = Serving.build(store, endpoint_keys=EndpointKeys(tmp_path / "keys"), probe_endpoints=True)
        with TestClient(create_app(store, serving=serving), raise_server_exceptions=False) as client:
            yield Seen(client), key, upstream, store, admin


def test_no_route_answer_log_or_stored_byte_holds_the_endpoints_key(world, tmp_path, caplog) -> None:
    seen, key, upstream, store, admin = world
    document = {
        "kind": "Endpoint",
        "name": "box",
        "url": f"http://127.0.0.1:{upstream.port}",
        "models": {"chat": "up-chat"},
        "keyFile": "box.key",
    }
    applied = seen.call("POST", "/api/v1/apply", json={"documents": [document]}, headers=admin)
    assert applied.status_code == 200, applied.text
    # Refused: a key file that is a path (another file of the server's host), a key in the document.
    for bad, field in [({"keyFile": "/etc/passwd"}, "keyFile"), ({"key": key}, "key")]:
        refused = seen.call("POST", "/api/v1/apply", json={"documents": [document | bad]}, headers=admin)
        assert refused.status_code == 422, refused.text
        assert [p["field"] for p in refused.json()["error"]["problems"]] == [field]
    deadline = time.monotonic() + 15
    while store.get_endpoint("box").state.value != "Ready":
        assert time.monotonic() < deadline, store.get_endpoint("box")
        time.sleep(0.05)
    _, token = store.create_api_key("attacker", ["*"], None, None, datetime.now(UTC))
    v1 = {"Authorization": f"Bearer {token}"}
    # /v1: the listing, an answer, a stream, an error the server makes repeat the key, a 404.
    deadline = time.monotonic() + 15
    while not seen.call("GET", "/v1/models", headers=v1).json()["data"]:
        assert time.monotonic() < deadline, "the Endpoint never reached the gateway's routes"
        time.sleep(0.05)
    chat = {"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    assert seen.call("POST", "/v1/chat/completions", json=chat, headers=v1).status_code == 200
    assert (
        seen.call("POST", "/v1/chat/completions", json=chat | {"stream": True}, headers=v1).status_code == 200
    )
    echoed = seen.call(
        "POST", "/v1/chat/completions", json=chat | {"fake_status": 401, "fake_echo_auth": True}, headers=v1
    )
    assert echoed.status_code == 401 and "key Bearer [redacted] refused" in echoed.text
    assert upstream.served.headers[-1][b"authorization"] == f"Bearer {key}".encode()  # it was sent
    assert (
        seen.call("POST", "/v1/chat/completions", json=chat | {"model": "nope"}, headers=v1).status_code
        == 404
    )
    # Every admin GET the OpenAPI document lists, with "box" for any name in its path.
    paths = seen.call("GET", "/openapi.json").json()["paths"]
    for path, operations in sorted(paths.items()):
        if "get" in operations and path.startswith("/api/v1/") and "/agent/" not in path:
            seen.call("GET", re.sub(r"\{[^}]+\}", "box", path), headers=admin)
    listed = seen.call("GET", "/api/v1/endpoints", headers=admin).json()
    assert [(e["name"], e["keyFile"], e["status"]["state"]) for e in listed] == [("box", "box.key", "Ready")]
    seen.call("GET", "/metrics")
    seen.call("GET", "/api/v1/events", headers=admin)
    assert sum(len(t) for t in seen.texts) > 10_000  # the search covered real answers
    for text in seen.texts:
        assert key not in text
    assert key not in caplog.text
    # Not in the store: the database file and its write-ahead log, byte for byte.
    stored = b"".join(p.read_bytes() for p in tmp_path.glob("state.db*"))
    assert b"up-chat" in stored and key.encode() not in stored
