"""The state store's tables (SQLAlchemy 2 declarative). The migrations create exactly these.

Documents are stored whole as JSON (``model_dump(mode="json", by_alias=True)``), restored with
``model_validate``. What the store itself must decide on — a node's state, cordon and epoch, a
deployment's generation, a replica's state, which device is whose — lives in columns, and the
columns win over the same fields inside the JSON.

``device_allocations`` has (node, device_index) as its primary key: the database itself refuses
to give one device to two replicas, whichever process asks. ``replica_shards`` holds each shard's
node, CPU claim and the node's epoch when the replica was placed (fencing).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, ClassVar

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Dialect,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    TypeDecorator,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

NAME = String(63)

NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_N_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class UtcDateTime(TypeDecorator[datetime]):
    """A timezone-aware UTC timestamp on every backend (SQLite keeps it as naive UTC text)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError(f"timestamps must be timezone-aware, got {value!r}")
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map: ClassVar[dict[Any, Any]] = {dict[str, Any]: JSON, datetime: UtcDateTime}


class DeviceClassRow(Base):
    __tablename__ = "device_classes"

    name: Mapped[str] = mapped_column(NAME, primary_key=True)
    spec: Mapped[dict[str, Any]]


class FabricRow(Base):
    __tablename__ = "fabrics"

    name: Mapped[str] = mapped_column(NAME, primary_key=True)
    spec: Mapped[dict[str, Any]]


class NodeRow(Base):
    __tablename__ = "nodes"

    name: Mapped[str] = mapped_column(NAME, primary_key=True)
    # The agent's hardware facts; state and cordon below are the store's.
    spec: Mapped[dict[str, Any]]
    state: Mapped[str] = mapped_column(String(16))
    cordon_reason: Mapped[str | None] = mapped_column(Text)
    cordon_by: Mapped[str | None] = mapped_column(String(255))
    # Bumped by every registration: a returning agent learns what moved away while it was gone.
    epoch: Mapped[int] = mapped_column(Integer)
    last_heartbeat: Mapped[datetime | None]
    # What the agent last reported beyond replica states: downloads in flight, cache, problems.
    agent_status: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)


class ModelRow(Base):
    __tablename__ = "models"

    name: Mapped[str] = mapped_column(NAME, primary_key=True)
    spec: Mapped[dict[str, Any]]
    # The spec before the last change of its weights (``rollout undo model/NAME`` applies it
    # again); None before any.
    previous_spec: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)


class AdapterRow(Base):
    """An Adapter (a LoRA adapter on a base model): its spec."""

    __tablename__ = "adapters"

    name: Mapped[str] = mapped_column(NAME, primary_key=True)
    spec: Mapped[dict[str, Any]]


class DeploymentRow(Base):
    __tablename__ = "deployments"

    name: Mapped[str] = mapped_column(NAME, primary_key=True)
    spec: Mapped[dict[str, Any]]
    # Bumped when the spec changes, not when it is re-applied unchanged.
    generation: Mapped[int] = mapped_column(Integer)
    status: Mapped[dict[str, Any]]
    # The spec before the last change (``rollout undo`` applies it again); None before any change.
    previous_spec: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)


class EndpointRow(Base):
    """An Endpoint (a server fleetserve did not start): its spec, and the control plane's last health
    check of it. Its API key is never here: the control plane reads it from its key file."""

    __tablename__ = "endpoints"

    name: Mapped[str] = mapped_column(NAME, primary_key=True)
    spec: Mapped[dict[str, Any]]
    # Unknown | Ready | NotReady: a change of state moves the change counter (the gateways'
    # routes), a check that only confirms it does not.
    state: Mapped[str] = mapped_column(String(16))
    last_error: Mapped[str | None] = mapped_column(Text, nullable=True)
    checked_at: Mapped[datetime | None] = mapped_column(UtcDateTime, nullable=True)


