"""Usage per minute, key and model; the audit log of admin actions; dashboard sessions.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-03
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | Sequence[str] | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

STAMP = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "usage_minutes",
        sa.Column("minute", STAMP, nullable=False),
        sa.Column("key_id", sa.Integer(), nullable=False),
        sa.Column("model", sa.String(63), nullable=False),
        sa.Column("requests", sa.BigInteger(), nullable=False),
        sa.Column("errors", sa.BigInteger(), nullable=False),
        sa.Column("prompt_tokens", sa.BigInteger(), nullable=False),
        sa.Column("completion_tokens", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("minute", "key_id", "model", name=op.f("pk_usage_minutes")),
    )
    op.create_index("ix_usage_minutes_model_minute", "usage_minutes", ["model", "minute"])
    op.create_table(
        "audit_events",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("at", STAMP, nullable=False),
        sa.Column("actor", sa.String(255), nullable=False),
        sa.Column("action", sa.String(63), nullable=False),
        sa.Column("target", sa.String(255), nullable=False),
        sa.Column("detail", sa.JSON(), nullable=False),
        sa.Column("source", sa.String(64), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_audit_events")),
    )
    op.create_index("ix_audit_events_at", "audit_events", ["at"])
    op.create_table(
        "ui_sessions",
        sa.Column("session_hash", sa.String(64), nullable=False),
        sa.Column("token_id", sa.Integer(), nullable=False),
        sa.Column("csrf_hash", sa.String(64), nullable=False),
        sa.Column("created_at", STAMP, nullable=False),
        sa.Column("expires_at", STAMP, nullable=False),
        sa.ForeignKeyConstraint(
            ["token_id"], ["tokens.id"], name=op.f("fk_ui_sessions_token_id_tokens"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("session_hash", name=op.f("pk_ui_sessions")),
    )
    op.create_index(op.f("ix_ui_sessions_token_id"), "ui_sessions", ["token_id"])


def downgrade() -> None:
    op.drop_index(op.f("ix_ui_sessions_token_id"), table_name="ui_sessions")
    op.drop_table("ui_sessions")
    op.drop_index("ix_audit_events_at", table_name="audit_events")
    op.drop_table("audit_events")
    op.drop_index("ix_usage_minutes_model_minute", table_name="usage_minutes")
    op.drop_table("usage_minutes")
