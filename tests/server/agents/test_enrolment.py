"""Node identity on the agents' API, in process (the real app over a real SQLite store): the join
token only enrols, a node's credential speaks for its own node only, approvals, epochs, GPU
samples, body limits and caps, and admin/join token rotation.

The same attacks against real server and agent processes are in tests/e2e/test_attacks.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from fastapi.testclient import TestClient

from builders import cpu_8c_32g, gpu_host_8c_64g
from fleetserve.protocol import MAX_DEVICES, MAX_GPU_SAMPLES, MAX_LABELS
from fleetserve.server.agents.enrolment import EnrolmentPolicy, parse_networks
from fleetserve.server.app import create_app
from fleetserve.spec.nodeparts import MAX_ENGINE_DEVICES, MAX_ENGINES
from fleetserve.spec.resources import Node, NodeState
from fleetserve.store import SqlStore, TokenKind
from fleetserve.store.audit import AuditAction

AGENT = "/api/v1/agent"
SOURCE = ("10.0.0.5", 40000)  # where the test client's requests come from


@dataclass
class Plane:
    """The app in a TestClient, its store, the admin and join tokens' headers, and the
    credentials of the nodes enrolled so far (as headers)."""

    client: TestClient
    store: SqlStore
    admin: dict[str, str]
    join: dict[str, str]
    nodes: dict[str, dict[str, str]] = field(default_factory=dict)

    def enrol(self, node: Node, headers: dict[str, str] | None = None) -> Any:
        """POST register; keeps the credential an enrolment returns. The raw response."""
        doc = node.model_dump(mode="json", by_alias=True)
        response = self.client.post(f"{AGENT}/register", json=doc, headers=headers or self.join)
        if response.status_code == 200 and response.json()["credential"]:
            self.nodes[node.name] = bearer(response.json()["credential"])
        return response


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def make_plane(store: SqlStore, policy: EnrolmentPolicy) -> Iterator[Plane]:
    now = datetime.now(UTC)
    admin = store.create_token(TokenKind.ADMIN, now).plaintext
    join = store.create_token(TokenKind.JOIN, now).plaintext
    app = create_app(store, enrolment=policy)
    with TestClient(app, raise_server_exceptions=False, client=SOURCE) as client:
        yield Plane(client, store, bearer(admin), bearer(join))


@pytest.fixture
def plane(sqlite_store: SqlStore) -> Iterator[Plane]:
    """New names enrol without an approval (``--approve-new-nodes``)."""
    yield from make_plane(sqlite_store, EnrolmentPolicy(approve_new=True))


@pytest.fixture
def strict(sqlite_store: SqlStore) -> Iterator[Plane]:
    """The default policy: every enrolment needs an operator's approval."""
    yield from make_plane(sqlite_store, EnrolmentPolicy())


def error_of(response: Any, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error: dict[str, Any] = response.json()["error"]
    return error


# --- the join token only enrols ------------------------------------------------------------------


def test_enrolment_returns_a_credential_bound_to_the_name_and_stored_only_hashed(plane: Plane) -> None:
    response = plane.enrol(cpu_8c_32g("n1"))
    assert response.status_code == 200, response.text
    credential = response.json()["credential"]
    assert credential.startswith("fs_node_") and len(credential) > 40
    assert plane.store.node_for_credential(credential) == "n1"
    with plane.store.engine.connect() as conn:
        dumped = " ".join(str(row) for row in conn.exec_driver_sql("SELECT * FROM node_credentials"))
    assert credential not in dumped and "n1" in dumped
    # Registering again with the credential gives no new one.
    again = plane.enrol(cpu_8c_32g("n1"), plane.nodes["n1"])
    assert again.status_code == 200, again.text
    assert (again.json()["epoch"], again.json()["credential"]) == (2, None)


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("POST", "/heartbeat", {"node": "n1", "epoch": 1}),
        ("POST", "/status", {"node": "n1", "epoch": 1}),
        ("GET", "/assignments?node=n1&epoch=1", None),
        ("GET", "/models/m/file", None),
        ("GET", "/models/m", None),
    ],
    ids=["heartbeat", "status", "assignments", "model file", "model document"],
)
def test_the_join_token_is_refused_on_every_route_but_enrolment(
    plane: Plane, method: str, path: str, body: dict[str, Any] | None
) -> None:
    assert plane.enrol(cpu_8c_32g("n1")).status_code == 200
    error = error_of(plane.client.request(method, AGENT + path, json=body, headers=plane.join), 401)
    assert "only enrols" in error["message"]


