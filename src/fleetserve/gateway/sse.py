"""The usage events of a server-sent event stream: found as the stream passes, and taken out only
where the gateway's own ask put them.

The gateway asks an engine for usage (``stream_options.include_usage``) when the client did not,
so that a stream's tokens are counted against its key's limits. What the client receives must not
change for it: ``UsageTap`` sits on the relayed bytes and passes whole events through untouched and
unparsed, except those carrying a non-null ``usage``, which it reads (with orjson). When the
gateway asked on the client's behalf (``strip``), it takes out only what the ask added:

- the usage-only event (empty ``choices``: vLLM's, llama.cpp's on chat) is removed, blank line
  too, when it holds nothing but OpenAI's chunk envelope; where it carries the engine's own fields
  (llama.cpp moves its ``timings`` into it when asked), only its ``usage`` is removed and the
  event, with every other field, passes on;
- usage on an event with choices is the engine's own (llama.cpp's ``/v1/completions`` final chunk
  carries it whether asked or not): passed on untouched.

A client that asked for usage gets it as OpenAI specifies: where the engine put it on chunks
with choices only (llama.cpp's ``/v1/completions``), a usage-only event (empty ``choices``, the
usage of every sequence) is added before ``[DONE]``; the engine's events pass as they came.

An engine that reports usage per sequence (llama.cpp: one usage event per choice and per prompt)
is counted from them all (``summed``, ``usage_events``). Bytes of an event not yet complete are
held back until its end arrives, so an event split across reads is seen whole.
"""

from __future__ import annotations

import re
from typing import Any

import orjson

MAX_CARRY = 64 * 1024
"""An incomplete event held back longer than this is passed on as it is (no event is this big)."""

_USAGE = b'"usage"'
_COUNTED = b'"tokens_predicted"'
# The final event of one prompt in a stream of llama.cpp's own routes (no spaces: as it writes JSON).
_FINAL = b'"stop":true'
_DONE = b"[DONE]"


_ENVELOPE = frozenset(
    {"id", "object", "created", "model", "system_fingerprint", "service_tier", "obfuscation", "choices"}
)
"""The fields of OpenAI's chunk envelope: a usage-only event with nothing else is the ask's alone."""


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

    def add(self, other: Usage) -> None:
        """Count ``other`` in too."""
        self.prompt += other.prompt
        self.completion += other.completion
        self.total += other.total


def _count(value: object) -> int:
    return value if isinstance(value, int) and value >= 0 else 0


def counted(answer: object) -> Usage | None:
    """The tokens llama.cpp's own answers count (``tokens_evaluated``: the prompt,
    ``tokens_predicted``: generated), on one answer object or summed over a list of them (one per
    prompt); None when none holds them."""
    items = answer if isinstance(answer, list) else [answer]
    total: Usage | None = None
    for item in items:
        if not isinstance(item, dict) or ("tokens_evaluated" not in item and "tokens_predicted" not in item):
            continue
        one = Usage(
            {"prompt_tokens": item.get("tokens_evaluated"), "completion_tokens": item.get("tokens_predicted")}
        )
        if total is None:
            total = one
        else:
            total.add(one)
    return total


def usage_of_body(body: bytes, counts: bool = False) -> Usage | None:
    """The usage of a whole (non-streamed) JSON answer, if it has one: its usage object, or with
    ``counts`` (``UsageBy.COUNTS``) llama.cpp's own token counts."""
    if (_COUNTED if counts else _USAGE) not in body:
        return None
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    if counts:
        return counted(data)
    if not isinstance(data, dict) or not isinstance(data.get("usage"), dict):
        return None
    return Usage(data["usage"])


_COUNT_FIELD = re.compile(rb'"tokens_(evaluated|predicted)":\s*(\d{1,12})')
TAIL_BYTES = 64 * 1024
"""How much of the end of an answer passed on in pieces is kept to read its usage from."""


class BodyUsage:
    """The usage of a non-streamed answer passed on in pieces, never held whole: read from its
    last ``TAIL_BYTES`` (OpenAI's usage object closes the answer: vLLM's, llama.cpp's), or with
    ``counts`` llama.cpp's own ``tokens_evaluated``/``tokens_predicted`` summed as they pass (one
    pair per prompt)."""

    __slots__ = ("_carry", "_completion", "_prompt", "counts", "tail")

    def __init__(self, counts: bool) -> None:
        self.counts = counts
        self.tail = b""
        self._carry = b""
        self._prompt = 0
        self._completion = 0

    def feed(self, piece: bytes) -> None:
        if self.counts:
            data = self._carry + piece
            end = 0
            for match in _COUNT_FIELD.finditer(data):
                if match.end() == len(data):
                    break  # the number may go on in the next piece
                if match.group(1) == b"evaluated":
                    self._prompt += int(match.group(2))
                else:
                    self._completion += int(match.group(2))
                end = match.end()
            self._carry = data[max(end, len(data) - 64) :]
        else:
            self.tail = (self.tail + piece)[-TAIL_BYTES:]

    def usage(self) -> Usage | None:
        """The answer's usage, once it has all passed; None where it cannot be read."""
        if self.counts:
            if not (self._prompt or self._completion):
                return None
            return Usage({"prompt_tokens": self._prompt, "completion_tokens": self._completion})
        at = self.tail.rfind(_USAGE)
        start = self.tail.find(b"{", at) if at >= 0 else -1
        if start < 0:
            return None
        depth = 0
        for i in range(start, len(self.tail)):  # a usage object holds numbers and objects only
            c = self.tail[i]
            if c == 0x7B:
                depth += 1
            elif c == 0x7D:
                depth -= 1
                if depth == 0:
                    try:
                        return Usage(orjson.loads(self.tail[start : i + 1]))
                    except orjson.JSONDecodeError:
                        return None
        return None


