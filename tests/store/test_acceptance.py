"""The agents' accepted-call rule (``store/acceptance.py``), pinned by one table over (credential,
node, epoch, node state), on SQLite and PostgreSQL.

Every row is judged the three ways the store applies the rule: the read that explains a refusal
(``judge``), a heartbeat (``judge_beats``: written exactly when accepted) and a status report
(``judge_reports``); each gives the row's verdict, alone and in one batch with every other row.

The fleet: n1 (Ready, registered twice: epoch 2), n2 (Ready, epoch 1), n3 (NotReady: a call at its
epoch is accepted and makes it Ready), n4 (Lost: must register again),
n5 (enrolled again: its first credential retired), and a credential bound to "ghost", a name
with no node.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime

import pytest

from builders import cpu_8c_32g
from fleetserve.spec.resources import NodeState
from fleetserve.store import SqlStore, TokenKind
from fleetserve.store.acceptance import Claim, Verdict
from fleetserve.store.identity import Enrolled
from fleetserve.store.reports import AgentReport
from fleetserve.store.tables import NodeCredentialRow

T0 = datetime(2026, 1, 1, tzinfo=UTC)
T1 = datetime(2026, 1, 1, 0, 1, tzinfo=UTC)


@dataclass(frozen=True)
class Row:
    """One case: whose credential is shown, the node and epoch it names, and the verdict."""

    case: str
    credential: str | None  # a node's name (its credential), "retired n5", "made-up", "join", None
    node: str
    epoch: int
    verdict: Verdict


ROWS = [
    Row("n1's credential naming n1 at its current epoch, Ready, is accepted", "n1", "n1", 2, Verdict.ACCEPTED),
    Row("n1's credential naming n1 at its older epoch is stale", "n1", "n1", 1, Verdict.STALE_EPOCH),
    Row("n1's credential naming n1 at an epoch it never had is stale", "n1", "n1", 3, Verdict.STALE_EPOCH),
    Row("n1's credential naming n2 at n2's current epoch speaks for another node", "n1", "n2", 1,
        Verdict.ANOTHER_NODE),
    Row("n1's credential naming a node never registered speaks for another node", "n1", "nobody", 1,
        Verdict.ANOTHER_NODE),
    Row("a made-up credential naming n1 at its epoch is no credential", "made-up", "n1", 2,
        Verdict.UNKNOWN_CREDENTIAL),
    Row("the join token naming n1 at its epoch is no node credential", "join", "n1", 2, Verdict.UNKNOWN_CREDENTIAL),
    Row("n5's retired credential naming n5 at its new epoch is no credential", "retired n5", "n5", 2,
        Verdict.UNKNOWN_CREDENTIAL),
    Row("n5's new credential naming n5 at its new epoch is accepted", "n5", "n5", 2, Verdict.ACCEPTED),
    Row("n5's new credential naming n5 at its first epoch is stale", "n5", "n5", 1, Verdict.STALE_EPOCH),
    Row("n3's credential naming n3, NotReady, at its epoch is accepted (and makes it Ready)", "n3", "n3", 1,
        Verdict.ACCEPTED),
    Row("n4's credential naming n4, Lost, at its epoch must register again", "n4", "n4", 1, Verdict.NOT_READY),
    Row("n3's credential naming n3, NotReady, at a stale epoch is stale first", "n3", "n3", 9, Verdict.STALE_EPOCH),
    Row("a credential bound to a name with no node names an unknown node", "ghost", "ghost", 1,
        Verdict.UNKNOWN_NODE),
    Row("the server's own call for n1 at its epoch (no credential) is accepted", None, "n1", 2, Verdict.ACCEPTED),
    Row("the server's own call for n1 at an older epoch is stale", None, "n1", 1, Verdict.STALE_EPOCH),
    Row("the server's own call for n3, NotReady, is accepted", None, "n3", 1, Verdict.ACCEPTED),
    Row("the server's own call for n4, Lost, must register again", None, "n4", 1, Verdict.NOT_READY),
    Row("the server's own call for a node never registered names an unknown node", None, "nobody", 1,
        Verdict.UNKNOWN_NODE),
]  # fmt: skip


@pytest.fixture
def fleet(store: SqlStore) -> dict[str, str | None]:
    """The module's fleet in ``store``; per row credential name, the plaintext shown."""
    shown: dict[str, str | None] = {None: None}  # type: ignore[dict-item]
    for name in ("n1", "n2", "n3", "n4", "n5"):
        got = store.enrol(cpu_8c_32g(name), T0, approve_new=True, source="10.0.0.1")
        assert isinstance(got, Enrolled)
        shown[name] = got.credential
    store.register(cpu_8c_32g("n1"))  # epoch 2
    store.set_state("n3", NodeState.NOT_READY)
    store.set_state("n4", NodeState.LOST)
    store.approve("n5", T0)
    again = store.enrol(cpu_8c_32g("n5"), T0, approve_new=False, source="10.0.0.1")
    assert isinstance(again, Enrolled)
    shown["retired n5"], shown["n5"] = shown["n5"], again.credential
    shown["made-up"] = "fs_node_" + "A" * 43
    shown["join"] = store.create_token(TokenKind.JOIN, T0).plaintext
    with store.engine.begin() as conn:  # a credential whose node row is gone
        conn.execute(
            NodeCredentialRow.__table__.insert(),
            {"node": "ghost", "token_hash": _hash("fs_node_ghost"), "approved": False},
        )
    shown["ghost"] = "fs_node_ghost"
    return shown


