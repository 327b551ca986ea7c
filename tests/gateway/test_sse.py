"""The usage event of a relayed stream: found whole however the stream is cut, stripped when the
client did not ask for it, passed on untouched when it did."""

from __future__ import annotations

import pytest

from fleetserve.gateway.sse import UsageTap, usage_of_body

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


def test_usage_riding_on_a_chunk_with_choices_is_removed_from_it_alone() -> None:
    last = b'data: {"id":"x","choices":[{"index":0,"delta":{},"finish_reason":"stop"}],"usage":{"total_tokens":9}}\n\n'
    tap = UsageTap(strip=True)
    out = relay(tap, [CHUNK + last + DONE])
    assert tap.usage is not None and tap.usage.total == 9
    assert (
        out
        == CHUNK + b'data: {"id":"x","choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n' + DONE
    )


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
