"""Reading a request's body: its declared length, and ONE bounded reader.

``read_body`` returns the whole body as ``bytes``, or an ``Unread`` saying why there is none:
the body grew past the caller's limit (the caller answers 413), or the client went away before
it was complete (there is nobody to answer).
"""

from __future__ import annotations

import enum

from fleetserve.rawasgi.types import Receive, Scope


class Unread(enum.Enum):
    """Why ``read_body`` returned no body."""

    OVER_LIMIT = "over_limit"  # more bytes than the limit arrived (or were declared to)
    GONE = "gone"  # the client disconnected before the body was complete


def declared_length(scope: Scope) -> int | None:
    """The request's Content-Length if it declares exactly one JSON body: one Content-Length of
    digits, one Content-Type ``application/json`` (parameters allowed), no Transfer-Encoding
    (None otherwise: the caller's slower path reads and judges it)."""
    length = kind = None
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            if length is not None or not value.isdigit():
                return None
            length = int(value)
        elif name == b"content-type":
            if kind is not None:
                return None
            kind = value.split(b";", 1)[0].strip().lower()
        elif name == b"transfer-encoding":
            return None
    return length if kind == b"application/json" else None


async def read_body(receive: Receive, limit: int) -> bytes | Unread:
    """The whole request body if it is at most ``limit`` bytes; ``Unread.OVER_LIMIT`` as soon as
    more arrived (the rest is not read); ``Unread.GONE`` if the client disconnected first."""
    message = await receive()
    if message["type"] != "http.request":
        return Unread.GONE
    body: bytes = message.get("body", b"")
    size = len(body)
    if size > limit:
        return Unread.OVER_LIMIT
    if not message.get("more_body", False):
        return body  # the common case: the whole body in one message, no copy
    parts = [body]
    while message.get("more_body", False):
        message = await receive()
        if message["type"] != "http.request":
            return Unread.GONE
        chunk: bytes = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return Unread.OVER_LIMIT
        parts.append(chunk)
    return b"".join(parts)
