"""A Model's change over a real store (SQLite and PostgreSQL): new weights roll every deployment
serving it and undo rolls them back; replicas an older server placed are stamped, not rolled."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from builders import deployment, gpu_host_32c_256g, safetensors_8gb
from fleetserve.reconcile.health import HeartbeatPolicy
from fleetserve.server.reconciler.loop import Reconciler
from fleetserve.spec.resources import DeviceClass, Replica, ReplicaState
from fleetserve.store import SqlStore

T0 = datetime(2025, 6, 1, 12, 0, tzinfo=UTC)
H100 = DeviceClass(name="h100", driver="gpu.nvidia.com", memory="80GiB")
MODEL = safetensors_8gb()
CHAT = deployment("chat", 2, {"name": "gpu", "engine": "vllm", "deviceClass": "h100"}, model=MODEL.name)
POLICY = HeartbeatPolicy(not_ready_after=timedelta(hours=1), lost_after=timedelta(hours=2))


def fleet(store: SqlStore) -> Reconciler:
    store.put_class(H100)
    store.register(gpu_host_32c_256g("g1", "h100", count=4))
    store.put_model(MODEL)
    store.put_deployment(CHAT)
    return Reconciler(store, policy=POLICY, clock=lambda: T0, holder="me")


def run_all(store: SqlStore) -> None:
    """What the agents would do: every replica placed runs."""
    for replica in store.replicas():
        if replica.state is ReplicaState.PENDING:
            store.set_replica_state(replica.name, ReplicaState.RUNNING)


def revisions(store: SqlStore) -> dict[str, str | None]:
    return {r.name: r.revision for r in store.replicas()}


def test_new_weights_roll_the_deployment_and_undoing_the_model_rolls_it_back(store: SqlStore) -> None:
    loop = fleet(store)
    loop.run_once()
    run_all(store)
    first = revisions(store)
    assert len(first) == 2 and len(set(first.values())) == 1

    store.put_model(MODEL.model_copy(update={"sha256": "e" * 64}))
    result = loop.run_once()
    assert len(result.allocated) == 1, "one surge replica (maxSurge 1) for the new weights"
    rollout = store.get_deployment("chat").status.rollout
    assert (rollout.cause, rollout.old) == ("model", 2)
    assert rollout.revision.split(".")[0] == next(iter(first.values())).split(".")[0]  # type: ignore[union-attr]

    assert store.undo_model(MODEL.name) == MODEL
    assert store.get_model(MODEL.name) == MODEL
    loop.run_once()
    status = store.get_deployment("chat").status.rollout
    assert status.revision == next(iter(first.values())), "back at the first revision"
    assert status.updated == 2


def test_a_model_change_that_keeps_the_weights_rolls_nothing(store: SqlStore) -> None:
    loop = fleet(store)
    loop.run_once()
    run_all(store)
    before = revisions(store)
    store.put_model(MODEL.model_copy(update={"size": 9 * 10**9}))
    result = loop.run_once()
    assert (result.allocated, result.draining, result.released) == ([], [], [])
    assert revisions(store) == before


def test_replicas_an_older_server_placed_are_stamped_not_rolled(store: SqlStore) -> None:
    loop = fleet(store)
    # Placed by a server whose revision did not count the weights.
    for i in range(2):
        store.allocate(
            Replica.model_validate(
                {
                    "name": f"chat-{i}",
                    "deployment": "chat",
                    "profile": "gpu",
                    "deviceClass": "h100",
                    "shards": [{"node": "g1", "devices": [i]}],
                    "revision": CHAT.template_revision(),
                }
            )
        )
    result = loop.run_once()
    assert (result.allocated, result.draining, result.released) == ([], [], [])
    full = CHAT.template_revision(MODEL.weights_digest())
    assert revisions(store) == {"chat-0": full, "chat-1": full}

    store.put_model(MODEL.model_copy(update={"sha256": "f" * 64}))
    assert len(loop.run_once().allocated) == 1, "stamped, they roll with the next model change"
