"""Node identity over SQL: enrolment with the join token, per-node credentials bound to a name,
and operator approvals.

The join token only enrols. ``enrol`` issues a random credential (stored as its sha256) bound to
the node's name and registers the node, in one transaction. A name that already has a
credential, or a node an operator declared, is refused until an operator approves the next
enrolment under it (``approve``); a new name is refused too unless the server's policy approves
new names. A refused request is recorded (time, source address) so an operator sees what waits.
Expected refusals are values (``Refused``), not exceptions.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum

from sqlalchemy import bindparam, func, select, tuple_, update
from sqlalchemy.orm import Session, aliased

from fleetserve.inventory.base import Registration
from fleetserve.spec.resources import Node, NodeState
from fleetserve.store.inventory import SqlInventory
from fleetserve.store.tables import NodeCredentialRow, NodeRow, stamp

# Enrolment requests of new names kept for an operator to look at; beyond this, not recorded.
MAX_PENDING = 1000
CREDENTIAL_PREFIX = "fs_node_"


class Refusal(StrEnum):
    """Why an enrolment with the join token was refused."""

    NAME_TAKEN = "name_taken"  # the name is enrolled (or declared) already: needs an approval
    APPROVAL_REQUIRED = "approval_required"  # a new name, and new names need an approval


@dataclass(frozen=True)
class Enrolled:
    """An enrolment: the registration, and the node's credential (plaintext, this once)."""

    registration: Registration
    credential: str


@dataclass(frozen=True)
class Refused:
    """An enrolment refused, and why."""

    node: str
    reason: Refusal


@dataclass(frozen=True)
class EnrolmentRecord:
    """A name's identity as an operator sees it (no secret)."""

    node: str
    enrolled: bool
    issued_at: datetime | None
    approved: bool
    requested_at: datetime | None
    requested_from: str | None


# The agents' per-request statements, built once: building one cost more CPU than running it
# (0.35 against 0.27 ms in process, bench/controlplane.py's heartbeat).
_BOUND_NODE = select(NodeCredentialRow.node).where(NodeCredentialRow.token_hash == bindparam("b_hash"))
# Many at once (``server/agents/batching.py`` gathers concurrent calls): which of these hashes are whose
# credential; and the heartbeats of the nodes whose own credential a caller showed, at the epoch
# that caller gave, while Ready (the credential checked again as the row is written: a revocation
# between the two statements writes nothing).
_BOUND_NODES = select(NodeCredentialRow.token_hash, NodeCredentialRow.node).where(
    NodeCredentialRow.token_hash.in_(bindparam("b_hashes", expanding=True))
)
_BEATING = aliased(NodeRow, name="beating")
# The rows are locked in name order before they are written, as every other writer of several
# nodes locks them (allocations: ``SqlInventory``): a batch's UPDATE alone locks them in the order
# its scan meets them, and PostgreSQL then found it in a deadlock with an allocation (one of the two
# aborted, its calls answered again by the route). SQLite has one writer: no lock to order.
_BEAT_LOCKS = (
    select(_BEATING.name)
    .where(
        tuple_(_BEATING.name, _BEATING.epoch).in_(bindparam("b_pairs", expanding=True)),
        _BEATING.name.in_(
            select(NodeCredentialRow.node)
            .where(NodeCredentialRow.token_hash.in_(bindparam("b_hashes", expanding=True)))
            .scalar_subquery()
        ),
        _BEATING.state == NodeState.READY.value,
    )
    .order_by(_BEATING.name)
    .with_for_update()
    .subquery("locked")
)
_BEATS = (
    update(NodeRow)
    .where(NodeRow.name == _BEAT_LOCKS.c.name)
    .values(last_heartbeat=bindparam("b_at", type_=NodeRow.last_heartbeat.type))
    .returning(NodeRow.name, NodeRow.epoch)
)


@dataclass(frozen=True)
class Beat:
    """A heartbeat as an agent sent it: the credential it showed, the node and epoch it claims."""

    credential: str
    node: str
    epoch: int


def _hash(plaintext: str) -> str:
    return hashlib.sha256(plaintext.encode()).hexdigest()


def _record(row: NodeCredentialRow) -> EnrolmentRecord:
    return EnrolmentRecord(
        row.node,
        row.token_hash is not None,
        row.issued_at,
        row.approved,
        row.requested_at,
        row.requested_from,
    )