def test_a_second_enrolment_under_a_taken_name_is_refused_and_the_node_keeps_its_credential(
    plane: Plane,
) -> None:
    assert plane.enrol(cpu_8c_32g("n1")).status_code == 200
    before = plane.client.get("/api/v1/nodes/n1", headers=plane.admin).json()

    impostor = cpu_8c_32g("n1", labels={"owned": "yes"})
    error = error_of(plane.enrol(impostor), 409)
    assert error["type"] == "name_taken"
    assert "fleetserve nodes approve n1" in error["message"]
    assert "epoch" not in error["message"]

    after = plane.client.get("/api/v1/nodes/n1", headers=plane.admin).json()
    assert after == before  # same epoch, same labels: nothing changed
    beat = plane.client.post(f"{AGENT}/heartbeat", json={"node": "n1", "epoch": 1}, headers=plane.nodes["n1"])
    assert beat.status_code == 200, beat.text


def test_an_approval_lets_one_re_enrolment_through_and_retires_the_old_credential(plane: Plane) -> None:
    assert plane.enrol(cpu_8c_32g("n1")).status_code == 200
    old = plane.nodes["n1"]
    approved = plane.client.post("/api/v1/nodes/n1/approve", headers=plane.admin)
    assert approved.status_code == 200, approved.text
    assert approved.json()["approved"] is True

    moved = plane.enrol(cpu_8c_32g("n1"))
    assert moved.status_code == 200, moved.text
    assert moved.json()["epoch"] == 2
    error = error_of(
        plane.client.post(f"{AGENT}/heartbeat", json={"node": "n1", "epoch": 2}, headers=old), 401
    )
    assert "not a node credential" in error["message"]
    # One approval, one enrolment: the next one is refused again.
    assert error_of(plane.enrol(cpu_8c_32g("n1")), 409)["type"] == "name_taken"


def test_an_enrolled_node_re_registering_with_1000_cores_is_held_and_draws_nothing(plane: Plane) -> None:
    """The audit's attack: a node enrolled (approved) as 8 cores registers again, with its own
    credential, claiming 1,000. It stays registered as 8 cores, the answer says what is held,
    `nodes enrolments` shows both, and three 16-core replicas are not placed on it; the operator's
    approval applies the claim."""
    from fleetserve.server.reconciler.loop import Reconciler

    docs = [
        {"kind": "Model", "name": "tiny", "source": "/models/tiny.gguf", "format": "gguf", "size": "1MB"},
        {
            "kind": "Deployment", "name": "tiny", "model": "tiny", "replicas": 3,
            "profiles": [{"name": "cpu", "engine": "llama.cpp", "cpu": {"cores": 16}}],
        },
    ]  # fmt: skip
    assert (
        plane.client.post("/api/v1/apply", json={"documents": docs}, headers=plane.admin).status_code == 200
    )
    assert plane.enrol(cpu_8c_32g("n1")).status_code == 200
    inflated = cpu_8c_32g("n1", cpu={"cores": 1000, "memory": "32Gi"}, labels={"gpu": "lots"})

    answer = plane.enrol(inflated, plane.nodes["n1"])

    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["held"] == {
        "approved": {"cores": 8, "memory": 32 << 30, "devices": {}},
        "claimed": {"cores": 1000, "memory": 32 << 30, "devices": {}},
    }
    assert body["node"]["cpu"]["cores"] == 8
    assert plane.client.get("/api/v1/nodes/n1", headers=plane.admin).json()["cpu"]["cores"] == 8
    (listed,) = plane.client.get("/api/v1/enrolments", headers=plane.admin).json()
    assert (listed["approvedHardware"]["cores"], listed["claimedHardware"]["cores"]) == (8, 1000)
    assert listed["heldAt"] is not None
    plane.client.post(
        f"{AGENT}/heartbeat", json={"node": "n1", "epoch": body["epoch"]}, headers=plane.nodes["n1"]
    )
    Reconciler(plane.store).run_once()
    assert plane.store.replicas() == []  # 0 of 3 replicas drawn
    (held,) = plane.store.events(action=AuditAction.NODE_HARDWARE_HELD)
    assert (held.actor, held.target, held.source) == ("node n1", "Node/n1", SOURCE[0])

    approved = plane.client.post("/api/v1/nodes/n1/approve", headers=plane.admin)
    assert approved.status_code == 200, approved.text
    assert (approved.json()["appliedHardware"]["cores"], approved.json()["claimedHardware"]) == (1000, None)
    assert approved.json()["approved"] is False  # no re-enrolment was let through
    assert error_of(plane.enrol(cpu_8c_32g("n1")), 409)["type"] == "name_taken"
    assert plane.client.get("/api/v1/nodes/n1", headers=plane.admin).json()["cpu"]["cores"] == 1000
    (event,) = plane.store.events(action=AuditAction.NODE_APPROVE)
    assert event.detail == {"hardware": {"cores": 1000, "memory": 32 << 30, "devices": {}}}


