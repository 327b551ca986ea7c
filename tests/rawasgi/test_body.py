"""rawasgi.body: the declared length of a JSON body, and the one bounded body reader."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

import pytest

from fleetserve.rawasgi.body import Unread, declared_length, read_body
from fleetserve.rawasgi.types import Message

JSON = (b"content-type", b"application/json")

LENGTH_CASES = [
    ("one length and a JSON type declare that length", [(b"content-length", b"12"), JSON], 12),
    (
        "a JSON type with a charset is JSON",
        [(b"content-length", b"3"), (b"content-type", b"Application/JSON; charset=utf-8")],
        3,
    ),
    ("no content type declares nothing", [(b"content-length", b"12")], None),
    (
        "another content type declares nothing",
        [(b"content-length", b"12"), (b"content-type", b"text/plain")],
        None,
    ),
    ("two content types declare nothing", [(b"content-length", b"12"), JSON, JSON], None),
    ("two lengths declare nothing", [(b"content-length", b"12"), (b"content-length", b"12"), JSON], None),
    ("a length not of digits declares nothing", [(b"content-length", b"-1"), JSON], None),
    (
        "a transfer encoding declares nothing",
        [(b"content-length", b"12"), JSON, (b"transfer-encoding", b"chunked")],
        None,
    ),
    ("no length declares nothing", [JSON], None),
]


@pytest.mark.parametrize(
    ("headers", "length"), [c[1:] for c in LENGTH_CASES], ids=[c[0] for c in LENGTH_CASES]
)
def test_a_request_declares_a_length_only_for_exactly_one_json_body(
    headers: list[tuple[bytes, bytes]], length: int | None
) -> None:
    assert declared_length({"type": "http", "headers": headers}) == length


def chunks(*parts: bytes) -> list[Message]:
    """The ``http.request`` messages of a body sent in ``parts``."""
    return [
        {"type": "http.request", "body": part, "more_body": i < len(parts) - 1}
        for i, part in enumerate(parts)
    ]


GONE: Message = {"type": "http.disconnect"}


class Fake:
    """A receive() that yields the given messages, then fails the test if asked for more."""

    def __init__(self, messages: Sequence[Message]) -> None:
        self.messages = list(messages)
        self.taken = 0

    async def __call__(self) -> Message:
        assert self.taken < len(self.messages), "read past the messages the test gave"
        self.taken += 1
        return self.messages[self.taken - 1]


@dataclass(frozen=True)
class Case:
    name: str
    messages: list[Message]
    limit: int
    result: bytes | Unread
    taken: int  # messages read: a reader stops as soon as it knows


CASES = [
    Case("a body in one message is returned whole", chunks(b"abc"), 10, b"abc", 1),
    Case("a body in pieces is joined", chunks(b"ab", b"", b"cd"), 10, b"abcd", 3),
    Case("an empty body is empty", [{"type": "http.request"}], 10, b"", 1),
    Case("a body of exactly the limit is returned", chunks(b"ab", b"cd"), 4, b"abcd", 2),
    Case("one message over the limit is refused", chunks(b"abcde"), 4, Unread.OVER_LIMIT, 1),
    Case(
        "pieces over the limit are refused without reading the rest",
        chunks(b"ab", b"cde", b"f"),
        4,
        Unread.OVER_LIMIT,
        2,
    ),
    Case("a disconnect before the body is the client gone", [GONE], 10, Unread.GONE, 1),
    Case(
        "a disconnect halfway through is the client gone",
        [*chunks(b"ab", b"cd")[:1], GONE],
        10,
        Unread.GONE,
        2,
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_a_body_is_read_whole_or_told_apart_as_over_the_limit_or_gone(case: Case) -> None:
    receive = Fake(case.messages)
    result = asyncio.run(read_body(receive, case.limit))
    assert result == case.result
    assert receive.taken == case.taken
