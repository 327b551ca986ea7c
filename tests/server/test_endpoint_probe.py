"""The control plane's Endpoint health checks against a fake OpenAI server that requires its key:
what each outcome makes the Endpoint, recorded in the store, and what the error says (never the key)."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from pathlib import Path

import pytest

from fake_engine import fake_upstream
from fleetserve.endpointkeys import EndpointKeys
from fleetserve.httpclient import HttpClient
from fleetserve.secretfile import write_secret
from fleetserve.server.endpointprobe import EndpointProber, verdict
from fleetserve.spec.endpoint import Endpoint, EndpointState
from fleetserve.store import SqlStore

T0 = datetime(2026, 12, 7, 3, 0, tzinfo=UTC)
READY, NOT_READY = EndpointState.READY, EndpointState.NOT_READY


@pytest.mark.parametrize(
    ("status", "failure", "expected"),
    [
        (200, None, (READY, None)),
        (204, None, (READY, None)),
        (401, None, (NOT_READY, "GET /v1/models answered 401 (is keyFile its key?)")),
        (503, None, (NOT_READY, "GET /v1/models answered 503")),
        (
            None,
            "GET /v1/models: ConnectFailed: refused",
            (NOT_READY, "GET /v1/models: ConnectFailed: refused"),
        ),
    ],
)
def test_a_check_is_ready_on_2xx_only_and_says_what_failed(status, failure, expected) -> None:
    assert verdict(status, failure, "/v1/models") == expected


def endpoint(name: str, port: int, **fields: object) -> Endpoint:
    return Endpoint.model_validate(
        {"name": name, "url": f"http://127.0.0.1:{port}", "models": ["m"]} | fields
    )


def test_every_endpoint_is_checked_with_its_key_and_the_verdicts_recorded(tmp_path: Path) -> None:
    write_secret(tmp_path / "keys" / "good.key", "sk-good")
    write_secret(tmp_path / "keys" / "bad.key", "sk-bad")
    with fake_upstream("sk-good") as up, SqlStore.open(tmp_path / "state.db") as store:
        closed = up.port + 1 if up.port < 65535 else up.port - 1
        docs = [
            endpoint("good", up.port, keyFile="good.key"),
            endpoint("bad", up.port, keyFile="bad.key"),
            endpoint("nokey", up.port),
            endpoint("missing", up.port, keyFile="missing.key"),
            endpoint("health", up.port, keyFile="good.key", healthPath="/health"),
            endpoint("dead", closed, keyFile="good.key"),
        ]
        for doc in docs:
            store.put_endpoint(doc)
        prober = EndpointProber(store, EndpointKeys(tmp_path / "keys"), timeout=2.0, clock=lambda: T0)

        async def once() -> dict[str, tuple[EndpointState, str | None]]:
            http = HttpClient(connect_timeout=2.0)
            try:
                return await prober.check_all(http)
            finally:
                await http.aclose()

        verdicts = asyncio.run(once())
    assert verdicts["good"] == verdicts["health"] == (READY, None)
    assert (
        verdicts["bad"]
        == verdicts["nokey"]
        == (NOT_READY, "GET /v1/models answered 401 (is keyFile its key?)")
    )
    state, error = verdicts["missing"]
    assert state is NOT_READY and error is not None and "missing.key is not a regular file" in error
    state, error = verdicts["dead"]
    assert state is NOT_READY and error is not None and error.startswith("GET /v1/models: ConnectFailed")
    assert all("sk-good" not in (e or "") and "sk-bad" not in (e or "") for _, e in verdicts.values())
    with SqlStore.open(tmp_path / "state.db") as store:
        recorded = {e.endpoint.name: (e.state, e.last_error, e.checked_at) for e in store.list_endpoints()}
    assert recorded["good"] == (READY, None, T0) and recorded["bad"][0] is NOT_READY
    # What the fake refused: the check with the wrong key and the one with none.
    assert up.served.refused == 2