def test_an_operators_apply_approves_the_hardware_of_the_node_it_declares(plane: Plane) -> None:
    assert plane.enrol(cpu_8c_32g("n1")).status_code == 200
    declared = cpu_8c_32g("n1", cpu={"cores": 64, "memory": "32Gi"}).model_dump(mode="json", by_alias=True)
    applied = plane.client.post("/api/v1/apply", json={"documents": [declared]}, headers=plane.admin)
    assert applied.status_code == 200, applied.text
    answer = plane.enrol(cpu_8c_32g("n1", cpu={"cores": 64, "memory": "32Gi"}), plane.nodes["n1"])
    assert answer.status_code == 200, answer.text
    assert (answer.json()["held"], answer.json()["node"]["cpu"]["cores"]) == (None, 64)


def test_a_node_an_operator_declared_is_a_taken_name(plane: Plane) -> None:
    doc = cpu_8c_32g("declared").model_dump(mode="json", by_alias=True)
    applied = plane.client.post("/api/v1/apply", json={"documents": [doc]}, headers=plane.admin)
    assert applied.status_code == 200, applied.text
    assert error_of(plane.enrol(cpu_8c_32g("declared")), 409)["type"] == "name_taken"


def test_by_default_a_new_name_waits_for_approval_and_is_listed_until_approved(strict: Plane) -> None:
    big = Node.model_validate({"name": "huge", "cpu": {"cores": 1000, "memory": "4TiB"}})
    error = error_of(strict.enrol(big), 403)
    assert error["type"] == "approval_required"
    assert "fleetserve nodes approve huge" in error["message"]
    assert strict.client.get("/api/v1/nodes", headers=strict.admin).json() == []
    waiting = strict.client.get("/api/v1/enrolments", headers=strict.admin).json()
    assert [(e["node"], e["enrolled"], e["approved"], e["requestedFrom"]) for e in waiting] == [
        ("huge", False, False, SOURCE[0])
    ]

    assert strict.client.post("/api/v1/nodes/huge/approve", headers=strict.admin).status_code == 200
    enrolled = strict.enrol(big)
    assert enrolled.status_code == 200, enrolled.text
    listed = strict.client.get("/api/v1/enrolments", headers=strict.admin).json()
    assert [(e["node"], e["enrolled"], e["approved"], e["requestedAt"]) for e in listed] == [
        ("huge", True, False, None)
    ]


# --- a node speaks for itself only ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("POST", "/heartbeat", {"node": "victim", "epoch": 1}),
        ("POST", "/status", {"node": "victim", "epoch": 1, "replicas": {}}),
        ("GET", "/assignments?node=victim&epoch=1", None),
    ],
    ids=["heartbeat", "status", "assignments"],
)
def test_a_node_credential_cannot_speak_for_another_node(
    plane: Plane, method: str, path: str, body: dict[str, Any] | None
) -> None:
    plane.enrol(cpu_8c_32g("victim"))
    plane.enrol(cpu_8c_32g("evil"))
    response = plane.client.request(method, AGENT + path, json=body, headers=plane.nodes["evil"])
    error = error_of(response, 403)
    assert error["message"] == "this credential is node evil's; it cannot speak for node victim"


def test_re_registering_under_another_name_with_a_credential_is_refused(plane: Plane) -> None:
    plane.enrol(cpu_8c_32g("victim"))
    plane.enrol(cpu_8c_32g("evil"))
    error_of(
        plane.enrol(cpu_8c_32g("victim", cpu={"cores": 1000, "memory": "1TiB"}), plane.nodes["evil"]), 403
    )
    assert plane.client.get("/api/v1/nodes/victim", headers=plane.admin).json()["cpu"]["cores"] == 8


