"""Streams as llama-server sent them, through the gateway (issue 31, item 3), against the real
engine on the tiny model (``llama_gateway``).

What llama-server sends, pinned here first straight at the engine: on a chat stream its
``timings`` ride on the last chunk, and move into a usage-only event (empty ``choices``) when
``stream_options.include_usage`` asks for usage; a ``/v1/completions`` stream's last chunk carries
``usage`` (and ``timings``) whether asked or not; with ``n`` choices every sequence sends its own.
Through the gateway, which asks for usage to count a key's tokens: a client that did not ask gets
no usage it would not have had, llama.cpp's ``timings`` and its default usage stay, and the tokens
of every sequence are counted; a client that asked gets OpenAI's usage-only event last, added on
``/v1/completions``, where llama-server sends none.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import orjson
import pytest
from llama_gateway import LlamaGateway, llama_behind_gateway

pytestmark = pytest.mark.slow

PROMPT_TOKENS = 23  # the chat template around "hi" on the tiny model
CHAT: dict[str, Any] = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 3,
    "ignore_eos": True,
    "stream": True,
}
COMPLETION: dict[str, Any] = {
    "model": "tiny",
    "prompt": "hi",
    "max_tokens": 3,
    "ignore_eos": True,
    "stream": True,
}
ASKED = {"stream_options": {"include_usage": True}}


@pytest.fixture(scope="module")
def lg(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaGateway]:
    with llama_behind_gateway(tmp_path_factory.mktemp("stream-usage")) as served:
        yield served


def events(text: str) -> list[dict[str, Any]]:
    """A stream's JSON events, in order (``[DONE]`` left out, and checked to end it)."""
    data = [line[5:].strip() for line in text.splitlines() if line.startswith("data:")]
    assert data and data[-1] == "[DONE]", text[-300:]
    return [orjson.loads(d) for d in data[:-1]]


def shapes(stream: list[dict[str, Any]]) -> set[tuple[int, tuple[str, ...]]]:
    """The kinds of event in a stream: choices and fields (how many content chunks llama-server
    sends for the same tokens varies)."""
    return {(len(e.get("choices") or ()), tuple(sorted(e))) for e in stream}


def direct(lg: LlamaGateway, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    answer = httpx.post(f"{lg.engine}/v1{path}", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    return events(answer.text)


def through(lg: LlamaGateway, path: str, body: dict[str, Any], token: str) -> list[dict[str, Any]]:
    answer = httpx.post(
        f"{lg.url}{path}", json=body, headers={"Authorization": f"Bearer {token}"}, timeout=60
    )
    assert answer.status_code == 200, answer.text
    return events(answer.text)


def new_key(lg: LlamaGateway, name: str) -> tuple[int, str]:
    key, token = lg.store.create_api_key(name, ["*"], None, None, datetime.now(UTC))
    return key.id, token


def counted(lg: LlamaGateway, key_id: int) -> tuple[int, int]:
    """(prompt, completion) tokens the gateway counted for ``key_id``, flushed to the store now."""
    flusher = lg.gw.gateway.usage_flusher
    assert flusher is not None
    asyncio.run_coroutine_threadsafe(flusher.flush(), lg.gw.loop).result(10)
    now = datetime.now(UTC)
    totals = lg.store.usage_totals(now - timedelta(minutes=5), now + timedelta(minutes=1), "key", key_id)
    counts = totals[key_id]
    return counts.prompt_tokens, counts.completion_tokens


def test_llama_server_moves_its_chat_timings_into_the_usage_event_and_always_sends_completions_usage(
    lg: LlamaGateway,
) -> None:
    unasked = direct(lg, "/chat/completions", CHAT)
    assert not any("usage" in e for e in unasked)
    assert "timings" in unasked[-1] and unasked[-1]["choices"][0]["finish_reason"] == "length"
    asked = direct(lg, "/chat/completions", {**CHAT, **ASKED})
    assert asked[-1]["choices"] == [] and {"usage", "timings"} <= set(asked[-1])
    assert "timings" not in asked[-2]
    for options in ({}, ASKED, {"stream_options": {"include_usage": False}}):
        last = direct(lg, "/completions", {**COMPLETION, **options})[-1]
        assert last["choices"] and {"usage", "timings"} <= set(last), options
    two = direct(lg, "/chat/completions", {**CHAT, **ASKED, "n": 2})
    assert [e["usage"]["completion_tokens"] for e in two if "usage" in e] == [3, 3]


def test_a_chat_stream_unasked_for_usage_keeps_the_timings_gets_no_usage_and_is_counted(
    lg: LlamaGateway,
) -> None:
    key_id, token = new_key(lg, "chat-unasked")
    got = through(lg, "/chat/completions", CHAT, token)
    assert not any("usage" in e for e in got)
    # The engine's timings reach the client: in the usage-only event the gateway's ask made it
    # send, kept without its usage, after the last chunk with choices.
    assert got[-1]["choices"] == [] and "timings" in got[-1]
    assert got[-2]["choices"][0]["finish_reason"] == "length"
    assert counted(lg, key_id) == (PROMPT_TOKENS, 3)


def test_a_completions_stream_reaches_the_client_as_llama_server_sent_it(lg: LlamaGateway) -> None:
    _, token = new_key(lg, "completions-unasked")
    got = through(lg, "/completions", COMPLETION, token)
    assert shapes(got) == shapes(direct(lg, "/completions", COMPLETION))
    assert got[-1]["usage"]["completion_tokens"] == 3 and "timings" in got[-1]


def test_a_completions_stream_that_asked_for_usage_gets_openais_usage_only_event_too(
    lg: LlamaGateway,
) -> None:
    _, token = new_key(lg, "completions-asked")
    got = through(lg, "/completions", {**COMPLETION, **ASKED, "n": 2}, token)
    engine = direct(lg, "/completions", {**COMPLETION, **ASKED, "n": 2})
    # llama-server's own events, as it sent them (usage and timings on each sequence's last chunk) ...
    assert shapes(got[:-1]) == shapes(engine)
    assert [e["usage"]["completion_tokens"] for e in got[:-1] if "usage" in e] == [3, 3]
    # ... and OpenAI's usage-only event, of the whole request, last.
    assert got[-1]["choices"] == [] and got[-1]["usage"]["completion_tokens"] == 6


def test_a_client_that_asked_gets_the_usage_only_event_as_openai_specifies(lg: LlamaGateway) -> None:
    _, token = new_key(lg, "chat-asked")
    got = through(lg, "/chat/completions", {**CHAT, **ASKED}, token)
    assert shapes(got) == shapes(direct(lg, "/chat/completions", {**CHAT, **ASKED}))
    assert got[-1]["choices"] == [] and got[-1]["usage"]["completion_tokens"] == 3


def test_every_sequence_of_a_stream_is_counted(lg: LlamaGateway) -> None:
    key_id, token = new_key(lg, "chat-two")
    got = through(lg, "/chat/completions", {**CHAT, "n": 2}, token)
    assert not any("usage" in e for e in got)
    assert counted(lg, key_id) == (2 * PROMPT_TOKENS, 2 * 3)
