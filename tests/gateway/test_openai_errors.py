"""``engine_error_body``: an engine's error answer in OpenAI's shape, keeping the engine's message.
A pure function over (status, body, content type), pinned by one table."""

from __future__ import annotations

import json

import pytest

from fleetserve.gateway.openai_errors import ENGINE_MESSAGE_LIMIT, engine_error_body

OPENAI = b'{"error":{"message":"bad","type":"invalid_request_error","param":"model","code":"x"}}'


def error(message: str, kind: str, code: object = None, param: object = None) -> dict[str, object]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@pytest.mark.parametrize(
    ("status", "body", "content_type", "expected"),
    [
        # OpenAI's shape (vLLM's errors, the gateway's own): relayed as it came.
        (400, OPENAI, b"application/json", None),
        # llama.cpp's: the same shape without param, and an integer code, kept.
        (
            501,
            b'{"error":{"code":501,"message":"no embeddings","type":"not_supported_error"}}',
            b"application/json",
            {
                "error": {
                    "code": 501,
                    "message": "no embeddings",
                    "type": "not_supported_error",
                    "param": None,
                }
            },
        ),
        # Extra fields an engine sends stay.
        (
            500,
            b'{"error":{"message":"m","n_prompt_tokens":9},"extra":1}',
            b"application/json",
            {
                "error": {
                    "message": "m",
                    "n_prompt_tokens": 9,
                    "type": "server_error",
                    "param": None,
                    "code": None,
                },
                "extra": 1,
            },
        ),
        # vLLM's older flat ErrorResponse.
        (
            400,
            b'{"object":"error","message":"too long","type":"BadRequestError","param":null,"code":400}',
            b"application/json",
            error("too long", "BadRequestError", 400),
        ),
        # FastAPI's detail, and an error given as a string.
        (404, b'{"detail":"Not Found"}', b"application/json", error("Not Found", "invalid_request_error")),
        (500, b'{"error":"out of memory"}', b"application/json", error("out of memory", "server_error")),
        # JSON without a message: its text is the message.
        (500, b'{"status":"bad"}', b"application/json", error('{"status":"bad"}', "server_error")),
        (500, b"[1, 2]", b"application/json", error("[1, 2]", "server_error")),
        # HTML: the text, without tags, scripts or entities.
        (
            502,
            b"<html><head><title>502 Bad Gateway</title><style>p{}</style></head>"
            b"<body><h1>Bad &amp; gone</h1><script>x()</script></body></html>",
            b"text/html; charset=utf-8",
            error("502 Bad Gateway Bad & gone", "server_error"),
        ),
        (503, b"<p></p>", b"", error("The engine answered 503 with an HTML page.", "server_error")),
        # Plain text, invalid JSON, empty bodies.
        (500, b"  Internal Server Error\n", b"text/plain", error("Internal Server Error", "server_error")),
        (400, b"{not json", b"application/json", error("{not json", "invalid_request_error")),
        (
            500,
            b"",
            b"",
            error("The engine answered 500 Internal Server Error with an empty body.", "server_error"),
        ),
        (
            429,
            b" \r\n",
            b"text/plain",
            error("The engine answered 429 Too Many Requests with an empty body.", "invalid_request_error"),
        ),
        (599, b"", b"", error("The engine answered 599 (no reason) with an empty body.", "server_error")),
    ],
    ids=[
        "openai-as-is",
        "llamacpp-param-added",
        "extra-fields-kept",
        "vllm-flat",
        "fastapi-detail",
        "error-string",
        "json-without-message",
        "json-array",
        "html",
        "html-without-text",
        "plain-text",
        "invalid-json",
        "empty",
        "blank-429",
        "empty-unknown-status",
    ],
)
def test_an_engine_error_is_put_in_openais_shape_keeping_its_message(
    status: int, body: bytes, content_type: bytes, expected: dict[str, object] | None
) -> None:
    shaped = engine_error_body(status, body, content_type)
    assert (None if shaped is None else json.loads(shaped)) == expected


@pytest.mark.parametrize(
    ("body", "content_type"),
    [
        (b"x" * 100_000, b"text/plain"),
        (b"<html><body>" + b"y" * 100_000 + b"</body></html>", b"text/html"),
        (json.dumps({"error": "z" * 100_000}).encode(), b"application/json"),
    ],
    ids=["text", "html", "json-string"],
)
def test_a_long_engine_message_is_cut_at_the_limit(body: bytes, content_type: bytes) -> None:
    shaped = engine_error_body(500, body, content_type)
    assert shaped is not None
    message = json.loads(shaped)["error"]["message"]
    assert 0 < len(message) <= ENGINE_MESSAGE_LIMIT and set(message) <= {"x", "y", "z"}