def test_a_report_naming_another_nodes_replica_changes_nothing_and_tells_to_stop_it(plane: Plane) -> None:
    docs = [
        cpu_8c_32g("victim").model_dump(mode="json", by_alias=True),
        {"kind": "Model", "name": "tiny", "source": "/models/tiny.gguf", "format": "gguf", "size": "1MB"},
        {
            "kind": "Deployment", "name": "tiny", "model": "tiny", "replicas": 1,
            "profiles": [{"name": "cpu", "engine": "llama.cpp", "cpu": {"cores": 1}}],
        },
    ]  # fmt: skip
    assert (
        plane.client.post("/api/v1/apply", json={"documents": docs[1:]}, headers=plane.admin).status_code
        == 200
    )
    plane.enrol(cpu_8c_32g("victim"))
    from fleetserve.server.reconciler.loop import Reconciler

    Reconciler(plane.store).run_once()
    (replica,) = plane.store.replicas()
    assert replica.shards[0].node == "victim"
    plane.enrol(cpu_8c_32g("evil"))
    evil_epoch = plane.store.epoch("evil")
    lie = {
        "node": "evil",
        "epoch": evil_epoch,
        "replicas": {replica.name: {"state": "Running", "port": 6666}},
    }
    response = plane.client.post(f"{AGENT}/status", json=lie, headers=plane.nodes["evil"])
    assert response.status_code == 200, response.text
    assert response.json() == {"stop": [replica.name]}
    assert plane.store.get_replica(replica.name).state.value == "Pending"
    assert plane.store.replica_status(replica.name).port is None
    # Nor may it fetch the victim's model.
    for path in ("/models/tiny", "/models/tiny/file"):
        error = error_of(plane.client.get(AGENT + path, headers=plane.nodes["evil"]), 403)
        assert error["message"] == "model tiny is not served by a replica assigned to node evil"


# --- epochs ------------------------------------------------------------------------------------


def test_a_heartbeat_without_an_epoch_is_a_422_and_a_dead_node_stays_dead(plane: Plane) -> None:
    plane.enrol(cpu_8c_32g("n1"))
    plane.store.set_state("n1", NodeState.LOST)
    no_epoch = plane.client.post(f"{AGENT}/heartbeat", json={"node": "n1"}, headers=plane.nodes["n1"])
    error = error_of(no_epoch, 422)
    assert [p["field"] for p in error["problems"]] == ["epoch"]
    right = plane.client.post(
        f"{AGENT}/heartbeat", json={"node": "n1", "epoch": 1}, headers=plane.nodes["n1"]
    )
    error = error_of(right, 409)
    assert error["message"] == "node n1 was marked Lost while silent; register again"
    assert plane.store.get_node("n1").state is NodeState.LOST
    stale = plane.client.post(
        f"{AGENT}/heartbeat", json={"node": "n1", "epoch": 7}, headers=plane.nodes["n1"]
    )
    assert "1" not in error_of(stale, 409)["message"].replace("n1", "")  # the epoch is never told


def test_a_not_ready_nodes_heartbeat_at_its_epoch_makes_it_ready_without_registering(plane: Plane) -> None:
    """Nothing is moved away from a NotReady node (only a Lost one's replicas are re-placed): its
    agent's next call at its epoch is a heartbeat like any other, and the node is Ready again."""
    plane.enrol(cpu_8c_32g("n1"))
    plane.store.set_state("n1", NodeState.NOT_READY)
    right = plane.client.post(
        f"{AGENT}/heartbeat", json={"node": "n1", "epoch": 1}, headers=plane.nodes["n1"]
    )
    assert right.status_code == 200, right.text
    node = plane.store.get_node("n1")
    assert node.state is NodeState.READY
    assert {h.name: h.epoch for h in plane.store.node_heartbeats()}["n1"] == 1  # no new registration


# --- GPU samples ---------------------------------------------------------------------------------


def sample(node: str, device: str) -> dict[str, Any]:
    labels = {"node": node, "device": device, "driver": "nvidia", "class": "h100"}
    return {"name": "fleetserve_gpu_utilization_ratio", "labels": labels, "value": 0.5}


