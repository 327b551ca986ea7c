"""CORS for the gateway's API (``/v1`` and the engines' own paths it relays): web pages of the
origins an operator named (``--cors-origin``) may call the API from a browser; no other origin
may, and with none named there is no CORS at all (``Cors.of`` gives None and the API answers as
it always did: ``OPTIONS`` gets 405).

- A preflight (``OPTIONS`` with ``Origin`` and ``Access-Control-Request-Method``) needs no API
  key: browsers send none with it. From an allowed origin, for GET or POST, it is answered 204
  with ``Access-Control-Allow-Origin`` (the request's origin), ``Vary``, the allowed methods,
  the allowed headers (``Authorization``, ``Content-Type``, ``X-Api-Key`` and, of those the page
  asked for, the ones in ``SAFE_HEADERS`` or under ``SAFE_PREFIXES``, at most
  ``MAX_REQUESTED``) and ``Access-Control-Max-Age``. Otherwise it is refused (``Refusal``): 403
  without any CORS header, so the browser stops there.
- Every answer to a request from an allowed origin (the gateway's refusals, an engine's answer,
  a stream) carries ``Access-Control-Allow-Origin``, ``Vary: Origin`` and
  ``Access-Control-Expose-Headers`` (``Retry-After``, so a page can wait as told). An answer to
  any other origin carries none.
- Credentials (cookies, HTTP authentication) are never allowed: API keys travel in headers the
  page sets itself, which needs no ``Access-Control-Allow-Credentials``. ``*`` allows every
  origin only when given, alone, and is then answered as ``*``.

Engines' own CORS headers never reach a client (``gateway.upstream`` drops them): the gateway's
are the only ones. Everything is computed once, in ``Cors.of``: an actual request costs one
dict lookup by its ``Origin``; a preflight (rare: browsers keep its answer ``MAX_AGE`` seconds)
also reads the headers it asked for.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum

from fleetserve.gateway.upstream import FORWARDED_HEADERS
from fleetserve.rawasgi.types import Header

ANY = "*"
"""The origin that stands for every origin, allowed only when given."""

METHODS = frozenset({b"GET", b"POST"})
"""The methods a preflight may ask for: what ``/v1`` answers (OPTIONS is the preflight itself)."""

ALWAYS_ALLOWED = ("Authorization", "Content-Type", "X-Api-Key")
"""The request headers every preflight allows: the API key (either header) and the JSON body."""

SAFE_HEADERS = frozenset(
    {
        "accept",
        "accept-language",
        "content-language",
        "openai-organization",
        "openai-project",
        "openai-beta",
        "anthropic-version",
        "anthropic-beta",
        "anthropic-dangerous-direct-browser-access",
        "idempotency-key",
        "x-request-id",
    }
) | {name.decode() for name in FORWARDED_HEADERS}
"""Other request headers a preflight allows when the page asks for them: what the OpenAI and
Anthropic SDKs send from a browser (``dangerouslyAllowBrowser``), and every header the gateway
forwards to an engine (``upstream.FORWARDED_HEADERS``: llama.cpp's conversation id, trace context)."""

SAFE_PREFIXES = ("x-stainless-",)
"""Prefixes of request headers allowed when asked for (the SDKs' client and retry telemetry)."""

MAX_REQUESTED = 32
"""At most this many asked-for headers are allowed in one preflight; the rest are not."""

MAX_AGE = 7200
"""Seconds a browser may keep a preflight's answer (Chromium keeps at most 2 hours)."""

EXPOSED = "Retry-After"
"""Answer headers a page may read besides the CORS-safelisted ones: how long to wait after a
429 or 503. (The gateway sends no other header of its own.)"""

_SCHEME = re.compile(r"[a-z][a-z0-9+.-]*")
_LABEL = re.compile(r"[a-z0-9_]([a-z0-9_-]*[a-z0-9_])?")
_TOKEN = re.compile(r"[a-z0-9!#$%&'*+.^_`|~-]{1,64}")
_DEFAULT_PORTS = {"http": 80, "https": 443}
_PATH_START = re.compile(r"[/?#]")


class Refusal(StrEnum):
    """Why a preflight is refused (403, no CORS headers)."""

    ORIGIN = "cors_origin_not_allowed"
    METHOD = "cors_method_not_allowed"


REFUSALS: Mapping[Refusal, str] = {
    Refusal.ORIGIN: "This origin may not call the API from a browser: the gateway's CORS origins "
    "(--cors-origin) do not include it.",
    Refusal.METHOD: "A browser may call the API with GET or POST only.",
}
"""What a refused preflight's body says, by reason."""


@dataclass(frozen=True)
class Preflight:
    """A preflight's answer: 204 with its headers, or 403 with none and the reason."""

    status: int
    headers: tuple[Header, ...] = ()
    refusal: Refusal | None = None


def parse_origin(text: str) -> str:
    """The origin ``text`` names as a browser writes it in ``Origin`` (scheme and host in lower
    case, no default port), or ``ANY``; ValueError, saying what is wrong, for anything else than
    ``scheme://host[:port]``."""
    if text == ANY:
        return ANY
    form = f"an origin is scheme://host[:port], e.g. https://app.example.com; got {text!r}"
    scheme, sep, rest = text.partition("://")
    scheme = scheme.lower()
    if not sep or not _SCHEME.fullmatch(scheme) or not rest:
        raise ValueError(form)
    path = _PATH_START.search(rest)
    authority = rest if path is None else rest[: path.start()]
    if not authority:
        raise ValueError(form)
    if path is not None:
        raise ValueError(
            f"an origin has no path, query or fragment: {scheme}://{authority.lower()}, not {text!r}"
        )
    if "@" in authority:
        raise ValueError(f"an origin names no user: {text!r}")
    host, port = _host_port(authority, form)
    if port is not None and port == _DEFAULT_PORTS.get(scheme):
        port = None
    return f"{scheme}://{host}" if port is None else f"{scheme}://{host}:{port}"


def _host_port(authority: str, form: str) -> tuple[str, int | None]:
    """The host (lower case; an IPv6 address bracketed and compressed) and port of ``authority``."""
    if authority.startswith("["):
        literal, close, after = authority[1:].partition("]")
        try:
            host = f"[{ipaddress.IPv6Address(literal).compressed}]" if close else ""
        except ValueError:
            host = ""
        if not host or (after and not after.startswith(":")):
            raise ValueError(form)
        port_text = after[1:] if after else None
    else:
        name, colon, port_text_or_empty = authority.partition(":")
        host = name.lower()
        if not all(_LABEL.fullmatch(label) for label in host.split(".")):
            raise ValueError(f"{form} (a host is a DNS name in ASCII, punycode for others, or an address)")
        port_text = port_text_or_empty if colon else None
    if port_text is None:
        return host, None
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"an origin's port is 1-65535: {authority!r}")
    return host, int(port_text)


