"""The dashboard's login sessions in the store, on SQLite and PostgreSQL: opened with an admin
token, valid until they expire, are ended, or their token is revoked or expires; only hashes are
stored."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import select

from fleetserve.store import SqlStore, TokenKind
from fleetserve.store.tables import UiSessionRow

T0 = datetime(2026, 1, 1, tzinfo=UTC)
TTL = timedelta(hours=12)


def test_an_open_session_is_checked_by_its_cookie_and_its_csrf_token(store: SqlStore) -> None:
    token = store.create_token(TokenKind.ADMIN, T0)
    opened = store.open_session(token.id, T0, TTL)
    assert opened.expires_at == T0 + TTL
    session = store.check_session(opened.cookie, T0 + timedelta(hours=1))
    assert session is not None and session.token_id == token.id
    assert session.csrf_matches(opened.csrf)
    assert not session.csrf_matches(opened.csrf + "x")
    assert not session.csrf_matches("")
    assert not session.csrf_matches(None)
    assert store.check_session(opened.cookie + "x", T0) is None
    assert store.check_session(opened.csrf, T0) is None  # the CSRF token is not a cookie


def test_only_hashes_of_the_secrets_are_stored(store: SqlStore) -> None:
    token = store.create_token(TokenKind.ADMIN, T0)
    opened = store.open_session(token.id, T0, TTL)
    with store.engine.connect() as conn:
        row = conn.execute(select(UiSessionRow)).one()
    assert opened.cookie not in tuple(str(v) for v in row)
    assert opened.csrf not in tuple(str(v) for v in row)
    assert opened.cookie not in repr(opened) and opened.csrf not in repr(opened)


def test_a_session_expires_at_its_time(store: SqlStore) -> None:
    token = store.create_token(TokenKind.ADMIN, T0)
    opened = store.open_session(token.id, T0, TTL)
    assert store.check_session(opened.cookie, T0 + TTL - timedelta(seconds=1)) is not None
    assert store.check_session(opened.cookie, T0 + TTL) is None


def test_a_session_ends_at_logout_and_only_that_one(store: SqlStore) -> None:
    token = store.create_token(TokenKind.ADMIN, T0)
    first = store.open_session(token.id, T0, TTL)
    second = store.open_session(token.id, T0, TTL)
    assert store.end_session(first.cookie) is True
    assert store.end_session(first.cookie) is False
    assert store.check_session(first.cookie, T0) is None
    assert store.check_session(second.cookie, T0) is not None


def test_revoking_the_admin_token_ends_its_sessions_and_no_other(store: SqlStore) -> None:
    token = store.create_token(TokenKind.ADMIN, T0)
    other = store.create_token(TokenKind.ADMIN, T0)
    mine = store.open_session(token.id, T0, TTL)
    theirs = store.open_session(other.id, T0, TTL)
    store.revoke_token(token.id)
    assert store.check_session(mine.cookie, T0) is None
    assert store.check_session(theirs.cookie, T0) is not None
    with store.engine.connect() as conn:
        assert conn.execute(select(UiSessionRow.token_id)).scalars().all() == [other.id]


def test_a_session_ends_when_its_admin_token_expires(store: SqlStore) -> None:
    token = store.create_token(TokenKind.ADMIN, T0, expires_at=T0 + timedelta(hours=1))
    opened = store.open_session(token.id, T0, TTL)
    assert store.check_session(opened.cookie, T0 + timedelta(minutes=59)) is not None
    assert store.check_session(opened.cookie, T0 + timedelta(hours=1)) is None


def test_a_session_of_a_join_token_is_never_valid(store: SqlStore) -> None:
    # The login refuses a join token; should a row exist anyway, it grants nothing.
    join = store.create_token(TokenKind.JOIN, T0)
    opened = store.open_session(join.id, T0, TTL)
    assert store.check_session(opened.cookie, T0) is None


def test_ending_every_session_of_a_token_and_pruning_expired_ones(store: SqlStore) -> None:
    token = store.create_token(TokenKind.ADMIN, T0)
    other = store.create_token(TokenKind.ADMIN, T0)
    store.open_session(token.id, T0, TTL)
    store.open_session(token.id, T0, TTL)
    short = store.open_session(other.id, T0, timedelta(minutes=5))
    long = store.open_session(other.id, T0, TTL)
    assert store.end_sessions_for_token(token.id) == 2
    assert store.prune_sessions(T0 + timedelta(minutes=5)) == 1
    assert store.check_session(short.cookie, T0) is None
    assert store.check_session(long.cookie, T0) is not None


def test_a_session_needs_a_positive_ttl_and_an_aware_time(store: SqlStore) -> None:
    token = store.create_token(TokenKind.ADMIN, T0)
    with pytest.raises(ValueError, match="positive ttl"):
        store.open_session(token.id, T0, timedelta(0))
    with pytest.raises(ValueError, match="timezone-aware"):
        store.open_session(token.id, datetime(2026, 1, 1), TTL)
