"""The endpoints aggregate over SQL: Endpoint documents (servers fleetserve did not start) and the
control plane's last health check of each. No API key is ever stored: the control plane reads it
from the Endpoint's key file when it needs it (``endpointkeys``)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from fleetserve.errors import NotFound
from fleetserve.spec.endpoint import Endpoint, EndpointState
from fleetserve.store.base import SqlBase, doc
from fleetserve.store.tables import EndpointRow, stamp

# The longest last error kept: a check's error says what failed, not a page of the upstream's.
MAX_ERROR = 512


@dataclass(frozen=True)
class StoredEndpoint:
    """An Endpoint as stored: its spec and the control plane's last health check of it."""

    endpoint: Endpoint
    state: EndpointState = EndpointState.UNKNOWN
    last_error: str | None = None
    checked_at: datetime | None = None


def _stored(row: EndpointRow) -> StoredEndpoint:
    return StoredEndpoint(
        Endpoint.model_validate(row.spec), EndpointState(row.state), row.last_error, row.checked_at
    )


class SqlEndpoints(SqlBase):
    """Endpoints and their health, over SQL."""

    def put_endpoint(self, endpoint: Endpoint) -> str:
        """Create or replace an Endpoint; created, configured or unchanged."""
        with self._write(f"storing endpoint {endpoint.name}") as s:
            return self._put_endpoint(s, endpoint)

    def _put_endpoint(self, s: Session, endpoint: Endpoint) -> str:
        spec = doc(endpoint)
        if self._insert_new(s, EndpointRow, name=endpoint.name, spec=spec, state=EndpointState.UNKNOWN.value):
            return "created"
        row = s.scalars(select(EndpointRow).where(EndpointRow.name == endpoint.name).with_for_update()).one()
        if row.spec == spec:
            return "unchanged"
        # A new URL or key file is checked afresh before it is routed again.
        row.spec, row.state, row.last_error = spec, EndpointState.UNKNOWN.value, None
        return "configured"

    def list_endpoints(self) -> list[StoredEndpoint]:
        with self._read("listing endpoints") as s:
            out = [_stored(r) for r in s.scalars(select(EndpointRow))]
        return sorted(out, key=lambda e: e.endpoint.name)

    def get_endpoint(self, name: str) -> StoredEndpoint:
        with self._read(f"reading endpoint {name}") as s:
            row = s.get(EndpointRow, name)
            if row is None:
                raise NotFound(f"no endpoint named {name!r} is stored")
            return _stored(row)

    def delete_endpoint(self, name: str) -> None:
        with self._write(f"deleting endpoint {name}") as s:
            self._delete(s, EndpointRow, name, "endpoint")

    def set_endpoint_health(
        self, name: str, spec: Endpoint, state: EndpointState, error: str | None, now: datetime
    ) -> bool:
        """Record a health check of ``spec`` (the Endpoint as it was checked); whether it was
        recorded (not when the Endpoint was deleted or its spec changed since)."""
        when = stamp(now)
        kept = error[:MAX_ERROR] if error is not None else None
        with self._write(f"recording the health of endpoint {name}") as s:
            row = s.scalars(
                select(EndpointRow).where(EndpointRow.name == name).with_for_update()
            ).one_or_none()
            if row is None or row.spec != doc(spec):
                return False
            row.state, row.last_error, row.checked_at = state.value, kept, when
            return True
