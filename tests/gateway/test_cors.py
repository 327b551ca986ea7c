"""gateway.cors, the pure part: origins as configured, a preflight's answer, an answer's headers."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from fleetserve.gateway.cors import (
    MAX_AGE,
    MAX_REQUESTED,
    REFUSALS,
    Cors,
    Refusal,
    allowed_headers,
    parse_origin,
)

APP = "https://app.example.com"


@dataclass(frozen=True)
class Origin:
    name: str
    given: str
    origin: str | None  # None: refused
    error: str = ""


ORIGINS = [
    Origin("an https origin is itself", "https://app.example.com", "https://app.example.com"),
    Origin("a port is kept", "http://localhost:5173", "http://localhost:5173"),
    Origin("scheme and host are lower-cased", "HTTPS://App.Example.COM", "https://app.example.com"),
    Origin("https's default port is dropped", "https://app.example.com:443", "https://app.example.com"),
    Origin("http's default port is dropped", "http://app.example.com:80", "http://app.example.com"),
    Origin("another scheme's port is kept", "https://app.example.com:80", "https://app.example.com:80"),
    Origin("an IPv4 address is a host", "http://192.168.1.20:3000", "http://192.168.1.20:3000"),
    Origin("an IPv6 address is compressed", "http://[0:0::1]:8080", "http://[::1]:8080"),
    Origin("an extension's scheme is an origin", "chrome-extension://abcdef", "chrome-extension://abcdef"),
    Origin("the wildcard is itself", "*", "*"),
    Origin("a path is refused", "https://app.example.com/", None, "no path"),
    Origin("a longer path is refused", "https://app.example.com/chat", None, "https://app.example.com,"),
    Origin("a query is refused", "https://app.example.com?x=1", None, "no path, query"),
    Origin("a user is refused", "https://me@app.example.com", None, "no user"),
    Origin("no scheme is refused", "app.example.com", None, "scheme://host"),
    Origin("no host is refused", "https://", None, "scheme://host"),
    Origin("an empty host is refused", "https:///x", None, "scheme://host"),
    Origin("a port of 0 is refused", "https://app.example.com:0", None, "1-65535"),
    Origin("a port past 65535 is refused", "https://app.example.com:65536", None, "1-65535"),
    Origin("a port that is not a number is refused", "https://app.example.com:x", None, "1-65535"),
    Origin("a host with a space is refused", "https://app example.com", None, "DNS name"),
    Origin("a non-ASCII host is refused", "https://bücher.example", None, "punycode"),
    Origin("a bad IPv6 literal is refused", "http://[::g]:80", None, "scheme://host"),
    Origin("the literal null is refused", "null", None, "scheme://host"),
]


@pytest.mark.parametrize("case", ORIGINS, ids=[c.name for c in ORIGINS])
def test_an_origin_is_parsed_as_a_browser_writes_it_or_refused_saying_why(case: Origin) -> None:
    if case.origin is not None:
        assert parse_origin(case.given) == case.origin
    else:
        with pytest.raises(ValueError, match=case.error.replace("?", r"\?")):
            parse_origin(case.given)


def test_no_origin_is_no_cors_and_a_wildcard_beside_others_is_refused() -> None:
    assert Cors.of([]) is None
    with pytest.raises(ValueError, match="give it alone"):
        Cors.of(["*", APP])
    twice = Cors.of([APP, "HTTPS://app.example.com"])
    assert twice is not None and twice.origins == (APP,)


def headers_of(pairs: tuple[tuple[bytes, bytes], ...] | None) -> dict[str, str]:
    assert pairs is not None
    names = [n for n, _ in pairs]
    assert len(names) == len(set(names)), names  # no header twice
    return {n.decode(): v.decode() for n, v in pairs}


@dataclass(frozen=True)
class Actual:
    name: str
    configured: tuple[str, ...]
    origin: bytes
    allow: str | None  # Access-Control-Allow-Origin; None: no CORS headers at all


ACTUAL = [
    Actual("a configured origin is echoed", (APP, "http://localhost:5173"), APP.encode(), APP),
    Actual("the second configured origin too", (APP, "http://localhost:5173"), b"http://localhost:5173", "http://localhost:5173"),
    Actual("another origin gets nothing", (APP,), b"https://evil.example", None),
    Actual("a configured origin in other case is another origin", (APP,), b"https://APP.example.com", None),
    Actual("a configured origin with a path is not an origin", (APP,), APP.encode() + b"/", None),
    Actual("the null origin gets nothing", (APP,), b"null", None),
    Actual("the wildcard answers any origin with *", ("*",), b"https://anyone.example", "*"),
    Actual("the wildcard answers the null origin with *", ("*",), b"null", "*"),
]  # fmt: skip


@pytest.mark.parametrize("case", ACTUAL, ids=[c.name for c in ACTUAL])
def test_an_answer_gets_cors_headers_only_for_an_allowed_origin(case: Actual) -> None:
    cors = Cors(case.configured)
    added = cors.actual(case.origin)
    if case.allow is None:
        assert added is None
        return
    got = headers_of(added)
    assert got["access-control-allow-origin"] == case.allow
    assert got["access-control-expose-headers"] == "Retry-After"
    assert "access-control-allow-credentials" not in got
    assert got.get("vary") == (None if case.allow == "*" else "Origin")


@dataclass(frozen=True)
class Pre:
    name: str
    configured: tuple[str, ...]
    origin: bytes
    method: bytes
    status: int
    refusal: Refusal | None = None


PREFLIGHTS = [
    Pre("a POST from a configured origin is allowed", (APP,), APP.encode(), b"POST", 204),
    Pre("a GET from a configured origin is allowed", (APP,), APP.encode(), b"GET", 204),
    Pre("another origin is refused", (APP,), b"https://evil.example", b"POST", 403, Refusal.ORIGIN),
    Pre("the null origin is refused", (APP,), b"null", b"POST", 403, Refusal.ORIGIN),
    Pre("a DELETE is refused", (APP,), APP.encode(), b"DELETE", 403, Refusal.METHOD),
    Pre("a PUT is refused", ("*",), APP.encode(), b"PUT", 403, Refusal.METHOD),
    Pre("a lower-case post is not POST", (APP,), APP.encode(), b"post", 403, Refusal.METHOD),
    Pre("the wildcard allows any origin", ("*",), b"https://anyone.example", b"POST", 204),
]


@pytest.mark.parametrize("case", PREFLIGHTS, ids=[c.name for c in PREFLIGHTS])
def test_a_preflight_is_answered_204_or_refused_403_without_cors_headers(case: Pre) -> None:
    answer = Cors(case.configured).preflight(case.origin, case.method, b"content-type, authorization")
    assert (answer.status, answer.refusal) == (case.status, case.refusal)
    if case.refusal is not None:
        assert answer.headers == ()
        assert REFUSALS[case.refusal]
        return
    got = headers_of(answer.headers)
    assert got["access-control-allow-origin"] == ("*" if case.configured == ("*",) else case.origin.decode())
    assert got["access-control-allow-methods"] == "GET, POST, OPTIONS"
    assert got["access-control-allow-headers"] == "Authorization, Content-Type, X-Api-Key"
    assert got["access-control-max-age"] == str(MAX_AGE)
    assert "access-control-allow-credentials" not in got
    if case.configured != ("*",):
        assert got["vary"].startswith("Origin")


@dataclass(frozen=True)
class Asked:
    name: str
    requested: bytes | None
    extra: list[str]


ASKED = [
    Asked("nothing asked is the three always allowed", None, []),
    Asked("an empty list is the same", b"", []),
    Asked("the always allowed are not repeated", b"Authorization,content-type, X-API-KEY", []),
    Asked("the SDKs' telemetry is allowed", b"x-stainless-os, X-Stainless-Lang", ["x-stainless-os", "x-stainless-lang"]),
    Asked("the SDKs' own headers are allowed", b"openai-organization,anthropic-version", ["openai-organization", "anthropic-version"]),
    Asked("Anthropic's browser opt-in is allowed", b"anthropic-dangerous-direct-browser-access", ["anthropic-dangerous-direct-browser-access"]),
    Asked("the headers relayed to engines are allowed", b"X-Conversation-Id, traceparent", ["x-conversation-id", "traceparent"]),
    Asked("an unknown header is not", b"x-evil, cookie, x-forwarded-for", []),
    Asked("a name that is not a token is not", b"x-stainless-\x00os, x-stainless-a b", []),
    Asked("a name asked twice is allowed once", b"x-stainless-os, x-stainless-os", ["x-stainless-os"]),
]  # fmt: skip


@pytest.mark.parametrize("case", ASKED, ids=[c.name for c in ASKED])
def test_a_preflight_allows_of_the_headers_asked_for_only_the_safe_ones(case: Asked) -> None:
    got = allowed_headers(case.requested).decode().split(", ")
    assert got == ["Authorization", "Content-Type", "X-Api-Key", *case.extra]


def test_a_preflight_allows_a_bounded_number_of_asked_for_headers() -> None:
    many = ", ".join(f"x-stainless-h{i}" for i in range(1000)).encode()
    got = allowed_headers(many).decode().split(", ")
    assert len(got) == 3 + MAX_REQUESTED
