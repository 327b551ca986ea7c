"""The state store: SQL tables (SQLite file by default, PostgreSQL to share state between
servers), their migrations, one module per aggregate (inventory: classes, fabrics, nodes and the
snapshot, over ``allocation``, which takes replicas onto devices, and ``replicas``, their reads
and states; identity, reports, deployments, credentials, usage, audit, sessions, lease),
``SqlStore`` composing them (``sql``), the agents' accepted-call rule that identity's and
reports' statements share (``acceptance``), and the narrow Protocols consumers depend on
(``protocols``)."""

from fleetserve.store.credentials import ApiKey, IssuedToken, TokenKind, TokenRecord
from fleetserve.store.db import make_engine
from fleetserve.store.deployments import Decision, StoredDeployment
from fleetserve.store.reports import NodeHeartbeat
from fleetserve.store.schema import migrate
from fleetserve.store.sql import SqlStore

__all__ = [
    "ApiKey",
    "Decision",
    "IssuedToken",
    "NodeHeartbeat",
    "SqlStore",
    "StoredDeployment",
    "TokenKind",
    "TokenRecord",
    "make_engine",
    "migrate",
]
