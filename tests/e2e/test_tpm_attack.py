"""Issue 31's attack on a key's tokens per minute (item 8, "n_predict past TPM"), against a real
llama-server through the gateway (``llama_gateway``: the tiny model, a 512-token context the
deployment declares). What the engine generated is read from the engine itself
(``llamacpp:tokens_predicted_total``), not from the answers the gateway reads.

- 8 requests at once on a 300-token key, each asking through llama.cpp's own ``n_predict`` for
  far more than the limit (every request sets ``ignore_eos``, so it runs to its cap or to the
  full context): one is answered, 7 get 429 (one reservation is past the limit), and the tokens
  spent (generated, plus each answered request's prompt) stay within the limit plus one
  request's reservation. (Before item 6, only ``max_tokens`` was read: 876 tokens.)
- Several choices (``n``): llama-server reports one sequence's usage for the whole request, so a
  key settled from that usage could send wave after wave. Waves of 8 requests of 4 choices each
  are sent until one wave is refused whole; the tokens spent (generated, plus each answered
  request's prompt) stay within the limit plus one request's reservation.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from typing import Any

import httpx
import orjson
import pytest
from llama_gateway import CONTEXT, LlamaGateway, llama_behind_gateway

from fleetserve.engines.spec import EngineKind
from fleetserve.gateway.accounting import reservation

pytestmark = pytest.mark.slow

TPM = 300
ATTACKERS = 8
PROMPT_TOKENS = 23  # the chat template around "hi" on the tiny model
KEYS = itertools.count()


@pytest.fixture(scope="module")
def lg(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaGateway]:
    with llama_behind_gateway(tmp_path_factory.mktemp("tpm-attack")) as served:
        yield served


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "ignore_eos": True, **fields}


def reserved(body: dict[str, Any]) -> int:
    """What the gateway reserves for ``body`` on this deployment."""
    return reservation(body, orjson.dumps(body), [EngineKind.LLAMACPP], CONTEXT, b"/v1/chat/completions")


def wave(lg: LlamaGateway, token: str, body: dict[str, Any]) -> list[httpx.Response]:
    """``ATTACKERS`` requests of ``body`` at once."""
    start = threading.Barrier(ATTACKERS)

    def one(_: int) -> httpx.Response:
        with httpx.Client(base_url=lg.url, timeout=120) as http:
            start.wait(10)
            return http.post("/chat/completions", json=body, headers={"Authorization": f"Bearer {token}"})

    with ThreadPoolExecutor(ATTACKERS) as pool:
        return list(pool.map(one, range(ATTACKERS)))


def attacker(lg: LlamaGateway) -> str:
    _, token = lg.store.create_api_key(f"attacker-{next(KEYS)}", ["*"], None, TPM, datetime.now(UTC))
    return token


def refused_as_rate_limited(answers: list[httpx.Response]) -> None:
    for answer in (a for a in answers if a.status_code == 429):
        assert answer.json()["error"]["code"] == "rate_limit_exceeded"
        assert int(answer.headers["retry-after"]) >= 1


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_8_requests_at_once_asking_past_the_limit_with_n_predict_are_held_to_it(
    lg: LlamaGateway, stream: bool
) -> None:
    body = chat(n_predict=1000, stream=stream)
    token = attacker(lg)
    before = lg.predicted()
    answers = wave(lg, token, body)
    generated = lg.predicted() - before
    # A key is admitted while what it used and reserved is under its limit: one request reserves
    # the deployment's whole context (and its prompt), past the limit, so the others are refused.
    statuses = sorted(a.status_code for a in answers)
    assert statuses == [200] + [429] * (ATTACKERS - 1), [a.text[:200] for a in answers]
    answered = 1
    refused_as_rate_limited(answers)
    spent = generated + answered * PROMPT_TOKENS
    assert 0 < spent <= TPM + reserved(body), (answered, spent)


def test_waves_of_requests_of_several_choices_stay_within_the_limit(lg: LlamaGateway) -> None:
    body = chat(n_predict=20, n=4)
    token = attacker(lg)
    before = lg.predicted()
    answered = 0
    for _ in range(6):  # settled from one sequence's usage, the key would get 5 answers in 4 waves
        answers = wave(lg, token, body)
        assert {a.status_code for a in answers} <= {200, 429}, [a.text[:200] for a in answers]
        refused_as_rate_limited(answers)
        ok = sum(a.status_code == 200 for a in answers)
        if ok == 0:
            break
        answered += ok
        for answer in (a for a in answers if a.status_code == 200):
            assert len(answer.json()["choices"]) == 4
    else:
        raise AssertionError("six waves and the key was never refused")
    generated = lg.predicted() - before
    assert generated == answered * 4 * 20
    spent = generated + answered * PROMPT_TOKENS
    assert answered >= 1 and spent <= TPM + reserved(body), (answered, spent)
