"""Which node a credential was found to be, kept for a bounded time: the agents' door asks the
database once per credential per ``ttl`` seconds, not once per call.

Only what the door decides before a call is written is taken from here: whether a status
report's body is read at all (a credential that is no node's gets its 401 first), whom it speaks
for (403), and which refusal of a malformed call comes first. The call's write is still judged
against the rows by the very statement that writes it (``store/acceptance.py``): a revoked or
replaced credential's heartbeats, reports and polls are refused from its next call on, on every
server, as before. What a kept entry can still let through is the reading of one report's body
(4 MiB at most) per call, and for at most ``ttl`` seconds after the revocation: the door forgets
a credential at once when a call's judgement finds it unknown, and every entry is dropped
``ttl`` seconds after it was found.

A credential is found by a lookup, or by an accepted heartbeat (the rows accepted it just then),
so that a status report, which agents send after a heartbeat or two, needs no statement before
its body is read. Only found credentials are kept (an unknown token is asked about at every call, so a
credential enrolled a moment ago is never refused from here), keyed by their hash (the
plaintexts are not held), at most ``limit`` of them (the oldest dropped first).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from fleetserve.store.acceptance import credential_hash

DEFAULT_TTL = 15.0  # over an agent's heartbeat interval: a report finds its last beat's entry
DEFAULT_LIMIT = 100_000


class CredentialCache:
    """Per credential found, its node, for ``ttl`` seconds of ``clock`` (0: nothing is kept)."""

    def __init__(
        self,
        ttl: float = DEFAULT_TTL,
        limit: int = DEFAULT_LIMIT,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if ttl < 0 or limit < 1:
            raise ValueError(
                f"a credential cache keeps entries for ttl >= 0 s, at most limit >= 1: {ttl}, {limit}"
            )
        self.ttl = ttl
        self.limit = limit
        self.clock = clock
        self._found: dict[str, tuple[str, float]] = {}  # credential hash -> (node, found at)

    def node(self, credential: str) -> str | None:
        """The node ``credential`` was found to be less than ``ttl`` seconds ago (None: ask)."""
        if not self.ttl:
            return None
        key = credential_hash(credential)
        kept = self._found.get(key)
        if kept is None:
            return None
        node, found = kept
        if self.clock() - found >= self.ttl:
            del self._found[key]
            return None
        return node

    def found(self, credential: str, node: str) -> None:
        """``credential`` is ``node``'s, as the rows stand now."""
        if not self.ttl:
            return
        key = credential_hash(credential)
        self._found.pop(key, None)  # re-inserted last: the oldest are first in the dict
        while len(self._found) >= self.limit:
            del self._found[next(iter(self._found))]
        self._found[key] = (node, self.clock())

    def forget(self, credential: str) -> None:
        """``credential`` was found to be no node's: ask again next time."""
        self._found.pop(credential_hash(credential), None)

    def __len__(self) -> int:
        return len(self._found)
