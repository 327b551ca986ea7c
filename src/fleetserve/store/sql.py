"""The SQL state store: ``SqlStore``, every aggregate over one engine (SQLite or PostgreSQL).

    SqlBase          store/base.py         engine, transactions, converters
    ├── SqlInventory store/inventory.py    classes, fabrics, nodes, snapshot, drain; it derives
    │   │                                  from SqlAllocation (store/allocation.py: replicas taken
    │   │                                  onto devices, released) and SqlReplicas
    │   │                                  (store/replicas.py: replicas read, states, draining)
    │   └── SqlIdentity store/identity.py  enrolment, node credentials, approvals
    ├── SqlReports   store/reports.py      heartbeats, assignments, agents' status reports
    ├── SqlDeployments store/deployments.py  models, deployments, decisions
    ├── SqlEndpoints store/endpoints.py    endpoints fleetserve did not start, their health
    ├── SqlAdapters  store/adapters.py     LoRA adapters on base models
    ├── SqlCredentials store/credentials.py  tokens, API keys
    ├── SqlUsage     store/usage.py        the gateways' usage per minute, key and model
    ├── SqlAudit     store/audit.py        the audit log of admin actions
    ├── SqlSessions  store/sessions.py     the dashboard's login sessions
    └── SqlLease     store/lease.py        the reconciler's lease

Consumers depend on the narrow Protocols of ``store/protocols.py`` (and ``inventory.Inventory``),
not on ``SqlStore``; this module only adds opening, closing and ``apply_documents``, which writes
across aggregates in one transaction.
"""

from __future__ import annotations

from types import TracebackType
from typing import TYPE_CHECKING

from fleetserve.spec.loader import Documents
from fleetserve.store.adapters import SqlAdapters
from fleetserve.store.audit import SqlAudit
from fleetserve.store.base import doc
from fleetserve.store.credentials import SqlCredentials
from fleetserve.store.db import make_engine
from fleetserve.store.deployments import SqlDeployments
from fleetserve.store.endpoints import SqlEndpoints
from fleetserve.store.identity import SqlIdentity
from fleetserve.store.lease import SqlLease
from fleetserve.store.reports import SqlReports
from fleetserve.store.schema import migrate
from fleetserve.store.sessions import SqlSessions
from fleetserve.store.tables import (
    DeviceClassRow,
    FabricRow,
)
from fleetserve.store.usage import SqlUsage

if TYPE_CHECKING:
    import os

    from fleetserve.inventory.base import Inventory


class SqlStore(
    SqlIdentity,
    SqlReports,
    SqlDeployments,
    SqlEndpoints,
    SqlAdapters,
    SqlCredentials,
    SqlUsage,
    SqlAudit,
    SqlSessions,
    SqlLease,
):
    """The state store over a SQLAlchemy engine (SQLite or PostgreSQL), schema already migrated.

    The engine stays the caller's unless the store was made by ``open``; ``close`` disposes it."""

    @classmethod
    def open(cls, url: str | os.PathLike[str] | None = None, *, migrate_schema: bool = True) -> SqlStore:
        """A store over a new engine for ``url`` (see ``make_engine``), migrated unless told not."""
        engine = make_engine(url)
        try:
            if migrate_schema:
                migrate(engine)
        except BaseException:
            engine.dispose()
            raise
        store = cls(engine)
        store._owned = True
        return store

    def close(self) -> None:
        """Dispose of the engine (and its autocommit twin) if this store created it."""
        if self._owned:
            self._engine.dispose()

    def __enter__(self) -> SqlStore:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # --- whole batches -------------------------------------------------------------------

    def apply_documents(self, docs: Documents) -> list[tuple[str, str, str]]:
        """Write classes, fabrics, nodes, models and deployments in ONE transaction (all or
        nothing), and endpoints; per document (kind, name, created|configured|unchanged). Nodes are
        registered (hardware facts updated, cordon kept) and the hardware they declare is approved.
        The caller checks references first."""
        out: list[tuple[str, str, str]] = []
        with self._write(f"applying {sum(1 for _ in docs.all())} documents") as s:
            for cls in docs.classes:
                out.append(("DeviceClass", cls.name, self._put_spec(s, DeviceClassRow, cls.name, doc(cls))))
            for fabric in docs.fabrics:
                out.append(("Fabric", fabric.name, self._put_spec(s, FabricRow, fabric.name, doc(fabric))))
            for node in docs.nodes:
                reg = self._register(s, node)
                self._approve_hardware(s, node)  # what an operator declares is approved
                out.append(("Node", node.name, "created" if reg.created else "configured"))
            for model in docs.models:
                out.append(("Model", model.name, self._put_model(s, model)))
            for adapter in docs.adapters:
                out.append(("Adapter", adapter.name, self._put_adapter(s, adapter)))
            for dep in docs.deployments:
                out.append(("Deployment", dep.name, self._put_deployment(s, dep)[1]))
            for endpoint in docs.endpoints:
                out.append(("Endpoint", endpoint.name, self._put_endpoint(s, endpoint)))
        return out


if TYPE_CHECKING:

    def _conforms(store: SqlStore) -> Inventory:
        return store  # mypy checks that SqlStore implements the Inventory protocol
