"""The leader lease over SQL: one server at a time runs the reconciler."""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy import delete, select

from fleetserve.store.base import SqlBase
from fleetserve.store.tables import (
    LeaderLeaseRow,
    stamp,
)


class SqlLease(SqlBase):
    """Leases with a holder and an expiry, over SQL."""

    def try_acquire_leadership(self, name: str, holder: str, now: datetime, ttl: timedelta) -> bool:
        """Take or renew the lease ``name`` for ``holder`` until ``now + ttl``. False while another
        holder's lease has not expired. Call again well within ``ttl`` to keep it."""
        if ttl <= timedelta(0):
            raise ValueError(f"a lease needs a positive ttl, got {ttl}")
        when = stamp(now)
        with self._write(f"acquiring lease {name}") as s:
            if self._insert_new(s, LeaderLeaseRow, name=name, holder=holder, expires_at=when + ttl):
                return True
            row = s.scalars(select(LeaderLeaseRow).where(LeaderLeaseRow.name == name).with_for_update()).one()
            if row.holder != holder and row.expires_at > when:
                return False
            row.holder, row.expires_at = holder, when + ttl
            return True

    def release_leadership(self, name: str, holder: str) -> bool:
        """Give the lease up if ``holder`` has it (so a successor need not wait); whether it did."""
        with self._write(f"releasing lease {name}") as s:
            result = s.connection().execute(
                delete(LeaderLeaseRow).where(LeaderLeaseRow.name == name, LeaderLeaseRow.holder == holder)
            )
            return result.rowcount == 1

    def leader(self, name: str, now: datetime) -> str | None:
        """Who holds the lease ``name`` at ``now``; None if nobody or it expired."""
        when = stamp(now)
        with self._read(f"reading lease {name}") as s:
            row = s.get(LeaderLeaseRow, name)
            return row.holder if row is not None and row.expires_at > when else None
