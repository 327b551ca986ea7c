"""The ASGI type aliases, named once for every raw handler (the ASGI 3 spec's shapes)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
"""A connection's scope: ``type``, ``method``, ``path``, ``query_string``, ``headers``, …"""

Message = MutableMapping[str, Any]
"""One event received from or sent to the server (``http.request``, ``http.response.start``, …)."""

Receive = Callable[[], Awaitable[Message]]
"""The awaitable that yields the next event from the client."""

Send = Callable[[Message], Awaitable[None]]
"""The awaitable that sends one event to the client."""

App = Callable[[Scope, Receive, Send], Awaitable[None]]
"""An ASGI application."""

Header = tuple[bytes, bytes]
"""One header as ASGI carries it: lower-cased name and raw value."""
