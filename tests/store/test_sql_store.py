"""The SQL store beyond the Inventory: workloads, decisions, tokens, leases, migrations, errors.

Every test runs against SQLite and PostgreSQL (the ``store`` fixture, tests/conftest.py).
"""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import select, text

from builders import cpu_8c_16g as node
from builders import deployment as build_deployment
from fleetserve.errors import ConfigError, NotFound, StoreError, UnknownNode, UnknownReplica
from fleetserve.protocol import ReplicaStatus
from fleetserve.reconcile.health import Transition
from fleetserve.spec.loader import Documents
from fleetserve.spec.resources import Deployment, Model, NodeState, Replica, ReplicaState
from fleetserve.spec.status import DecisionRecord, DeploymentStatus
from fleetserve.store import SqlStore, TokenKind, make_engine, migrate
from fleetserve.store.schema import MIGRATIONS
from fleetserve.store.tables import Base, TokenRow

T0 = datetime(2025, 6, 1, 12, 0, tzinfo=UTC)


def model(name: str, size: str = "4Gi") -> Model:
    return Model.model_validate({"name": name, "source": f"/models/{name}.gguf", "size": size})


def deployment(name: str = "chat", replicas: int = 1, model_name: str = "llama") -> Deployment:
    return build_deployment(
        name, replicas, {"name": "cpu", "engine": "llama.cpp", "cpu": {"cores": 4}}, model=model_name
    )


# --- models and deployments --------------------------------------------------------------------


def test_models_crud(store: SqlStore) -> None:
    store.put_model(model("qwen"))
    store.put_model(model("llama"))
    store.put_model(model("qwen", size="8Gi"))  # replaces

    assert store.get_model("qwen") == model("qwen", size="8Gi")
    assert [m.name for m in store.list_models()] == ["llama", "qwen"]

    store.delete_model("qwen")
    assert store.list_models() == [model("llama")]
    with pytest.raises(NotFound, match="qwen"):
        store.get_model("qwen")
    with pytest.raises(NotFound):
        store.delete_model("qwen")


def test_deployment_generation_bumps_only_on_a_spec_change(store: SqlStore) -> None:
    generations = [
        store.put_deployment(deployment(replicas=1)),
        store.put_deployment(deployment(replicas=1)),  # re-applied unchanged
        store.put_deployment(deployment(replicas=3)),
        store.put_deployment(deployment(replicas=3)),
        store.put_deployment(deployment(replicas=1)),  # back again is a change too
    ]
    assert generations == [1, 1, 2, 2, 3]
    assert store.put_deployment(deployment("other")) == 1  # per deployment

    stored = store.get_deployment("chat")
    assert stored.deployment == deployment(replicas=1)
    assert stored.generation == 3
    assert dict(stored.status) == {}


def test_deployment_status_list_and_delete(store: SqlStore) -> None:
    store.put_deployment(deployment("b"))
    store.put_deployment(deployment("a"))
    status = {"observedGeneration": 1, "conditions": [{"type": "Accepted", "status": True}]}
    store.set_deployment_status("a", DeploymentStatus.model_validate(status))
    store.put_deployment(deployment("a", replicas=2))  # a spec change keeps the status

    assert dict(store.get_deployment("a").status) == status
    assert [(d.deployment.name, d.generation) for d in store.list_deployments()] == [("a", 2), ("b", 1)]

    store.delete_deployment("a")
    assert [d.deployment.name for d in store.list_deployments()] == ["b"]
    for operation in (
        lambda: store.get_deployment("a"),
        lambda: store.set_deployment_status("a", DeploymentStatus()),
        lambda: store.delete_deployment("a"),
    ):
        with pytest.raises(NotFound, match="'a'"):
            operation()


# --- nodes and replicas ------------------------------------------------------------------------


