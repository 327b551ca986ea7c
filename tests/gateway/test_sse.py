"""The usage events of a relayed stream: found whole however the stream is cut; when the gateway
asked for usage the client did not, only what that ask added is taken out (the usage-only event,
or just its ``usage`` where the engine put its own fields in it); passed on untouched otherwise.

The llama.cpp events below are the shapes llama-server sends (checked against the real one in
tests/e2e/test_stream_usage.py): on chat, ``timings`` ride on the last chunk unasked and move into
the usage-only event when usage is asked; on completions, the last chunk carries ``usage`` always.
"""

from __future__ import annotations

import orjson
import pytest

from fleetserve.gateway.sse import BodyUsage, UsageTap, usage_of_body

CHUNK = b'data: {"id":"x","choices":[{"index":0,"delta":{"content":"hi"}}],"usage":null}\n\n'
USAGE = (
    b'data: {"id":"x","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5}}\n\n'
)
DONE = b"data: [DONE]\n\n"
STREAM = CHUNK * 2 + USAGE + DONE


def relay(tap: UsageTap, pieces: list[bytes]) -> bytes:
    return b"".join(tap.feed(p) for p in pieces) + tap.flush()


@pytest.mark.parametrize("size", [1, 7, 64, len(STREAM)], ids=lambda n: f"pieces-of-{n}")
@pytest.mark.parametrize("strip", [True, False], ids=["unasked", "asked"])
def test_the_usage_is_read_however_the_stream_is_cut(size: int, strip: bool) -> None:
    tap = UsageTap(strip)
    out = relay(tap, [STREAM[i : i + size] for i in range(0, len(STREAM), size)])
    assert tap.usage is not None
    assert (tap.usage.prompt, tap.usage.completion, tap.usage.total) == (3, 2, 5)
    assert out == (CHUNK * 2 + DONE if strip else STREAM)


def test_usage_on_a_chunk_with_choices_is_the_engines_own_and_passes_untouched() -> None:
    # llama.cpp's /v1/completions: the final chunk has its usage (and timings) whether asked or not
    last = (
        b'data: {"choices":[{"text":"a","index":0,"logprobs":null,"finish_reason":"length"}],'
        b'"object":"text_completion","usage":{"completion_tokens":3,"prompt_tokens":3,"total_tokens":6},'
        b'"id":"c","timings":{"predicted_n":3}}\n\n'
    )
    tap = UsageTap(strip=True)
    out = relay(tap, [CHUNK + last + DONE])
    assert tap.usage is not None and tap.usage.total == 6
    assert out == CHUNK + last + DONE


def test_a_usage_only_event_with_the_engines_own_fields_keeps_them_and_loses_only_its_usage() -> None:
    # llama.cpp's chat stream when asked for usage: its timings move into the usage-only event
    asked = (
        b'data: {"choices":[],"created":1,"id":"c","model":"m","system_fingerprint":"b1",'
        b'"object":"chat.completion.chunk","usage":{"completion_tokens":3,"prompt_tokens":23,'
        b'"total_tokens":26},"timings":{"prompt_n":1,"predicted_n":3}}\n\n'
    )
    tap = UsageTap(strip=True)
    out = relay(tap, [CHUNK, asked, DONE])
    assert tap.usage is not None and tap.usage.total == 26
    kept = b'{"choices":[],"created":1,"id":"c","model":"m","system_fingerprint":"b1",'
    kept += b'"object":"chat.completion.chunk","timings":{"prompt_n":1,"predicted_n":3}}'
    assert out == CHUNK + b"data: " + kept + b"\n\n" + DONE
    assert tap.events == 3


def test_a_client_that_asked_gets_openais_usage_only_event_where_the_engine_sent_none() -> None:
    # llama.cpp's /v1/completions with n=2: usage rides on each sequence's final chunk
    last = (
        b'data: {"choices":[{"text":"a","index":0,"finish_reason":"length"}],"created":1,"id":"c",'
        b'"model":"m","object":"text_completion","usage":{"completion_tokens":3,"prompt_tokens":2,'
        b'"total_tokens":5},"timings":{"predicted_n":3}}\n\n'
    )
    tap = UsageTap(strip=False)
    out = relay(tap, [CHUNK, last, last[:40], last[40:] + DONE])
    owed = b'data: {"choices":[],"created":1,"id":"c","model":"m","object":"text_completion",'
    owed += b'"usage":{"prompt_tokens":4,"completion_tokens":6,"total_tokens":10}}\n\n'
    assert out == CHUNK + last + last + owed + DONE
    # Where the engine sent one (chat), nothing is added.
    tap = UsageTap(strip=False)
    assert relay(tap, [CHUNK, USAGE, DONE]) == CHUNK + USAGE + DONE


