"""The narrow views of the state store its consumers depend on, as ``inventory.Inventory`` is.

Each consumer names the few methods it calls, so a test can hand it an in-memory fake instead of
a database, and ``SqlStore`` is checked (below) to provide every view. They live together here,
beside the store that implements them, because several consumers share views (the gateway and
the observer both read routes); each is small enough to fake in a few lines.

    RouteSource      the gateway's endpoint table     deployments + replica endpoints + Endpoints
    EndpointHealth   the Endpoints' health checks     Endpoints, and their health recorded
    ApiKeys          the gateway's key check          verify an API key
    AgentReports     the observer                     routes + the agents' GPU samples
    Tokens           auth, token bootstrap            verify, create, list tokens; node credentials
    Sessions         auth, the dashboard's login      open, check, end dashboard sessions
    AdminAuth        auth                             Tokens + Sessions
    Deployments      the reconciler                   models, deployments, status, decisions
    Heartbeats       the reconciler                   when each node was last heard from
    Lease            the reconciler                   one leader among servers
    Drains           the reconciler                   turn replicas Draining (out of the routes)
    AssignmentSource held assignment polls            what every node's assignments are built from
    AssignmentReads  the agents' API                  what one node's assignment set is built from
    NodeCredentials  the agents' door                 whose credential a token is; is it a join token
    AgentCalls       the agents' door                 judge and write heartbeats and status reports
    AgentDoorStore   the agents' door                 the three above
    ReconcilerStore  the reconciler                   Inventory + the four above
    UsageSink        the gateway's usage flush        add counts per minute, key and model
    AuditLog         the admin API                    record an admin action
    Retention        the server's pruning             drop old usage and audit events
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Protocol

from fleetserve.inventory.base import Inventory
from fleetserve.protocol import AgentStatus
from fleetserve.reconcile.health import Transition
from fleetserve.routing import ReplicaEndpoint
from fleetserve.spec.adapter import Adapter
from fleetserve.spec.endpoint import Endpoint, EndpointState
from fleetserve.spec.resources import DeviceClass, Model, Node, Replica
from fleetserve.spec.status import DecisionRecord, DeploymentStatus
from fleetserve.store.acceptance import Claim, Judgement
from fleetserve.store.audit import AuditEntry
from fleetserve.store.credentials import ApiKey, IssuedToken, TokenKind, TokenRecord
from fleetserve.store.deployments import StoredDeployment
from fleetserve.store.endpoints import StoredEndpoint
from fleetserve.store.reports import AgentReport, AssignmentInputs, NodeHeartbeat
from fleetserve.store.sessions import OpenedSession, UiSession
from fleetserve.store.usage import UsageRecord

if TYPE_CHECKING:
    from fleetserve.store.sql import SqlStore


class RouteSource(Protocol):
    """What the gateway's endpoint table reads: the deployments and where their replicas are."""

    def list_deployments(self) -> list[StoredDeployment]: ...

    def replica_endpoints(self) -> list[ReplicaEndpoint]: ...

    def list_endpoints(self) -> list[StoredEndpoint]: ...

    def fleet_changes(self) -> int: ...


class EndpointHealth(Protocol):
    """What the control plane's Endpoint health checks read and write."""

    def list_endpoints(self) -> list[StoredEndpoint]: ...

    def set_endpoint_health(
        self, name: str, spec: Endpoint, state: EndpointState, error: str | None, now: datetime
    ) -> bool: ...


class ApiKeys(Protocol):
    """What the gateway checks a request's API key against."""

    def verify_api_key(self, plaintext: str) -> ApiKey | None: ...


class GatewayStore(RouteSource, ApiKeys, Protocol):
    """Everything a gateway reads: routes and API keys."""


class AgentReports(RouteSource, Protocol):
    """What the observer reads: the routes, and the GPU samples agents reported."""

    def agent_statuses(self) -> dict[str, AgentStatus]: ...


class Tokens(Protocol):
    """Admin and join tokens and node credentials: checked on every request, created on first start."""

    def verify_token(self, plaintext: str, kind: TokenKind, now: datetime | None = None) -> bool: ...

    def token_id_for(self, plaintext: str, kind: TokenKind, now: datetime | None = None) -> int | None: ...

    def create_token(
        self, kind: TokenKind, now: datetime, expires_at: datetime | None = None
    ) -> IssuedToken: ...

    def list_tokens(self) -> list[TokenRecord]: ...

    def node_for_credential(self, plaintext: str) -> str | None: ...


class Sessions(Protocol):
    """The dashboard's login sessions: opened with an admin token, checked on every request."""

    def open_session(self, token_id: int, now: datetime, ttl: timedelta) -> OpenedSession: ...

    def check_session(self, cookie: str, now: datetime | None = None) -> UiSession | None: ...

    def end_session(self, cookie: str) -> bool: ...

    def prune_sessions(self, now: datetime) -> int: ...