def test_heartbeats(store: SqlStore) -> None:
    store.register(node("n2"))
    store.register(node("n1"))
    assert [(h.name, h.last_heartbeat) for h in store.node_heartbeats()] == [("n1", None), ("n2", None)]

    store.heartbeat("n1", T0.astimezone(timezone(timedelta(hours=2))))  # any zone, stored as UTC
    store.set_state("n2", NodeState.NOT_READY)

    beats = store.node_heartbeats()
    assert beats[0].last_heartbeat == T0
    assert beats[0].last_heartbeat is not None and beats[0].last_heartbeat.tzinfo == UTC
    assert (beats[1].state, beats[1].epoch, beats[1].last_heartbeat) == (NodeState.NOT_READY, 1, None)
    with pytest.raises(UnknownNode):
        store.heartbeat("nope", T0)
    with pytest.raises(ValueError, match="timezone-aware"):
        store.heartbeat("n1", datetime(2025, 6, 1, 12, 0))


def test_silent_nodes_are_marked_in_one_go_and_a_node_moved_or_heard_since_is_left_alone(
    store: SqlStore,
) -> None:
    for name in ("n1", "n2", "n3", "n4"):
        store.register(node(name))
        store.heartbeat(name, T0)
    store.set_state("n3", NodeState.NOT_READY)  # moved since the judgement read it Ready
    store.heartbeat("n4", T0 + timedelta(seconds=5))  # heard after the heartbeat the judgement saw
    ready, not_ready, lost = NodeState.READY, NodeState.NOT_READY, NodeState.LOST
    moved = store.mark_silent(
        [
            Transition("n1", ready, not_ready, T0),
            Transition("n3", ready, not_ready, T0),
            Transition("n2", ready, lost, T0),
            Transition("n4", ready, not_ready, T0),
        ]
    )
    assert moved == ["n1", "n2"]
    states = {h.name: h.state for h in store.node_heartbeats()}
    assert states == {"n1": not_ready, "n2": lost, "n3": not_ready, "n4": ready}
    assert store.mark_silent([]) == []
    assert store.mark_silent([Transition("gone", ready, not_ready, T0)]) == []


def test_a_node_row_another_transaction_holds_is_skipped_without_waiting(postgres_store: SqlStore) -> None:
    """A server stopped (SIGSTOP) in the middle of writing a heartbeat holds that node's row: the
    reconciler's liveness judgement marks every other node and skips that one, rather than waiting
    on the stopped process until it resumes (PostgreSQL; SQLite has one writer at a time)."""
    from concurrent.futures import ThreadPoolExecutor

    for name in ("n1", "n2"):
        postgres_store.register(node(name))
    holder = postgres_store.engine.connect()
    try:
        with ThreadPoolExecutor(1) as pool, holder.begin():  # the lock goes before the pool waits
            holder.execute(text("UPDATE nodes SET state = state WHERE name = 'n1'"))  # the row lock
            judged = pool.submit(
                postgres_store.mark_silent,
                [Transition(n, NodeState.READY, NodeState.NOT_READY) for n in ("n1", "n2")],
            )
            # Had it waited on the lock it would wait for as long as the holder's transaction lasts:
            # the holder stays open until this answer comes (or 30 s pass and the test fails).
            assert judged.result(timeout=30) == ["n2"]
    finally:
        holder.close()
    assert postgres_store.mark_silent([Transition("n1", NodeState.READY, NodeState.NOT_READY)]) == ["n1"]


def test_replica_state_and_placement_epochs(store: SqlStore) -> None:
    store.register(node("n1"))
    store.register(node("n1"))
    store.register(node("n2"))
    r = Replica.model_validate(
        {
            "name": "chat-0",
            "deployment": "chat",
            "profile": "cpu",
            "state": "Pending",
            "shards": [{"node": "n1", "cpuCores": 2}, {"node": "n2", "cpuCores": 2}],
        }
    )
    store.allocate(r)
    store.allocate(r.model_copy(update={"name": "other-0", "deployment": "other"}))

    assert store.get_replica("chat-0") == r
    assert store.set_replica_state("chat-0", ReplicaState.RUNNING).state is ReplicaState.RUNNING
    assert store.get_replica("chat-0").state is ReplicaState.RUNNING
    assert store.snapshot().replicas[0].state is ReplicaState.RUNNING
    assert [x.name for x in store.replicas(deployment="chat")] == ["chat-0"]
    assert store.placement_epochs("chat-0") == {"n1": 2, "n2": 1}
    assert store.epoch("n1") == 2
    assert store.epoch("never") == 0
    for operation in (
        lambda: store.get_replica("nope"),
        lambda: store.set_replica_state("nope", ReplicaState.FAILED),
        lambda: store.placement_epochs("nope"),
    ):
        with pytest.raises(UnknownReplica):
            operation()


