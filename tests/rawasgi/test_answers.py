"""rawasgi.answers: a whole response sent at once."""

from __future__ import annotations

import asyncio

import pytest

from fleetserve.rawasgi.answers import JSON, answer
from fleetserve.rawasgi.types import Header, Message

CASES = [
    (
        "a body without headers is JSON with its length",
        200,
        b'{"a":1}',
        None,
        [JSON, (b"content-length", b"7")],
    ),
    (
        "given headers replace the JSON type and get the length",
        201,
        b"hello",
        [(b"content-type", b"text/plain"), (b"retry-after", b"3")],
        [(b"content-type", b"text/plain"), (b"retry-after", b"3"), (b"content-length", b"5")],
    ),
    ("an empty body has a length of zero", 204, b"", [], [(b"content-length", b"0")]),
]


@pytest.mark.parametrize(
    ("status", "body", "headers", "sent"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_an_answer_is_one_start_and_one_body_with_its_content_length(
    status: int, body: bytes, headers: list[Header] | None, sent: list[Header]
) -> None:
    messages: list[Message] = []

    async def send(message: Message) -> None:
        messages.append(message)

    given = None if headers is None else list(headers)
    asyncio.run(answer(send, status, body, given))
    assert messages == [
        {"type": "http.response.start", "status": status, "headers": sent},
        {"type": "http.response.body", "body": body},
    ]
    assert given == headers  # the caller's list is not changed