@pytest.mark.parametrize(
    ("samples", "field_name"),
    [
        ([sample("victim", "0")], "gpuMetrics[0].labels.node"),
        ([sample("gpu", "0"), sample("gpu", "7")], "gpuMetrics[1].labels.device"),
    ],
    ids=["labelled as another node", "a device the node does not have"],
)
def test_gpu_samples_of_anything_but_the_nodes_own_devices_are_refused(
    plane: Plane, samples: list[dict[str, Any]], field_name: str
) -> None:
    plane.enrol(cpu_8c_32g("victim"))
    plane.enrol(gpu_host_8c_64g("gpu", "h100", count=2))
    report = {"node": "gpu", "epoch": 1, "gpuMetrics": samples}
    error = error_of(plane.client.post(f"{AGENT}/status", json=report, headers=plane.nodes["gpu"]), 422)
    assert field_name in [p["field"] for p in error["problems"]]
    assert plane.store.agent_status("gpu").gpu_metrics == []


def test_own_gpu_samples_are_kept_while_ready_and_dropped_when_the_node_leaves_ready(plane: Plane) -> None:
    plane.enrol(gpu_host_8c_64g("gpu", "h100", count=2))
    report = {"node": "gpu", "epoch": 1, "gpuMetrics": [sample("gpu", "0"), sample("gpu", "1")]}
    assert plane.client.post(f"{AGENT}/status", json=report, headers=plane.nodes["gpu"]).status_code == 200
    assert len(plane.store.agent_status("gpu").gpu_metrics) == 2
    plane.store.set_state("gpu", NodeState.NOT_READY)
    assert plane.store.agent_status("gpu").gpu_metrics == []


# --- bounds ----------------------------------------------------------------------------------------


def test_a_body_over_its_routes_limit_is_a_413_naming_the_limit_before_anything_is_stored(
    plane: Plane,
) -> None:
    doc = cpu_8c_32g("fat").model_dump(mode="json", by_alias=True)
    doc["labels"] = {"padding": "x" * (300 * 1024)}
    error = error_of(plane.client.post(f"{AGENT}/register", json=doc, headers=plane.join), 413)
    assert (
        error["message"]
        == "the body of POST /api/v1/agent/register is over its limit of 256 KiB (262144 bytes)"
    )

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
        for _ in range(100):
            yield b" " * 4096

    headers = {**plane.join, "Content-Type": "application/json"}
    response = plane.client.post(f"{AGENT}/register", content=chunks(), headers=headers)
    assert error_of(response, 413)["type"] == "body_too_large"
    assert plane.client.get("/api/v1/nodes", headers=plane.admin).json() == []


@pytest.mark.parametrize(
    ("doc", "field_name", "limit"),
    [
        ({"labels": {f"k{i}": "v" for i in range(MAX_LABELS + 1)}}, "labels", MAX_LABELS),
        ({"gpus": [{"class": "h100", "count": MAX_DEVICES + 1}]}, "devices", MAX_DEVICES),
        ({"hcas": [{"name": f"mlx5_{i}", "fabric": "ib"} for i in range(65)]}, "hcas", 64),
        ({"engines": [{"engine": "vllm", "variants": ["cpu"]}] * (MAX_ENGINES + 1)}, "engines", MAX_ENGINES),
        (
            {"engines": [{"engine": "llama.cpp", "devices": [{"name": "CUDA0"}] * (MAX_ENGINE_DEVICES + 1)}]},
            "engines.0.devices",
            MAX_ENGINE_DEVICES,
        ),
    ],
    ids=["labels", "devices", "HCAs", "engines", "an-engines-devices"],
)
def test_a_node_document_over_a_cap_is_a_422_naming_the_field_and_the_cap(
    plane: Plane, doc: dict[str, Any], field_name: str, limit: int
) -> None:
    body = {"kind": "Node", "name": "n1", "cpu": {"cores": 8, "memory": "8GiB"}, **doc}
    error = error_of(plane.client.post(f"{AGENT}/register", json=body, headers=plane.join), 422)
    (problem,) = [p for p in error["problems"] if p["field"] == field_name]
    assert f"at most {limit} " in problem["message"]


@pytest.mark.parametrize(
    "engine",
    [
        pytest.param({"engine": "sglang", "variants": ["cuda"]}, id="an-engine-no-row-has"),
        pytest.param({"engine": "vllm", "variants": ["sycl"]}, id="a-variant-no-row-has"),
        pytest.param({"engine": "vllm", "version": "x" * 129}, id="a-version-over-its-cap"),
        pytest.param({"engine": "vllm", "version": "0.1\x00"}, id="a-version-holding-nul"),
    ],
)
def test_an_agent_claiming_engines_outside_the_table_is_refused(plane: Plane, engine: dict[str, Any]) -> None:
    body = {"kind": "Node", "name": "n1", "cpu": {"cores": 8, "memory": "8GiB"}, "engines": [engine]}
    error_of(plane.client.post(f"{AGENT}/register", json=body, headers=plane.join), 422)
    assert plane.client.get("/api/v1/nodes", headers=plane.admin).json() == []