def test_every_replica_gets_its_own_engine_key_for_its_agent_gateway_and_observer_only(
    store: SqlStore,
) -> None:
    store.register(node("n1"))
    for name in ("chat-0", "chat-1"):
        store.allocate(
            Replica.model_validate(
                {
                    "name": name,
                    "deployment": "chat",
                    "profile": "cpu",
                    "shards": [{"node": "n1", "cpuCores": 1}],
                }
            )
        )
    keys = store.engine_keys(["chat-0", "chat-1", "gone-0"])
    assert set(keys) == {"chat-0", "chat-1"} and keys["chat-0"] != keys["chat-1"]
    assert all(len(k) >= 43 for k in keys.values())
    assert {e.replica.name: e.engine_key for e in store.replica_endpoints()} == keys
    # The replica as the admin API shows it carries no key.
    assert keys["chat-0"] not in store.get_replica("chat-0").model_dump_json()
    store.release("chat-0")
    assert store.engine_keys(["chat-0"]) == {}


def test_replica_endpoints_carry_the_state_of_the_least_healthy_node(store: SqlStore) -> None:
    for name in ("n1", "n2", "n3"):
        store.register(node(name))
    for name, nodes in (("one-0", ["n1"]), ("two-0", ["n1", "n2"]), ("far-0", ["n3"])):
        shards = [{"node": n, "cpuCores": 1} for n in nodes]
        store.allocate(
            Replica.model_validate(
                {
                    "name": name,
                    "deployment": name[:-2],
                    "profile": "cpu",
                    "state": "Running",
                    "shards": shards,
                }
            )
        )
    store.set_state("n2", NodeState.NOT_READY)
    store.set_state("n3", NodeState.LOST)
    states = {e.replica.name: e.node_state for e in store.replica_endpoints()}
    assert states == {"one-0": NodeState.READY, "two-0": NodeState.NOT_READY, "far-0": NodeState.LOST}


def test_drain_cordons_drains_what_serves_and_releases_the_rest_in_one_transaction(store: SqlStore) -> None:
    for name in ("n1", "n2", "n3"):
        store.register(node(name))
    spread = {"deployment": "chat", "profile": "cpu", "state": "Running"}
    store.allocate(
        Replica.model_validate({**spread, "name": "chat-0", "shards": [{"node": "n1", "cpuCores": 2}]})
    )
    store.allocate(
        Replica.model_validate(
            {
                **spread,
                "state": "Starting",
                "name": "chat-1",
                "shards": [{"node": "n2", "cpuCores": 2}, {"node": "n1", "cpuCores": 2}],
            }
        )
    )
    store.allocate(
        Replica.model_validate({**spread, "name": "chat-2", "shards": [{"node": "n3", "cpuCores": 2}]})
    )
    now = datetime(2026, 1, 1, tzinfo=UTC)

    drained, released, draining = store.drain("n1", "kernel update", now=now)

    assert drained.cordon is not None and drained.cordon.reason == "kernel update"
    assert [r.name for r in released] == ["chat-1"], "a replica that serves nothing goes at once"
    assert draining == ["chat-0"], "one that serves drains first"
    assert store.get_node("n1").cordon == drained.cordon
    assert {r.name: r.state for r in store.replicas()} == {"chat-0": "Draining", "chat-2": "Running"}
    assert store.snapshot().nodes[0].cordon == drained.cordon
    assert store.snapshot().facts_of("chat-0").draining_since == now
    # Draining is the control plane's word: the agent's next report does not undo it.
    epoch = store.epoch("n1")
    store.report("n1", epoch, now, {"chat-0": (ReplicaState.RUNNING, ReplicaStatus(inFlight=1))})
    assert store.get_replica("chat-0").state is ReplicaState.DRAINING
    facts = store.snapshot().facts_of("chat-0")
    assert (facts.in_flight, facts.reported_at) == (1, now)


