"""The dashboard's login sessions over SQL: opened with an admin token, checked on every request,
ended at logout, with their token (revoked or expired) or at their own expiry.

A session has two secrets, both 256 random bits returned once and stored as sha256 only: the
cookie's value and the CSRF token the page sends back in a header on every change. A session is
valid only while the admin token it was opened with is valid too, so revoking that token ends it
even before ``end_sessions_for_token`` deletes the rows.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from sqlalchemy import delete, or_, select

from fleetserve.store.base import SqlBase
from fleetserve.store.tables import TokenRow, UiSessionRow, stamp


def _hash(plaintext: str) -> str:
    return hashlib.sha256(plaintext.encode()).hexdigest()


@dataclass(frozen=True)
class OpenedSession:
    """A new session: the cookie's value and the CSRF token, returned this once (never stored)."""

    cookie: str = field(repr=False)
    csrf: str = field(repr=False)
    token_id: int
    expires_at: datetime


@dataclass(frozen=True)
class UiSession:
    """A valid session as a request sees it: the admin token behind it, and the CSRF check."""

    token_id: int
    expires_at: datetime
    csrf_hash: str = field(repr=False)

    def csrf_matches(self, presented: str | None) -> bool:
        """Whether ``presented`` is this session's CSRF token (compared in constant time)."""
        if not presented:
            return False
        return hmac.compare_digest(_hash(presented), self.csrf_hash)


class SqlSessions(SqlBase):
    """Dashboard sessions, over SQL."""

    def open_session(self, token_id: int, now: datetime, ttl: timedelta) -> OpenedSession:
        """A new session for admin token ``token_id``, valid until ``now + ttl``."""
        if ttl <= timedelta(0):
            raise ValueError(f"a session needs a positive ttl, got {ttl}")
        when = stamp(now)
        cookie = secrets.token_urlsafe(32)
        csrf = secrets.token_urlsafe(32)
        with self._write("opening a dashboard session") as s:
            row = UiSessionRow(
                session_hash=_hash(cookie), token_id=token_id, csrf_hash=_hash(csrf),
                created_at=when, expires_at=when + ttl,
            )  # fmt: skip
            s.add(row)
        return OpenedSession(cookie, csrf, token_id, when + ttl)

    def check_session(self, cookie: str, now: datetime | None = None) -> UiSession | None:
        """The session whose cookie is ``cookie``, if it is unexpired at ``now`` (default: the
        current time) and its admin token is still valid; None otherwise."""
        when = stamp(now) if now is not None else datetime.now(UTC)
        query = (
            select(UiSessionRow.token_id, UiSessionRow.expires_at, UiSessionRow.csrf_hash)
            .join(TokenRow, TokenRow.id == UiSessionRow.token_id)
            .where(
                UiSessionRow.session_hash == _hash(cookie),
                UiSessionRow.expires_at > when,
                TokenRow.kind == "admin",
                TokenRow.revoked.is_(False),
                or_(TokenRow.expires_at.is_(None), TokenRow.expires_at > when),
            )
        )
        with self._read("checking a dashboard session") as s:
            row = s.execute(query).one_or_none()
            return None if row is None else UiSession(row.token_id, row.expires_at, row.csrf_hash)

    def end_session(self, cookie: str) -> bool:
        """End the session whose cookie is ``cookie`` (a logout); whether there was one."""
        with self._write("ending a dashboard session") as s:
            result = s.connection().execute(
                delete(UiSessionRow).where(UiSessionRow.session_hash == _hash(cookie))
            )
            return result.rowcount > 0

    def end_sessions_for_token(self, token_id: int) -> int:
        """End every session opened with admin token ``token_id``; how many there were."""
        with self._write(f"ending the dashboard sessions of token {token_id}") as s:
            result = s.connection().execute(delete(UiSessionRow).where(UiSessionRow.token_id == token_id))
            return int(result.rowcount)

    def prune_sessions(self, now: datetime) -> int:
        """Delete the sessions expired at ``now``; how many."""
        when = stamp(now)
        with self._write("pruning expired dashboard sessions") as s:
            result = s.connection().execute(delete(UiSessionRow).where(UiSessionRow.expires_at <= when))
            return int(result.rowcount)
