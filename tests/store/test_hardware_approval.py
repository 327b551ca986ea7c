"""A node's hardware is not its word, in the store, on SQLite and PostgreSQL: an enrolment approves
what it claims; a registration claiming more (cores, memory, devices, another class) is held and
the node placed with its approved facts until ``approve`` applies the claim; less is accepted and
logged, the approval staying the ceiling; an operator's ``apply`` approves what it declares."""

from __future__ import annotations

from datetime import UTC, datetime

from sqlalchemy import text

from builders import GiB, cpu_8c_32g, gpu_host_8c_64g, node
from fleetserve.inventory.approval import Hardware, HardwareHeld
from fleetserve.server.reconciler.loop import Reconciler
from fleetserve.spec.loader import Documents
from fleetserve.spec.resources import Deployment, Model
from fleetserve.store import SqlStore
from fleetserve.store.audit import AuditAction
from fleetserve.store.identity import Enrolled

EIGHT = Hardware(cores=8, memory=32 * GiB)
CLAIM_1000 = Hardware(cores=1000, memory=32 * GiB)


def enrol(store: SqlStore, name: str = "n1") -> Enrolled:
    enrolled = store.enrol(cpu_8c_32g(name), datetime.now(UTC), approve_new=True, source="10.0.0.1")
    assert isinstance(enrolled, Enrolled)
    return enrolled


def events(store: SqlStore, action: AuditAction) -> list[tuple[str, str, str | None]]:
    return [(e.actor, e.target, e.source) for e in store.events(action=action)]


def sixteen_core_replicas(store: SqlStore, count: int = 3) -> None:
    """A deployment of ``count`` llama.cpp replicas of 16 cores each: none fits 8 approved cores."""
    store.put_model(Model(name="tiny", source="/models/tiny.gguf", format="gguf", size="1MB"))
    store.put_deployment(
        Deployment.model_validate(
            {
                "name": "tiny", "model": "tiny", "replicas": count,
                "profiles": [{"name": "cpu", "engine": "llama.cpp", "cpu": {"cores": 16}}],
            }
        )
    )  # fmt: skip


def drawn(store: SqlStore, reconciler: Reconciler) -> dict[str, int]:
    """One reconciler cycle (the node heard from just before); replicas per node."""
    store.heartbeat("n1", datetime.now(UTC))
    assert reconciler.run_once().leader
    out: dict[str, int] = {}
    for replica in store.replicas():
        for shard in replica.shards:
            out[shard.node] = out.get(shard.node, 0) + 1
    return out


def test_an_enrolment_approves_the_hardware_it_claims(store: SqlStore) -> None:
    enrolled = enrol(store)
    assert enrolled.registration.held is None
    (record,) = store.enrolments()
    assert (record.approved_hardware, record.claimed_hardware, record.held_at) == (EIGHT, None, None)


def test_the_1000_core_re_registration_is_held_and_draws_nothing_until_approved(store: SqlStore) -> None:
    enrol(store)
    sixteen_core_replicas(store)
    reconciler = Reconciler(store)  # one for the test: it keeps the lease
    t1 = datetime(2026, 12, 7, 3, 0, tzinfo=UTC)

    held = store.reregister(cpu_8c_32g("n1", cpu={"cores": 1000, "memory": "32Gi"}), t1, source="10.0.0.1")

    assert held.held == HardwareHeld(approved=EIGHT, claimed=CLAIM_1000)
    assert held.node.cpu.cores == 8 and store.get_node("n1").cpu.cores == 8  # placed as approved
    (record,) = store.enrolments()
    assert (record.approved_hardware, record.claimed_hardware, record.held_at) == (EIGHT, CLAIM_1000, t1)
    (event,) = store.events(action=AuditAction.NODE_HARDWARE_HELD)
    assert (event.actor, event.target, event.source) == ("node n1", "Node/n1", "10.0.0.1")
    assert event.detail["differences"] == "cores 1000 (approved 8)"
    assert drawn(store, reconciler) == {}  # 3 replicas of 16 cores: the 1,000 claimed cores draw none

    # The same claim again (the agent restarted): still held, since the first time, logged once.
    again = store.reregister(
        cpu_8c_32g("n1", cpu={"cores": 1000, "memory": "32Gi"}), datetime.now(UTC), source="x"
    )
    assert again.held is not None and store.enrolments()[0].held_at == t1
    assert len(events(store, AuditAction.NODE_HARDWARE_HELD)) == 1
    assert drawn(store, reconciler) == {}

    approval = store.approve("n1", datetime.now(UTC))

    assert approval.hardware == CLAIM_1000
    assert (approval.record.approved_hardware, approval.record.claimed_hardware) == (CLAIM_1000, None)
    assert approval.record.approved is False  # the hardware, not a new enrolment, was approved
    assert store.get_node("n1").cpu.cores == 1000
    assert drawn(store, reconciler) == {"n1": 3}