def test_more_gpu_samples_than_the_cap_is_a_422_naming_it(plane: Plane) -> None:
    plane.enrol(gpu_host_8c_64g("gpu", "h100", count=2))
    report = {"node": "gpu", "epoch": 1, "gpuMetrics": [sample("gpu", "0")] * (MAX_GPU_SAMPLES + 1)}
    error = error_of(plane.client.post(f"{AGENT}/status", json=report, headers=plane.nodes["gpu"]), 422)
    (problem,) = error["problems"]
    assert problem["field"] == "gpuMetrics" and f"at most {MAX_GPU_SAMPLES} " in problem["message"]


# --- addresses -------------------------------------------------------------------------------------


def test_a_node_must_give_the_address_it_connects_from(plane: Plane) -> None:
    error = error_of(plane.enrol(cpu_8c_32g("n1", address="10.9.9.9")), 403)
    assert "10.9.9.9" in error["message"] and "--node-address-allow" in error["message"]
    assert plane.enrol(cpu_8c_32g("n1", address=SOURCE[0])).status_code == 200


def test_an_allowed_network_admits_addresses_other_than_the_source(sqlite_store: SqlStore) -> None:
    policy = EnrolmentPolicy(approve_new=True, address_allow=parse_networks(["192.168.7.0/24"]))
    for plane in make_plane(sqlite_store, policy):
        assert plane.enrol(cpu_8c_32g("n1", address="192.168.7.20")).status_code == 200
        assert plane.enrol(cpu_8c_32g("n2", address="192.168.8.20")).status_code == 403


# --- admin and join tokens -------------------------------------------------------------------------


def test_tokens_are_created_listed_and_revoked_and_an_expired_join_token_is_refused(plane: Plane) -> None:
    created = plane.client.post(
        "/api/v1/tokens", json={"kind": "join", "expiresIn": 3600}, headers=plane.admin
    )
    assert created.status_code == 200, created.text
    fresh = created.json()
    assert fresh["token"].startswith("fs_join_") and fresh["expiresAt"] is not None
    assert plane.enrol(cpu_8c_32g("n1"), bearer(fresh["token"])).status_code == 200
    listed = plane.client.get("/api/v1/tokens", headers=plane.admin).json()
    assert all("token" not in t for t in listed) and len(listed) == 3

    past = plane.store.create_token(
        TokenKind.JOIN, datetime.now(UTC) - timedelta(hours=2), datetime.now(UTC) - timedelta(hours=1)
    )
    error_of(plane.enrol(cpu_8c_32g("n2"), bearer(past.plaintext)), 401)

    assert plane.client.delete(f"/api/v1/tokens/{fresh['id']}", headers=plane.admin).status_code == 200
    error_of(plane.enrol(cpu_8c_32g("n3"), bearer(fresh["token"])), 401)
    # The node it enrolled keeps its own credential.
    beat = plane.client.post(f"{AGENT}/heartbeat", json={"node": "n1", "epoch": 1}, headers=plane.nodes["n1"])
    assert beat.status_code == 200, beat.text


def test_the_last_valid_admin_token_cannot_be_revoked_but_a_rotated_one_can(plane: Plane) -> None:
    (admin_id,) = [
        t["id"]
        for t in plane.client.get("/api/v1/tokens", headers=plane.admin).json()
        if t["kind"] == "admin"
    ]
    error = error_of(plane.client.delete(f"/api/v1/tokens/{admin_id}", headers=plane.admin), 422)
    assert "last valid admin token" in error["problems"][0]["message"]
    new = plane.client.post("/api/v1/tokens", json={"kind": "admin"}, headers=plane.admin).json()
    assert plane.client.delete(f"/api/v1/tokens/{admin_id}", headers=bearer(new["token"])).status_code == 200
    error_of(plane.client.get("/api/v1/nodes", headers=plane.admin), 401)
    assert plane.client.get("/api/v1/nodes", headers=bearer(new["token"])).status_code == 200
