"""A fast stand-in for an OpenAI-compatible engine: what the gateway's benchmark and tests proxy to.

Raw asyncio with the ``httptools`` request parser, so that as little CPU as possible goes to the
upstream itself. ``POST /v1/chat/completions``, ``/v1/completions`` and ``/v1/embeddings``
answer at once: a JSON body, or with ``"stream": true`` a server-sent event stream of one
content event per token, each written on its own, then the usage event when
``stream_options.include_usage`` asks for it, then ``[DONE]``. Usage counts one prompt token per
4 bytes of the request body and one completion token per event, as engines report them.

Tokens per choice are read as llama-server reads them (``tokens_asked``): ``n_predict``, else
``max_completion_tokens``, else ``max_tokens`` or the Responses API's ``max_output_tokens``,
default 16; a negative cap runs until the fake's context of ``CONTEXT`` tokens is full, and no
cap goes past it. ``n`` (or ``n_cmpl``) choices each generate that many.

Three fields of a request steer it, for tests: ``"fake_delay": SECONDS`` waits that long before
each event, ``"fake_status": CODE`` answers with that status (with ``"fake_echo_auth": true`` its error
repeats the Authorization header it got), ``"fake_break_after": N`` drops the
connection after N events of a stream. ``GET /health`` and ``/metrics``
answer 200; ``GET /v1/models`` lists the fake's ``models``. ``FakeEngine`` counts what it served
and what was cut off by a closed connection. Given a ``key`` (a hosted API's, an Endpoint's), it
answers 401 to every request that does not send ``Authorization: Bearer KEY``, as such servers do.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import Any, cast

import httptools
import orjson

_CONTENT = b"hi "
CONTEXT = 4096
"""The fake's context: no choice generates more tokens than this."""
DEFAULT_TOKENS = 16


def _integer(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def tokens_asked(request: dict[str, Any]) -> tuple[int, int]:
    """Tokens per choice and choices ``request`` asks for, read as llama-server reads them."""
    tokens = DEFAULT_TOKENS
    for name in ("n_predict", "max_completion_tokens", "max_tokens", "max_output_tokens"):
        value = _integer(request.get(name))
        if value is not None:
            tokens = CONTEXT if value < 0 else min(value, CONTEXT)
            break
    choices = _integer(request.get("n_cmpl"))
    if choices is None:
        choices = _integer(request.get("n"))
    return tokens, max(1, choices or 1)


@dataclass
class Served:
    """What a fake engine saw: requests, bodies (the last few), streams finished and cut off, and
    the completion tokens it generated."""

    requests: int = 0
    refused: int = 0  # requests without the key, answered 401
    generated: int = 0
    streams_done: int = 0
    streams_cut: int = 0
    bodies: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[bytes, bytes]] = field(default_factory=list)

    def keep(self, body: dict[str, Any], headers: dict[bytes, bytes]) -> None:
        self.bodies = [*self.bodies[-15:], body]
        self.headers = [*self.headers[-15:], headers]


