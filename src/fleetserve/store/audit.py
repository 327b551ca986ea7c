"""The audit log over SQL: every admin action, who did it (the admin token's actor name), what, on
what, from where and when. Written by the admin API after an action succeeded; read newest first.
A node's registration writes what an operator must know of its hardware claim (actor ``node NAME``).
``detail`` is what else an operator needs to read the event, and never holds a secret.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import Any

from sqlalchemy import delete, select

from fleetserve.store.base import SqlBase
from fleetserve.store.tables import AuditEventRow, stamp

# The most events one ``events`` call returns.
MAX_EVENTS = 1000


class AuditAction(StrEnum):
    """What an admin did; the ``action`` column."""

    APPLY = "apply"
    DELETE = "delete"
    CORDON = "cordon"
    UNCORDON = "uncordon"
    DRAIN = "drain"
    ROLLOUT_UNDO = "rollout.undo"
    KEY_CREATE = "key.create"
    KEY_REVOKE = "key.revoke"
    TOKEN_CREATE = "token.create"
    TOKEN_REVOKE = "token.revoke"
    NODE_APPROVE = "node.approve"
    # Written by a registration, not an admin: a node's hardware claim held for an approval, or
    # accepted with less than approved (``store.identity``).
    NODE_HARDWARE_HELD = "node.hardware.held"
    NODE_HARDWARE_LESS = "node.hardware.less"
    MODEL_UPLOAD = "model.upload"


@dataclass(frozen=True)
class AuditEntry:
    """An admin action to record: who, what, on what ("Deployment/chat", "ApiKey/4"), from where."""

    actor: str
    action: AuditAction
    target: str
    detail: Mapping[str, Any] = field(default_factory=dict)
    source: str | None = None


@dataclass(frozen=True)
class AuditEvent:
    """A recorded admin action, with its id and time."""

    id: int
    at: datetime
    actor: str
    action: str
    target: str
    detail: Mapping[str, Any]
    source: str | None


def _event(row: AuditEventRow) -> AuditEvent:
    return AuditEvent(row.id, row.at, row.actor, row.action, row.target, dict(row.detail), row.source)


class SqlAudit(SqlBase):
    """The audit log, over SQL."""

    def record_events(self, entries: Sequence[AuditEntry], now: datetime) -> None:
        """Record ``entries`` (all at ``now``) in one transaction."""
        when = stamp(now)
        if not entries:
            return
        with self._write(f"recording {len(entries)} audit events") as s:
            s.add_all(
                AuditEventRow(
                    at=when, actor=e.actor[:255], action=AuditAction(e.action).value, target=e.target[:255],
                    detail=dict(e.detail), source=e.source[:64] if e.source else None,
                )
                for e in entries
            )  # fmt: skip

    def record_event(
        self,
        actor: str,
        action: AuditAction,
        target: str,
        detail: Mapping[str, Any],
        source: str | None,
        now: datetime,
    ) -> None:
        """Record one admin action at ``now``."""
        self.record_events([AuditEntry(actor, action, target, detail, source)], now)

    def events(
        self, since: datetime | None = None, limit: int = 100, action: AuditAction | None = None
    ) -> list[AuditEvent]:
        """Recorded events at or after ``since`` (and of ``action``), newest first, at most ``limit``."""
        if not 1 <= limit <= MAX_EVENTS:
            raise ValueError(f"limit must be 1..{MAX_EVENTS}, got {limit}")
        query = select(AuditEventRow)
        if since is not None:
            query = query.where(AuditEventRow.at >= stamp(since))
        if action is not None:
            query = query.where(AuditEventRow.action == AuditAction(action).value)
        query = query.order_by(AuditEventRow.at.desc(), AuditEventRow.id.desc()).limit(limit)
        with self._read("reading the audit log") as s:
            return [_event(r) for r in s.scalars(query)]

    def prune_events(self, older_than: datetime) -> int:
        """Delete the events recorded before ``older_than``; how many went."""
        when = stamp(older_than)
        with self._write("pruning the audit log") as s:
            result = s.connection().execute(delete(AuditEventRow).where(AuditEventRow.at < when))
            return int(result.rowcount)