class AdminAuth(Tokens, Sessions, Protocol):
    """What the admin API's token check reads: admin tokens, and the dashboard's sessions."""


class Deployments(Protocol):
    """The deployments and models the reconciler drives, their status and its decisions."""

    def list_deployments(self) -> list[StoredDeployment]: ...

    def list_models(self) -> list[Model]: ...

    def list_adapters(self) -> list[Adapter]: ...

    def set_deployment_status(self, name: str, status: DeploymentStatus) -> None: ...

    def record_decision(self, deployment: str, explanation: DecisionRecord, now: datetime) -> int: ...


class Heartbeats(Protocol):
    """When each node's agent was last heard from."""

    def node_heartbeats(self) -> list[NodeHeartbeat]: ...

    def mark_silent(self, changes: Sequence[Transition]) -> list[str]: ...


class Lease(Protocol):
    """A lease one holder at a time has: the reconciler's leadership among servers."""

    def try_acquire_leadership(self, name: str, holder: str, now: datetime, ttl: timedelta) -> bool: ...

    def release_leadership(self, name: str, holder: str) -> bool: ...


class Drains(Protocol):
    """Taking replicas out of every route before they are released (a drain)."""

    def start_draining(self, names: Sequence[str], now: datetime) -> list[str]: ...


class Stamps(Protocol):
    """Recording the current revision on replicas placed before the revision counted the weights."""

    def stamp_revision(self, names: Sequence[str], revision: str) -> list[str]: ...


class AssignmentSource(Protocol):
    """What wakes held assignment polls: the inputs of every node's assignments, in one read."""

    def assignment_inputs(self) -> AssignmentInputs: ...

    def fleet_changes(self) -> int: ...


class AssignmentReads(Protocol):
    """What one node's assignment set is built from: its replicas and what they name."""

    def assignments(self, node: str) -> list[Replica]: ...

    def device_classes(self) -> dict[str, DeviceClass]: ...

    def node_addresses(self, names: Sequence[str]) -> dict[str, str]: ...

    def engine_keys(self, replicas: Sequence[str]) -> dict[str, str]: ...

    def get_deployment(self, name: str) -> StoredDeployment: ...

    def get_model(self, name: str) -> Model: ...

    def get_adapter(self, name: str) -> Adapter: ...


class NodeCredentials(Protocol):
    """Whose credential each token is, and whether a token is the join token (a 401 says which)."""

    def nodes_for_credentials(self, plaintexts: Sequence[str]) -> list[str | None]: ...

    def verify_token(self, plaintext: str, kind: TokenKind, now: datetime | None = None) -> bool: ...


class AgentCalls(Protocol):
    """The agents' calls under the accepted-call rule (``store/acceptance.py``): judged, and
    written when accepted; and the node a status report's GPU samples must be of."""

    def judge(self, claims: Sequence[Claim]) -> list[Judgement]: ...

    def judge_beats(self, beats: Sequence[Claim], now: datetime) -> list[Judgement]: ...

    def judge_reports(self, batch: Sequence[AgentReport], now: datetime) -> list[list[str] | Judgement]: ...

    def get_node(self, name: str) -> Node: ...


class AgentDoorStore(NodeCredentials, AgentCalls, AssignmentReads, Protocol):
    """Everything the agents' door reads and writes."""


class ReconcilerStore(Inventory, Deployments, Heartbeats, Lease, Drains, Stamps, Protocol):
    """Everything the reconciler reads and writes."""

    def fleet_changes(self) -> int: ...


class UsageSink(Protocol):
    """Where a gateway writes the usage it counted: added into the rows per minute, key and model."""

    def add_usage(self, records: Sequence[UsageRecord], now: datetime) -> int: ...


class AuditLog(Protocol):
    """Where the admin API records what admins did."""

    def record_events(self, entries: Sequence[AuditEntry], now: datetime) -> None: ...


class Retention(Protocol):
    """Dropping usage and audit events older than their retention."""

    def prune_usage(self, older_than: datetime) -> int: ...

    def prune_events(self, older_than: datetime) -> int: ...


if TYPE_CHECKING:

    def _conforms(
        store: SqlStore,
    ) -> tuple[
        GatewayStore,
        AgentReports,
        Tokens,
        Sessions,
        ReconcilerStore,
        AssignmentSource,
        AgentDoorStore,
        UsageSink,
        AuditLog,
        Retention,
        EndpointHealth,
    ]:
        # mypy checks that SqlStore provides every view
        return store, store, store, store, store, store, store, store, store, store, store
