"""The allocated replicas over SQL: reading them, their state in life, the node epochs they were
placed at (fencing), and turning them Draining.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from fleetserve.errors import UnknownReplica
from fleetserve.spec.resources import Replica, ReplicaState
from fleetserve.store.base import SqlBase, replica_of
from fleetserve.store.tables import ReplicaRow, ReplicaShardRow, stamp


class SqlReplicas(SqlBase):
    """Reads and state changes of allocated replicas, over SQL."""

    def replicas(self, deployment: str | None = None) -> list[Replica]:
        """Every allocated replica (of one deployment, if named), by name."""
        query = select(ReplicaRow)
        if deployment is not None:
            query = query.where(ReplicaRow.deployment == deployment)
        with self._read("listing replicas") as s:
            out = [replica_of(r.spec, r.state) for r in s.scalars(query)]
        return sorted(out, key=lambda r: r.name)

    def get_replica(self, name: str) -> Replica:
        with self._read(f"reading replica {name}") as s:
            row = s.get(ReplicaRow, name)
            if row is None:
                raise UnknownReplica(f"no replica named {name!r} is allocated")
            return replica_of(row.spec, row.state)

    def set_replica_state(self, name: str, state: ReplicaState) -> Replica:
        """Record where a replica is in its life; raises UnknownReplica."""
        with self._write(f"setting replica {name} {state}") as s:
            row = s.scalars(select(ReplicaRow).where(ReplicaRow.name == name).with_for_update()).one_or_none()
            if row is None:
                raise UnknownReplica(f"no replica named {name!r} is allocated")
            row.state = ReplicaState(state).value
            return replica_of(row.spec, row.state)

    def placement_epochs(self, name: str) -> dict[str, int]:
        """Per node of the replica, the node's epoch when the replica was placed (fencing)."""
        with self._read(f"reading replica {name}") as s:
            if s.get(ReplicaRow, name) is None:
                raise UnknownReplica(f"no replica named {name!r} is allocated")
            rows = s.execute(
                select(ReplicaShardRow.node, ReplicaShardRow.node_epoch).where(
                    ReplicaShardRow.replica == name
                )
            )
            return {node: epoch for node, epoch in rows}

    def stamp_revision(self, names: Sequence[str], revision: str) -> list[str]:
        """Record ``revision`` as the one replicas ``names`` were placed for (replicas placed before
        the revision counted the weights, taken as current: ``reconcile.lifecycle``); the names
        that were allocated. Nothing else of a replica's document changes."""
        with self._write("stamping replica revisions") as s:
            query = select(ReplicaRow).where(ReplicaRow.name.in_(list(names))).with_for_update()
            rows = s.scalars(query).all()
            for row in rows:
                row.spec = {**row.spec, "revision": revision}
            done = sorted(row.name for row in rows)
        self._replica_docs.forget(done)
        return done

    def start_draining(self, names: Sequence[str], now: datetime) -> list[str]:
        """Turn replicas Draining (out of every route) from ``now``, in one transaction; the names
        that were allocated and not already draining."""
        when = stamp(now)
        with self._write("draining replicas") as s:
            return self._start_draining(s, names, when)

    @staticmethod
    def _start_draining(s: Session, names: Sequence[str], when: datetime) -> list[str]:
        rows = s.scalars(
            select(ReplicaRow)
            .where(ReplicaRow.name.in_(list(names)), ReplicaRow.state != ReplicaState.DRAINING.value)
            .with_for_update()
        ).all()
        for row in rows:
            row.state, row.draining_since = ReplicaState.DRAINING.value, when
        s.flush()  # before any Core statement of the same transaction reads the states
        return sorted(row.name for row in rows)
