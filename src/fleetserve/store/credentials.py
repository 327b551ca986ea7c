"""The credentials aggregate over SQL: admin and join tokens, and the gateway's API keys. Only
a secret's sha256 is stored (secrets are 256 random bits, so a fast hash is enough).
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum

from sqlalchemy import delete, or_, select, update

from fleetserve.errors import (
    NotFound,
)
from fleetserve.store.base import SqlBase
from fleetserve.store.tables import (
    ApiKeyRow,
    TokenRow,
    UiSessionRow,
    stamp,
)


class TokenKind(StrEnum):
    """What a token lets its bearer do."""

    ADMIN = "admin"  # the admin API
    JOIN = "join"  # an agent registering its node


@dataclass(frozen=True)
class IssuedToken:
    """A new token. ``plaintext`` is returned this once; only its sha256 is stored."""

    id: int
    kind: TokenKind
    plaintext: str


@dataclass(frozen=True)
class ApiKey:
    """A gateway API key, without its secret."""

    id: int
    name: str
    models: tuple[str, ...]
    rpm: int | None
    tpm: int | None
    created_at: datetime
    revoked: bool

    def allows(self, model: str) -> bool:
        """Whether this key may use ``model``."""
        return "*" in self.models or model in self.models


def _api_key(row: ApiKeyRow) -> ApiKey:
    return ApiKey(row.id, row.name, tuple(row.models), row.rpm, row.tpm, row.created_at, row.revoked)


@dataclass(frozen=True)
class TokenRecord:
    """A stored token, without any secret."""

    id: int
    kind: TokenKind
    created_at: datetime
    revoked: bool
    expires_at: datetime | None = None

    def valid(self, now: datetime) -> bool:
        """Whether the token is accepted at ``now``: not revoked, not expired."""
        return not self.revoked and (self.expires_at is None or now < self.expires_at)


def _hash(plaintext: str) -> str:
    return hashlib.sha256(plaintext.encode()).hexdigest()


class SqlCredentials(SqlBase):
    """Tokens and API keys, over SQL."""

    def create_token(self, kind: TokenKind, now: datetime, expires_at: datetime | None = None) -> IssuedToken:
        """A new random token of ``kind``, refused after ``expires_at`` if given. Its plaintext is
        in the result only; the store keeps its sha256 (tokens are 256 random bits, so a fast hash
        is enough)."""
        kind = TokenKind(kind)
        when = stamp(now)
        until = stamp(expires_at) if expires_at is not None else None
        plaintext = f"fs_{kind.value}_{secrets.token_urlsafe(32)}"
        with self._write(f"creating a {kind.value} token") as s:
            row = TokenRow(
                kind=kind.value, token_hash=_hash(plaintext), created_at=when, revoked=False, expires_at=until
            )
            s.add(row)
            s.flush()
            return IssuedToken(row.id, kind, plaintext)

    def verify_token(self, plaintext: str, kind: TokenKind, now: datetime | None = None) -> bool:
        """Whether ``plaintext`` is a stored, unrevoked token of ``kind``, unexpired at ``now``
        (default: the current time)."""
        return self.token_id_for(plaintext, kind, now) is not None

    def token_id_for(self, plaintext: str, kind: TokenKind, now: datetime | None = None) -> int | None:
        """The id of the stored, unrevoked token of ``kind`` that ``plaintext`` is, unexpired at
        ``now`` (default: the current time); None if it is no such token."""
        when = stamp(now) if now is not None else datetime.now(UTC)
        query = select(TokenRow.id).where(
            TokenRow.token_hash == _hash(plaintext),
            TokenRow.kind == TokenKind(kind).value,
            TokenRow.revoked.is_(False),
            or_(TokenRow.expires_at.is_(None), TokenRow.expires_at > when),
        )
        with self._read("verifying a token") as s:
            found: int | None = s.scalar(query)
            return found

    def revoke_token(self, token_id: int) -> None:
        """Revoke a token for good, ending the dashboard sessions opened with it; raises NotFound."""
        with self._write(f"revoking token {token_id}") as s:
            result = s.connection().execute(
                update(TokenRow).where(TokenRow.id == token_id).values(revoked=True)
            )
            if result.rowcount == 0:
                raise NotFound(f"no token with id {token_id} is stored")
            s.connection().execute(delete(UiSessionRow).where(UiSessionRow.token_id == token_id))

    def list_tokens(self) -> list[TokenRecord]:
        """Every admin and join token (no secrets), by id."""
        with self._read("listing tokens") as s:
            rows = s.scalars(select(TokenRow).order_by(TokenRow.id))
            return [TokenRecord(r.id, TokenKind(r.kind), r.created_at, r.revoked, r.expires_at) for r in rows]

    def create_api_key(
        self, name: str, models: Sequence[str], rpm: int | None, tpm: int | None, now: datetime
    ) -> tuple[ApiKey, str]:
        """A new API key; the plaintext is returned this once, only its sha256 is stored."""
        plaintext = f"fs_key_{secrets.token_urlsafe(32)}"
        when = stamp(now)
        with self._write(f"creating API key {name}") as s:
            row = ApiKeyRow(
                name=name, key_hash=_hash(plaintext), models=list(models), rpm=rpm, tpm=tpm,
                created_at=when, revoked=False,
            )  # fmt: skip
            s.add(row)
            s.flush()
            return _api_key(row), plaintext

    def list_api_keys(self) -> list[ApiKey]:
        """Every API key (no secrets), by id."""
        with self._read("listing API keys") as s:
            return [_api_key(r) for r in s.scalars(select(ApiKeyRow).order_by(ApiKeyRow.id))]

    def revoke_api_key(self, key_id: int) -> None:
        """Revoke an API key for good; raises NotFound."""
        with self._write(f"revoking API key {key_id}") as s:
            result = s.connection().execute(
                update(ApiKeyRow).where(ApiKeyRow.id == key_id).values(revoked=True)
            )
            if result.rowcount == 0:
                raise NotFound(f"no API key with id {key_id}")

    def verify_api_key(self, plaintext: str) -> ApiKey | None:
        """The unrevoked key ``plaintext`` is, or None."""
        with self._read("verifying an API key") as s:
            row = s.scalars(
                select(ApiKeyRow).where(ApiKeyRow.key_hash == _hash(plaintext), ApiKeyRow.revoked.is_(False))
            ).one_or_none()
            return _api_key(row) if row is not None else None