def allowed_headers(requested: bytes | None) -> bytes:
    """``Access-Control-Allow-Headers`` for a preflight that asked for ``requested`` (the
    ``Access-Control-Request-Headers`` value): ``ALWAYS_ALLOWED`` and, of the names asked for,
    the safe ones, at most ``MAX_REQUESTED``."""
    names = list(ALWAYS_ALLOWED)
    if requested:
        always = {n.lower() for n in ALWAYS_ALLOWED}
        extra: list[str] = []
        for raw in requested.decode("latin-1").split(",")[: MAX_REQUESTED * 2]:
            name = raw.strip().lower()
            if (
                name not in always
                and name not in extra
                and _TOKEN.fullmatch(name)
                and (name in SAFE_HEADERS or name.startswith(SAFE_PREFIXES))
            ):
                extra.append(name)
                if len(extra) == MAX_REQUESTED:
                    break
        names += extra
    return ", ".join(names).encode("latin-1")


class Cors:
    """The CORS answers for a set of allowed origins, each computed once: ``actual`` for the
    headers an answer gets, ``preflight`` for a preflight's answer."""

    def __init__(self, origins: Iterable[str]) -> None:
        """Raises ValueError for an origin that is not ``scheme://host[:port]`` or ``*``, for
        ``*`` beside others, or for none at all (``Cors.of`` gives None for none)."""
        parsed = list(dict.fromkeys(parse_origin(o) for o in origins))
        if not parsed:
            raise ValueError("no CORS origin given")
        if ANY in parsed and len(parsed) > 1:
            raise ValueError("'*' allows every origin: give it alone, or name the origins")
        self.origins: tuple[str, ...] = tuple(parsed)
        exposed: Header = (b"access-control-expose-headers", EXPOSED.encode())
        common: tuple[Header, ...] = (
            (b"access-control-allow-methods", b"GET, POST, OPTIONS"),
            (b"access-control-max-age", str(MAX_AGE).encode()),
        )
        self._actual: dict[bytes, tuple[Header, ...]] = {}
        self._preflight: dict[bytes, tuple[Header, ...]] = {}
        self._any_actual: tuple[Header, ...] | None = None
        self._any_preflight: tuple[Header, ...] | None = None
        if parsed == [ANY]:
            allow: Header = (b"access-control-allow-origin", b"*")
            self._any_actual = (allow, exposed)
            self._any_preflight = (allow, *common)
            return
        for origin in parsed:
            allow = (b"access-control-allow-origin", origin.encode())
            self._actual[origin.encode()] = (allow, (b"vary", b"Origin"), exposed)
            varies: Header = (b"vary", b"Origin, Access-Control-Request-Headers")
            self._preflight[origin.encode()] = (allow, varies, *common)

    @classmethod
    def of(cls, origins: Iterable[str]) -> Cors | None:
        """The CORS of ``origins``; None for none (no CORS). ValueError as ``Cors()``."""
        given = list(origins)
        return cls(given) if given else None

    def actual(self, origin: bytes) -> tuple[Header, ...] | None:
        """The headers an answer to a request from ``origin`` gets; None: not an allowed origin."""
        return self._actual.get(origin, self._any_actual)

    def preflight(self, origin: bytes, method: bytes, requested: bytes | None) -> Preflight:
        """The answer to a preflight from ``origin`` for ``method`` (``Access-Control-Request-Method``)
        asking for the headers ``requested`` (``Access-Control-Request-Headers``, if sent)."""
        base = self._preflight.get(origin, self._any_preflight)
        if base is None:
            return Preflight(403, refusal=Refusal.ORIGIN)
        if method not in METHODS:
            return Preflight(403, refusal=Refusal.METHOD)
        return Preflight(204, (*base, (b"access-control-allow-headers", allowed_headers(requested))))
