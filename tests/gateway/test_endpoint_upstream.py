"""An Endpoint (a server fleetserve did not start) behind the gateway, over real sockets: a fake
OpenAI server (fleetserve.dev.fake_openai) that refuses every request without its key, checked
by the control plane's prober and answered through the gateway with the official ``openai``
client: its model name translated, its key sent and never shown, its tokens limited and counted.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import openai
import pytest

from fake_engine import ServedGateway, engines_on, fake_upstream
from fleetserve.dev.fake_openai import FakeEngine
from fleetserve.secretfile import write_secret
from fleetserve.spec.endpoint import Endpoint, EndpointState
from fleetserve.store.sql import SqlStore


def wait_for(check, timeout: float = 15.0, what: str = "it"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@dataclass
class Served:
    gw: ServedGateway
    upstream: FakeEngine
    key: str  # the upstream's key, in the Endpoint's key file
    keys: Path

    def api_key(self, models: list[str] | None = None, rpm: int | None = None, tpm: int | None = None) -> str:
        _, plaintext = self.gw.store.create_api_key(
            secrets.token_hex(4), models or ["*"], rpm, tpm, datetime.now(UTC)
        )
        return plaintext


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    tmp = tmp_path_factory.mktemp("endpoint")
    key = "sk-upstream-" + secrets.token_urlsafe(24)
    keys = tmp / "keys"
    write_secret(keys / "box.key", key + "\n")
    with (
        fake_upstream(key, models=("other", "up-chat")) as upstream,
        SqlStore.open(tmp / "state.db") as store,
        ServedGateway(store, engines=0, endpoint_keys=keys, probe_endpoints=True) as gw,
    ):
        store.put_endpoint(
            Endpoint.model_validate(
                {
                    "name": "box",
                    "url": f"http://127.0.0.1:{upstream.port}",
                    "models": {"chat": "up-chat"},
                    "keyFile": "box.key",
                }
            )
        )
        wait_for(
            lambda: (r := gw.gateway.table.routes.get("chat")) and r.endpoints, what="the Endpoint's route"
        )
        yield Served(gw, upstream, key, keys)


def test_the_endpoint_answers_through_the_gateway_with_its_key_and_its_upstream_name(served: Served) -> None:
    stored = served.gw.store.get_endpoint("box")
    assert (stored.state, stored.last_error) == (EndpointState.READY, None)
    with openai.OpenAI(base_url=f"{served.gw.url}/v1", api_key=served.api_key(), max_retries=0) as oc:
        (listed,) = oc.models.list().data
        assert (listed.id, listed.owned_by) == ("chat", "fake")  # the upstream's own entry for up-chat
        answer = oc.chat.completions.create(
            model="chat", messages=[{"role": "user", "content": "hi"}], max_tokens=5
        )
        assert answer.choices[0].message.content == "hi " * 5
        assert answer.usage is not None and answer.usage.completion_tokens == 5
        body, head = served.upstream.served.bodies[-1], served.upstream.served.headers[-1]
        assert body["model"] == "up-chat" and body["messages"] == [{"role": "user", "content": "hi"}]
        assert head[b"authorization"] == f"Bearer {served.key}".encode()
        stream = oc.chat.completions.create(
            model="chat", messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True
        )
        chunks = list(stream)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "hi " * 4
        # The gateway asked for usage to count it, and took out what its ask added.
        assert all(c.usage is None for c in chunks)
        assert served.upstream.served.bodies[-1]["stream_options"] == {"include_usage": True}
    assert served.upstream.served.refused == 0


def test_tokens_are_limited_and_counted_as_for_replicas(served: Served) -> None:
    started = datetime.now(UTC)
    record, token = served.gw.store.create_api_key("limited", ["*"], None, 12, started)
    with httpx.Client(base_url=f"{served.gw.url}/v1", headers={"Authorization": f"Bearer {token}"}) as c:
        ask = {"model": "chat", "messages": [{"role": "user", "content": "x"}], "max_tokens": 10}
        assert c.post("/chat/completions", json=ask).status_code == 200
        # 10 reserved, then settled at what was used (prompt + 10): the next 10 do not fit in 12.
        refused = c.post("/chat/completions", json=ask)
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "rate_limit_exceeded"
    flusher = served.gw.gateway.usage_flusher
    assert flusher is not None
    asyncio.run_coroutine_threadsafe(flusher.flush(), served.gw.loop).result(30)
    rows = served.gw.store.usage(
        started - timedelta(minutes=1), datetime.now(UTC) + timedelta(minutes=1), record.id
    )
    assert [(r.model, r.counts.requests, r.counts.errors, r.counts.completion_tokens) for r in rows] == [
        ("chat", 2, 1, 10)
    ]


def test_a_key_that_may_not_use_the_model_gets_the_404_of_a_model_that_does_not_exist(served: Served) -> None:
    token = served.api_key(models=["tiny"])
    with httpx.Client(base_url=f"{served.gw.url}/v1", headers={"Authorization": f"Bearer {token}"}) as c:
        ask = {"model": "chat", "messages": [{"role": "user", "content": "x"}]}
        refused = c.post("/chat/completions", json=ask)
        missing = c.post("/chat/completions", json={**ask, "model": "nothing"})
    assert refused.status_code == missing.status_code == 404
    assert refused.json()["error"]["code"] == missing.json()["error"]["code"] == "model_not_found"


def test_a_wrong_key_makes_the_endpoint_not_ready_and_takes_it_out_of_the_routes(served: Served) -> None:
    write_secret(served.keys / "box.key", "sk-wrong\n")
    try:
        stored = wait_for(
            lambda: (e := served.gw.store.get_endpoint("box")).state is EndpointState.NOT_READY and e,
            what="the failed check",
        )
        assert stored.last_error == "GET /v1/models answered 401 (is keyFile its key?)"
        wait_for(lambda: not served.gw.gateway.table.routes["chat"].endpoints, what="the route to empty")
        with httpx.Client(
            base_url=f"{served.gw.url}/v1", headers={"Authorization": f"Bearer {served.api_key()}"}
        ) as c:
            models = c.get("/models").json()["data"]
        assert models == []
    finally:
        write_secret(served.keys / "box.key", served.key + "\n")
    wait_for(lambda: served.gw.gateway.table.routes["chat"].endpoints, what="the Endpoint back in its route")


def test_an_endpoint_a_deployment_lists_shares_its_requests_with_the_replicas(tmp_path: Path) -> None:
    key = "sk-beside-" + secrets.token_urlsafe(16)
    write_secret(tmp_path / "keys" / "beside.key", key)
    with (
        fake_upstream(key, models=("tiny-hosted",)) as upstream,
        SqlStore.open(tmp_path / "state.db") as store,
        ServedGateway(store, engines=1, endpoint_keys=tmp_path / "keys", probe_endpoints=True) as gw,
    ):
        store.put_endpoint(
            Endpoint.model_validate(
                {
                    "name": "beside",
                    "url": f"http://127.0.0.1:{upstream.port}",
                    "models": {"tiny": "tiny-hosted"},
                    "keyFile": "beside.key",
                    "weight": 2,
                }
            )
        )
        engines_on(store, [gw.engines[0].port], tmp_path / "tiny.gguf", endpoints=["beside"])
        wait_for(
            lambda: (r := gw.gateway.table.routes.get("tiny")) and len(r.endpoints) == 2,
            what="both in the route",
        )
        _, token = store.create_api_key("both", ["*"], None, None, datetime.now(UTC))
        ask = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
        with httpx.Client(base_url=f"{gw.url}/v1", headers={"Authorization": f"Bearer {token}"}) as c:
            assert all(c.post("/chat/completions", json=ask).status_code == 200 for _ in range(30))
        replica, hosted = gw.engines[0].served, upstream.served
    # Idle, one at a time: ties broken at random, so both serve; each got what it expects.
    assert replica.requests > 0 and hosted.requests > 0 and replica.requests + hosted.requests == 30
    assert {b["model"] for b in hosted.bodies} == {"tiny-hosted"} and {
        b["model"] for b in replica.bodies
    } == {"tiny"}
    assert {h[b"authorization"] for h in hosted.headers} == {f"Bearer {key}".encode()}
    assert all(h.get(b"authorization") != f"Bearer {key}".encode() for h in replica.headers)


def test_the_request_to_an_https_endpoint_goes_under_its_base_path_with_its_key() -> None:
    from fleetserve.gateway.picker import Endpoint as Upstream
    from fleetserve.gateway.upstream import Call, upstream_request

    hosted = Upstream("endpoint/h", "https://api.example.com/openai", engine_key="sk-h", redact=True)
    origin, request = upstream_request(hosted, Call(b"POST", b"/v1/chat/completions?x=1"), b"{}")
    assert (origin.host, origin.port, origin.tls) == ("api.example.com", 443, True)
    head = request.split(b"\r\n")
    assert head[0] == b"POST /openai/v1/chat/completions?x=1 HTTP/1.1"
    assert b"Host: api.example.com" in head and b"Authorization: Bearer sk-h" in head
    replica = Upstream("r-0", "http://[fd00::7]:8000")
    origin, request = upstream_request(replica, Call(b"GET", b"/health", body=False), b"")
    assert (origin.host, origin.port, origin.tls) == ("fd00::7", 8000, False)
    assert request.startswith(b"GET /health HTTP/1.1\r\nHost: [fd00::7]:8000\r\n")
