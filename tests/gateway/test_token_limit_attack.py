"""Issue 31's attack on a key's tokens per minute, over real sockets: uvicorn serving the gateway in
this process in front of a fake engine that generates what a request's cap asks for, read as
llama-server reads it (``n_predict`` first; ``fleetserve.dev.fake_openai``). A 300-token key sends
8 requests at once, each asking for far more than its limit through one field or another: one is
answered, the rest get 429 with Retry-After, and the tokens generated stay within the limit plus
one request's worth. (Before, only ``max_tokens`` was read: two got through and 876 tokens were
generated.)

``max_output_tokens`` is the Responses API's field; this branch's gateway relays the Chat
Completions route only, so it is sent there, where engines ignore it (llama-server generates until
the context is full) and the gateway reserves the context; the fake engine honours it.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest

from builders import deployment
from fake_engine import ServedGateway, engines_on
from fleetserve.store.sql import SqlStore

TPM = 300
CONTEXT = 4096  # the deployment's profile, and the fake engine's own context
ATTACKERS = 8
KEYS = itertools.count()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedGateway]:
    tmp = tmp_path_factory.mktemp("tokens")
    with SqlStore.open(tmp / "state.db") as store, ServedGateway(store, engines=1) as gw:
        engines_on(store, [e.port for e in gw.engines], tmp / "tiny.gguf")
        profile = {"name": "cpu", "engine": "llama.cpp", "cpu": {"cores": 1}, "context": CONTEXT}
        store.put_deployment(deployment("tiny", 1, profile, model="tiny"))
        deadline = time.monotonic() + 10
        while True:
            route = gw.gateway.table.routes.get("tiny")
            if route is not None and route.endpoints and route.context == CONTEXT:
                break
            assert time.monotonic() < deadline, "the route never carried the profile's context"
            time.sleep(0.02)
        yield gw


def attack(gw: ServedGateway, name: str, fields: dict[str, Any]) -> tuple[list[httpx.Response], int]:
    """``ATTACKERS`` requests with ``fields`` at once on a new key of TPM tokens a minute: their
    answers, and the tokens the engine generated meanwhile."""
    _, token = gw.store.create_api_key(name, ["*"], None, TPM, datetime.now(UTC))
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], **fields}
    engine = gw.engines[0].served
    before = engine.generated
    start = threading.Barrier(ATTACKERS)

    def one(_: int) -> httpx.Response:
        with httpx.Client(base_url=f"{gw.url}/v1", timeout=60) as http:
            start.wait(10)
            return http.post("/chat/completions", json=body, headers={"Authorization": f"Bearer {token}"})

    with ThreadPoolExecutor(ATTACKERS) as pool:
        answers = list(pool.map(one, range(ATTACKERS)))
    return answers, engine.generated - before


# (sentence, the fields each request carries, what one such request may generate)
ATTACKS: list[tuple[str, dict[str, Any], int]] = [
    ("llama.cpp's n_predict", {"n_predict": 1000, "stream": True, "fake_delay": 0.001}, 1000),
    ("n_predict -1, until the context is full", {"n_predict": -1}, CONTEXT),
    ("n_predict over a small max_tokens", {"n_predict": 1000, "max_tokens": 10}, 1000),
    ("the Responses API's max_output_tokens", {"max_output_tokens": 1000}, 1000),
    ("n 4 choices of a small max_tokens", {"max_tokens": 200, "n": 4}, 800),
    ("n 4 streamed", {"max_tokens": 200, "n": 4, "stream": True}, 800),
]


@pytest.mark.parametrize(("fields", "worth"), [pytest.param(f, w, id=s) for s, f, w in ATTACKS])
def test_a_300_token_key_sending_8_greedy_requests_at_once_gets_one_answered_and_the_rest_429(
    served: ServedGateway, fields: dict[str, Any], worth: int
) -> None:
    answers, generated = attack(served, f"attacker-{next(KEYS)}", fields)
    statuses = sorted(a.status_code for a in answers)
    assert statuses == [200] + [429] * (ATTACKERS - 1), [a.text[:200] for a in answers]
    for refused in (a for a in answers if a.status_code == 429):
        assert refused.json()["error"]["code"] == "rate_limit_exceeded"
        assert int(refused.headers["retry-after"]) >= 1
    assert generated == worth  # the one answered got what it asked for ...
    assert generated <= TPM + worth  # ... and nothing beyond the limit plus one request's worth