def _hash(plaintext: str) -> str:
    from fleetserve.store.acceptance import credential_hash

    return credential_hash(plaintext)


def claim_of(fleet: dict[str, str | None], row: Row) -> Claim:
    return Claim(fleet[row.credential], row.node, row.epoch)  # type: ignore[index]


def heartbeats(store: SqlStore) -> dict[str, datetime | None]:
    return {h.name: h.last_heartbeat for h in store.node_heartbeats()}


@pytest.mark.parametrize("row", ROWS, ids=[r.case for r in ROWS])
def test_the_rule_gives_each_call_its_verdict_in_every_statement_that_applies_it(
    store: SqlStore, fleet: dict[str, str | None], row: Row
) -> None:
    claim = claim_of(fleet, row)
    (read,) = store.judge([claim])
    assert read.verdict is row.verdict
    before = heartbeats(store)
    (beat,) = store.judge_beats([claim], T1)
    assert beat.verdict is row.verdict
    moved = {n for n, at in heartbeats(store).items() if at != before[n]}
    assert moved == ({row.node} if row.verdict is Verdict.ACCEPTED else set())
    if row.verdict is Verdict.ACCEPTED:  # an accepted call is a heartbeat: the node is Ready again
        assert store.get_node(row.node).state is NodeState.READY
    report = AgentReport(row.node, row.epoch, {}, credential=claim.credential)
    (reported,) = store.judge_reports([report], T1)
    assert (reported == []) if row.verdict is Verdict.ACCEPTED else (reported.verdict is row.verdict)  # type: ignore[union-attr]


def test_a_refusal_names_the_credentials_node_and_the_named_nodes_state(
    store: SqlStore, fleet: dict[str, str | None]
) -> None:
    another, lost = store.judge([Claim(fleet["n1"], "n2", 1), Claim(fleet["n4"], "n4", 1)])
    assert (another.bound, another.state) == ("n1", NodeState.READY)
    assert (lost.bound, lost.state) == ("n4", NodeState.LOST)


@pytest.mark.parametrize("with_status", [False, True], ids=["bare reports", "reports with agent status"])
def test_a_batch_of_every_row_gives_each_the_verdict_it_gets_alone(
    store: SqlStore, fleet: dict[str, str | None], with_status: bool
) -> None:
    """Batches are judged by other statements than a call alone (one statement for a whole batch
    on PostgreSQL): each row still gets its own verdict, whatever shares its batch."""
    from fleetserve.protocol import AgentStatus

    claims = [claim_of(fleet, r) for r in ROWS]
    expected = [r.verdict for r in ROWS]
    assert [j.verdict for j in store.judge(claims)] == expected
    assert [j.verdict for j in store.judge_beats(claims, T1)] == expected
    status = AgentStatus(problems=["p"]) if with_status else None
    batch = [AgentReport(c.node, c.epoch, {}, agent_status=status, credential=c.credential) for c in claims]
    got = store.judge_reports(batch, T1)
    assert [Verdict.ACCEPTED if g == [] else g.verdict for g in got] == expected  # type: ignore[union-attr]
