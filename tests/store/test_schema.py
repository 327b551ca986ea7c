"""Migrating: the ids follow the chain in order, and a database stamped under the old numbering
(before the ids were renumbered) is migrated to the head as its own migrations say, on SQLite and
PostgreSQL."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine, text

from fleetserve.spec.resources import Fabric, Model
from fleetserve.store import SqlStore, make_engine, migrate
from fleetserve.store.schema import MIGRATIONS, RENUMBERED
from fleetserve.store.tables import Base

# The same migrations in chain order: under the old ids, and under the ids they have now.
# (None: a migration newer than the old numbering, which no database stamped under it is at.)
OLD_IDS = ("0001", "0003", "0005", "0002", "0006", "0007", "0008", None, None, None, None, None)
NEW_IDS = ("0001", "0002", "0003", "0004", "0005", "0006", "0007", "0008", "0009", "0010", "0011", "0012")


@pytest.fixture(params=["sqlite", "postgres"])
def bare(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Engine]:
    """An empty database (a fresh PostgreSQL schema, dropped after), not migrated."""
    if request.param == "sqlite":
        engine = make_engine(tmp_path / "state.db")
        yield engine
        engine.dispose()
        return
    import psycopg
    from psycopg import sql

    url: str = request.getfixturevalue("postgres_url")
    schema = f"fs_test_{secrets.token_hex(6)}"
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
    engine = make_engine(url, connect_args={"options": f"-csearch_path={schema}"})
    try:
        yield engine
    finally:
        engine.dispose()
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))


def upgrade_to(engine: Engine, revision: str) -> None:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    with engine.begin() as connection:
        config.attributes["connection"] = connection
        command.upgrade(config, revision)


def stamped(engine: Engine) -> list[str]:
    with engine.connect() as conn:
        return list(conn.execute(text("SELECT version_num FROM alembic_version")).scalars())


def test_the_migration_ids_follow_the_chain_in_order() -> None:
    scripts = ScriptDirectory(str(MIGRATIONS))
    chain = [s.revision for s in reversed(list(scripts.walk_revisions()))]
    assert chain == list(NEW_IDS)
    for script in scripts.walk_revisions():
        assert Path(script.path).name.startswith(f"{script.revision}_"), script.path


@pytest.mark.parametrize("numbering", ["old", "new"])
@pytest.mark.parametrize("position", range(1, len(NEW_IDS)))
def test_a_database_at_any_step_under_either_numbering_is_migrated_to_the_head(
    bare: Engine, numbering: str, position: int
) -> None:
    if numbering == "old" and OLD_IDS[position] is None:
        pytest.skip("no database under the old numbering is at this step")
    upgrade_to(bare, NEW_IDS[position])
    if numbering == "old":
        with bare.begin() as conn:
            conn.execute(text("UPDATE alembic_version SET version_num = :old"), {"old": OLD_IDS[position]})

    migrate(bare)

    assert stamped(bare) == [NEW_IDS[-1]]
    with bare.connect() as conn:
        assert compare_metadata(MigrationContext.configure(conn), Base.metadata) == []
    # Fabrics move the change counter (0007); models still do after 0008 added their column.
    store = SqlStore(bare)
    before = store.fleet_changes()
    store.put_fabric(Fabric(name="ib0"))
    assert store.fleet_changes() > before
    before = store.fleet_changes()
    store.put_model(Model(name="m", source="/m.gguf", size="1GB"))
    assert store.fleet_changes() > before


def test_an_old_id_taken_for_granted_as_old_is_no_migration_of_today() -> None:
    """An old id mapped without a probe is read as old wherever it is stamped: a new migration of
    that id must bring its probe (or the mapping go), else its databases would be migrated back."""
    revisions = {s.revision for s in ScriptDirectory(str(MIGRATIONS)).walk_revisions()}
    assert {old for old, entry in RENUMBERED.items() if entry.is_new is None} & revisions == set()
    assert {old for old, entry in RENUMBERED.items() if entry.is_new is not None} <= revisions


def test_a_node_enrolled_before_hardware_approvals_is_judged_against_its_stored_facts(bare: Engine) -> None:
    """0009 records no approved hardware for the nodes enrolled before it: the next registration
    of one is judged against the facts its node row holds, which become its approved facts."""
    from datetime import UTC, datetime

    from sqlalchemy import insert

    from builders import cpu_8c_32g
    from fleetserve.inventory.approval import Hardware
    from fleetserve.store.base import doc
    from fleetserve.store.tables import NodeCredentialRow, NodeRow

    upgrade_to(bare, "0008")
    now = datetime.now(UTC)
    with bare.begin() as conn:  # the columns 0008 has: what an enrolment wrote then
        conn.execute(
            insert(NodeRow.__table__).values(
                name="n1", spec=doc(cpu_8c_32g("n1"), exclude={"state", "cordon"}), state="Ready", epoch=1
            )
        )
        conn.execute(
            insert(NodeCredentialRow.__table__).values(
                node="n1", token_hash="ab" * 32, issued_at=now, approved=False
            )
        )

    migrate(bare)

    store = SqlStore(bare)
    assert store.enrolments()[0].approved_hardware is None
    held = store.reregister(cpu_8c_32g("n1", cpu={"cores": 1000, "memory": "32Gi"}), now, source="10.0.0.1")
    assert held.held is not None and held.held.approved == Hardware.of(cpu_8c_32g("n1"))
    assert store.get_node("n1").cpu.cores == 8


def test_a_replicas_reported_adapters_move_the_change_counter(bare: Engine) -> None:
    """The gateway routes an adapter to the replicas whose agents report it loaded (0011)."""
    migrate(bare)
    with bare.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO replicas (name, deployment, profile, state, spec, status) VALUES "
                "('r-0', 'r', 'p', 'Running', '{}', '{\"port\": 1}')"
            )
        )
    store = SqlStore(bare)
    before = store.fleet_changes()
    with bare.begin() as conn:
        conn.execute(text('UPDATE replicas SET status = \'{"port": 1, "adapters": ["a"]}\''))
    assert store.fleet_changes() > before
    before = store.fleet_changes()
    with bare.begin() as conn:
        conn.execute(text('UPDATE replicas SET status = \'{"port": 1, "adapters": ["a"], "inFlight": 3}\''))
    assert store.fleet_changes() == before


def test_a_replicas_kv_cache_clears_move_the_change_counter(bare: Engine) -> None:
    """A vLLM replica's engine dropped its whole cache (its agent's kvCache.clears): every gateway
    reads it within a refresh; its held block counts, which move with every request, do not (0012)."""
    migrate(bare)
    status = '{"port": 1, "kvCache": {"blocks": %d, "blockTokens": 16, "clears": %d}}'
    with bare.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO replicas (name, deployment, profile, state, spec, status) VALUES "
                f"('r-0', 'r', 'p', 'Running', '{{}}', '{status % (5, 0)}')"
            )
        )
    store = SqlStore(bare)
    before = store.fleet_changes()
    with bare.begin() as conn:
        conn.execute(text(f"UPDATE replicas SET status = '{status % (9, 0)}'"))
    assert store.fleet_changes() == before
    with bare.begin() as conn:
        conn.execute(text(f"UPDATE replicas SET status = '{status % (0, 1)}'"))
    assert store.fleet_changes() > before