class ReplicaOrdinalRow(Base):
    """The next replica ordinal per deployment name. Identities are never reused — not after a
    release, not after the deployment is deleted and made again — so a replica moved away can
    never be confused with its replacement (fencing)."""

    __tablename__ = "replica_ordinals"

    deployment: Mapped[str] = mapped_column(NAME, primary_key=True)
    next_ordinal: Mapped[int] = mapped_column(Integer)


class ReplicaRow(Base):
    __tablename__ = "replicas"

    name: Mapped[str] = mapped_column(NAME, primary_key=True)
    deployment: Mapped[str] = mapped_column(NAME, index=True)
    profile: Mapped[str] = mapped_column(NAME)
    spec: Mapped[dict[str, Any]]
    state: Mapped[str] = mapped_column(String(16))
    # What the agent reported: a message, restarts, the last lines of the engine's stderr.
    status: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    # When the agent last reported the replica (its in-flight count is as of then).
    reported_at: Mapped[datetime | None]
    # When the replica turned Draining (out of the routes); None while it is not draining.
    draining_since: Mapped[datetime | None]
    # The engine's API key, made at allocation: only the replica's agent (in its assignment), the
    # gateway and the observer read it; the admin API never shows it. None: placed before keys.
    engine_key: Mapped[str | None] = mapped_column(String(64), nullable=True)


class ReplicaShardRow(Base):
    __tablename__ = "replica_shards"

    replica: Mapped[str] = mapped_column(
        NAME, ForeignKey("replicas.name", ondelete="CASCADE"), primary_key=True
    )
    shard: Mapped[int] = mapped_column(Integer, primary_key=True)
    node: Mapped[str] = mapped_column(NAME, ForeignKey("nodes.name"), index=True)
    cpu_cores: Mapped[int] = mapped_column(Integer)
    memory: Mapped[int] = mapped_column(BigInteger)
    # The node's epoch when the replica was placed on it.
    node_epoch: Mapped[int] = mapped_column(Integer)


class DeviceAllocationRow(Base):
    __tablename__ = "device_allocations"

    # The primary key is the uniqueness rule: one device, at most one replica.
    node: Mapped[str] = mapped_column(NAME, ForeignKey("nodes.name"), primary_key=True)
    device_index: Mapped[int] = mapped_column(Integer, primary_key=True)
    replica: Mapped[str] = mapped_column(NAME, ForeignKey("replicas.name", ondelete="CASCADE"), index=True)


