"""What a request reserves against its key's tokens per minute: whichever field carries its cap, as
each engine reads it, times its choices and prompts, the context when unbounded; the context a
deployment's replicas start with, as the gateway's routes learn it; and what a request is settled
at once answered (llama.cpp reports one sequence's usage for several)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from builders import deployment
from fleetserve.engines.registry import ENGINES
from fleetserve.engines.spec import EngineKind
from fleetserve.gateway.accounting import (
    BYTES_PER_TOKEN,
    DEFAULT_RESERVE_TOKENS,
    MAX_SEQUENCES,
    MAX_TOKENS_PER_SEQUENCE,
    Exchange,
    reservation,
    settlement,
)
from fleetserve.gateway.endpoints import deployment_context
from fleetserve.gateway.sse import UsageTap

LLAMA = frozenset({EngineKind.LLAMACPP})
VLLM = frozenset({EngineKind.VLLM})
BOTH = LLAMA | VLLM
CTX = 4096

# (sentence, request body, the deployment's engines, its context, tokens reserved for generation)
CASES: list[tuple[str, dict[str, Any], frozenset[EngineKind], int | None, int]] = [
    ("max_tokens is the cap", {"max_tokens": 100}, LLAMA, CTX, 100),
    ("max_completion_tokens is the cap", {"max_completion_tokens": 70}, VLLM, CTX, 70),
    ("llama.cpp's n_predict is the cap", {"n_predict": 300}, LLAMA, CTX, 300),
    (
        "llama.cpp reads n_predict before max_tokens, a smaller one included",
        {"n_predict": 5, "max_tokens": 100},
        LLAMA,
        CTX,
        5,
    ),
    (
        "llama.cpp reads n_predict before max_tokens, a larger one included",
        {"n_predict": 1000, "max_tokens": 10},
        LLAMA,
        CTX,
        1000,
    ),
    (
        "llama.cpp reads max_completion_tokens before max_tokens",
        {"max_completion_tokens": 7, "max_tokens": 100},
        LLAMA,
        CTX,
        7,
    ),
    ("n_predict -1 on llama.cpp runs until the context is full", {"n_predict": -1}, LLAMA, CTX, CTX),
    (
        "n_predict -1 wins over max_tokens on llama.cpp: the context",
        {"n_predict": -1, "max_tokens": 10},
        LLAMA,
        CTX,
        CTX,
    ),
    ("a request without a cap is reserved at the context", {}, LLAMA, CTX, CTX),
    ("a request without a cap on vLLM is reserved at the context", {}, VLLM, 8192, 8192),
    (
        "without a known context an uncapped request falls back to the default",
        {},
        LLAMA,
        None,
        DEFAULT_RESERVE_TOKENS,
    ),
    (
        "without a known context n_predict -1 falls back to the default",
        {"n_predict": -1},
        LLAMA,
        None,
        DEFAULT_RESERVE_TOKENS,
    ),
    ("a cap past the context is reserved at the context", {"n_predict": 10**9}, LLAMA, CTX, CTX),
    (
        "without a known context a huge cap is bounded",
        {"max_tokens": 10**30},
        LLAMA,
        None,
        MAX_TOKENS_PER_SEQUENCE,
    ),
    ("vLLM ignores n_predict: the request is uncapped there", {"n_predict": 5}, VLLM, CTX, CTX),
    (
        "vLLM reads max_tokens beside an n_predict it ignores",
        {"n_predict": 5, "max_tokens": 50},
        VLLM,
        CTX,
        50,
    ),
    (
        "a deployment on both engines reserves what the greedier may generate",
        {"n_predict": 5, "max_tokens": 50},
        BOTH,
        CTX,
        50,
    ),
    (
        "a route whose engines are not known reserves for every engine",
        {"n_predict": 5},
        frozenset(),
        CTX,
        CTX,
    ),
    (
        "llama.cpp skips a string cap and reads the next field",
        {"n_predict": "5", "max_tokens": 40},
        LLAMA,
        CTX,
        40,
    ),
    ("llama.cpp skips a string cap: uncapped", {"max_tokens": "5"}, LLAMA, CTX, CTX),
    ("vLLM reads a numeric string cap", {"max_tokens": "40"}, VLLM, CTX, 40),
    ("a boolean cap is never read as a smaller one", {"n_predict": True}, LLAMA, CTX, CTX),
    ("a null cap is no cap", {"max_tokens": None}, LLAMA, CTX, CTX),
    ("a fractional cap is rounded up", {"max_tokens": 2.5}, LLAMA, CTX, 3),
    ("a cap of 0 still reserves a token", {"max_tokens": 0}, LLAMA, CTX, 1),
    ("n choices multiply the cap", {"max_tokens": 100, "n": 4}, LLAMA, CTX, 400),
    ("n choices multiply the context when uncapped", {"n": 3}, LLAMA, CTX, 3 * CTX),
    ("llama.cpp reads n_cmpl before n", {"max_tokens": 10, "n_cmpl": 5, "n": 2}, LLAMA, CTX, 50),
    (
        "vLLM's best_of sequences count when larger than n",
        {"max_tokens": 10, "n": 2, "best_of": 6},
        VLLM,
        CTX,
        60,
    ),
    ("n 0 is not trusted to shrink the reservation", {"max_tokens": 100, "n": 0}, LLAMA, CTX, 100),
    ("a negative n is not trusted to shrink it", {"max_tokens": 100, "n": -3}, LLAMA, CTX, 100),
    ("a nonsense n is one choice", {"max_tokens": 100, "n": {"x": 1}}, BOTH, CTX, 100),
    ("vLLM reads a numeric string n", {"max_tokens": 100, "n": "3"}, VLLM, CTX, 300),
    (
        "a huge n is bounded",
        {"max_tokens": 2, "n": 10**12},
        LLAMA,
        CTX,
        2 * MAX_SEQUENCES,
    ),
    (
        "a list of prompts is answered prompt by prompt",
        {"prompt": ["a", "b", [1, 2]], "max_tokens": 10},
        LLAMA,
        CTX,
        30,
    ),
    ("a list of token ids is one prompt", {"prompt": [1, 2, 3], "max_tokens": 10}, LLAMA, CTX, 10),
    (
        "prompts times choices",
        {"prompt": ["a", "b"], "n": 3, "max_tokens": 10},
        VLLM,
        CTX,
        60,
    ),
]


@pytest.mark.parametrize(
    ("body", "engines", "context", "expected"),
    [pytest.param(b, e, c, x, id=s) for s, b, e, c, x in CASES],
)
def test_a_request_reserves_what_its_engines_may_generate(
    body: dict[str, Any], engines: frozenset[EngineKind], context: int | None, expected: int
) -> None:
    assert reservation(body, b"", engines, context) == expected


# (sentence, request body, the deployment's engines, the path it is sent to, tokens reserved)
ROUTES: list[tuple[str, dict[str, Any], frozenset[EngineKind], bytes, int]] = [
    ("on the Responses route max_output_tokens is the cap", {"max_output_tokens": 90}, LLAMA, b"/v1/responses", 90),
    ("on vLLM's Responses route too", {"max_output_tokens": 90}, VLLM, b"/v1/responses", 90),
    ("elsewhere llama.cpp ignores max_output_tokens: the context", {"max_output_tokens": 90}, LLAMA, b"/v1/chat/completions", CTX),
    ("elsewhere vLLM ignores it too", {"max_output_tokens": 90}, VLLM, b"/v1/completions", CTX),
    ("beside max_tokens on the Responses route, the larger", {"max_output_tokens": 9, "max_tokens": 20}, LLAMA, b"/v1/responses", 20),
    ("n_predict still comes first on llama.cpp's Responses route", {"max_output_tokens": 9, "n_predict": 30}, LLAMA, b"/v1/responses", 30),
]  # fmt: skip


@pytest.mark.parametrize(
    ("body", "engines", "path", "expected"), [pytest.param(b, e, p, x, id=s) for s, b, e, p, x in ROUTES]
)
def test_max_output_tokens_caps_a_request_on_the_responses_route_only(
    body: dict[str, Any], engines: frozenset[EngineKind], path: bytes, expected: int
) -> None:
    assert reservation(body, b"", engines, CTX, path) == expected


def test_the_prompt_is_estimated_from_the_bodys_bytes_on_top() -> None:
    data = {"model": "tiny", "messages": [{"role": "user", "content": "x" * 400}], "max_tokens": 10}
    body = orjson.dumps(data)
    assert reservation(data, body, LLAMA, CTX) == 10 + len(body) // BYTES_PER_TOKEN


LLAMA_CPU = {"name": "cpu", "engine": "llama.cpp", "cpu": {"cores": 1}}
VLLM_GPU = {"name": "gpu", "engine": "vllm", "deviceClass": "h100"}

# (sentence, the deployment's profiles, the context its replicas start with as the gateway reads it)
CONTEXTS: list[tuple[str, list[dict[str, Any]], int | None]] = [
    ("a profile's context is the context", [LLAMA_CPU | {"context": 2048}], 2048),
    ("a profile without a context leaves it to the model's own: unknown here", [LLAMA_CPU], None),
    ("vLLM's --max-model-len in engineArgs overrides the profile's", [VLLM_GPU | {"context": 2048, "engineArgs": ["--max-model-len", "8192"]}], 8192),
    ("vLLM's --max-model-len=N form is read too", [VLLM_GPU | {"engineArgs": ["--max-model-len=1024"]}], 1024),
    ("the last --max-model-len wins, as vLLM reads them", [VLLM_GPU | {"engineArgs": ["--max-model-len", "100", "--max-model-len", "300"]}], 300),
    ("a --max-model-len the gateway cannot read leaves it unknown", [VLLM_GPU | {"context": 2048, "engineArgs": ["--max-model-len", "8k"]}], None),
    ("several profiles: the largest context", [LLAMA_CPU | {"context": 2048}, VLLM_GPU | {"context": 8192}], 8192),
    ("several profiles, one unknown: unknown", [LLAMA_CPU | {"context": 2048}, VLLM_GPU], None),
]  # fmt: skip


@pytest.mark.parametrize(("profiles", "expected"), [pytest.param(p, x, id=s) for s, p, x in CONTEXTS])
def test_the_context_a_deployments_replicas_start_with(
    profiles: list[dict[str, Any]], expected: int | None
) -> None:
    assert deployment_context(deployment("d", 1, *profiles).profiles) == expected


def exchange(usage: tuple[int, int] | None, events: list[tuple[int, int]] | None = None) -> Exchange:
    """What a request saw: the usage it reported (prompt, completion), and a stream's usage events."""
    ex = Exchange()
    if usage is not None:
        ex.prompt, ex.completion = usage
        ex.usage_total = sum(usage)
    if events is not None:
        tap = ex.tap = UsageTap(strip=True)
        for prompt, completion in events:
            payload = {"choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": completion}}
            tap.feed(b"data: " + orjson.dumps(payload) + b"\n\n")
    return ex


