"""The initial state store: inventory, workloads, allocations, decisions, tokens, leader lease.

Revision ID: 0001
Revises:
Create Date: 2025-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | Sequence[str] | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

NAME = sa.String(63)
STAMP = sa.DateTime(timezone=True)


def upgrade() -> None:
    for table in ("device_classes", "fabrics", "models"):
        op.create_table(
            table,
            sa.Column("name", NAME, nullable=False),
            sa.Column("spec", sa.JSON(), nullable=False),
            sa.PrimaryKeyConstraint("name", name=op.f(f"pk_{table}")),
        )
    op.create_table(
        "nodes",
        sa.Column("name", NAME, nullable=False),
        sa.Column("spec", sa.JSON(), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("cordon_reason", sa.Text(), nullable=True),
        sa.Column("cordon_by", sa.String(255), nullable=True),
        sa.Column("epoch", sa.Integer(), nullable=False),
        sa.Column("last_heartbeat", STAMP, nullable=True),
        sa.Column("agent_status", sa.JSON(), nullable=True),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_nodes")),
    )
    op.create_table(
        "deployments",
        sa.Column("name", NAME, nullable=False),
        sa.Column("spec", sa.JSON(), nullable=False),
        sa.Column("generation", sa.Integer(), nullable=False),
        sa.Column("status", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_deployments")),
    )
    op.create_table(
        "replica_ordinals",
        sa.Column("deployment", NAME, nullable=False),
        sa.Column("next_ordinal", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("deployment", name=op.f("pk_replica_ordinals")),
    )
    op.create_table(
        "replicas",
        sa.Column("name", NAME, nullable=False),
        sa.Column("deployment", NAME, nullable=False),
        sa.Column("profile", NAME, nullable=False),
        sa.Column("spec", sa.JSON(), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("status", sa.JSON(), nullable=True),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_replicas")),
    )
    op.create_index(op.f("ix_replicas_deployment"), "replicas", ["deployment"])
    op.create_table(
        "replica_shards",
        sa.Column("replica", NAME, nullable=False),
        sa.Column("shard", sa.Integer(), nullable=False),
        sa.Column("node", NAME, nullable=False),
        sa.Column("cpu_cores", sa.Integer(), nullable=False),
        sa.Column("memory", sa.BigInteger(), nullable=False),
        sa.Column("node_epoch", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(
            ["replica"],
            ["replicas.name"],
            name=op.f("fk_replica_shards_replica_replicas"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(["node"], ["nodes.name"], name=op.f("fk_replica_shards_node_nodes")),
        sa.PrimaryKeyConstraint("replica", "shard", name=op.f("pk_replica_shards")),
    )
    op.create_index(op.f("ix_replica_shards_node"), "replica_shards", ["node"])
    op.create_table(
        "device_allocations",
        sa.Column("node", NAME, nullable=False),
        sa.Column("device_index", sa.Integer(), nullable=False),
        sa.Column("replica", NAME, nullable=False),
        sa.ForeignKeyConstraint(["node"], ["nodes.name"], name=op.f("fk_device_allocations_node_nodes")),
        sa.ForeignKeyConstraint(
            ["replica"],
            ["replicas.name"],
            name=op.f("fk_device_allocations_replica_replicas"),
            ondelete="CASCADE",
        ),
        # One device, at most one replica — enforced by the database for every process.
        sa.PrimaryKeyConstraint("node", "device_index", name=op.f("pk_device_allocations")),
    )
    op.create_index(op.f("ix_device_allocations_replica"), "device_allocations", ["replica"])
    op.create_table(
        "decisions",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("deployment", NAME, nullable=False),
        sa.Column("created_at", STAMP, nullable=False),
        sa.Column("explanation", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_decisions")),
    )
    op.create_index("ix_decisions_deployment_created_at", "decisions", ["deployment", "created_at"])
    op.create_table(
        "tokens",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("token_hash", sa.String(64), nullable=False),
        sa.Column("created_at", STAMP, nullable=False),
        sa.Column("revoked", sa.Boolean(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_tokens")),
        sa.UniqueConstraint("token_hash", name=op.f("uq_tokens_token_hash")),
    )
    op.create_table(
        "api_keys",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("name", sa.String(63), nullable=False),
        sa.Column("key_hash", sa.String(64), nullable=False),
        sa.Column("models", sa.JSON(), nullable=False),
        sa.Column("rpm", sa.Integer(), nullable=True),
        sa.Column("tpm", sa.Integer(), nullable=True),
        sa.Column("created_at", STAMP, nullable=False),
        sa.Column("revoked", sa.Boolean(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_api_keys")),
        sa.UniqueConstraint("key_hash", name=op.f("uq_api_keys_key_hash")),
    )
    op.create_table(
        "leader_lease",
        sa.Column("name", sa.String(255), nullable=False),
        sa.Column("holder", sa.String(255), nullable=False),
        sa.Column("expires_at", STAMP, nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_leader_lease")),
    )


def downgrade() -> None:
    for table in (
        "leader_lease",
        "api_keys",
        "tokens",
        "decisions",
        "device_allocations",
        "replica_shards",
        "replicas",
        "deployments",
        "replica_ordinals",
        "nodes",
        "models",
        "fabrics",
        "device_classes",
    ):
        op.drop_table(table)