def _event_end(data: bytes) -> int:
    """The index just past the last complete event in ``data``; 0 if there is none."""
    end = data.rfind(b"\n\n")
    if end >= 0:
        return end + 2
    end = data.rfind(b"\r\n\r\n")
    return end + 4 if end >= 0 else 0


class UsageTap:
    """Watches a relayed event stream for its usage: the last usage event (``usage``), the sum of
    them all (``summed``) and how many there were (``usage_events``). ``strip``: the gateway asked
    for usage the client did not, and takes out what its ask added."""

    __slots__ = ("_carry", "_owed", "counts", "events", "strip", "summed", "usage", "usage_events")

    def __init__(self, strip: bool, counts: bool = False) -> None:
        self.strip = strip
        # The stream is of llama.cpp's own routes (``UsageBy.COUNTS``): each prompt's final event
        # holds its token counts; they are summed, the events passed on as they came.
        self.counts = counts
        self.usage: Usage | None = None
        self.summed: Usage | None = None
        self.usage_events = 0
        self.events = 0
        self._carry = b""
        # OpenAI's usage-only event, owed to a client that asked for usage where the engine put it
        # on a chunk with choices only; sent before [DONE].
        self._owed: dict[str, Any] | None = None

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
        data = self._usage_events(data)
        if self._owed is not None:
            done = data.find(_DONE)
            if done >= 0:  # OpenAI's usage-only event, which the engine did not send, before [DONE]
                start = data.rfind(b"data:", 0, done)
                start = done if start < 0 else start
                data = data[:start] + b"data: " + orjson.dumps(self._owed) + b"\n\n" + data[start:]
                self._owed = None
                self.events += 1
        return data

    def _usage_events(self, data: bytes) -> bytes:
        if self.counts:
            self._counted_events(data)
            return data
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

    def _counted_events(self, data: bytes) -> None:
        """Sum the counts of each prompt's final event in ``data`` (read, never changed)."""
        at = data.find(_FINAL)
        while at >= 0:
            start = data.rfind(b"data:", 0, at)
            stop = data.find(b"\n", at)
            if start < 0:
                return
            stop = len(data) if stop < 0 else stop
            try:
                usage = counted(orjson.loads(data[start + 5 : stop]))
            except orjson.JSONDecodeError:
                usage = None
            if usage is not None:
                self.usage_events += 1
                if self.summed is None:
                    self.summed = usage
                else:
                    self.summed.add(usage)
                self.usage = Usage(
                    {"prompt_tokens": self.summed.prompt, "completion_tokens": self.summed.completion}
                )
            at = data.find(_FINAL, stop)

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
        self.usage_events += 1
        if self.summed is None:
            self.summed = Usage(usage)
        else:
            self.summed.add(Usage(usage))
        if not self.strip:
            # The client asked: as it came. Usage on a chunk with choices (llama.cpp's completions)
            # is owed OpenAI's usage-only event too, of every sequence's usage, before [DONE].
            if event.get("choices"):
                self._owed = self._usage_only(event)
            else:
                self._owed = None
            return b"data:" + payload
        if event.get("choices"):
            return b"data:" + payload  # the engine's own usage: exactly as it came
        del event["usage"]
        if event.keys() <= _ENVELOPE:
            self.events -= 1
            return b""  # the usage-only event only the gateway's ask added: gone, blank line too
        return b"data: " + orjson.dumps(event)  # the engine's own fields (timings) stay

    def _usage_only(self, event: dict[str, Any]) -> dict[str, Any]:
        """OpenAI's usage-only chunk for a stream whose last usage rode on ``event``: its envelope,
        no choices, the usage of every sequence so far."""
        summed = self.summed or Usage(None)
        out = {k: v for k, v in event.items() if k in _ENVELOPE}
        out["choices"] = []
        out["usage"] = {
            "prompt_tokens": summed.prompt,
            "completion_tokens": summed.completion,
            "total_tokens": summed.total,
        }
        return out
