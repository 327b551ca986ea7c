"""Allocation over SQL: replicas taken whole onto their nodes' devices, cores and memory; released.

An allocation locks the rows of the nodes it touches (in name order, so two allocations never
deadlock), then checks free capacity, then inserts its device rows — whose primary key
(node, device_index) makes the database refuse a doubly allocated device even if every check above
were wrong. ``allocate_all`` takes many replicas in batches with the same guarantees; ``release``
gives one back (its shards and device rows go with it).
"""

from __future__ import annotations

from collections.abc import Sequence
from types import MappingProxyType

from sqlalchemy import delete, func, insert, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from fleetserve.errors import AllocationConflict, StoreError, UnknownReplica
from fleetserve.inventory.base import allocate_each
from fleetserve.placement.state import WorkingState
from fleetserve.routing import new_engine_key
from fleetserve.snapshot import ClusterSnapshot, replica_ordinal
from fleetserve.spec.resources import Replica
from fleetserve.store.base import IN_CHUNK, SqlBase, doc, node_of, replica_of
from fleetserve.store.db import describe
from fleetserve.store.tables import (
    DeviceAllocationRow,
    NodeRow,
    ReplicaOrdinalRow,
    ReplicaRow,
    ReplicaShardRow,
)

# Replicas per transaction in ``allocate_all``: short enough that nodes stay locked only briefly.
ALLOCATE_BATCH = 200


class _BatchRefused(StoreError):
    """The database refused a batch the checks accepted (a concurrent writer): take it one by one."""


