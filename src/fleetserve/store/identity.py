"""Node identity over SQL: enrolment with the join token, per-node credentials bound to a name,
and operator approvals.

The join token only enrols. ``enrol`` issues a random credential (stored as its sha256) bound to
the node's name and registers the node, in one transaction. A name that already has a
credential, or a node an operator declared, is refused until an operator approves the next
enrolment under it (``approve``); a new name is refused too unless the server's policy approves
new names. A refused request is recorded (time, source address) so an operator sees what waits.
Expected refusals are values (``Refused``), not exceptions.

A node's hardware is not its word (``inventory.approval``): every registration — an enrolment, or
a registration again with the node's credential (``reregister``) — is judged against the hardware
the operator approved. An enrolment that finds none recorded approves what it claims; an operator's
``apply`` of a Node approves what it declares (``_approve_hardware``). A claim with more devices,
cores or memory, or another device class, is held: the node stays registered, placed with its
claim cut down to the approved facts, and the claim waits until ``approve`` applies it. Less is
accepted; the approved facts stay the ceiling. Both are written to the audit log
(``node.hardware.held``, ``node.hardware.less``) in the registration's transaction. A node enrolled
before approvals were recorded is judged, at its next registration, against the facts its node row
holds then, which become its approved facts.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from enum import StrEnum

from sqlalchemy import Connection, bindparam, func, select, update
from sqlalchemy.orm import Session

from fleetserve.errors import UnknownNode
from fleetserve.inventory import approval
from fleetserve.inventory.approval import Hardware, HardwareHeld, Verdict, cap
from fleetserve.inventory.base import Registration
from fleetserve.spec.resources import Node
from fleetserve.store.acceptance import (
    ACCEPTED,
    HEARD,
    Claim,
    Judgement,
    accepts,
    array_values,
    claim_arrays,
    claim_values,
    credential_hash,
    judge,
    locked_nodes,
    one_claim,
)
from fleetserve.store.audit import AuditAction
from fleetserve.store.base import doc, node_of
from fleetserve.store.inventory import SqlInventory
from fleetserve.store.tables import AuditEventRow, NodeCredentialRow, NodeRow, stamp

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
    # The hardware approved (None: none recorded yet), and a registration's claim beyond it that
    # waits for ``approve`` (None: nothing waits), since ``held_at``.
    approved_hardware: Hardware | None = None
    claimed_hardware: Hardware | None = None
    held_at: datetime | None = None


@dataclass(frozen=True)
class Approval:
    """What ``approve`` did: the name's identity after it, and the hardware it applied (the claim
    that waited), or None when it let the next enrolment through."""

    record: EnrolmentRecord
    hardware: Hardware | None


# The agents' per-request statements, built once: building one cost more CPU than running it
# (0.35 against 0.27 ms in process, bench/controlplane.py's heartbeat).
_BOUND_NODE = select(NodeCredentialRow.node).where(NodeCredentialRow.token_hash == bindparam("b_hash"))
# Many at once (``server/agents/batching.py`` gathers concurrent calls): which of these hashes are
# whose credential.
_BOUND_NODES = select(NodeCredentialRow.token_hash, NodeCredentialRow.node).where(
    NodeCredentialRow.token_hash.in_(bindparam("b_hashes", expanding=True))
)
_AT = bindparam("b_at", type_=NodeRow.last_heartbeat.type)
# A batch of heartbeats on PostgreSQL, in one statement: every beat whose claim the rule accepts
# (``acceptance.accepts``: the credential is the named node's, the epoch its current one, the
# node Ready) is written, its node's row locked in name order first (``acceptance.locked_nodes``).
_CLAIMS, _CLAIM = claim_arrays(credential=True)
_LOCKED = locked_nodes()
_BEATS = (
    update(NodeRow)
    .where(NodeRow.name == _LOCKED.c.name, accepts(_CLAIM))
    .values(last_heartbeat=_AT, **HEARD)
    .returning(NodeRow.name, NodeRow.epoch, _CLAIMS.c.credential)
)
# One heartbeat, with a credential or without (SQLite: one statement per beat in one transaction,
# in process, no round trip).
_BEAT = {
    credential: update(NodeRow)
    .where(accepts(one_claim(credential)))
    .values(last_heartbeat=_AT, **HEARD)
    .returning(NodeRow.name)
    for credential in (True, False)
}

# A heartbeat is a bare claim: the credential shown, the node and the epoch it speaks for.
Beat = Claim


def _record(row: NodeCredentialRow) -> EnrolmentRecord:
    return EnrolmentRecord(
        row.node,
        row.token_hash is not None,
        row.issued_at,
        row.approved,
        row.requested_at,
        row.requested_from,
        _approved(row),
        _claimed(row),
        row.held_at,
    )


def _approved(row: NodeCredentialRow) -> Hardware | None:
    return None if row.approved_hardware is None else Hardware.model_validate(row.approved_hardware)


def _claimed(row: NodeCredentialRow) -> Hardware | None:
    return None if row.claimed_spec is None else Hardware.of(Node.model_validate(row.claimed_spec))


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
            row.token_hash, row.issued_at, row.approved = credential_hash(plaintext), when, False
            row.requested_at = row.requested_from = None
            s.flush()
            return Enrolled(self._register_claim(s, row, node, when, source), plaintext)

    def reregister(self, node: Node, now: datetime, *, source: str) -> Registration:
        """Register ``node`` again, for the caller holding its credential (from ``source``): its
        claim judged against its approved hardware; a claim beyond it is held (``held`` on the
        answer) and the node registered with the approved facts as its ceiling."""
        when = stamp(now)
        with self._write(f"registering node {node.name}") as s:
            row = s.scalars(
                select(NodeCredentialRow).where(NodeCredentialRow.node == node.name).with_for_update()
            ).one_or_none()
            if row is None or row.token_hash is None:  # deleted since its credential was checked
                raise UnknownNode(f"node {node.name} has no credential any more; it must enrol again")
            return self._register_claim(s, row, node, when, source)

    def _register_claim(
        self, s: Session, row: NodeCredentialRow, node: Node, when: datetime, source: str
    ) -> Registration:
        """Register ``node`` under its identity ``row``: judged, capped and held as the module says."""
        stored = s.get(NodeRow, node.name)
        before = Hardware.of(node_of(stored)) if stored is not None else None
        claim = Hardware.of(node)
        if row.approved_hardware is None:  # first enrolment, or enrolled before approvals were kept
            row.approved_hardware = (before or claim).model_dump(mode="json")
        approved = Hardware.model_validate(row.approved_hardware)
        judged = approval.judge(claim, approved)
        held = None
        placed = node
        if judged.verdict is Verdict.MORE:
            already = _claimed(row)
            row.claimed_spec = doc(node, exclude={"state", "cordon"})
            row.held_at = row.held_at if already == claim else when
            held = HardwareHeld(approved=approved, claimed=claim)
            placed = cap(node, approved)
            if already != claim:
                self._log_claim(
                    s, AuditAction.NODE_HARDWARE_HELD, node.name, held, judged.describe(), when, source
                )
        else:
            row.claimed_spec = row.held_at = None
            if judged.verdict is Verdict.LESS and before != claim:
                less = HardwareHeld(approved=approved, claimed=claim)
                self._log_claim(
                    s, AuditAction.NODE_HARDWARE_LESS, node.name, less, judged.describe(), when, source
                )
        return replace(self._register(s, placed), held=held)

    @staticmethod
    def _log_claim(
        s: Session,
        action: AuditAction,
        name: str,
        claim: HardwareHeld,
        what: str,
        when: datetime,
        source: str,
    ) -> None:
        s.add(
            AuditEventRow(
                at=when, actor=f"node {name}", action=action.value, target=f"Node/{name}",
                detail={**claim.model_dump(mode="json"), "differences": what}, source=source[:64] or None,
            )
        )  # fmt: skip

    @staticmethod
    def _approve_hardware(s: Session, node: Node) -> None:
        """Record ``node``'s facts as its approved hardware (an operator declared them), in the
        caller's transaction; a claim that waited is settled by them."""
        row = s.get(NodeCredentialRow, node.name)
        if row is None:
            row = NodeCredentialRow(node=node.name, approved=False)
            s.add(row)
        row.approved_hardware = Hardware.of(node).model_dump(mode="json")
        row.claimed_spec = row.held_at = None

    @staticmethod
    def _record_request(
        s: Session, row: NodeCredentialRow | None, name: str, when: datetime, source: str
    ) -> None:
        if row is None:
            pending = s.scalar(
                select(func.count())
                .select_from(NodeCredentialRow)
                .where(NodeCredentialRow.token_hash.is_(None), NodeCredentialRow.requested_at.is_not(None))
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
            node: str | None = c.scalar(_BOUND_NODE, {"b_hash": credential_hash(plaintext)})
            return node

    def nodes_for_credentials(self, plaintexts: Sequence[str]) -> list[str | None]:
        """``node_for_credential`` of each, in one statement: per credential, its node or None."""
        hashes = [credential_hash(p) for p in plaintexts]
        if not hashes:
            return []
        with self._single("verifying node credentials", write=False) as c:
            rows = c.execute(_BOUND_NODES, {"b_hashes": sorted(set(hashes))})
            bound = {token_hash: node for token_hash, node in rows if token_hash is not None}
        return [bound.get(h) for h in hashes]

    def beat_with_credential(self, plaintext: str, node: str, epoch: int, now: datetime) -> bool:
        """The agents' most frequent call: record a heartbeat of ``node`` at ``now`` if the rule
        accepts it (``acceptance``); whether it was recorded (``beats`` of one)."""
        return self.beats([Beat(plaintext, node, epoch)], now)[0]

    def beats(self, beats: Sequence[Beat], now: datetime) -> list[bool]:
        """``judge_beats``, told as whether each was recorded."""
        return [judged.accepted for judged in self.judge_beats(beats, now)]

    def judge_beats(self, beats: Sequence[Beat], now: datetime) -> list[Judgement]:
        """Heartbeats from many callers; per beat, the rule's verdict (``acceptance``). A beat the
        rule accepts is recorded; nothing is written for any other, whose verdict is read (rows
        locked) and returned. The accepted ones cost one statement for the whole batch on
        PostgreSQL, one per beat in one transaction on SQLite.

        Each beat is judged on its own: the credential is paired with the node claimed, so a
        batch that holds a node's own beat at a stale epoch and another caller's beat for that
        node at its current one writes nothing for it."""
        if not beats:
            return []
        at = stamp(now)
        out: list[Judgement | None] = [None] * len(beats)
        with self._single(f"recording {len(beats)} heartbeats", write=True) as c:
            together = [i for i, b in enumerate(beats) if b.credential is not None] if self._postgres else []
            if together:
                claims = [beats[i] for i in together]
                values = {**array_values(claims, credential=True), "b_at": at}
                written = {(name, epoch, h) for name, epoch, h in c.execute(_BEATS, values)}
                for i, b in zip(together, claims, strict=True):
                    if (b.node, b.epoch, credential_hash(b.credential or "")) in written:
                        out[i] = ACCEPTED
            alone = set(together)
            for i, b in enumerate(beats):
                if (
                    i not in alone
                    and c.execute(_BEAT[b.credential is not None], {**claim_values(b), "b_at": at}).first()
                ):
                    out[i] = ACCEPTED
            if not self._postgres:  # one transaction (SQLite): the refused are judged in it too
                self._judge_refused(c, beats, out, at)
        if self._postgres and None in out:
            with self._write(f"judging {out.count(None)} refused heartbeats") as s:
                self._judge_refused(s.connection(), beats, out, at)
        return [judged or ACCEPTED for judged in out]

    def _judge_refused(
        self, c: Connection, beats: Sequence[Beat], out: list[Judgement | None], at: datetime
    ) -> None:
        """Fill in the verdicts of the beats not recorded (``None`` in ``out``), their rows locked;
        one that passes now (its row moved between the two statements) is recorded."""
        refused = [i for i, judged in enumerate(out) if judged is None]
        for i, judged in zip(
            refused, judge(c, [beats[i] for i in refused], postgres=self._postgres, lock=True), strict=True
        ):
            if judged.accepted:
                c.execute(_BEAT[beats[i].credential is not None], {**claim_values(beats[i]), "b_at": at})
            out[i] = judged

    def approve(self, name: str, now: datetime) -> Approval:
        """Apply the hardware claim that waits under ``name`` (the node is registered with it as
        claimed, which becomes its approved hardware; no enrolment is let through). With no claim
        waiting: let the next enrolment under ``name`` through (a new name, or one enrolled
        already: the new credential then replaces the old one, which stops working)."""
        stamp(now)
        with self._write(f"approving node {name}") as s:
            row = s.scalars(
                select(NodeCredentialRow).where(NodeCredentialRow.node == name).with_for_update()
            ).one_or_none()
            if row is None:
                row = NodeCredentialRow(node=name, approved=True)
                s.add(row)
            elif row.claimed_spec is not None:
                claimed = Node.model_validate(row.claimed_spec)
                node = s.get(NodeRow, name)
                if node is not None:
                    self._locked_node(s, name).spec = doc(claimed, exclude={"state", "cordon"})
                row.approved_hardware = Hardware.of(claimed).model_dump(mode="json")
                row.claimed_spec = row.held_at = None
                s.flush()
                return Approval(_record(row), Hardware.of(claimed))
            row.approved = True
            s.flush()
            return Approval(_record(row), None)

    def enrolments(self) -> list[EnrolmentRecord]:
        """Every name with a credential, an approval or a request waiting, by name."""
        with self._read("listing enrolments") as s:
            return [_record(r) for r in s.scalars(select(NodeCredentialRow).order_by(NodeCredentialRow.node))]