def test_less_is_accepted_and_logged_and_the_approval_stays_the_ceiling(store: SqlStore) -> None:
    approved = Hardware(cores=8, memory=64 * GiB, devices={"h100": 2})
    enrolled = store.enrol(gpu_host_8c_64g("g1", "h100", 2), datetime.now(UTC), approve_new=True, source="s")
    assert isinstance(enrolled, Enrolled)

    less = store.reregister(gpu_host_8c_64g("g1", "h100", 1), datetime.now(UTC), source="s")
    assert less.held is None and len(less.node.devices) == 1  # a GPU fell off the bus
    (event,) = store.events(action=AuditAction.NODE_HARDWARE_LESS)
    assert event.detail["differences"] == "devices of class h100 1 (approved 2)"
    assert store.enrolments()[0].approved_hardware == approved

    back = store.reregister(gpu_host_8c_64g("g1", "h100", 2), datetime.now(UTC), source="s")
    assert back.held is None and len(back.node.devices) == 2  # back to what was approved: accepted
    more = store.reregister(gpu_host_8c_64g("g1", "h100", 3), datetime.now(UTC), source="s")
    assert more.held == HardwareHeld(approved=approved, claimed=Hardware.of(gpu_host_8c_64g("g", "h100", 3)))
    assert [d.index for d in more.node.devices] == [0, 1]
    # A claim within the approval settles the one that waited.
    store.reregister(gpu_host_8c_64g("g1", "h100", 2), datetime.now(UTC), source="s")
    assert store.enrolments()[0].claimed_hardware is None


def test_another_device_class_is_held_and_its_devices_are_not_placed(store: SqlStore) -> None:
    store.enrol(gpu_host_8c_64g("g1", "h100", 2), datetime.now(UTC), approve_new=True, source="s")
    swapped = store.reregister(gpu_host_8c_64g("g1", "b200", 2), datetime.now(UTC), source="s")
    assert swapped.held is not None and swapped.held.claimed.devices == {"b200": 2}
    assert store.get_node("g1").devices == ()


def test_a_node_enrolled_before_approvals_were_kept_is_judged_against_its_stored_facts(
    store: SqlStore,
) -> None:
    enrol(store)
    with store._engine.begin() as c:  # as the migration leaves a node enrolled before it
        c.execute(text("UPDATE node_credentials SET approved_hardware = NULL"))
    assert store.enrolments()[0].approved_hardware is None

    held = store.reregister(
        cpu_8c_32g("n1", cpu={"cores": 1000, "memory": "32Gi"}), datetime.now(UTC), source="s"
    )

    assert held.held == HardwareHeld(approved=EIGHT, claimed=CLAIM_1000)
    assert store.enrolments()[0].approved_hardware == EIGHT


def test_an_approved_re_enrolment_is_judged_against_the_approved_hardware(store: SqlStore) -> None:
    enrol(store)
    approval = store.approve("n1", datetime.now(UTC))  # nothing held: the next enrolment may pass
    assert approval.hardware is None and approval.record.approved
    again = store.enrol(node("n1", 1000, "32Gi"), datetime.now(UTC), approve_new=False, source="10.0.0.2")
    assert isinstance(again, Enrolled)
    assert again.registration.held == HardwareHeld(approved=EIGHT, claimed=CLAIM_1000)
    assert store.get_node("n1").cpu.cores == 8


def test_an_operators_apply_approves_the_hardware_it_declares(store: SqlStore) -> None:
    enrol(store)
    store.reregister(node("n1", 32, "32Gi"), datetime.now(UTC), source="s")
    assert store.enrolments()[0].claimed_hardware is not None

    store.apply_documents(Documents(nodes=[node("n1", 32, "32Gi")]))

    (record,) = store.enrolments()
    assert (record.approved_hardware, record.claimed_hardware) == (Hardware(cores=32, memory=32 * GiB), None)
    assert store.reregister(node("n1", 32, "32Gi"), datetime.now(UTC), source="s").held is None
    # A node an operator declares before any agent enrols is approved as declared, not "waiting".
    store.apply_documents(Documents(nodes=[cpu_8c_32g("declared")]))
    declared = {r.node: r for r in store.enrolments()}["declared"]
    assert (declared.enrolled, declared.requested_at, declared.approved_hardware) == (False, None, EIGHT)
