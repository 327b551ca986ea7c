"""The state store: SQL tables (SQLite file by default, PostgreSQL to share state between
servers), their migrations, and ``SqlStore``, which implements the ``Inventory`` and keeps the
control plane's models, deployments, decisions, tokens and leader lease."""

from fleetserve.store.db import make_engine
from fleetserve.store.schema import migrate
from fleetserve.store.sql import (
    Decision,
    IssuedToken,
    NodeHeartbeat,
    SqlStore,
    StoredDeployment,
    TokenKind,
    TokenRecord,
)

__all__ = [
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
