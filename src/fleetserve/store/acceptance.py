"""The agents' accepted-call rule, stated once: a call is accepted when it is made with a node's
credential, names that node, speaks for the node's current registration (epoch), and the node is
not Lost. An accepted call is a heartbeat: it makes a NotReady node Ready again (as a kubelet's
status does), because nothing was moved away from a NotReady node; a Lost node's replicas were
re-placed, so only a registration (a new epoch, which tells its agent what moved) brings it back.

Each condition is one SQL clause over the node's row (``NodeRow``) and the call's claim (node,
epoch, credential hash: bound parameters, or the columns of a batch), paired with the verdict its
failure gives, in the order a refusal is explained:

    condition                                        failing it
    the credential is some node's                    UNKNOWN_CREDENTIAL
    ... and that node is the one named               ANOTHER_NODE
    the named node is registered                     UNKNOWN_NODE
    the claim's epoch is the node's current one      STALE_EPOCH
    the node is not Lost                             NOT_READY

``accepts`` is their conjunction: the WHERE of every statement that writes an accepted call
(heartbeats and status reports, one by one or a whole batch, on SQLite and PostgreSQL alike:
``store/identity.py``, ``store/reports.py``). ``verdict`` is the first condition that fails, for
the read that explains a refusal (``judge``). A call the server makes for itself (a registration's
heartbeat, a test) has no credential: its claim leaves the first two conditions out. Nothing else
spells the rule.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from sqlalchemy import (
    ARRAY,
    ColumnElement,
    Connection,
    FromClause,
    Integer,
    Select,
    String,
    Text,
    and_,
    any_,
    bindparam,
    case,
    cast,
    func,
    literal,
    select,
    true,
)

from fleetserve.spec.resources import NodeState
from fleetserve.store.tables import NodeCredentialRow, NodeRow


class Verdict(StrEnum):
    """What the rule says of one call: accepted, or the first condition it fails."""

    ACCEPTED = "accepted"
    UNKNOWN_CREDENTIAL = "unknown_credential"  # not any node's credential (wrong, retired, deleted)
    ANOTHER_NODE = "another_node"  # a node's credential, naming another node
    UNKNOWN_NODE = "unknown_node"  # the named node is not registered
    STALE_EPOCH = "stale_epoch"  # an older registration of the node
    NOT_READY = "not_ready"  # judged Lost while silent (its replicas moved): it must register again


@dataclass(frozen=True)
class Claim:
    """A call as an agent made it: the credential it showed (None: the server's own call), the
    node and the registration (epoch) it speaks for."""

    credential: str | None
    node: str
    epoch: int


@dataclass(frozen=True)
class Judgement:
    """The rule's verdict on a call, with what explains a refusal: the node the credential is
    bound to (None: none) and the named node's state (None: not registered)."""

    verdict: Verdict
    bound: str | None = None
    state: NodeState | None = None

    @property
    def accepted(self) -> bool:
        return self.verdict is Verdict.ACCEPTED


ACCEPTED = Judgement(Verdict.ACCEPTED)


def credential_hash(plaintext: str) -> str:
    """How a node credential is stored and compared: its sha256, never the credential."""
    return hashlib.sha256(plaintext.encode()).hexdigest()


@dataclass(frozen=True)
class ClaimColumns:
    """A claim as SQL: the node, epoch and credential hash of a call (None: no credential)."""

    node: ColumnElement[str]
    epoch: ColumnElement[int]
    credential: ColumnElement[str] | None


def bound_node(claim: ClaimColumns) -> ColumnElement[str | None]:
    """The node the claim's credential is bound to (NULL: none, or no credential)."""
    if claim.credential is None:
        return literal(None, String)
    return (
        select(NodeCredentialRow.node)
        .where(NodeCredentialRow.token_hash == claim.credential)
        .scalar_subquery()
    )


def conditions(claim: ClaimColumns) -> list[tuple[Verdict, ColumnElement[bool]]]:
    """The rule, condition by condition over ``NodeRow``, each with the verdict its failure gives,
    in the order a refusal is explained (the module's table)."""
    out: list[tuple[Verdict, ColumnElement[bool]]] = []
    if claim.credential is not None:
        bound = bound_node(claim)
        out.append((Verdict.UNKNOWN_CREDENTIAL, bound.is_not(None)))
        out.append((Verdict.ANOTHER_NODE, bound == claim.node))
    out.append((Verdict.UNKNOWN_NODE, NodeRow.name == claim.node))
    out.append((Verdict.STALE_EPOCH, NodeRow.epoch == claim.epoch))
    out.append((Verdict.NOT_READY, NodeRow.state != NodeState.LOST.value))
    return out


# Conditions a later one implies (a credential bound to no node is bound to no node named):
# ``accepts`` leaves them out, so a statement checks the credential once.
_IMPLIED = frozenset({Verdict.UNKNOWN_CREDENTIAL})


def accepts(claim: ClaimColumns) -> ColumnElement[bool]:
    """THE predicate: the node row is the named node's, at the claimed epoch, not Lost, and (with a
    credential) the credential is that node's."""
    return and_(*(condition for v, condition in conditions(claim) if v not in _IMPLIED))


def verdict(claim: ClaimColumns) -> ColumnElement[str]:
    """The verdict as SQL: the first condition that is not true (false, or NULL where the node
    row is missing from an outer join), or ``accepted``."""
    return case(
        *((condition.is_not(true()), literal(v.value)) for v, condition in conditions(claim)),
        else_=literal(Verdict.ACCEPTED.value),
    )


# What every accepted call writes beside its own columns: the node heard from is Ready (a NotReady
# one again; a Ready one unchanged, which no change-counter trigger counts).
HEARD = {"state": NodeState.READY.value}


# --- claims as SQL: one call's bound parameters, or a batch's arrays (PostgreSQL) --------------


def one_claim(credential: bool) -> ClaimColumns:
    """A call's claim as bound parameters ``b_node``, ``b_epoch`` and (with ``credential``)
    ``b_hash``."""
    return ClaimColumns(
        bindparam("b_node", type_=String),
        bindparam("b_epoch", type_=Integer),
        bindparam("b_hash", type_=String) if credential else None,
    )


def claim_values(claim: Claim) -> dict[str, object]:
    """The bound parameters of ``one_claim`` for ``claim``."""
    values: dict[str, object] = {"b_node": claim.node, "b_epoch": claim.epoch}
    if claim.credential is not None:
        values["b_hash"] = credential_hash(claim.credential)
    return values


def claim_arrays(credential: bool, *extra: str) -> tuple[FromClause, ClaimColumns]:
    """A batch of claims as one row each (PostgreSQL: ``unnest`` of the arrays ``b_nodes``,
    ``b_epochs``, ``b_hashes`` with ``credential``, and one TEXT array ``b_<name>`` per ``extra``
    column), numbered from 1 in column ``i``: the statement is built and compiled once, whatever
    the batch's size."""
    arrays = [
        cast(bindparam("b_nodes", type_=ARRAY(Text)), ARRAY(Text)),
        cast(bindparam("b_epochs", type_=ARRAY(Integer)), ARRAY(Integer)),
    ]
    names = ["node", "epoch"]
    if credential:
        arrays.append(cast(bindparam("b_hashes", type_=ARRAY(Text)), ARRAY(Text)))
        names.append("credential")
    for name in extra:
        arrays.append(cast(bindparam(f"b_{name}", type_=ARRAY(Text)), ARRAY(Text)))
        names.append(name)
    table = func.unnest(*arrays).table_valued(*names, with_ordinality="i").render_derived(name="claim")
    columns = ClaimColumns(table.c.node, table.c.epoch, table.c.credential if credential else None)
    return table, columns


def array_values(claims: Sequence[Claim], credential: bool) -> dict[str, object]:
    """The bound parameters of ``claim_arrays`` for ``claims`` (extra columns not included)."""
    values: dict[str, object] = {
        "b_nodes": [c.node for c in claims],
        "b_epochs": [c.epoch for c in claims],
    }
    if credential:
        values["b_hashes"] = [credential_hash(c.credential or "") for c in claims]
    return values


# --- explaining refusals -----------------------------------------------------------------------


def _judging(source: FromClause, claim: ClaimColumns, *first: ColumnElement[Any]) -> Select[*tuple[Any, ...]]:
    return select(*first, verdict(claim), bound_node(claim), NodeRow.state).select_from(
        source.outerjoin(NodeRow, NodeRow.name == claim.node)
    )


def _one_row(credential: bool) -> tuple[FromClause, ClaimColumns]:
    params = one_claim(credential)
    columns: list[ColumnElement[Any]] = [params.node.label("node"), params.epoch.label("epoch")]
    if params.credential is not None:
        columns.append(params.credential.label("credential"))
    row = select(*columns).subquery("claim")
    return row, ClaimColumns(row.c.node, row.c.epoch, row.c.credential if credential else None)


def locked_nodes() -> FromClause:
    """The rows of a batch's named nodes (``b_nodes``, PostgreSQL), locked in name order, as every
    writer of several nodes locks them (allocations: ``SqlInventory``): a batch's UPDATE alone
    locks them in the order its scan meets them, and PostgreSQL then found it in a deadlock with an
    allocation."""
    names = cast(bindparam("b_nodes", type_=ARRAY(Text)), ARRAY(Text))
    return (
        select(NodeRow.name)
        .where(NodeRow.name == any_(names))
        .order_by(NodeRow.name)
        .with_for_update()
        .subquery("locked")
    )


# Built once per shape: a call alone (with or without a credential), and a batch (PostgreSQL).
_JUDGE_ONE = {credential: _judging(*_one_row(credential)) for credential in (True, False)}
_BATCH, _BATCH_CLAIM = claim_arrays(True)
_JUDGE_BATCH = _judging(_BATCH, _BATCH_CLAIM, _BATCH.c.i)
_LOCK = (
    select(NodeRow.name).where(NodeRow.name.in_(bindparam("b_names", expanding=True))).order_by(NodeRow.name)
)


def _judgement(raw: str, bound: str | None, state: str | None) -> Judgement:
    return Judgement(Verdict(raw), bound, None if state is None else NodeState(state))


def judge(
    conn: Connection, claims: Sequence[Claim], *, postgres: bool, lock: bool = False
) -> list[Judgement]:
    """The rule's verdict on each of ``claims`` as the rows stand (with ``lock``, the named nodes'
    rows locked first, in name order, so that a write of the accepted ones in the same
    transaction sees what was judged)."""
    if not claims:
        return []
    if lock:
        conn.execute(_LOCK.with_for_update(), {"b_names": sorted({c.node for c in claims})})
    if postgres and all(c.credential is not None for c in claims):
        rows = conn.execute(_JUDGE_BATCH, array_values(claims, credential=True)).all()
        by_index = {int(i): _judgement(v, b, s) for i, v, b, s in rows}
        return [by_index[i + 1] for i in range(len(claims))]
    out = []
    for claim in claims:
        statement = _JUDGE_ONE[claim.credential is not None]
        raw, bound, state = conn.execute(statement, claim_values(claim)).one()
        out.append(_judgement(raw, bound, state))
    return out
