"""Reading request headers: one value by name, and the bearer token of ``Authorization``.

Header names in an ASGI scope are lower-case bytes; values are raw bytes, decoded here as
latin-1 (HTTP's own charset) only where text is wanted.
"""

from __future__ import annotations

from fleetserve.rawasgi.types import Scope


def header(scope: Scope, name: bytes) -> bytes | None:
    """The value of the request's first header called ``name`` (lower-case), or None."""
    for key, value in scope.get("headers", ()):
        if key == name:
            return bytes(value)
    return None


def bearer(authorization: bytes) -> str | None:
    """The token of one ``Authorization`` value ``Bearer TOKEN`` (scheme in any case, token
    stripped); None for another scheme or an empty token.

    Pure and cheap, so a caller may cache what a raw value names (the gateway keeps its key
    lookups per raw header value)."""
    scheme, _, token = authorization.decode("latin-1").partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


def bearer_token(scope: Scope) -> str | None:
    """The token of the request's ``Authorization: Bearer TOKEN`` header (None: no such header,
    more than one, or not a bearer token)."""
    found = [value for key, value in scope.get("headers", ()) if key == b"authorization"]
    if len(found) != 1:
        return None
    return bearer(found[0])
