"""The admin API's credentials: gateway API keys and admin and join tokens (created, listed,
revoked; a secret is shown once, when created, and stored hashed), and node enrolments (listed,
approved)."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Annotated

from fastapi import APIRouter, Request
from fastapi import Path as FastApiPath

from fleetserve.adminapi.credentials import (
    ApprovalView,
    CreatedKey,
    CreatedToken,
    EnrolmentView,
    KeyRequest,
    KeyView,
    TokenRequest,
    TokenView,
)
from fleetserve.adminapi.values import Revoked
from fleetserve.errors import ConfigError, Problem
from fleetserve.server.admin import audit
from fleetserve.server.params import NameParam
from fleetserve.store.audit import AuditAction
from fleetserve.store.credentials import ApiKey, TokenKind, TokenRecord
from fleetserve.store.identity import EnrolmentRecord
from fleetserve.store.sql import SqlStore

Id = Annotated[int, FastApiPath(ge=1, le=2**31 - 1)]


def key_view(key: ApiKey) -> KeyView:
    """An API key as the API shows it (no secret)."""
    return KeyView(
        id=key.id, name=key.name, models=list(key.models), rpm=key.rpm, tpm=key.tpm,
        created_at=key.created_at, revoked=key.revoked,
    )  # fmt: skip


def token_view(token: TokenRecord, now: datetime) -> TokenView:
    """A token as the API shows it (no secret), valid or not at ``now``."""
    return TokenView(
        id=token.id, kind=token.kind, created_at=token.created_at, expires_at=token.expires_at,
        revoked=token.revoked, valid=token.valid(now),
    )  # fmt: skip


def enrolment_view(record: EnrolmentRecord) -> EnrolmentView:
    """A node name's identity as the API shows it."""
    return EnrolmentView(
        node=record.node, enrolled=record.enrolled, issued_at=record.issued_at, approved=record.approved,
        requested_at=record.requested_at, requested_from=record.requested_from,
        approved_hardware=record.approved_hardware, claimed_hardware=record.claimed_hardware,
        held_at=record.held_at,
    )  # fmt: skip


def build_credentials_router(store: SqlStore, on_key_revoked: Callable[[], None] | None) -> APIRouter:
    """Keys, tokens and enrolments; ``on_key_revoked`` tells this process's gateway to forget keys."""
    api = APIRouter()

    @api.post("/keys", tags=["keys"], summary="Create a gateway API key (shown once, stored hashed)")
    def create_key(body: KeyRequest, request: Request) -> CreatedKey:
        key, plaintext = store.create_api_key(body.name, body.models, body.rpm, body.tpm, datetime.now(UTC))
        audit.record(
            store, request, AuditAction.KEY_CREATE, f"ApiKey/{key.id}",
            {"name": key.name, "models": list(key.models), "rpm": key.rpm, "tpm": key.tpm},
        )  # fmt: skip
        return CreatedKey(**dict(key_view(key)), key=plaintext)

    @api.get("/keys", tags=["keys"], summary="Gateway API keys (no secrets)")
    def list_keys() -> list[KeyView]:
        return [key_view(k) for k in store.list_api_keys()]

    @api.delete("/keys/{key_id}", tags=["keys"], summary="Revoke a gateway API key")
    def revoke_key(key_id: Id, request: Request) -> Revoked:
        store.revoke_api_key(key_id)
        audit.record(store, request, AuditAction.KEY_REVOKE, f"ApiKey/{key_id}")
        if on_key_revoked is not None:
            on_key_revoked()  # this process's gateway forgets it now; others within seconds
        return Revoked(revoked=key_id)

    @api.post("/tokens", tags=["tokens"], summary="Create an admin or join token (shown once, stored hashed)")
    def create_token(body: TokenRequest, request: Request) -> CreatedToken:
        now = datetime.now(UTC)
        until = now + timedelta(seconds=body.expires_in) if body.expires_in is not None else None
        issued = store.create_token(body.kind, now, until)
        audit.record(
            store, request, AuditAction.TOKEN_CREATE, f"Token/{issued.id}",
            {"kind": issued.kind.value, "expiresAt": until.isoformat() if until else None},
        )  # fmt: skip
        record = next(t for t in store.list_tokens() if t.id == issued.id)
        return CreatedToken(**dict(token_view(record, now)), token=issued.plaintext)

    @api.get("/tokens", tags=["tokens"], summary="Admin and join tokens (no secrets)")
    def list_tokens() -> list[TokenView]:
        now = datetime.now(UTC)
        return [token_view(t, now) for t in store.list_tokens()]

    @api.delete("/tokens/{token_id}", tags=["tokens"], summary="Revoke an admin or join token")
    def revoke_token(token_id: Id, request: Request) -> Revoked:
        now = datetime.now(UTC)
        tokens = {t.id: t for t in store.list_tokens()}
        target = tokens.get(token_id)
        valid_admins = [t for t in tokens.values() if t.kind is TokenKind.ADMIN and t.valid(now)]
        if target is not None and target.kind is TokenKind.ADMIN and valid_admins == [target]:
            raise ConfigError(
                [
                    Problem(
                        f"Token {token_id}",
                        "",
                        "the last valid admin token cannot be revoked; create another first",
                    )
                ]
            )
        store.revoke_token(token_id)
        audit.record(
            store, request, AuditAction.TOKEN_REVOKE, f"Token/{token_id}",
            {"kind": target.kind.value} if target is not None else None,
        )  # fmt: skip
        return Revoked(revoked=token_id)

    @api.get(
        "/enrolments",
        tags=["nodes"],
        summary="Node identities: enrolled, approved, waiting; hardware approved and claimed",
    )
    def list_enrolments() -> list[EnrolmentView]:
        return [enrolment_view(r) for r in store.enrolments()]

    @api.post(
        "/nodes/{name}/approve",
        tags=["nodes"],
        summary="Apply the hardware claim that waits under a name; with none, let the next enrolment "
        "through (a new name, or one enrolled already)",
    )
    def approve(name: NameParam, request: Request) -> ApprovalView:
        approval = store.approve(name, datetime.now(UTC))
        detail: dict[str, object] = (
            {"reEnrolment": approval.record.enrolled}
            if approval.hardware is None
            else {"hardware": approval.hardware.model_dump(mode="json")}
        )
        audit.record(store, request, AuditAction.NODE_APPROVE, f"Node/{name}", detail)
        return ApprovalView(**dict(enrolment_view(approval.record)), applied_hardware=approval.hardware)

    return api