def test_a_deployments_previous_spec_is_kept_and_undo_swaps_it_back(store: SqlStore) -> None:
    first = build_deployment("chat", 1, {"name": "cpu", "engine": "llama.cpp", "cpu": {"cores": 1}})
    second = first.model_copy(update={"model": "other"})
    store.put_deployment(first)
    assert store.get_deployment("chat").previous is None
    with pytest.raises(NotFound, match="no previous revision"):
        store.undo_deployment("chat")
    store.put_deployment(second)
    store.put_deployment(second)  # re-applied unchanged: the previous spec stays
    assert store.get_deployment("chat").previous == first
    undone = store.undo_deployment("chat")
    assert (undone.deployment, undone.previous, undone.generation) == (first, second, 3)


def test_a_drain_that_fails_changes_nothing(store: SqlStore) -> None:
    store.register(node("n1"))
    store.allocate(
        Replica.model_validate(
            {
                "name": "chat-0",
                "deployment": "chat",
                "profile": "cpu",
                "shards": [{"node": "n1", "cpuCores": 2}],
            }
        )
    )
    with pytest.raises(UnknownNode):
        store.drain("ghost", "retire")
    with pytest.raises(ConfigError):
        store.drain("n1", "")  # a cordon needs a reason: refused before anything is written
    assert store.get_node("n1").cordon is None
    assert [r.name for r in store.replicas()] == ["chat-0"]


# --- decisions ---------------------------------------------------------------------------------


def test_decisions_newest_first_filtered_limited_and_pruned(store: SqlStore) -> None:
    for minute, name in [(0, "a"), (1, "b"), (2, "a"), (3, "a")]:
        explanation = DecisionRecord.model_validate({"minute": minute, "profiles": [{"fits": False}]})
        store.record_decision(name, explanation, T0 + timedelta(minutes=minute))

    assert [d.explanation["minute"] for d in store.list_decisions()] == [3, 2, 1, 0]
    latest = store.list_decisions("a", limit=2)
    assert [(d.deployment, d.created_at) for d in latest] == [
        ("a", T0 + timedelta(minutes=3)),
        ("a", T0 + timedelta(minutes=2)),
    ]
    assert latest[0].explanation == {"minute": 3, "profiles": [{"fits": False}]}

    assert store.prune_decisions(T0 + timedelta(minutes=2)) == 2
    assert [d.explanation["minute"] for d in store.list_decisions()] == [3, 2]


# --- tokens ------------------------------------------------------------------------------------


def test_tokens_store_only_a_hash(store: SqlStore) -> None:
    admin = store.create_token(TokenKind.ADMIN, T0)
    join = store.create_token(TokenKind.JOIN, T0)

    assert store.verify_token(admin.plaintext, TokenKind.ADMIN)
    assert store.verify_token(join.plaintext, TokenKind.JOIN)
    assert not store.verify_token(join.plaintext, TokenKind.ADMIN)  # a join token is not an admin one
    assert not store.verify_token(admin.plaintext + "x", TokenKind.ADMIN)
    assert not store.verify_token("", TokenKind.ADMIN)

    with store.engine.connect() as conn:
        rows = conn.execute(select(TokenRow.__table__)).all()
        dump = " ".join(str(v) for row in rows for v in row)
    assert {row.token_hash for row in rows} == {
        hashlib.sha256(t.plaintext.encode()).hexdigest() for t in (admin, join)
    }
    assert admin.plaintext not in dump and join.plaintext not in dump

    store.revoke_token(admin.id)
    assert not store.verify_token(admin.plaintext, TokenKind.ADMIN)
    assert store.verify_token(join.plaintext, TokenKind.JOIN)
    assert [(t.kind, t.revoked, t.created_at) for t in store.list_tokens()] == [
        (TokenKind.ADMIN, True, T0),
        (TokenKind.JOIN, False, T0),
    ]
    with pytest.raises(NotFound):
        store.revoke_token(9999)


# --- leadership --------------------------------------------------------------------------------


