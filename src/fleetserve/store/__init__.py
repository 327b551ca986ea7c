"""The state store: SQL tables (SQLite file by default, PostgreSQL to share state between
servers), their migrations, one module per aggregate (inventory, reports, deployments,
credentials, lease), ``SqlStore`` composing them, and the narrow Protocols consumers depend on
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
