"""Node identity in the store, on SQLite and PostgreSQL: enrolment issues a hashed credential
bound to the name and registers the node in one transaction; refusals are values, recorded for
an operator; an approval lets one enrolment through; deleting the node forgets its credential."""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime

import pytest
from sqlalchemy import text

from builders import cpu_8c_32g
from fleetserve.store import SqlStore
from fleetserve.store.identity import Beat, Enrolled, Refusal, Refused

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def test_enrolment_binds_a_credential_to_the_name_and_registers_the_node(store: SqlStore) -> None:
    enrolled = store.enrol(cpu_8c_32g("n1"), T0, approve_new=True, source="10.0.0.1")
    assert isinstance(enrolled, Enrolled)
    assert (enrolled.registration.epoch, enrolled.registration.created) == (1, True)
    assert store.node_for_credential(enrolled.credential) == "n1"
    assert store.node_for_credential(enrolled.credential + "x") is None
    assert [n.name for n in store.nodes()] == ["n1"]


def test_a_taken_name_is_refused_recorded_and_let_through_once_after_an_approval(store: SqlStore) -> None:
    first = store.enrol(cpu_8c_32g("n1"), T0, approve_new=True, source="10.0.0.1")
    assert isinstance(first, Enrolled)
    assert store.enrol(cpu_8c_32g("n1"), T0, approve_new=True, source="10.6.6.6") == Refused(
        "n1", Refusal.NAME_TAKEN
    )
    (record,) = store.enrolments()
    assert (record.enrolled, record.approved, record.requested_from) == (True, False, "10.6.6.6")
    assert store.epoch("n1") == 1

    store.approve("n1", T0)
    second = store.enrol(cpu_8c_32g("n1"), T0, approve_new=False, source="10.0.0.2")
    assert isinstance(second, Enrolled) and second.registration.epoch == 2
    assert store.node_for_credential(first.credential) is None  # the old credential is retired
    assert store.node_for_credential(second.credential) == "n1"
    assert isinstance(store.enrol(cpu_8c_32g("n1"), T0, approve_new=True, source="x"), Refused)


def test_a_new_name_waits_for_approval_unless_the_policy_approves_new_names(store: SqlStore) -> None:
    assert store.enrol(cpu_8c_32g("n2"), T0, approve_new=False, source="10.0.0.9") == Refused(
        "n2", Refusal.APPROVAL_REQUIRED
    )
    assert store.nodes() == []
    store.approve("n2", T0)
    assert isinstance(store.enrol(cpu_8c_32g("n2"), T0, approve_new=False, source="10.0.0.9"), Enrolled)


def test_deleting_a_node_forgets_its_credential(store: SqlStore) -> None:
    enrolled = store.enrol(cpu_8c_32g("n1"), T0, approve_new=True, source="10.0.0.1")
    assert isinstance(enrolled, Enrolled)
    store.delete_node("n1")
    assert store.node_for_credential(enrolled.credential) is None
    assert store.enrolments() == []


def test_a_heartbeat_by_credential_is_written_only_for_the_credentials_own_ready_node_at_its_epoch(
    store: SqlStore,
) -> None:
    """The agents' hot path checks the credential and writes the heartbeat together
    (``beat_with_credential``, a batch of one): played as a node that holds a real credential and tries every
    other node's name, old epochs, a made-up credential and a retired one, it writes nothing."""
    from fleetserve.spec.resources import NodeState

    one = store.enrol(cpu_8c_32g("n1"), T0, approve_new=True, source="10.0.0.1")
    two = store.enrol(cpu_8c_32g("n2"), T0, approve_new=True, source="10.0.0.2")
    assert isinstance(one, Enrolled) and isinstance(two, Enrolled)

    def last() -> dict[str, datetime | None]:
        return {h.name: h.last_heartbeat for h in store.node_heartbeats()}

    before = last()
    t1 = datetime(2026, 1, 1, 0, 0, 5, tzinfo=UTC)
    assert store.beat_with_credential(one.credential, "n2", 1, t1) is False  # another node's name
    assert store.beat_with_credential(one.credential, "n1", 2, t1) is False  # an epoch it does not hold
    assert store.beat_with_credential(one.credential + "x", "n1", 1, t1) is False  # not a credential
    assert store.beat_with_credential(two.credential, "nobody", 1, t1) is False  # no such node
    assert last() == before

    assert store.beat_with_credential(one.credential, "n1", 1, t1) is True
    beats = last()
    assert beats["n1"] is not None and beats["n1"].replace(tzinfo=UTC) == t1
    assert beats["n2"] == before["n2"]

    store.set_state("n2", NodeState.LOST)  # judged Lost: its agent must register again
    assert store.beat_with_credential(two.credential, "n2", 1, t1) is False

    store.approve("n1", T0)  # the name enrolled again: the first credential is retired
    again = store.enrol(cpu_8c_32g("n1"), T0, approve_new=False, source="10.0.0.1")
    assert isinstance(again, Enrolled)
    t2 = datetime(2026, 1, 1, 0, 0, 9, tzinfo=UTC)
    assert store.beat_with_credential(one.credential, "n1", 1, t2) is False
    assert store.beat_with_credential(one.credential, "n1", 2, t2) is False
    assert store.beat_with_credential(again.credential, "n1", 2, t2) is True