def test_leadership_lease(store: SqlStore) -> None:
    ttl = timedelta(seconds=10)

    def at(seconds: float) -> datetime:
        return T0 + timedelta(seconds=seconds)

    assert store.try_acquire_leadership("reconciler", "a", at(0), ttl)
    assert not store.try_acquire_leadership("reconciler", "b", at(5), ttl)
    assert store.leader("reconciler", at(5)) == "a"
    assert store.try_acquire_leadership("reconciler", "a", at(8), ttl)  # renewed until 18
    assert not store.try_acquire_leadership("reconciler", "b", at(17.9), ttl)
    assert store.leader("reconciler", at(18)) is None  # expired
    assert store.try_acquire_leadership("reconciler", "b", at(18), ttl)
    assert not store.try_acquire_leadership("reconciler", "a", at(19), ttl)
    assert store.leader("reconciler", at(19)) == "b"
    assert store.try_acquire_leadership("scraper", "a", at(19), ttl)  # leases are independent

    assert not store.release_leadership("reconciler", "a")  # not a's to give up
    assert store.release_leadership("reconciler", "b")
    assert store.leader("reconciler", at(20)) is None
    assert store.try_acquire_leadership("reconciler", "a", at(20), ttl)
    with pytest.raises(ValueError, match="positive ttl"):
        store.try_acquire_leadership("reconciler", "a", at(21), timedelta(0))


# --- migrations --------------------------------------------------------------------------------


def test_migrations_run_twice_and_match_the_tables(store: SqlStore) -> None:
    migrate(store.engine)  # the fixture ran them once already
    migrate(store.engine)

    head = ScriptDirectory(str(MIGRATIONS)).get_current_head()
    with store.engine.connect() as conn:
        assert conn.execute(text("SELECT version_num FROM alembic_version")).scalars().all() == [head]
        assert compare_metadata(MigrationContext.configure(conn), Base.metadata) == []
    store.put_model(model("still-works"))


def test_migrate_and_open_take_a_url_or_a_path(tmp_path: Path) -> None:
    path = tmp_path / "nested" / "state.db"
    migrate(f"sqlite:///{path}")
    migrate(path)
    with SqlStore.open(path) as store:
        store.put_model(model("m"))
        assert [m.name for m in store.list_models()] == ["m"]
        with store.engine.connect() as conn:
            pragmas = [conn.exec_driver_sql(f"PRAGMA {p}").scalar() for p in ("journal_mode", "foreign_keys")]
            assert pragmas == ["wal", 1]
            assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() == 30000


# --- errors at the boundary --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("mysql://root@localhost/x", "unsupported database 'mysql'"),
        ("sqlite://", "in-memory SQLite"),
        ("sqlite:///:memory:", "in-memory SQLite"),
        ("postgresql://no such url::", "not a database URL"),
    ],
)
def test_bad_database_urls(url: str, message: str) -> None:
    with pytest.raises(StoreError, match=message):
        make_engine(url)


def test_postgres_urls_use_psycopg_3() -> None:
    for url in ("postgresql://u@h/db", "postgres://u@h/db", "postgresql+psycopg://u@h/db"):
        engine = make_engine(url)
        assert (engine.dialect.name, engine.dialect.driver) == ("postgresql", "psycopg")
        engine.dispose()


def test_database_errors_become_store_errors(tmp_path: Path) -> None:
    unreachable = make_engine("postgresql://postgres@127.0.0.1:1/test")
    try:
        with pytest.raises(StoreError, match="listing nodes failed: OperationalError") as caught:
            SqlStore(unreachable).nodes()
        assert caught.value.__cause__ is not None
    finally:
        unreachable.dispose()

    unmigrated = make_engine(tmp_path / "empty.db")
    try:
        with pytest.raises(StoreError, match=r"no such table: nodes \(is the schema migrated"):
            SqlStore(unmigrated).register(node("n1"))
    finally:
        unmigrated.dispose()


