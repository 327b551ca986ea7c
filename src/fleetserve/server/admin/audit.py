"""Recording admin actions in the audit log from the admin API's routes: the actor is the admin
token the auth middleware recorded (``auth.admin_of``), the source the caller's address. A route
records after its action succeeded, in the same request; ``detail`` never carries a secret.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from typing import Any

from fastapi import Request

from fleetserve.server.auth import admin_of
from fleetserve.store.audit import AuditAction, AuditEntry
from fleetserve.store.protocols import AuditLog


def source_of(request: Request) -> str | None:
    """The caller's address, as the listener saw it."""
    return request.client.host if request.client is not None else None


def entry(
    request: Request, action: AuditAction, target: str, detail: Mapping[str, Any] | None = None
) -> AuditEntry:
    """The audit entry for an action the caller of ``request`` took on ``target``."""
    return AuditEntry(admin_of(request).actor, action, target, dict(detail or {}), source_of(request))


def record(
    log: AuditLog,
    request: Request,
    action: AuditAction,
    target: str,
    detail: Mapping[str, Any] | None = None,
) -> None:
    """Record one action the caller of ``request`` took (after it succeeded)."""
    log.record_events([entry(request, action, target, detail)], datetime.now(UTC))


def record_all(log: AuditLog, entries: Iterable[AuditEntry]) -> None:
    """Record several actions of one request in one transaction."""
    log.record_events(list(entries), datetime.now(UTC))