class DecisionRow(Base):
    __tablename__ = "decisions"
    __table_args__ = (Index("ix_decisions_deployment_created_at", "deployment", "created_at"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    deployment: Mapped[str] = mapped_column(NAME)
    created_at: Mapped[datetime]
    explanation: Mapped[dict[str, Any]]


class TokenRow(Base):
    __tablename__ = "tokens"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    kind: Mapped[str] = mapped_column(String(16))
    # sha256 of the token, hex; the plaintext is never stored.
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[datetime]
    revoked: Mapped[bool] = mapped_column(Boolean, default=False)
    # After this instant the token is refused (join tokens made with an expiry); None: never.
    expires_at: Mapped[datetime | None] = mapped_column(nullable=True)


class NodeCredentialRow(Base):
    """A node's identity: the sha256 of its per-node credential (issued at enrolment, bound to the
    name), whether an operator approved the next enrolment under the name, the last enrolment
    request that waits for that approval, and the node's approved hardware with a claim beyond it."""

    __tablename__ = "node_credentials"

    # No foreign key to nodes: a new name waiting for approval has no node row yet.
    node: Mapped[str] = mapped_column(NAME, primary_key=True)
    token_hash: Mapped[str | None] = mapped_column(String(64), unique=True, nullable=True)
    issued_at: Mapped[datetime | None] = mapped_column(nullable=True)
    approved: Mapped[bool] = mapped_column(Boolean, default=False)
    requested_at: Mapped[datetime | None] = mapped_column(nullable=True)
    requested_from: Mapped[str | None] = mapped_column(String(64), nullable=True)
    # The hardware an operator approved (``inventory.approval.Hardware``; None: enrolled before
    # approvals were recorded), and a registration's claim beyond it that waits (the node document
    # as claimed, and since when; None when nothing waits).
    approved_hardware: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    claimed_spec: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    held_at: Mapped[datetime | None] = mapped_column(nullable=True)


class ApiKeyRow(Base):
    """A gateway API key: its sha256 (never the key), the models it may use, its rate limits."""

    __tablename__ = "api_keys"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(63))
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    # Model (deployment) names this key may use; ["*"] for every model.
    models: Mapped[list[str]] = mapped_column(JSON)
    rpm: Mapped[int | None] = mapped_column(Integer, nullable=True)
    tpm: Mapped[int | None] = mapped_column(Integer, nullable=True)
    created_at: Mapped[datetime]
    revoked: Mapped[bool] = mapped_column(Boolean, default=False)


class UsageMinuteRow(Base):
    """Gateway usage, summed per minute, API key and model by each gateway before it writes (never
    a row per request). Two gateways add into the same row: the write is an upsert that adds."""

    __tablename__ = "usage_minutes"
    __table_args__ = (Index("ix_usage_minutes_model_minute", "model", "minute"),)

    # The minute's start (UTC, seconds zero).
    minute: Mapped[datetime] = mapped_column(primary_key=True)
    # The API key's id; 0 for requests made without a key (a gateway with auth off).
    key_id: Mapped[int] = mapped_column(Integer, primary_key=True)
    model: Mapped[str] = mapped_column(NAME, primary_key=True)
    requests: Mapped[int] = mapped_column(BigInteger, default=0)
    errors: Mapped[int] = mapped_column(BigInteger, default=0)
    prompt_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    completion_tokens: Mapped[int] = mapped_column(BigInteger, default=0)


class AuditEventRow(Base):
    """One admin action: who (the actor the auth middleware recorded), what, on what, when."""

    __tablename__ = "audit_events"
    __table_args__ = (Index("ix_audit_events_at", "at"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    at: Mapped[datetime]
    # "admin token 3", or "admin token 3 (ui session)"; see server.auth.actor_of.
    actor: Mapped[str] = mapped_column(String(255))
    # apply, delete, cordon, uncordon, drain, key.create, key.revoke, token.create, token.revoke,
    # node.approve, rollout.undo, ...
    action: Mapped[str] = mapped_column(String(63))
    # "Deployment/chat", "Node/gpu-1", "ApiKey/4", ...
    target: Mapped[str] = mapped_column(String(255))
    # What else an operator needs to read the event (never a secret).
    detail: Mapped[dict[str, Any]]
    # The caller's address, when known.
    source: Mapped[str | None] = mapped_column(String(64), nullable=True)


class UiSessionRow(Base):
    """A dashboard login: the sha256 of the session cookie's value (never the value), the admin
    token it was opened with (revoking that token ends the session), its CSRF token's sha256, and
    when it expires."""

    __tablename__ = "ui_sessions"

    session_hash: Mapped[str] = mapped_column(String(64), primary_key=True)
    token_id: Mapped[int] = mapped_column(Integer, ForeignKey("tokens.id", ondelete="CASCADE"), index=True)
    csrf_hash: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime]
    expires_at: Mapped[datetime]


class LeaderLeaseRow(Base):
    __tablename__ = "leader_lease"

    name: Mapped[str] = mapped_column(String(255), primary_key=True)
    holder: Mapped[str] = mapped_column(String(255))
    expires_at: Mapped[datetime]


class FleetChangeRow(Base):
    """The change counter the whole-fleet readers compare before reading (``store.changes``):
    bumped by the database's triggers (migrations 0006 and 0007), never written by the application. Its
    value is the sum of ``n`` over the slots (several on PostgreSQL, so writers do not queue)."""

    __tablename__ = "fleet_changes"

    slot: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    n: Mapped[int] = mapped_column(BigInteger)


def stamp(value: datetime) -> datetime:
    """Check that a passed-in time is timezone-aware, and return it in UTC."""
    if value.tzinfo is None:
        raise ValueError(f"timestamps must be timezone-aware, got {value!r}")
    return value.astimezone(UTC)
