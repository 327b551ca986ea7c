"""The adapters aggregate over SQL: Adapter documents (LoRA adapters on a base model)."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from fleetserve.errors import NotFound
from fleetserve.spec.adapter import Adapter
from fleetserve.store.base import SqlBase, doc
from fleetserve.store.tables import AdapterRow


class SqlAdapters(SqlBase):
    """Adapters, over SQL."""

    def put_adapter(self, adapter: Adapter) -> str:
        """Create or replace an Adapter; created, configured or unchanged."""
        with self._write(f"storing adapter {adapter.name}") as s:
            return self._put_adapter(s, adapter)

    def _put_adapter(self, s: Session, adapter: Adapter) -> str:
        spec = doc(adapter)
        if self._insert_new(s, AdapterRow, name=adapter.name, spec=spec):
            return "created"
        row = s.scalars(select(AdapterRow).where(AdapterRow.name == adapter.name).with_for_update()).one()
        if row.spec == spec:
            return "unchanged"
        row.spec = spec
        return "configured"

    def list_adapters(self) -> list[Adapter]:
        with self._read("listing adapters") as s:
            out = [Adapter.model_validate(r.spec) for r in s.scalars(select(AdapterRow))]
        return sorted(out, key=lambda a: a.name)

    def get_adapter(self, name: str) -> Adapter:
        with self._read(f"reading adapter {name}") as s:
            row = s.get(AdapterRow, name)
            if row is None:
                raise NotFound(f"no adapter named {name!r} is stored")
            return Adapter.model_validate(row.spec)

    def delete_adapter(self, name: str) -> None:
        with self._write(f"deleting adapter {name}") as s:
            self._delete(s, AdapterRow, name, "adapter")
