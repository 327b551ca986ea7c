"""The usage event of a server-sent event stream: found as the stream passes, stripped when unasked.

The gateway always asks an engine for the usage event (``stream_options.include_usage``), so
that a stream's tokens are counted against its key's limits whether or not the client asked for
them. ``UsageTap`` sits on the relayed bytes: it passes whole events through untouched and
unparsed, except the one carrying a non-null ``usage``, which it reads (with orjson) and, when
the client did not ask for it, removes (an event with no choices left) or strips of its usage
field. Bytes of an event not yet complete are held back until its end arrives, so an event split
across reads is seen whole.
"""

from __future__ import annotations

from typing import Any

import orjson

MAX_CARRY = 64 * 1024
"""An incomplete event held back longer than this is passed on as it is (no event is this big)."""

_USAGE = b'"usage"'


class Usage:
    """Token counts from a usage object, OpenAI's (``prompt_tokens``, ``completion_tokens``) or
    Anthropic's and the Responses API's (``input_tokens`` beside ``cache_read_input_tokens``,
    ``output_tokens``); zeros where absent, or what ``before`` counted (an Anthropic stream tells
    the prompt in ``message_start`` and the output in ``message_delta``)."""

    __slots__ = ("completion", "prompt", "total")
    prompt: int
    completion: int
    total: int

    def __init__(self, raw: object, before: Usage | None = None) -> None:
        data = raw if isinstance(raw, dict) else {}
        prompt = _count(data.get("prompt_tokens")) or (
            _count(data.get("input_tokens")) + _count(data.get("cache_read_input_tokens"))
        )
        completion = _count(data.get("completion_tokens")) or _count(data.get("output_tokens"))
        self.prompt = prompt or (before.prompt if before else 0)
        self.completion = completion or (before.completion if before else 0)
        total = _count(data.get("total_tokens"))
        self.total = total if total and before is None else self.prompt + self.completion


def _count(value: object) -> int:
    return value if isinstance(value, int) and value >= 0 else 0


def usage_of_body(body: bytes) -> Usage | None:
    """The usage of a whole (non-streamed) JSON answer, if it has one."""
    if _USAGE not in body:
        return None
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("usage"), dict):
        return None
    return Usage(data["usage"])


def _event_end(data: bytes) -> int:
    """The index just past the last complete event in ``data``; 0 if there is none."""
    end = data.rfind(b"\n\n")
    if end >= 0:
        return end + 2
    end = data.rfind(b"\r\n\r\n")
    return end + 4 if end >= 0 else 0


class UsageTap:
    """Watches a relayed event stream for its usage; ``strip`` removes it from what passes on."""

    __slots__ = ("_carry", "events", "strip", "usage")

    def __init__(self, strip: bool) -> None:
        self.strip = strip
        self.usage: Usage | None = None
        self.events = 0
        self._carry = b""

    def feed(self, piece: bytes) -> bytes:
        """The bytes to pass on for this ``piece`` (whole events only; the rest is held back)."""
        if self._carry:
            piece = self._carry + piece
            self._carry = b""
        end = _event_end(piece)
        if end < len(piece):
            if end == 0 and len(piece) < MAX_CARRY:
                self._carry = piece
                return b""
            if end:
                self._carry = piece[end:]
                piece = piece[:end]
        return self._events(piece)

    def flush(self) -> bytes:
        """What is still held back, at the end of the stream."""
        carry, self._carry = self._carry, b""
        return self._events(carry) if carry else b""

    def _events(self, data: bytes) -> bytes:
        self.events += data.count(b"data:")
        at = data.find(_USAGE)
        while at >= 0:
            value = data[at + len(_USAGE) : at + len(_USAGE) + 8].lstrip(b": ")
            if value.startswith(b"null"):
                at = data.find(_USAGE, at + 1)
                continue
            start = data.rfind(b"data:", 0, at)
            stop = data.find(b"\n", at)
            if start < 0:
                return data
            stop = len(data) if stop < 0 else stop
            replaced = self._usage_event(data[start + 5 : stop])
            if replaced is None:
                return data
            if replaced:
                data = data[:start] + replaced + data[stop:]
            else:  # the whole event goes, with the blank line that ended it
                data = data[:start] + data[stop:].lstrip(b"\r\n")
            at = data.find(_USAGE, start + len(replaced))
        return data

    def _usage_event(self, payload: bytes) -> bytes | None:
        """What replaces one event's ``data:`` line carrying usage: itself, stripped, or nothing."""
        try:
            event: Any = orjson.loads(payload)
        except orjson.JSONDecodeError:
            return None
        if not isinstance(event, dict):
            return None
        usage = event.get("usage")
        if not isinstance(usage, dict):  # Anthropic's message_start, Responses' response.completed
            inner = event.get("message") or event.get("response")
            usage = inner.get("usage") if isinstance(inner, dict) else None
            if not isinstance(usage, dict):
                return None
            self.usage = Usage(usage, self.usage)
            return b"data:" + payload  # never stripped: the engine sends it unasked
        self.usage = Usage(usage, self.usage)
        if not self.strip:
            return b"data:" + payload  # passed on exactly as it came
        if not event.get("choices"):
            self.events -= 1
            return b""  # the usage-only event the client did not ask for: gone, blank line too
        del event["usage"]
        return b"data: " + orjson.dumps(event)
