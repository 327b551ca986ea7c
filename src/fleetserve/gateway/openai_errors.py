"""The gateway's answers in OpenAI's error shape: ``{"error": {message, type, param, code}}``.

OpenAI clients read these fields (``type`` and ``code`` to decide, ``message`` to show), so every
refusal of the data path is one of these bodies; a stream that broke off after its first byte
ends with one as a server-sent event. An engine's own error answer reaches the client with the
engine's status and message: as it came when it is in this shape, else put in it
(``engine_error_body``). Not to be confused with ``fleetserve.errors``, the package's exception
tree.
"""

from __future__ import annotations

import html
from http import HTTPStatus
from typing import Any

import orjson

from fleetserve.rawasgi.answers import JSON, answer
from fleetserve.rawasgi.types import Send


def error_body(message: str, kind: str, code: str | int | None = None, param: str | None = None) -> bytes:
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


ENGINE_MESSAGE_LIMIT = 2048
"""The most of an engine's error text (bytes of a text body, characters of one in HTML) kept
when its answer is put in OpenAI's shape."""

_FIELDS = ("message", "type", "param", "code")


def engine_error_body(status: int, body: bytes, content_type: bytes = b"") -> bytes | None:
    """An engine's error answer (``status`` >= 400) in OpenAI's shape, keeping the engine's message:
    None when ``body`` is in that shape already (vLLM's errors), so it is relayed as it came.

    - ``{"error": {"message": ..., ...}}`` lacking some of type, param and code (llama.cpp's lack
      ``param``): the missing ones are added (null, the type as below); every field the engine
      sent stays as it sent it.
    - Another JSON object: its ``error`` (a string), ``message`` (vLLM's older flat errors, with
      their ``type``, ``param`` and ``code``) or ``detail`` (FastAPI's) is the message, else the
      body's first ``ENGINE_MESSAGE_LIMIT`` bytes.
    - HTML: its text without tags; plain text: as it came; both cut at ``ENGINE_MESSAGE_LIMIT``.
    - No body: the status and its reason phrase.
    The type is the engine's where it named one, else ``invalid_request_error`` for a 4xx and
    ``server_error`` for a 5xx, as OpenAI's own answers have them.
    """
    data: Any = None
    if body.lstrip()[:1] in (b"{", b"["):
        try:
            data = orjson.loads(body)
        except orjson.JSONDecodeError:
            data = None
    if isinstance(data, dict):
        error = data.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            missing = [f for f in _FIELDS if f not in error]
            if not missing:
                return None
            for name in missing:
                error[name] = _kind(status) if name == "type" else None
            return orjson.dumps(data)
        fields = data if isinstance(data.get("message"), str) else {}
        for text in (error, data.get("message"), data.get("detail")):
            if isinstance(text, str) and text:
                return error_body(
                    _bounded(text),
                    _str(fields.get("type")) or _kind(status),
                    _code(fields.get("code")),
                    _str(fields.get("param")),
                )
    if not body.strip():
        try:
            reason = HTTPStatus(status).phrase
        except ValueError:
            reason = "(no reason)"
        return error_body(f"The engine answered {status} {reason} with an empty body.", _kind(status))
    if b"html" in content_type.lower() or body.lstrip()[:1] == b"<":
        page = body[: 16 * ENGINE_MESSAGE_LIMIT].decode("utf-8", "replace")
        text = _html_text(page)[:ENGINE_MESSAGE_LIMIT]
        message = text or f"The engine answered {status} with an HTML page."
    else:
        message = body[:ENGINE_MESSAGE_LIMIT].decode("utf-8", "replace").strip()
    return error_body(message, _kind(status))


def _html_text(page: str) -> str:
    """An HTML page's text: tags, scripts and styles out, entities read, blanks collapsed. One pass
    (no backtracking regex: an engine's page is not to cost the gateway time)."""
    out = []
    skipping = ""
    for i, part in enumerate(page.split("<")):
        if i == 0:
            out.append(part)
            continue
        tag, closed, text = part.partition(">")
        if not closed:
            continue  # a tag the page (or its first bytes) never closes
        name = tag.split(None, 1)[0].lower() if tag.strip() else ""
        if skipping:
            if name == "/" + skipping:
                skipping = ""
            continue
        if name in ("script", "style"):
            skipping = name
            continue
        out.append(" ")
        out.append(text)
    return " ".join(html.unescape("".join(out)).split())


def _kind(status: int) -> str:
    return "invalid_request_error" if status < 500 else "server_error"


def _bounded(text: str) -> str:
    return text[:ENGINE_MESSAGE_LIMIT]


def _str(value: object) -> str | None:
    return value if isinstance(value, str) and value else None


def _code(value: object) -> str | int | None:
    return value if isinstance(value, (str, int)) and not isinstance(value, bool) else None
