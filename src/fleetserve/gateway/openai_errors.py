"""The gateway's answers in OpenAI's error shape: ``{"error": {message, type, param, code}}``.

OpenAI clients read these fields (``type`` and ``code`` to decide, ``message`` to show), so every
refusal of the data path is one of these bodies; a stream that broke off after its first byte
ends with one as a server-sent event. Not to be confused with ``fleetserve.errors``, the
package's exception tree.
"""

from __future__ import annotations

import orjson

from fleetserve.rawasgi.answers import JSON, answer
from fleetserve.rawasgi.types import Send


def error_body(message: str, kind: str, code: str | None = None, param: str | None = None) -> bytes:
    """An error in OpenAI's JSON shape."""
    return orjson.dumps({"error": {"message": message, "type": kind, "param": param, "code": code}})


async def send_error(
    send: Send,
    status: int,
    message: str,
    kind: str,
    code: str | None = None,
    param: str | None = None,
    retry_after: int | None = None,
) -> None:
    """Answer with an error in OpenAI's shape (and ``Retry-After`` when given)."""
    headers = [JSON]
    if retry_after is not None:
        headers.append((b"retry-after", str(retry_after).encode()))
    await answer(send, status, error_body(message, kind, code, param), headers)


def broken_stream_event(replica: str) -> bytes:
    """The server-sent event that ends a stream whose upstream broke off mid-way."""
    body = {
        "error": {
            "message": f"the upstream stream from replica {replica} broke off before it was complete",
            "type": "upstream_error",
            "param": None,
            "code": "stream_broken",
        }
    }
    return b"\n\ndata: " + orjson.dumps(body) + b"\n\n"