class SqlIdentity(SqlInventory):
    """Enrolment, node credentials and approvals, over SQL (beside the inventory they register in)."""

    def enrol(self, node: Node, now: datetime, *, approve_new: bool, source: str) -> Enrolled | Refused:
        """Enrol ``node`` (a join-token request from ``source``): issue its credential and register
        it, or refuse (recording the request) when the name needs an operator's approval."""
        when = stamp(now)
        with self._write(f"enrolling node {node.name}") as s:
            row = s.scalars(
                select(NodeCredentialRow).where(NodeCredentialRow.node == node.name).with_for_update()
            ).one_or_none()
            known = (row is not None and row.token_hash is not None) or s.get(NodeRow, node.name) is not None
            approved = row is not None and row.approved
            if not approved and (known or not approve_new):
                self._record_request(s, row, node.name, when, source)
                return Refused(node.name, Refusal.NAME_TAKEN if known else Refusal.APPROVAL_REQUIRED)
            plaintext = f"{CREDENTIAL_PREFIX}{secrets.token_urlsafe(32)}"
            if row is None:
                row = NodeCredentialRow(node=node.name, approved=False)
                s.add(row)
            row.token_hash, row.issued_at, row.approved = _hash(plaintext), when, False
            row.requested_at = row.requested_from = None
            s.flush()
            return Enrolled(self._register(s, node), plaintext)

    @staticmethod
    def _record_request(
        s: Session, row: NodeCredentialRow | None, name: str, when: datetime, source: str
    ) -> None:
        if row is None:
            pending = s.scalar(
                select(func.count())
                .select_from(NodeCredentialRow)
                .where(NodeCredentialRow.token_hash.is_(None))
            )
            if (pending or 0) >= MAX_PENDING:
                return
            row = NodeCredentialRow(node=name, approved=False)
            s.add(row)
        row.requested_at, row.requested_from = when, source[:64]

    def node_for_credential(self, plaintext: str) -> str | None:
        """The node a credential is bound to, or None (unknown or revoked). Asked on every agent
        request: one indexed statement, no ORM session, nothing kept (a revocation or a deletion
        holds from the next request on, on every server)."""
        with self._single("verifying a node credential", write=False) as c:
            node: str | None = c.scalar(_BOUND_NODE, {"b_hash": _hash(plaintext)})
            return node

    def nodes_for_credentials(self, plaintexts: Sequence[str]) -> list[str | None]:
        """``node_for_credential`` of each, in one statement: per credential, its node or None."""
        hashes = [_hash(p) for p in plaintexts]
        bound = self._bound_nodes(hashes)
        return [bound.get(h) for h in hashes]

    def _bound_nodes(self, hashes: Sequence[str]) -> dict[str, str]:
        """Per credential hash among ``hashes``, the node it is bound to (unknown ones left out)."""
        if not hashes:
            return {}
        with self._single("verifying node credentials", write=False) as c:
            rows = c.execute(_BOUND_NODES, {"b_hashes": sorted(set(hashes))})
            return {token_hash: node for token_hash, node in rows if token_hash is not None}

    def beat_with_credential(self, plaintext: str, node: str, epoch: int, now: datetime) -> bool:
        """The agents' most frequent call: record a heartbeat of ``node`` at ``now`` if
        ``plaintext`` is the node's own credential, ``epoch`` its registration and the node
        Ready; whether it was recorded (``beats`` of one)."""
        return self.beats([Beat(plaintext, node, epoch)], now)[0]

    def beats(self, beats: Sequence[Beat], now: datetime) -> list[bool]:
        """Heartbeats from many callers in two statements; per beat, whether it was recorded. A
        beat is recorded only if its credential is the claimed node's own, its epoch the node's
        registration and the node Ready; nothing is written otherwise, and nothing said why (the
        caller then asks ``node_for_credential`` and ``heartbeat`` for the answer to give).

        Each beat is judged on its own: the credential is paired with the node claimed before
        anything is written, so a batch that holds a node's own beat at a stale epoch and another
        caller's beat for that node at its current one writes nothing for it."""
        if not beats:
            return []
        hashes = [_hash(b.credential) for b in beats]
        bound = self._bound_nodes(hashes)
        own = [i for i, (b, h) in enumerate(zip(beats, hashes, strict=True)) if bound.get(h) == b.node]
        if not own:
            return [False] * len(beats)
        values = {
            "b_pairs": sorted({(beats[i].node, beats[i].epoch) for i in own}),
            "b_hashes": sorted({hashes[i] for i in own}),
            "b_at": stamp(now),
        }
        with self._single(f"recording {len(own)} heartbeats", write=True) as c:
            written = {(name, epoch) for name, epoch in c.execute(_BEATS, values)}
        recorded = [False] * len(beats)
        for i in own:
            recorded[i] = (beats[i].node, beats[i].epoch) in written
        return recorded

    def approve(self, name: str, now: datetime) -> EnrolmentRecord:
        """Let the next enrolment under ``name`` through (a new name, or one enrolled already:
        the new credential then replaces the old one, which stops working)."""
        stamp(now)
        with self._write(f"approving the enrolment of node {name}") as s:
            row = s.get(NodeCredentialRow, name)
            if row is None:
                row = NodeCredentialRow(node=name, approved=True)
                s.add(row)
            row.approved = True
            s.flush()
            return _record(row)

    def enrolments(self) -> list[EnrolmentRecord]:
        """Every name with a credential, an approval or a request waiting, by name."""
        with self._read("listing enrolments") as s:
            return [_record(r) for r in s.scalars(select(NodeCredentialRow).order_by(NodeCredentialRow.node))]