class SqlAllocation(SqlBase):
    """Replicas taken whole onto their nodes (locked, checked, keyed) and given back, over SQL."""

    def allocate(self, replica: Replica) -> None:
        names = sorted({shard.node for shard in replica.shards})
        with self._write(f"allocating replica {replica.name}") as s:
            # Lock the nodes first: concurrent allocations on them wait here, then see our rows.
            rows = s.scalars(
                select(NodeRow).where(NodeRow.name.in_(names)).order_by(NodeRow.name).with_for_update()
            ).all()
            if s.get(ReplicaRow, replica.name) is not None:
                raise AllocationConflict(f"replica {replica.name} is already allocated")
            self._free_capacity(s, rows).check(replica)
            epochs = {row.name: row.epoch for row in rows}
            conn = s.connection()
            try:
                conn.execute(
                    insert(ReplicaRow).values(
                        name=replica.name,
                        deployment=replica.deployment,
                        profile=replica.profile,
                        spec=doc(replica, exclude={"state"}),
                        state=replica.state.value,
                        engine_key=new_engine_key(),
                    )
                )
                conn.execute(
                    insert(ReplicaShardRow),
                    [
                        {
                            "replica": replica.name,
                            "shard": i,
                            "node": shard.node,
                            "cpu_cores": shard.cpu_cores,
                            "memory": shard.memory,
                            "node_epoch": epochs[shard.node],
                        }
                        for i, shard in enumerate(replica.shards)
                    ],
                )
                devices = [
                    {"node": shard.node, "device_index": index, "replica": replica.name}
                    for shard in replica.shards
                    for index in shard.devices
                ]
                if devices:
                    conn.execute(insert(DeviceAllocationRow), devices)
                ordinal = replica_ordinal(replica.deployment, replica.name)
                if ordinal is not None:
                    self._bump_ordinal(s, replica.deployment, ordinal + 1)
            except IntegrityError as exc:
                raise AllocationConflict(
                    f"replica {replica.name}: taken concurrently by another allocation ({describe(exc)})"
                ) from exc

    def allocate_all(self, replicas: Sequence[Replica]) -> list[AllocationConflict | None]:
        """Take each replica whole, in order, ``ALLOCATE_BATCH`` to a transaction; per replica,
        None or the conflict that refused it (it then takes nothing).

        One transaction per replica cost a cycle ten round trips each, which at thousands of new
        replicas made the commit phase the longest of a cycle (``bench/controlplane.py``). Within a
        batch every replica is checked against the capacity the ones before it left, exactly as
        one ``allocate`` after another would be; the database's keys still refuse a device taken
        twice, and should that ever fire, the batch is rolled back and taken one by one."""
        out: list[AllocationConflict | None] = []
        for i in range(0, len(replicas), ALLOCATE_BATCH):
            batch = replicas[i : i + ALLOCATE_BATCH]
            try:
                with self._write(f"allocating {len(batch)} replicas") as s:
                    out += self._allocate_batch(s, batch)
            except _BatchRefused:
                out += allocate_each(self.allocate, batch)
        return out

    def _allocate_batch(self, s: Session, batch: Sequence[Replica]) -> list[AllocationConflict | None]:
        names = sorted({shard.node for replica in batch for shard in replica.shards})
        rows: list[NodeRow] = []
        for i in range(0, len(names), IN_CHUNK):
            # Lock the nodes first, in name order (chunks are in order too): no deadlock with others.
            chunk = names[i : i + IN_CHUNK]
            query = select(NodeRow).where(NodeRow.name.in_(chunk)).order_by(NodeRow.name).with_for_update()
            rows += s.scalars(query).all()
        wanted = [replica.name for replica in batch]
        existing: set[str] = set()
        for i in range(0, len(wanted), IN_CHUNK):
            chunk = wanted[i : i + IN_CHUNK]
            existing |= set(s.scalars(select(ReplicaRow.name).where(ReplicaRow.name.in_(chunk))))
        state = self._free_capacity(s, rows)
        epochs = {row.name: row.epoch for row in rows}
        outcomes: list[AllocationConflict | None] = []
        taken: list[Replica] = []
        for replica in batch:
            try:
                if replica.name in existing:
                    raise AllocationConflict(f"replica {replica.name} is already allocated")
                state.allocate(replica)  # checks against what the batch took before it
            except AllocationConflict as exc:
                outcomes.append(exc)
                continue
            existing.add(replica.name)
            taken.append(replica)
            outcomes.append(None)
        if not taken:
            return outcomes
        conn = s.connection()
        replica_rows = [
            {
                "name": r.name,
                "deployment": r.deployment,
                "profile": r.profile,
                "spec": doc(r, exclude={"state"}),
                "state": r.state.value,
                "engine_key": new_engine_key(),
            }
            for r in taken
        ]
        shard_rows = [
            {
                "replica": r.name,
                "shard": i,
                "node": shard.node,
                "cpu_cores": shard.cpu_cores,
                "memory": shard.memory,
                "node_epoch": epochs[shard.node],
            }
            for r in taken
            for i, shard in enumerate(r.shards)
        ]
        devices = [
            {"node": shard.node, "device_index": index, "replica": r.name}
            for r in taken
            for shard in r.shards
            for index in shard.devices
        ]
        ordinals: dict[str, int] = {}
        for r in taken:
            ordinal = replica_ordinal(r.deployment, r.name)
            if ordinal is not None:
                ordinals[r.deployment] = max(ordinals.get(r.deployment, 0), ordinal + 1)
        try:
            conn.execute(insert(ReplicaRow), replica_rows)
            conn.execute(insert(ReplicaShardRow), shard_rows)
            if devices:
                conn.execute(insert(DeviceAllocationRow), devices)
            for deployment, at_least in sorted(ordinals.items()):
                self._bump_ordinal(s, deployment, at_least)
        except IntegrityError as exc:
            raise _BatchRefused(describe(exc)) from exc
        return outcomes

    def _bump_ordinal(self, s: Session, deployment: str, at_least: int) -> None:
        dialect_insert = postgresql.insert if self._postgres else sqlite.insert
        stmt = dialect_insert(ReplicaOrdinalRow).values(deployment=deployment, next_ordinal=at_least)
        s.connection().execute(
            stmt.on_conflict_do_update(
                index_elements=["deployment"],
                set_={"next_ordinal": func.max(ReplicaOrdinalRow.next_ordinal, stmt.excluded.next_ordinal)}
                if not self._postgres
                else {
                    "next_ordinal": func.greatest(ReplicaOrdinalRow.next_ordinal, stmt.excluded.next_ordinal)
                },
            )
        )

    @staticmethod
    def _free_capacity(session: Session, rows: Sequence[NodeRow]) -> WorkingState:
        """The free devices, cores and memory of the locked nodes, as a ``WorkingState``."""
        state = WorkingState(ClusterSnapshot(classes=MappingProxyType({}), nodes=tuple(map(node_of, rows))))
        all_names = [row.name for row in rows]
        for i in range(0, len(all_names), IN_CHUNK):
            names = all_names[i : i + IN_CHUNK]
            taken = select(DeviceAllocationRow.node, DeviceAllocationRow.device_index).where(
                DeviceAllocationRow.node.in_(names)
            )
            for node, index in session.execute(taken):
                work = state.by_name[node]
                cls = work.class_of.get(index)
                if cls is not None and cls in work.free:
                    work.free[cls].discard(index)
            used = (
                select(
                    ReplicaShardRow.node,
                    func.sum(ReplicaShardRow.cpu_cores),
                    func.sum(ReplicaShardRow.memory),
                )
                .where(ReplicaShardRow.node.in_(names))
                .group_by(ReplicaShardRow.node)
            )
            for node, cores, memory in session.execute(used):
                state.by_name[node].used_cores = int(cores or 0)
                state.by_name[node].used_memory = int(memory or 0)
        return state

    def release(self, name: str) -> Replica:
        with self._write(f"releasing replica {name}") as s:
            # Shards and device rows go with it (ON DELETE CASCADE).
            row = (
                s.connection()
                .execute(
                    delete(ReplicaRow)
                    .where(ReplicaRow.name == name)
                    .returning(ReplicaRow.spec, ReplicaRow.state)
                )
                .one_or_none()
            )
            if row is None:
                raise UnknownReplica(f"no replica named {name!r} is allocated")
            return replica_of(row.spec, row.state)