LLAMA_FIELDS = ENGINES[EngineKind.LLAMACPP].cap_fields
VLLM_FIELDS = ENGINES[EngineKind.VLLM].cap_fields
RESERVED = 500

# (sentence, request body, the answering engine's fields, what it saw, tokens settled)
SETTLEMENTS: list[tuple[str, dict[str, Any], Any, Exchange, int]] = [
    ("one sequence: its usage", {"max_tokens": 10}, LLAMA_FIELDS, exchange((20, 10)), 30),
    ("no usage: the reservation", {"max_tokens": 10}, LLAMA_FIELDS, exchange(None), RESERVED),
    ("nothing generated (an error without usage): nothing", {"n": 4}, LLAMA_FIELDS, exchange((0, 0)), 0),
    ("llama.cpp, n 4, a whole answer's one-sequence usage: the reservation", {"n": 4}, LLAMA_FIELDS, exchange((20, 10)), RESERVED),
    ("llama.cpp, n_cmpl 2 before n", {"n_cmpl": 2, "n": 1}, LLAMA_FIELDS, exchange((20, 10)), RESERVED),
    ("llama.cpp, a list of prompts", {"prompt": ["a", "b"]}, LLAMA_FIELDS, exchange((20, 10)), RESERVED),
    ("llama.cpp, a stream with one usage event per sequence: their sum", {"n": 2}, LLAMA_FIELDS, exchange((20, 10), [(20, 10), (20, 12)]), 62),
    ("llama.cpp, a stream missing a sequence's usage: the reservation", {"n": 3}, LLAMA_FIELDS, exchange((20, 10), [(20, 10), (20, 12)]), RESERVED),
    ("llama.cpp, usage past the reservation: the usage", {"n": 2}, LLAMA_FIELDS, exchange((400, 300)), 700),
    ("vLLM's usage is the whole request's", {"n": 4}, VLLM_FIELDS, exchange((20, 40)), 60),
    ("no engine known (no replica tried): the usage", {"n": 4}, None, exchange((0, 0)), 0),
]  # fmt: skip


@pytest.mark.parametrize(
    ("body", "fields", "ex", "expected"), [pytest.param(b, f, e, x, id=s) for s, b, f, e, x in SETTLEMENTS]
)
def test_a_request_is_settled_at_what_its_engine_generated_for_every_sequence(
    body: dict[str, Any], fields: Any, ex: Exchange, expected: int
) -> None:
    assert settlement(RESERVED, ex, fields, body) == expected


def test_a_streams_summed_usage_is_what_the_key_is_counted_for() -> None:
    ex = exchange((20, 10), [(20, 10), (20, 12)])
    settlement(RESERVED, ex, LLAMA_FIELDS, {"n": 2})
    assert (ex.prompt, ex.completion, ex.usage_total) == (40, 22, 62)