def test_a_batch_of_heartbeats_judges_each_beat_on_its_own_credential(store: SqlStore) -> None:
    """Concurrent heartbeats are written together (``beats``). Played as a node holding a real
    credential whose beats share a batch with its victims' own: it claims another node at that
    node's current epoch while the victim's own beat is stale, claims a node whose own beat is
    in the batch, and sends made-up and retired credentials. Only the beats that would be
    accepted one by one are recorded, and only their nodes' rows move."""
    from fleetserve.spec.resources import NodeState

    enrolled = {}
    for name in ("n1", "n2", "n3", "n4"):
        got = store.enrol(cpu_8c_32g(name), T0, approve_new=True, source="10.0.0.1")
        assert isinstance(got, Enrolled)
        enrolled[name] = got.credential
    store.set_state("n4", NodeState.LOST)
    thief = enrolled["n1"]

    def last() -> dict[str, datetime | None]:
        return {h.name: h.last_heartbeat for h in store.node_heartbeats()}

    before = last()
    t1 = datetime(2026, 1, 1, 0, 0, 5, tzinfo=UTC)
    batch = [
        Beat(enrolled["n2"], "n2", 7),  # n2's own credential, a stale epoch: refused
        Beat(thief, "n2", 1),  # the thief claims n2 at its current epoch: refused
        Beat(thief, "n3", 1),  # the thief claims n3, whose own beat follows
        Beat(enrolled["n3"], "n3", 1),  # n3's own: recorded
        Beat(thief + "x", "n1", 1),  # not a credential
        Beat(enrolled["n4"], "n4", 1),  # Lost
        Beat("fs_node_" + "A" * 43, "nobody", 1),
        Beat(enrolled["n3"], "n3", 1),  # the same beat twice: both recorded
    ]
    assert store.beats(batch, t1) == [False, False, False, True, False, False, False, True]
    after = last()
    assert {n for n in after if after[n] != before[n]} == {"n3"}
    assert store.beats([], t1) == []
    assert store.nodes_for_credentials([thief, "nope", enrolled["n3"], thief]) == ["n1", None, "n3", "n1"]

    store.approve("n2", T0)  # n2 enrolled again: its first credential is retired
    again = store.enrol(cpu_8c_32g("n2"), T0, approve_new=False, source="10.0.0.2")
    assert isinstance(again, Enrolled)
    t2 = datetime(2026, 1, 1, 0, 0, 9, tzinfo=UTC)
    # The retired credential at the new epoch beside the new one at the old epoch: neither.
    assert store.beats([Beat(enrolled["n2"], "n2", 2), Beat(again.credential, "n2", 1)], t2) == [False, False]
    assert last()["n2"] == after["n2"]
    assert store.beats([Beat(again.credential, "n2", 2), Beat(thief, "n1", 1)], t2) == [True, True]


def test_a_batch_of_heartbeats_locks_its_nodes_in_name_order_as_allocations_do(store: SqlStore) -> None:
    """An allocation locks its nodes in name order (``SqlInventory``). Played on PostgreSQL: a
    transaction holds n1 and will want n2, like an allocation spanning both; a batch of heartbeats
    for n2 and n1 (n2 stored first, so a plain scan meets it first) starts meanwhile. The batch
    waits for n1 holding nothing, so the transaction takes n2 at once and both finish: no
    deadlock (one of the two aborted by PostgreSQL)."""
    if store.engine.dialect.name != "postgresql":
        pytest.skip("SQLite has one writer at a time: there is no lock order to keep")
    credentials = {}
    for name in ("n2", "n1"):
        got = store.enrol(cpu_8c_32g(name), T0, approve_new=True, source="10.0.0.1")
        assert isinstance(got, Enrolled)
        credentials[name] = got.credential
    t1 = datetime(2026, 1, 1, 0, 0, 5, tzinfo=UTC)
    lock = "SELECT name FROM nodes WHERE name = :name FOR UPDATE"
    with store.engine.connect() as holder:
        holder.execute(text("SET lock_timeout = '10s'"))
        holder.execute(text(lock), {"name": "n1"})
        result: list[list[bool]] = []
        batch = threading.Thread(
            target=lambda: result.append(store.beats([Beat(credentials[n], n, 1) for n in ("n2", "n1")], t1))
        )
        batch.start()
        time.sleep(0.5)  # the batch is waiting for n1 by now
        holder.execute(text(lock), {"name": "n2"})  # refused (deadlock) if the batch held n2
        holder.commit()
    batch.join(timeout=30)
    assert result == [[True, True]]
    assert {h.name: h.last_heartbeat for h in store.node_heartbeats()} == {"n1": t1, "n2": t1}