def _head(status: int, content_type: bytes, length: int | None) -> bytes:
    reason = {200: b"OK", 404: b"Not Found"}.get(status, b"Status")
    framing = b"Transfer-Encoding: chunked" if length is None else b"Content-Length: %d" % length
    return b"HTTP/1.1 %d %s\r\nContent-Type: %s\r\n%s\r\n\r\n" % (status, reason, content_type, framing)


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def completion(path: bytes, prompt_tokens: int, tokens: int, choices: int = 1) -> bytes:
    """The non-streamed answer to ``path`` (chat, completions or embeddings): ``choices`` choices of
    ``tokens`` tokens each."""
    usage = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": tokens * choices,
        "total_tokens": prompt_tokens + tokens * choices,
    }
    if path.endswith(b"/embeddings"):
        usage = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}
        return orjson.dumps(
            {
                "object": "list",
                "data": [{"object": "embedding", "index": 0, "embedding": [0.0] * 8}],
                "usage": usage,
            }
        )
    text = (_CONTENT * tokens).decode()
    if path.endswith(b"/chat/completions"):
        answers: list[dict[str, Any]] = [
            {"index": i, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
            for i in range(choices)
        ]
        kind = "chat.completion"
    else:
        answers = [{"index": i, "text": text, "finish_reason": "length"} for i in range(choices)]
        kind = "text_completion"
    return orjson.dumps(
        {"id": "fake-1", "object": kind, "created": 1, "model": "fake", "choices": answers, "usage": usage}
    )


class _Request(asyncio.Protocol):
    """One client connection; requests on it are answered in order."""

    def __init__(self, engine: FakeEngine) -> None:
        self.engine = engine
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.url = b""
        self.body: list[bytes] = []
        self.headers: dict[bytes, bytes] = {}
        self.streaming: asyncio.Task[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's does not subclass it

    def connection_lost(self, exc: Exception | None) -> None:
        if self.streaming is not None and not self.streaming.done():
            self.streaming.cancel()

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            if self.transport is not None:
                self.transport.close()

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.lower()] = value

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        url, body, headers = self.url, b"".join(self.body), self.headers
        self.url, self.body, self.headers = b"", [], {}
        transport = self.transport
        if transport is None:
            return
        key = self.engine.key
        if key is not None and headers.get(b"authorization") != b"Bearer " + key.encode():
            self.engine.served.refused += 1
            error = b'{"error":{"message":"Incorrect API key provided","type":"invalid_request_error"}}'
            transport.write(_head(401, b"application/json", len(error)) + error)
            return
        if self.parser.get_method() != b"POST":
            if url == b"/v1/models":
                listed = orjson.dumps(
                    {
                        "object": "list",
                        "data": [
                            {"id": m, "object": "model", "owned_by": "fake"} for m in self.engine.models
                        ],
                    }
                )
                transport.write(_head(200, b"application/json", len(listed)) + listed)
                return
            text = b"" if url != b"/metrics" else b"# no metrics\n"
            transport.write(_head(200, b"text/plain", len(text)) + text)
            return
        self.engine.served.requests += 1
        try:
            request = orjson.loads(body)
        except orjson.JSONDecodeError:
            request = {}
        if not isinstance(request, dict):
            request = {}
        self.engine.served.keep(request, headers)
        status = request.get("fake_status")
        if isinstance(status, int) and status != 200:
            error = b'{"error":{"message":"fake failure","type":"server_error","param":null,"code":null}}'
            if request.get("fake_echo_auth"):  # a server whose error repeats the key it was sent
                said = headers.get(b"authorization", b"").decode("latin-1")
                error = orjson.dumps(
                    {"error": {"message": f"key {said} refused", "type": "invalid_request_error"}}
                )
            transport.write(_head(status, b"application/json", len(error)) + error)
            return
        per_choice, choices = tokens_asked(request)
        tokens = per_choice * choices  # streamed as one run of events
        prompt_tokens = max(1, len(body) // 4)
        delay = request.get("fake_delay") or 0
        if request.get("stream"):
            options = request.get("stream_options") or {}
            usage = bool(options.get("include_usage")) if isinstance(options, dict) else False
            self.streaming = asyncio.get_running_loop().create_task(
                self._stream(
                    transport,
                    url,
                    prompt_tokens,
                    int(tokens),
                    usage,
                    float(delay),
                    request.get("fake_break_after"),
                )
            )
            return
        answer = completion(url, prompt_tokens, per_choice, choices)
        if not url.endswith(b"/embeddings"):
            self.engine.served.generated += tokens
        transport.write(_head(200, b"application/json", len(answer)) + answer)

    async def _stream(
        self,
        transport: asyncio.Transport,
        url: bytes,
        prompt_tokens: int,
        tokens: int,
        usage: bool,
        delay: float,
        break_after: object = None,
    ) -> None:
        chat = url.endswith(b"/chat/completions")
        kind = b"chat.completion.chunk" if chat else b"text_completion"
        prefix = b'data: {"id":"fake-1","object":"%s","created":1,"model":"fake","choices":[' % kind
        if chat:
            event = prefix + b'{"index":0,"delta":{"content":"hi "},"finish_reason":null}]}\n\n'
            last = prefix + b'{"index":0,"delta":{},"finish_reason":"length"}]}\n\n'
        else:
            event = prefix + b'{"index":0,"text":"hi ","finish_reason":null}]}\n\n'
            last = prefix + b'{"index":0,"text":"","finish_reason":"length"}]}\n\n'
        try:
            transport.write(_head(200, b"text/event-stream", None))
            for i in range(tokens):
                if isinstance(break_after, int) and i == break_after:
                    transport.abort()  # an engine that died mid-stream
                    self.engine.served.streams_cut += 1
                    return
                if delay:
                    await asyncio.sleep(delay)
                else:
                    await asyncio.sleep(0)  # each event in a write of its own, as tokens come
                transport.write(_chunk(event))
                self.engine.served.generated += 1
            tail = last
            if usage:
                numbers = b'{"prompt_tokens":%d,"completion_tokens":%d,"total_tokens":%d}' % (
                    prompt_tokens,
                    tokens,
                    prompt_tokens + tokens,
                )
                tail += prefix + b'],"usage":%s}\n\n' % numbers
            transport.write(_chunk(tail + b"data: [DONE]\n\n") + b"0\r\n\r\n")
            self.engine.served.streams_done += 1
        except asyncio.CancelledError:
            self.engine.served.streams_cut += 1
            raise


class FakeEngine:
    """A fake OpenAI-compatible engine on 127.0.0.1, in the running event loop."""

    def __init__(self, key: str | None = None, models: tuple[str, ...] = ("fake",)) -> None:
        self.served = Served()
        self.key = key
        self.models = models
        self.port = 0
        self._server: asyncio.base_events.Server | None = None

    async def start(self, port: int = 0) -> int:
        """Listen (on ``port``, or any free one); the port."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Request(self), "127.0.0.1", port, backlog=1024)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()


def main() -> None:
    """``python -m fleetserve.dev.fake_openai PORT``: serve until killed (uvloop when installed)."""
    import sys

    import uvloop

    async def serve() -> None:
        engine = FakeEngine()
        await engine.start(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
        print(engine.port, flush=True)
        await asyncio.Event().wait()

    uvloop.run(serve())


if __name__ == "__main__":
    main()