@pytest.mark.parametrize("with_status", [False, True], ids=["states only", "with agent status"])
def test_a_batch_of_status_reports_is_judged_report_by_report(store: SqlStore, with_status: bool) -> None:
    """``reports`` (concurrent reports in one transaction) accepts or refuses each on its own
    node's row, as ``report`` would alone: a stale epoch or a node judged dead writes nothing of
    that report, a replica of another node is only listed to stop, and of two reports of one
    replica the later wins. Reports with their agents' status have every node written in one
    statement: the same outcome."""
    from fleetserve.protocol import AgentStatus
    from fleetserve.store.reports import AgentReport

    def sent(node: str, epoch: int, replicas: dict, model_cache: list[str] | None = None) -> AgentReport:
        status = AgentStatus(problems=[f"{node} at epoch {epoch}"], reportedAt="t") if with_status else None
        return AgentReport(node, epoch, replicas, model_cache, status)

    for name in ("n1", "n2", "n3"):
        store.register(node(name))
    base = {"deployment": "chat", "profile": "cpu", "state": "Starting"}
    for name, where in (("chat-0", "n1"), ("chat-1", "n2"), ("chat-2", "n3")):
        store.allocate(
            Replica.model_validate({**base, "name": name, "shards": [{"node": where, "cpuCores": 2}]})
        )
    store.set_state("n3", NodeState.LOST)
    t1 = datetime(2026, 1, 1, tzinfo=UTC)
    running, failed = (ReplicaState.RUNNING, ReplicaStatus(port=8001)), (ReplicaState.FAILED, ReplicaStatus())
    beats = {h.name: h.last_heartbeat for h in store.node_heartbeats()}
    batch = [
        sent("n2", 7, {"chat-1": running}),  # a stale epoch: nothing of it
        sent("n1", 1, {"chat-0": failed, "chat-1": running}),  # chat-1 is n2's: stop it
        sent("n3", 1, {"chat-2": running}),  # judged dead: nothing of it
        sent("n1", 1, {"chat-0": running}, model_cache=["llama"]),  # later: it wins
    ]
    assert store.reports(batch, t1) == [None, ["chat-1"], None, []]
    assert {r.name: r.state for r in store.replicas()} == {
        "chat-0": ReplicaState.RUNNING,
        "chat-1": ReplicaState.STARTING,
        "chat-2": ReplicaState.STARTING,
    }
    assert store.replica_status("chat-0").port == 8001
    after = {h.name: h.last_heartbeat for h in store.node_heartbeats()}
    assert after["n1"] is not None and after["n1"].replace(tzinfo=UTC) == t1
    assert (after["n2"], after["n3"]) == (beats["n2"], beats["n3"])
    assert store.get_node("n1").model_cache == ("llama",)
    if with_status:
        assert store.agent_status("n1").problems == ["n1 at epoch 1"]
        assert store.agent_status("n2").problems == store.agent_status("n3").problems == []
    assert store.reports([], t1) == []


def test_a_models_previous_spec_is_kept_and_undo_swaps_it_back(store: SqlStore) -> None:
    first = Model(name="m", source="/models/m.gguf", size="1GB", sha256="a" * 64)
    second = first.model_copy(update={"sha256": "b" * 64})
    store.put_model(first)
    with pytest.raises(NotFound, match="no previous spec"):
        store.undo_model("m")
    store.put_model(second)
    store.apply_documents(Documents(models=[second]))  # re-applied unchanged: the previous stays
    assert store.undo_model("m") == first
    assert store.get_model("m") == first
    assert store.undo_model("m") == second, "a second undo redoes"
    with pytest.raises(NotFound, match="no model"):
        store.undo_model("ghost")


def test_stamping_a_revision_rewrites_only_the_replicas_revision(store: SqlStore) -> None:
    store.register(node("n1"))
    replica = Replica.model_validate(
        {"name": "chat-0", "deployment": "chat", "profile": "cpu", "shards": [{"node": "n1", "cpuCores": 2}]}
    )
    store.allocate(replica)
    assert store.snapshot().replicas[0].revision is None  # read once: kept in the parse cache
    assert store.stamp_revision(["chat-0", "ghost"], "abc.def") == ["chat-0"]
    assert store.snapshot().replicas == (replica.model_copy(update={"revision": "abc.def"}),)