def test_usage_events_of_several_sequences_are_summed() -> None:
    # llama.cpp with n=2: one usage event per sequence
    tap = UsageTap(strip=True)
    out = relay(tap, [CHUNK, USAGE, CHUNK, USAGE, DONE])
    assert out == CHUNK * 2 + DONE
    assert tap.usage_events == 2
    summed = tap.summed
    assert summed is not None and (summed.prompt, summed.completion, summed.total) == (6, 4, 10)
    assert tap.usage is not None and tap.usage.total == 5


def test_crlf_framed_events_flow_without_waiting_for_the_end() -> None:
    tap = UsageTap(strip=False)
    first = b"data: one\r\n\r\n"
    assert tap.feed(first + b"data: tw") == first
    assert tap.feed(b"o\r\n\r\n") == b"data: two\r\n\r\n"


def test_a_stream_without_usage_passes_untouched() -> None:
    tap = UsageTap(strip=True)
    assert relay(tap, [CHUNK, CHUNK, DONE]) == CHUNK * 2 + DONE
    assert tap.usage is None and tap.events == 3


@pytest.mark.parametrize(
    ("body", "total"),
    [
        (b'{"usage":{"prompt_tokens":4,"completion_tokens":6}}', 10),
        (b'{"usage":{"prompt_tokens":4,"total_tokens":4}}', 4),
        (b'{"usage":null}', None),
        (b'{"choices":[]}', None),
        (b"not json", None),
    ],
)
def test_the_usage_of_a_whole_answer(body: bytes, total: int | None) -> None:
    usage = usage_of_body(body)
    assert (usage.total if usage else None) == total


def test_llamacpps_own_stream_is_counted_from_each_prompts_final_event_and_passed_unchanged():
    events = [
        {"index": 0, "content": "a", "stop": False, "tokens_predicted": 1, "tokens_evaluated": 3},
        {"index": 1, "content": "b", "stop": False, "tokens_predicted": 1, "tokens_evaluated": 4},
        {"index": 0, "content": "", "stop": True, "tokens_predicted": 5, "tokens_evaluated": 3},
        {"index": 1, "content": '"stop":true', "stop": True, "tokens_predicted": 2, "tokens_evaluated": 4},
    ]
    stream = b"".join(b"data: " + orjson.dumps(e) + b"\n\n" for e in events)
    tap = UsageTap(strip=False, counts=True)
    out = b"".join(tap.feed(stream[i : i + 7]) for i in range(0, len(stream), 7)) + tap.flush()
    assert out == stream
    assert tap.usage is not None and (tap.usage.prompt, tap.usage.completion) == (7, 7)
    assert tap.usage_events == 2


def test_llamacpps_own_answer_counts_are_summed_over_its_prompts():
    assert (
        usage_of_body(b'{"content": "x", "tokens_predicted": 4, "tokens_evaluated": 2}', counts=True).total
        == 6
    )
    listed = usage_of_body(
        orjson.dumps(
            [{"tokens_predicted": 4, "tokens_evaluated": 2}, {"tokens_predicted": 1, "tokens_evaluated": 3}]
        ),
        counts=True,
    )
    assert listed is not None and (listed.prompt, listed.completion) == (5, 5)
    assert usage_of_body(b'[{"embedding": [0.1]}]', counts=True) is None


@pytest.mark.parametrize("size", [1, 7, 64, 4096])
def test_a_body_passed_in_pieces_is_counted_as_if_whole(size: int) -> None:
    answer = orjson.dumps(
        {"data": [{"embedding": [0.5] * 50}] * 20, "usage": {"prompt_tokens": 12, "total_tokens": 12}}
    )
    native = orjson.dumps([{"content": "x" * 100, "tokens_predicted": 41, "tokens_evaluated": 7}] * 3)
    for body, counts, want in [(answer, False, (12, 0)), (native, True, (21, 123))]:
        meter = BodyUsage(counts)
        for at in range(0, len(body), size):
            meter.feed(body[at : at + size])
        got = meter.usage()
        assert got is not None and (got.prompt, got.completion) == want
    meter = BodyUsage(False)
    meter.feed(b'{"data": []}')
    assert meter.usage() is None
