"""Sending a whole response at once: status, headers, body and its Content-Length."""

from __future__ import annotations

from collections.abc import Sequence

from fleetserve.rawasgi.types import Header, Send

JSON: Header = (b"content-type", b"application/json")
"""The Content-Type header of a JSON body."""


async def answer(send: Send, status: int, body: bytes, headers: Sequence[Header] | None = None) -> None:
    """Send ``body`` as the whole response with ``status``; its headers are ``headers`` (a JSON
    Content-Type when None) and the Content-Length, added here."""
    length = (b"content-length", b"%d" % len(body))
    head = [JSON, length] if headers is None else [*headers, length]
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": body})
