"""CORS through the real app over real sockets: a gateway allowing one origin (and one allowing
none) served by uvicorn in this process, in front of a fake OpenAI engine, asked by httpx as a
browser would ask (``Origin``, preflights)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime

import httpx
import pytest

from fake_engine import ServedGateway, engines_on
from fleetserve.store.sql import SqlStore

APP = "https://chat.example.com"
EVIL = "https://evil.example"
CHAT = "/v1/chat/completions"
KEYS = itertools.count()
PREFLIGHT = {
    "Access-Control-Request-Method": "POST",
    "Access-Control-Request-Headers": "authorization, content-type",
}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedGateway]:
    tmp = tmp_path_factory.mktemp("cors")
    with SqlStore.open(tmp / "state.db") as store, ServedGateway(store, cors_origins=(APP,)) as gw:
        engines_on(store, [gw.engines[0].port], tmp / "tiny.gguf")
        deadline = time.monotonic() + 10
        while not (gw.gateway.table.routes.get("tiny") and gw.gateway.table.routes["tiny"].endpoints):
            assert time.monotonic() < deadline, "timed out waiting for the replica in the routes"
            time.sleep(0.02)
        yield gw


@pytest.fixture(scope="module")
def no_cors(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedGateway]:
    tmp = tmp_path_factory.mktemp("no-cors")
    with SqlStore.open(tmp / "state.db") as store, ServedGateway(store, engines=0) as gw:
        yield gw


def key(gw: ServedGateway, rpm: int | None = None) -> str:
    _, plaintext = gw.store.create_api_key(f"cors-{next(KEYS)}", ["*"], rpm, None, datetime.now(UTC))
    return plaintext


def chat(**fields: object) -> dict[str, object]:
    return {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields}


def cors_headers(response: httpx.Response) -> dict[str, list[str]]:
    return {
        name: response.headers.get_list(name)
        for name in response.headers
        if name.startswith("access-control-") or name == "vary"
    }


def test_a_preflight_from_an_allowed_origin_is_answered_204_without_an_api_key(served: ServedGateway) -> None:
    asked = {
        **PREFLIGHT,
        "Access-Control-Request-Headers": "authorization, content-type, x-stainless-os, x-evil",
    }
    r = httpx.options(served.url + CHAT, headers={"Origin": APP, **asked})
    assert r.status_code == 204 and r.content == b""
    assert cors_headers(r) == {
        "access-control-allow-origin": [APP],
        "vary": ["Origin, Access-Control-Request-Headers"],
        "access-control-allow-methods": ["GET, POST, OPTIONS"],
        "access-control-max-age": ["7200"],
        "access-control-allow-headers": ["Authorization, Content-Type, X-Api-Key, x-stainless-os"],
    }


def test_a_preflight_from_another_origin_is_refused_403_without_cors_headers(served: ServedGateway) -> None:
    r = httpx.options(served.url + CHAT, headers={"Origin": EVIL, **PREFLIGHT})
    assert r.status_code == 403
    assert r.json()["error"]["code"] == "cors_origin_not_allowed"
    assert cors_headers(r) == {}


def test_a_preflight_for_a_method_the_api_does_not_answer_is_refused(served: ServedGateway) -> None:
    r = httpx.options(served.url + CHAT, headers={"Origin": APP, "Access-Control-Request-Method": "DELETE"})
    assert r.status_code == 403 and cors_headers(r) == {}


def test_without_cors_origins_options_gets_405_as_before_and_no_answer_has_cors_headers(
    no_cors: ServedGateway,
) -> None:
    r = httpx.options(no_cors.url + CHAT, headers={"Origin": APP, **PREFLIGHT})
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
    assert cors_headers(r) == {}
    r = httpx.post(no_cors.url + CHAT, headers={"Origin": APP}, json=chat())
    assert r.status_code == 401 and cors_headers(r) == {}


@dataclass(frozen=True)
class Call:
    name: str
    method: str
    path: str
    status: int
    auth: str = "key"  # "key", "none" or "rpm1" (a key whose one request a minute is spent)
    body: dict[str, object] | None = field(default_factory=chat)
    headers: dict[str, str] = field(default_factory=dict)


CALLS = [
    Call("a chat completion", "POST", CHAT, 200),
    Call("a streamed chat completion", "POST", CHAT, 200, body=chat(stream=True)),
    Call("the model list", "GET", "/v1/models", 200, body=None),
    Call("a request without a key", "POST", CHAT, 401, auth="none"),
    Call("a request for a missing model", "POST", CHAT, 404, body=chat(model="nope")),
    Call("a request over the key's rate", "POST", CHAT, 429, auth="rpm1"),
    Call("an unknown route", "POST", "/v1/nothing", 404),
    Call("an OPTIONS that is not a preflight", "OPTIONS", CHAT, 405, body=None),
]


def call(gw: ServedGateway, case: Call, origin: str) -> httpx.Response:
    headers = {"Origin": origin, **case.headers}
    if case.auth != "none":
        token = key(gw, rpm=1 if case.auth == "rpm1" else None)
        headers["Authorization"] = f"Bearer {token}"
        if case.auth == "rpm1":
            assert httpx.post(gw.url + CHAT, headers=headers, json=chat()).status_code == 200
    with httpx.Client(timeout=30) as client:
        request = client.build_request(case.method, gw.url + case.path, headers=headers, json=case.body)
        response = client.send(request, stream=True)
        response.read()
        return response


@pytest.mark.parametrize("case", CALLS, ids=[c.name for c in CALLS])
def test_every_answer_to_an_allowed_origin_carries_the_cors_headers_once(
    served: ServedGateway, case: Call
) -> None:
    r = call(served, case, APP)
    assert r.status_code == case.status, r.text
    assert cors_headers(r) == {
        "access-control-allow-origin": [APP],
        "vary": ["Origin"],
        "access-control-expose-headers": ["Retry-After"],
    }
    if case.status == 429:
        assert r.headers["retry-after"].isdigit()


@pytest.mark.parametrize("case", CALLS, ids=[c.name for c in CALLS])
def test_an_answer_to_another_origin_is_the_same_without_any_cors_header(
    served: ServedGateway, case: Call
) -> None:
    r = call(served, case, EVIL)
    assert r.status_code == case.status, r.text
    assert cors_headers(r) == {}
