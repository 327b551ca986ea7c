"""The attacker with a node of its own: what a replica's engine said of its KV cache
(``kvCache`` in a status report, from its KV events) reaches the gateways only from the agent of
that replica's node. A report for another node's replica is refused (speaking for that node) or
not recorded (speaking for itself: it is told to stop the replica), so no forged clear moves that
replica's engine epoch and no forged count reaches any gateway's model; an unbounded summary is a
422 naming its field. The real app and agents' door, over SQLite and PostgreSQL."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pytest
from fastapi.testclient import TestClient

from builders import cpu_8c_32g
from fleetserve.changegate import ChangeGate
from fleetserve.metrics.exposition import FleetMetrics
from fleetserve.server.agents.enrolment import EnrolmentPolicy
from fleetserve.server.app import create_app
from fleetserve.server.observer import Observer
from fleetserve.server.reconciler.loop import Reconciler
from fleetserve.store import SqlStore, TokenKind

AGENT = "/api/v1/agent"
DOCS = [
    {"kind": "Model", "name": "tiny", "source": "/models/tiny.gguf", "format": "gguf", "size": "1MB"},
    {
        "kind": "Deployment", "name": "tiny", "model": "tiny", "replicas": 1,
        "profiles": [{"name": "cpu", "engine": "llama.cpp", "cpu": {"cores": 1}}],
    },
]  # fmt: skip


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture
def placed(store: SqlStore) -> Iterator[tuple[TestClient, dict[str, dict[str, str]], str]]:
    now = datetime.now(UTC)
    admin = bearer(store.create_token(TokenKind.ADMIN, now).plaintext)
    join = bearer(store.create_token(TokenKind.JOIN, now).plaintext)
    with TestClient(create_app(store, enrolment=EnrolmentPolicy(approve_new=True))) as client:
        nodes = {}
        for name in ("real", "evil"):
            doc = cpu_8c_32g(name).model_dump(mode="json", by_alias=True)
            answer = client.post(f"{AGENT}/register", json=doc, headers=join)
            assert answer.status_code == 200, answer.text
            nodes[name] = bearer(answer.json()["credential"])
        assert client.post("/api/v1/apply", json={"documents": DOCS}, headers=admin).status_code == 200
        store.cordon("evil", "not for the tiny model", "test")
        Reconciler(store).run_once()
        (replica,) = store.replicas()
        assert replica.shards[0].node == "real"
        yield client, nodes, replica.name


def report(node: str, replica: str, **kv: Any) -> dict[str, Any]:
    summary = {"blocks": 40, "blockTokens": 16, "stored": 40, "clears": 0, **kv}
    return {
        "node": node,
        "epoch": 1,
        "replicas": {replica: {"state": "Running", "port": 8001, "kvCache": summary}},
    }


def test_a_forged_kv_report_for_another_nodes_replica_is_refused(store: SqlStore, placed) -> None:
    client, nodes, name = placed
    assert client.post(f"{AGENT}/status", json=report("real", name), headers=nodes["real"]).json() == {
        "stop": []
    }
    observer = Observer(store, FleetMetrics())
    observer.gate = ChangeGate(full_every=0.0, pace=0.0)  # it reads the fleet at every look
    observer.targets()
    assert observer.epochs.get(name, 0) == 0 and observer.reports[name].held_tokens == 40 * 16
    changes = store.fleet_changes()

    # Speaking for the real node with its own credential: refused, nothing read into the store.
    forged = report("real", name, blocks=0, clears=5)
    answer = client.post(f"{AGENT}/status", json=forged, headers=nodes["evil"])
    assert answer.status_code == 403 and answer.json()["error"]["type"] == "forbidden"
    # Speaking for itself of a replica not its own: not recorded; it is told to stop it.
    answer = client.post(
        f"{AGENT}/status", json=report("evil", name, blocks=0, clears=5), headers=nodes["evil"]
    )
    assert answer.status_code == 200 and answer.json() == {"stop": [name]}

    status = store.replica_status(name)
    assert status.kv_cache is not None and status.kv_cache.clears == 0 and status.kv_cache.blocks == 40
    assert store.fleet_changes() == changes
    observer.targets()
    assert observer.epochs.get(name, 0) == 0 and observer.reports[name].held_tokens == 40 * 16

    # The real agent's clear does move the counter, and the observer's epoch.
    answer = client.post(
        f"{AGENT}/status", json=report("real", name, blocks=0, clears=1), headers=nodes["real"]
    )
    assert answer.json() == {"stop": []}
    assert store.fleet_changes() > changes
    observer.targets()
    assert observer.epochs[name] == 1 and observer.reports[name].held_tokens == 0


@pytest.mark.parametrize(
    ("field", "value"),
    [("blocks", -1), ("blocks", 2**31), ("blockTokens", 0), ("clears", -3), ("stored", 2**63), ("extra", 1)],
)
def test_an_unbounded_kv_summary_is_refused_naming_its_field(store: SqlStore, placed, field, value) -> None:
    client, nodes, name = placed
    answer = client.post(
        f"{AGENT}/status", json=report("real", name, **{field: value}), headers=nodes["real"]
    )
    assert answer.status_code == 422, answer.text
    assert field in answer.text
    assert store.replica_status(name).kv_cache is None
