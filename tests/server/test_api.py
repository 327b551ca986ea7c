"""The control plane's HTTP API, in process: the real FastAPI app over a real store.

Every test runs on SQLite and on PostgreSQL (the ``store`` fixture behind ``api``). The reconciler
is driven by hand (``Reconciler.run_once``) where a test needs replicas.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import pytest
from fastapi.testclient import TestClient

from fleetserve.server.agents.enrolment import EnrolmentPolicy
from fleetserve.server.app import create_app
from fleetserve.server.reconciler.loop import CycleResult, Reconciler
from fleetserve.store import SqlStore, TokenKind

T0 = datetime(2025, 6, 1, 12, 0, tzinfo=UTC)

ADMIN_PATHS = {
    "/api/v1/apply",
    "/api/v1/classes",
    "/api/v1/classes/{name}",
    "/api/v1/fabrics",
    "/api/v1/nodes",
    "/api/v1/nodes/{name}",
    "/api/v1/nodes/{name}/cordon",
    "/api/v1/nodes/{name}/uncordon",
    "/api/v1/nodes/{name}/drain",
    "/api/v1/models",
    "/api/v1/models/{name}",
    "/api/v1/deployments",
    "/api/v1/deployments/{name}",
    "/api/v1/deployments/{name}/explain",
    "/api/v1/deployments/{name}/undo",
    "/api/v1/decisions",
    "/api/v1/replicas",
    "/api/v1/replicas/{name}",
    "/api/v1/endpoints",
    "/api/v1/endpoints/{name}",
}
AGENT_PATHS = {"/api/v1/agent/register", "/api/v1/agent/heartbeat"}


@dataclass
class Api:
    """The app in a TestClient, its store, and one token of each kind."""

    client: TestClient
    store: SqlStore
    admin_token: str
    join_token: str
    admin: dict[str, str] = field(init=False)
    join: dict[str, str] = field(init=False)
    reconciler: Reconciler = field(init=False)
    # Each enrolled node's credential, as an Authorization header.
    nodes: dict[str, dict[str, str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.admin = {"Authorization": f"Bearer {self.admin_token}"}
        self.join = {"Authorization": f"Bearer {self.join_token}"}
        # One reconciler for the whole test: it keeps the leader lease from cycle to cycle.
        self.reconciler = Reconciler(self.store)

    def reconcile(self) -> CycleResult:
        """One reconciler cycle, which must lead and meet no conflict."""
        result = self.reconciler.run_once()
        assert result.leader and not result.conflicts, result
        return result

    def get(self, path: str) -> Any:
        """GET an admin route that must answer 200; its JSON."""
        response = self.client.get(path, headers=self.admin)
        assert response.status_code == 200, response.text
        return response.json()

    def apply(self, documents: list[dict[str, Any]]) -> list[dict[str, str]]:
        """Apply documents that must be accepted; the per-document results."""
        response = self.client.post("/api/v1/apply", json={"documents": documents}, headers=self.admin)
        assert response.status_code == 200, response.text
        applied: list[dict[str, str]] = response.json()["applied"]
        return applied


@pytest.fixture
def api(store: SqlStore) -> Iterator[Api]:
    """The real app over the real store (SQLite and PostgreSQL), with an admin and a join token;
    new node names enrol without an approval (the enrolment tests are in test_enrolment.py).

    Server exceptions come back as 500 answers, as a client would see them, not as raised errors."""
    admin = store.create_token(TokenKind.ADMIN, T0).plaintext
    join = store.create_token(TokenKind.JOIN, T0).plaintext
    app = create_app(store, enrolment=EnrolmentPolicy(approve_new=True))
    with TestClient(app, raise_server_exceptions=False) as client:
        yield Api(client, store, admin, join)


def assert_error(response: Any, status: int, kind: str | None = None) -> dict[str, Any]:
    """The response is ``status`` with the one error shape; its ``error`` object."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}, body
    error: dict[str, Any] = body["error"]
    assert set(error) == {"type", "message", "problems"}, error
    assert isinstance(error["message"], str) and error["message"], error
    assert isinstance(error["problems"], list), error
    for problem in error["problems"]:
        assert set(problem) == {"location", "field", "message"}, problem
    if kind is not None:
        assert error["type"] == kind, error
    return error


def node_doc(name: str, cores: int = 16, **extra: Any) -> dict[str, Any]:
    return {"kind": "Node", "name": name, "cpu": {"cores": cores, "memory": "64GiB"}, **extra}


def state_of(api: Api) -> dict[str, Any]:
    """Everything the admin API lists: what a refused request must leave untouched."""
    return {
        kind: api.get(f"/api/v1/{kind}")
        for kind in ("classes", "fabrics", "nodes", "models", "deployments", "replicas")
    }


# --- authentication ----------------------------------------------------------------------------


@dataclass(frozen=True)
class AuthCase:
    id: str
    method: str
    path: str
    credentials: str  # none | admin | join | revoked-admin | revoked-join | unknown | basic
    body: Any = None


AUTH_REFUSED = [
    AuthCase("no token on an admin list", "GET", "/api/v1/nodes", "none"),
    AuthCase("no token on apply", "POST", "/api/v1/apply", "none", {"documents": [node_doc("n1")]}),
    AuthCase("a join token on an admin route", "GET", "/api/v1/deployments", "join"),
    AuthCase("a join token on apply", "POST", "/api/v1/apply", "join", {"documents": [node_doc("n1")]}),
    AuthCase("a join token on a delete", "DELETE", "/api/v1/nodes/n1", "join"),
    AuthCase("a revoked admin token", "GET", "/api/v1/classes", "revoked-admin"),
    AuthCase("an unknown token", "GET", "/api/v1/classes", "unknown"),
    AuthCase("a token under another scheme", "GET", "/api/v1/classes", "basic"),
    AuthCase("an admin token on agent register", "POST", "/api/v1/agent/register", "admin", node_doc("n1")),
    AuthCase("an admin token on agent heartbeat", "POST", "/api/v1/agent/heartbeat", "admin", {"node": "n1"}),
    AuthCase("no token on agent register", "POST", "/api/v1/agent/register", "none", node_doc("n1")),
    AuthCase("a revoked join token", "POST", "/api/v1/agent/register", "revoked-join", node_doc("n1")),
]


def credentials_for(api: Api, which: str) -> dict[str, str]:
    match which:
        case "none":
            return {}
        case "admin":
            return api.admin
        case "join":
            return api.join
        case "unknown":
            return {"Authorization": "Bearer fs_admin_this-token-was-never-issued"}
        case "basic":
            return {"Authorization": f"Basic {api.admin_token}"}
        case "revoked-admin" | "revoked-join":
            kind = TokenKind.ADMIN if which == "revoked-admin" else TokenKind.JOIN
            token = api.store.create_token(kind, T0)
            api.store.revoke_token(token.id)
            return {"Authorization": f"Bearer {token.plaintext}"}
    raise AssertionError(which)


@pytest.mark.parametrize("case", AUTH_REFUSED, ids=lambda c: c.id)
def test_requests_without_the_right_token_are_refused_with_401_and_change_nothing(
    api: Api, case: AuthCase
) -> None:
    api.apply([node_doc("n1")])  # something for a refused delete or register to change
    before = state_of(api)
    response = api.client.request(
        case.method, case.path, json=case.body, headers=credentials_for(api, case.credentials)
    )
    error = assert_error(response, 401, "unauthorized")
    assert error["problems"] == []
    assert response.headers["WWW-Authenticate"] == "Bearer"
    assert state_of(api) == before


@pytest.mark.parametrize(
    ("path", "credentials"),
    [("/api/v1/apply", "none"), ("/api/v1/apply", "join"), ("/api/v1/agent/register", "none")],
    ids=["apply without a token", "apply with a join token", "register without a token"],
)
def test_a_request_without_the_right_token_is_a_401_even_when_its_body_is_malformed(
    api: Api, path: str, credentials: str
) -> None:
    # Credentials are checked before anything else: a caller without them learns nothing about
    # what the route would accept (FastAPI parses a JSON body before it runs dependencies).
    headers = {**credentials_for(api, credentials), "Content-Type": "application/json"}
    response = api.client.post(path, content=b'{"documents": [', headers=headers)
    assert_error(response, 401, "unauthorized")


def test_the_right_token_of_each_kind_is_let_through(api: Api) -> None:
    assert api.client.get("/api/v1/nodes", headers=api.admin).status_code == 200
    response = api.client.post("/api/v1/agent/register", json=node_doc("n1"), headers=api.join)
    assert response.status_code == 200, response.text


def test_healthz_needs_no_token(api: Api) -> None:
    response = api.client.get("/healthz")
    assert response.status_code == 200
    assert response.json()["status"] == "ok"


def test_the_openapi_document_is_served_and_lists_every_api_path(api: Api) -> None:
    response = api.client.get("/openapi.json")
    assert response.status_code == 200
    spec = response.json()
    paths = set(spec["paths"])
    assert paths >= ADMIN_PATHS | AGENT_PATHS, sorted((ADMIN_PATHS | AGENT_PATHS) - paths)
    assert {p for p in paths if p.startswith("/api/")} <= {p for p in paths if p.startswith("/api/v1/")}
    schemes = spec["components"]["securitySchemes"]
    assert any(s["type"] == "http" and s["scheme"] == "bearer" for s in schemes.values()), schemes
    assert spec["paths"]["/api/v1/nodes"]["get"]["security"], "admin routes must declare the bearer token"


# --- apply -------------------------------------------------------------------------------------


def test_applying_the_datacenter_example_creates_every_document(
    api: Api, datacenter: list[dict[str, Any]]
) -> None:
    applied = api.apply(datacenter)
    assert sorted((a["kind"], a["name"]) for a in applied) == sorted(
        (d["kind"], d["name"]) for d in datacenter
    )
    assert {a["result"] for a in applied} == {"created"}

    assert [n["name"] for n in api.get("/api/v1/nodes")] == sorted(
        d["name"] for d in datacenter if d["kind"] == "Node"
    )
    deployments = api.get("/api/v1/deployments")
    assert [(d["name"], d["generation"], d["status"]) for d in deployments] == [
        ("gaudi-trial", 1, {}),
        ("llama-405b", 1, {}),
        ("llama-70b", 1, {}),
        ("qwen-7b", 1, {}),
    ]


def test_applying_the_same_documents_again_leaves_them_unchanged(
    api: Api, datacenter: list[dict[str, Any]]
) -> None:
    api.apply(datacenter)
    again = api.apply(datacenter)
    by_kind: dict[str, set[str]] = {}
    for a in again:
        by_kind.setdefault(a["kind"], set()).add(a["result"])
    # A node is re-registered (its hardware facts rewritten), so it reads "configured".
    assert by_kind == {
        "DeviceClass": {"unchanged"},
        "Fabric": {"unchanged"},
        "Node": {"configured"},
        "Model": {"unchanged"},
        "Deployment": {"unchanged"},
    }
    assert {d["generation"] for d in api.get("/api/v1/deployments")} == {1}


def test_changing_a_deployment_configures_it_and_bumps_its_generation(
    api: Api, datacenter: list[dict[str, Any]]
) -> None:
    api.apply(datacenter)
    qwen = next(d for d in datacenter if d["kind"] == "Deployment" and d["name"] == "qwen-7b")
    assert api.apply([{**qwen, "replicas": 2}]) == [
        {"kind": "Deployment", "name": "qwen-7b", "result": "configured"}
    ]
    stored = api.get("/api/v1/deployments/qwen-7b")
    assert (stored["replicas"], stored["generation"]) == ([], 2)


BASE = [
    {"kind": "DeviceClass", "name": "h100", "driver": "gpu.nvidia.com", "memory": "80GiB"},
    node_doc("gpu-1", gpus=[{"class": "h100", "count": 2}]),
    {"kind": "Model", "name": "m", "source": "hf://org/m", "format": "safetensors", "size": "4GB"},
    {
        "kind": "Deployment",
        "name": "chat",
        "model": "m",
        "replicas": 1,
        "profiles": [{"name": "gpu", "engine": "vllm", "deviceClass": "h100"}],
    },
]

# Good documents that go along with the bad one: new objects and a change to a stored one.
GOOD = [
    {"kind": "DeviceClass", "name": "mi300x", "driver": "gpu.amd.com", "memory": "192GiB"},
    {"kind": "Fabric", "name": "ib-0"},
    node_doc("gpu-1", gpus=[{"class": "h100", "count": 4}], labels={"changed": "yes"}),
    node_doc("cpu-9"),
    {"kind": "Model", "name": "m2", "source": "hf://org/m2", "format": "gguf", "size": "2GB"},
    {**BASE[3], "replicas": 5},
]


@dataclass(frozen=True)
class BadDoc:
    id: str
    doc: dict[str, Any]
    location: str  # "{n}" stands for the document's 1-based position in the batch
    field: str
    message: str  # a part of the problem's message


BAD_DOCS = [
    BadDoc(
        "an unknown field",
        node_doc("bad-node", gpuz=4),
        "document {n} (Node bad-node)",
        "gpuz",
        "unknown field; valid fields of Node are:",
    ),
    BadDoc(
        "a vllm profile without a device class",
        {"kind": "Deployment", "name": "bad", "model": "m", "profiles": [{"name": "p", "engine": "vllm"}]},
        "Deployment bad",
        "profiles.p.deviceClass",
        "vllm needs a deviceClass",
    ),
    BadDoc(
        "a deployment naming an unknown model",
        {**BASE[3], "name": "bad", "model": "ghost"},
        "Deployment bad",
        "model",
        "unknown model 'ghost'",
    ),
    BadDoc(
        "a Replica",
        {
            "kind": "Replica",
            "name": "chat-7",
            "deployment": "chat",
            "profile": "gpu",
            "shards": [{"node": "gpu-1"}],
        },
        "document {n} (Replica chat-7)",
        "kind",
        "replicas are created by the reconciler, not applied",
    ),
    BadDoc(
        "a Cluster (for fleetserve kube, not the server)",
        {"kind": "Cluster", "name": "dc", "classes": ["cpu"]},
        "document {n} (Cluster dc)",
        "kind",
        "describes a Kubernetes cluster for `fleetserve kube`",
    ),
    BadDoc(
        "an unknown kind", {"kind": "Pod", "name": "p"}, "document {n}", "kind", "got 'Pod'; valid kinds:"
    ),
    BadDoc(
        "a node with a device of an unknown class",
        node_doc("bad-node", gpus=[{"class": "ghost", "count": 1}]),
        "Node bad-node",
        "devices[0].class",
        "unknown device class 'ghost'",
    ),
    BadDoc(
        "an invalid name",
        {"kind": "Model", "name": "Not_A_Name", "size": "1GB"},
        "document {n} (Model Not_A_Name)",
        "name",
        "is not a valid name",
    ),
]


@pytest.mark.parametrize("bad", BAD_DOCS, ids=lambda b: b.id)
def test_a_batch_with_one_bad_document_is_refused_whole_naming_where_and_why(api: Api, bad: BadDoc) -> None:
    api.apply(BASE)
    before = state_of(api)
    batch = [*GOOD, bad.doc]

    response = api.client.post("/api/v1/apply", json={"documents": batch}, headers=api.admin)

    error = assert_error(response, 422, "invalid_document")
    [problem] = error["problems"]
    assert problem["location"] == bad.location.format(n=len(batch))
    assert problem["field"] == bad.field
    assert bad.message in problem["message"]
    assert state_of(api) == before  # nothing of the batch was written, not even the good documents


def test_every_bad_document_of_a_batch_is_reported_at_once(api: Api) -> None:
    batch = [node_doc("a", gpuz=1), node_doc("b"), {"kind": "Pod", "name": "p"}]
    response = api.client.post("/api/v1/apply", json={"documents": batch}, headers=api.admin)
    error = assert_error(response, 422, "invalid_document")
    assert [(p["location"], p["field"]) for p in error["problems"]] == [
        ("document 1 (Node a)", "gpuz"),
        ("document 3", "kind"),
    ]
    assert api.get("/api/v1/nodes") == []


@dataclass(frozen=True)
class BadBody:
    id: str
    body: bytes


BAD_BODIES = [
    BadBody("malformed JSON", b'{"documents": [{"kind": '),
    BadBody("an empty body", b""),
    BadBody("null", b"null"),
    BadBody("a list instead of an object", b"[]"),
    BadBody("no documents field", b"{}"),
    BadBody("an empty documents list", b'{"documents": []}'),
    BadBody("documents not a list", b'{"documents": "fleet.yaml"}'),
    BadBody("a document that is not a mapping", b'{"documents": ["kind: Node"]}'),
    BadBody(
        "an unknown top-level field", b'{"documents": [{"kind": "Fabric", "name": "f"}], "dryRun": true}'
    ),
    BadBody("a document with no kind", b'{"documents": [{"name": "x"}]}'),
    BadBody("a name that is not a string", b'{"documents": [{"kind": "Fabric", "name": 5}]}'),
    BadBody("an unreadable size", b'{"documents": [{"kind": "Model", "name": "m", "size": "lots"}]}'),
    BadBody("a negative size", b'{"documents": [{"kind": "Model", "name": "m", "size": "-5GB"}]}'),
    BadBody("a NaN size", b'{"documents": [{"kind": "Model", "name": "m", "size": NaN}]}'),
    BadBody(
        "an inverted replica range",
        b'{"documents": [{"kind": "Deployment", "name": "d", "model": "m", "replicas": {"min": 3, "max": 1},'
        b' "profiles": [{"name": "p", "engine": "llama.cpp"}]}]}',
    ),
    BadBody(
        "an unknown engine",
        b'{"documents": [{"kind": "Deployment", "name": "d", "model": "m",'
        b' "profiles": [{"name": "p", "engine": "tgi"}]}]}',
    ),
    BadBody(
        "a huge integer",
        b'{"documents": [{"kind": "Node", "name": "n", "cpu": {"cores": 1e400, "memory": 1}}]}',
    ),
]


@pytest.mark.parametrize("bad", BAD_BODIES, ids=lambda b: b.id)
def test_a_malformed_apply_request_is_a_422_never_a_500(api: Api, bad: BadBody) -> None:
    response = api.client.post(
        "/api/v1/apply", content=bad.body, headers={**api.admin, "Content-Type": "application/json"}
    )
    error = assert_error(response, 422)
    assert error["problems"], error
    assert api.get("/api/v1/models") == []


# A byte quantity (``memory``, ``size``) of a JSON type that is neither a number nor a string, or
# a number too large for an int. Found by this suite: fleetserve.units.parse_bytes raises
# TypeError / OverflowError, which pydantic does not turn into a validation error, so the request
# fails with 500 (and `fleetserve plan -f` with a traceback) instead of naming the field.
BYTE_QUANTITIES_OF_THE_WRONG_TYPE = [
    BadBody(
        "node memory null",
        b'{"documents": [{"kind": "Node", "name": "n", "cpu": {"cores": 4, "memory": null}}]}',
    ),
    BadBody(
        "node memory a list",
        b'{"documents": [{"kind": "Node", "name": "n", "cpu": {"cores": 4, "memory": [1]}}]}',
    ),
    BadBody(
        "class memory an object",
        b'{"documents": [{"kind": "DeviceClass", "name": "c", "driver": "gpu.amd.com", "memory": {"GiB": 80}}]}',
    ),
    BadBody("model size a list", b'{"documents": [{"kind": "Model", "name": "m", "size": [4]}]}'),
    # Python's json module reads 1e400 as an infinite float.
    BadBody("model size infinite", b'{"documents": [{"kind": "Model", "name": "m", "size": 1e400}]}'),
]


@pytest.mark.parametrize("bad", BYTE_QUANTITIES_OF_THE_WRONG_TYPE, ids=lambda b: b.id)
def test_a_byte_quantity_of_the_wrong_json_type_is_a_422_naming_the_field_not_a_500(
    api: Api, bad: BadBody
) -> None:
    response = api.client.post(
        "/api/v1/apply", content=bad.body, headers={**api.admin, "Content-Type": "application/json"}
    )
    error = assert_error(response, 422, "invalid_document")
    assert [p["field"] for p in error["problems"]] in (["cpu.memory"], ["memory"], ["size"])


def test_an_empty_documents_list_names_the_field(api: Api) -> None:
    response = api.client.post("/api/v1/apply", json={"documents": []}, headers=api.admin)
    error = assert_error(response, 422, "invalid_request")
    assert [p["field"] for p in error["problems"]] == ["documents"]


# --- reading -----------------------------------------------------------------------------------


def test_lists_and_single_objects_after_applying_the_datacenter_example(
    api: Api, datacenter: list[dict[str, Any]]
) -> None:
    api.apply(datacenter)

    assert [c["name"] for c in api.get("/api/v1/classes")] == [
        "amd-mi325x",
        "intel-gaudi3",
        "nvidia-h100-80gb",
        "nvidia-h100-pcie",
    ]
    mi325x = api.get("/api/v1/classes/amd-mi325x")
    assert (mi325x["kind"], mi325x["driver"], mi325x["memory"]) == ("DeviceClass", "gpu.amd.com", 256 << 30)
    assert [f["name"] for f in api.get("/api/v1/fabrics")] == ["ib-east", "roce-amd"]

    nodes = api.get("/api/v1/nodes")
    assert len(nodes) == 17
    hgx08 = api.get("/api/v1/nodes/hgx-08")
    assert hgx08["cordon"]["reason"] == "NVSwitch fabric manager errors, RMA ticket 4411"
    assert hgx08["status"] == {
        "epoch": 1,
        "lastHeartbeat": None,
        "allocatedDevices": [],
        "replicas": [],
        "agent": {},
    }
    assert len(hgx08["devices"]) == 8

    assert [m["name"] for m in api.get("/api/v1/models")] == ["llama-3.1-405b", "llama-3.3-70b", "qwen2.5-7b"]
    assert api.get("/api/v1/models/qwen2.5-7b")["format"] == "gguf"

    qwen = api.get("/api/v1/deployments/qwen-7b")
    assert (qwen["model"], qwen["replicas"], qwen["generation"]) == ("qwen2.5-7b", [], 1)
    assert api.get("/api/v1/replicas") == []

    api.reconcile()

    replicas = api.get("/api/v1/replicas")
    assert [r["name"] for r in replicas] == sorted(r.name for r in api.store.replicas())
    assert [r["name"] for r in api.get("/api/v1/replicas?deployment=qwen-7b")] == [
        "qwen-7b-0",
        "qwen-7b-1",
        "qwen-7b-2",
    ]
    one = api.get("/api/v1/replicas/qwen-7b-0")
    assert (one["deployment"], one["profile"], len(one["shards"])) == ("qwen-7b", "cpu", 1)
    assert [r["name"] for r in api.get("/api/v1/deployments/qwen-7b")["replicas"]] == [
        "qwen-7b-0",
        "qwen-7b-1",
        "qwen-7b-2",
    ]
    held = {n["name"]: n["status"] for n in api.get("/api/v1/nodes")}
    for replica in replicas:
        for shard in replica["shards"]:
            assert replica["name"] in held[shard["node"]]["replicas"]
            assert set(shard["devices"]) <= set(held[shard["node"]]["allocatedDevices"])


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/api/v1/classes/ghost"),
        ("GET", "/api/v1/nodes/ghost"),
        ("GET", "/api/v1/models/ghost"),
        ("GET", "/api/v1/deployments/ghost"),
        ("GET", "/api/v1/deployments/ghost/explain"),
        ("GET", "/api/v1/replicas/ghost"),
        ("DELETE", "/api/v1/classes/ghost"),
        ("DELETE", "/api/v1/nodes/ghost"),
        ("DELETE", "/api/v1/models/ghost"),
        ("DELETE", "/api/v1/deployments/ghost"),
        ("POST", "/api/v1/nodes/ghost/cordon"),
        ("POST", "/api/v1/nodes/ghost/uncordon"),
        ("POST", "/api/v1/nodes/ghost/drain"),
    ],
)
def test_an_unknown_name_is_a_404_naming_it(api: Api, method: str, path: str) -> None:
    body = (
        {"reason": "maintenance"} if path.endswith(("cordon", "drain")) and "uncordon" not in path else None
    )
    response = api.client.request(method, path, json=body, headers=api.admin)
    error = assert_error(response, 404, "not_found")
    assert "ghost" in error["message"]


INVALID_NAMES = [
    "UPPER",
    "under_score",
    "-leading",
    "trailing-",
    "a" * 64,
    "sp%20ace",
    "caf%C3%A9",
    "nul%00byte",
    "slash%2Fencoded",
    "%F0%9F%92%A9",
    "semi;colon",
    "%25",
    "..",
]


@pytest.mark.parametrize("name", INVALID_NAMES)
def test_a_name_with_invalid_characters_in_the_path_is_a_4xx_never_a_500(api: Api, name: str) -> None:
    for method, template in [
        ("GET", "/api/v1/classes/{}"),
        ("GET", "/api/v1/nodes/{}"),
        ("GET", "/api/v1/models/{}"),
        ("GET", "/api/v1/deployments/{}"),
        ("GET", "/api/v1/deployments/{}/explain"),
        ("GET", "/api/v1/replicas/{}"),
        ("DELETE", "/api/v1/nodes/{}"),
        ("POST", "/api/v1/nodes/{}/cordon"),
    ]:
        body = {"reason": "r"} if method == "POST" else None
        response = api.client.request(method, template.format(name), json=body, headers=api.admin)
        assert response.status_code in (404, 422), (method, template, response.status_code, response.text)
        assert_error(response, response.status_code)


# --- cordon, drain, delete ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "body",
    [{"reason": ""}, {}, {"reason": None}, {"reason": "x" * 1001}, {"reason": "ok", "by": "me"}, None],
    ids=["empty reason", "no reason", "null reason", "reason too long", "unknown field", "no body"],
)
def test_a_cordon_needs_a_reason(api: Api, body: Any) -> None:
    api.apply([node_doc("n1")])
    response = api.client.post("/api/v1/nodes/n1/cordon", json=body, headers=api.admin)
    error = assert_error(response, 422, "invalid_request")
    assert error["problems"]
    assert api.get("/api/v1/nodes/n1")["cordon"] is None


def test_cordon_and_uncordon_round_trip(api: Api) -> None:
    api.apply([node_doc("n1")])
    response = api.client.post("/api/v1/nodes/n1/cordon", json={"reason": "bad DIMM"}, headers=api.admin)
    assert response.status_code == 200, response.text
    assert response.json()["cordon"] == {"reason": "bad DIMM", "by": "operator"}
    assert api.get("/api/v1/nodes/n1")["cordon"] == {"reason": "bad DIMM", "by": "operator"}

    response = api.client.post("/api/v1/nodes/n1/uncordon", headers=api.admin)
    assert response.status_code == 200, response.text
    assert response.json()["cordon"] is None
    assert api.get("/api/v1/nodes/n1")["cordon"] is None


def holders(api: Api) -> dict[str, list[str]]:
    """Node → the replicas it holds, for nodes that hold any."""
    return {n["name"]: n["status"]["replicas"] for n in api.get("/api/v1/nodes") if n["status"]["replicas"]}


def test_drain_cordons_the_node_and_releases_its_replicas_which_are_placed_elsewhere(
    api: Api, datacenter: list[dict[str, Any]]
) -> None:
    api.apply(datacenter)
    api.reconcile()
    node, held = next((n, rs) for n, rs in holders(api).items() if n.startswith("cpu-"))
    others = sorted({r["name"] for r in api.get("/api/v1/replicas")} - set(held))

    response = api.client.post(
        f"/api/v1/nodes/{node}/drain", json={"reason": "kernel update"}, headers=api.admin
    )

    assert response.status_code == 200, response.text
    assert response.json()["released"] == held
    assert response.json()["cordon"]["reason"] == "kernel update"
    assert sorted(r["name"] for r in api.get("/api/v1/replicas")) == others
    assert api.get(f"/api/v1/nodes/{node}")["status"]["replicas"] == []

    api.reconcile()
    assert node not in holders(api)
    qwen = api.get("/api/v1/deployments/qwen-7b")
    assert len(qwen["replicas"]) == 3
    assert all(s["node"] != node for r in qwen["replicas"] for s in r["shards"])


def test_drain_needs_a_reason_too(api: Api) -> None:
    api.apply([node_doc("n1")])
    assert_error(api.client.post("/api/v1/nodes/n1/drain", json={"reason": ""}, headers=api.admin), 422)
    assert api.get("/api/v1/nodes/n1")["cordon"] is None


def test_deleting_a_node_is_refused_with_409_while_it_holds_replicas(
    api: Api, datacenter: list[dict[str, Any]]
) -> None:
    api.apply(datacenter)
    api.reconcile()
    node, held = next(iter(holders(api).items()))

    error = assert_error(api.client.delete(f"/api/v1/nodes/{node}", headers=api.admin), 409, "conflict")
    assert node in error["message"] and "drain" in error["message"]
    assert api.get(f"/api/v1/nodes/{node}")["status"]["replicas"] == held

    drained = api.client.post(f"/api/v1/nodes/{node}/drain", json={"reason": "retire"}, headers=api.admin)
    assert drained.status_code == 200, drained.text
    deleted = api.client.delete(f"/api/v1/nodes/{node}", headers=api.admin)
    assert deleted.status_code == 200, deleted.text
    assert_error(api.client.get(f"/api/v1/nodes/{node}", headers=api.admin), 404)


def test_a_deleted_deployments_replicas_are_released_by_the_next_cycle(
    api: Api, datacenter: list[dict[str, Any]]
) -> None:
    api.apply(datacenter)
    api.reconcile()
    names = [r["name"] for r in api.get("/api/v1/replicas?deployment=llama-70b")]
    assert len(names) == 4

    response = api.client.delete("/api/v1/deployments/llama-70b", headers=api.admin)
    assert response.status_code == 200, response.text
    assert_error(api.client.get("/api/v1/deployments/llama-70b", headers=api.admin), 404)

    result = api.reconcile()
    assert sorted(result.released) == names
    assert api.get("/api/v1/replicas?deployment=llama-70b") == []
    held = [r for rs in holders(api).values() for r in rs]
    assert not any(r.startswith("llama-70b-") for r in held)


# --- the agent API -----------------------------------------------------------------------------


def register(api: Api, doc: dict[str, Any]) -> dict[str, Any]:
    """Enrol the node with the join token, or register it again with its credential."""
    headers = api.nodes.get(doc["name"], api.join)
    response = api.client.post("/api/v1/agent/register", json=doc, headers=headers)
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    if body["credential"]:
        api.nodes[doc["name"]] = {"Authorization": f"Bearer {body['credential']}"}
    return body


def test_registering_returns_epoch_1_then_2_on_re_registration(api: Api) -> None:
    first = register(api, node_doc("n1"))
    assert (first["epoch"], first["created"], first["node"]["name"]) == (1, True, "n1")
    second = register(api, node_doc("n1", cores=8))
    assert (second["epoch"], second["created"], second["held"]) == (2, False, None)
    stored = api.get("/api/v1/nodes/n1")
    assert stored["cpu"]["cores"] == 8  # less than approved: the hardware facts follow the agent
    assert stored["status"]["epoch"] == 2
    assert stored["status"]["lastHeartbeat"] is not None
    # More than the 16 cores approved at enrolment waits for an approval: the node stays at 16.
    third = register(api, node_doc("n1", cores=32))
    assert (third["epoch"], third["held"]["claimed"]["cores"], third["node"]["cpu"]["cores"]) == (3, 32, 16)
    assert api.get("/api/v1/nodes/n1")["cpu"]["cores"] == 16


def test_re_registering_a_cordoned_node_keeps_the_cordon(api: Api) -> None:
    register(api, node_doc("n1"))
    cordoned = api.client.post("/api/v1/nodes/n1/cordon", json={"reason": "ECC storm"}, headers=api.admin)
    assert cordoned.status_code == 200, cordoned.text

    again = register(api, node_doc("n1", cores=8))

    assert again["node"]["cordon"] == {"reason": "ECC storm", "by": "operator"}
    stored = api.get("/api/v1/nodes/n1")
    assert stored["cordon"] == {"reason": "ECC storm", "by": "operator"}
    assert stored["cpu"]["cores"] == 8


def test_a_heartbeat_from_a_registered_node_is_recorded_and_the_answer_tells_no_epoch(api: Api) -> None:
    register(api, node_doc("n1"))
    beat = {"node": "n1", "epoch": 1}
    response = api.client.post("/api/v1/agent/heartbeat", json=beat, headers=api.nodes["n1"])
    assert response.status_code == 200, response.text
    assert response.json() == {"node": "n1", "ok": True}


def test_a_heartbeat_for_another_node_is_a_403_naming_whose_credential_it_is(api: Api) -> None:
    register(api, node_doc("n1"))
    beat = {"node": "ghost", "epoch": 1}
    error = assert_error(api.client.post("/api/v1/agent/heartbeat", json=beat, headers=api.nodes["n1"]), 403)
    assert "node n1's" in error["message"] and "ghost" in error["message"]


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/api/v1/agent/register", node_doc("n1", gpuz=1)),
        ("/api/v1/agent/register", node_doc("Bad_Name")),
        ("/api/v1/agent/register", {"kind": "Node", "name": "n1"}),
        ("/api/v1/agent/heartbeat", {}),
        ("/api/v1/agent/heartbeat", {"node": ""}),
        ("/api/v1/agent/heartbeat", {"node": "n0", "epoch": 1, "extra": 1}),
        ("/api/v1/agent/heartbeat", {"node": "n0"}),
    ],
    ids=[
        "unknown field",
        "bad name",
        "no cpu",
        "no node",
        "empty node",
        "unknown field in heartbeat",
        "no epoch",
    ],
)
def test_a_malformed_agent_request_is_a_422(api: Api, path: str, body: dict[str, Any]) -> None:
    register(api, node_doc("n0"))
    before = api.get("/api/v1/nodes")
    headers = api.join if path.endswith("/register") else api.nodes["n0"]
    error = assert_error(api.client.post(path, json=body, headers=headers), 422, "invalid_request")
    assert error["problems"]
    assert api.get("/api/v1/nodes") == before


# --- explain -----------------------------------------------------------------------------------


def test_explain_is_empty_until_the_reconciler_decided(api: Api, datacenter: list[dict[str, Any]]) -> None:
    api.apply(datacenter)
    explained = api.get("/api/v1/deployments/qwen-7b/explain")
    assert explained == {
        "deployment": "qwen-7b",
        "generation": 1,
        "status": {},
        "decision": None,
        "decidedAt": None,
    }


def test_explain_returns_the_decision_with_the_placed_replicas(
    api: Api, datacenter: list[dict[str, Any]]
) -> None:
    api.apply(datacenter)
    api.reconcile()

    explained = api.get("/api/v1/deployments/qwen-7b/explain")

    decision = explained["decision"]
    assert decision["deployment"] == "qwen-7b"
    assert [p["replica"] for p in decision["placed"]] == ["qwen-7b-0", "qwen-7b-1", "qwen-7b-2"]
    assert all(p["profile"] == "cpu" and p["shards"] for p in decision["placed"])
    assert explained["status"]["replicas"] == ["qwen-7b-0", "qwen-7b-1", "qwen-7b-2"]
    assert explained["decidedAt"] is not None
    accepted = next(c for c in explained["status"]["conditions"] if c["type"] == "Accepted")
    assert accepted["status"] is True


def test_explain_still_shows_the_placing_decision_after_a_steady_state_cycle(
    api: Api, datacenter: list[dict[str, Any]]
) -> None:
    api.apply(datacenter)
    api.reconcile()
    settled = api.reconcile()  # nothing to do: everything desired already runs
    assert not (settled.allocated or settled.released)

    decision = api.get("/api/v1/deployments/qwen-7b/explain")["decision"]

    # A cycle that only kept what runs must not bury the decision that placed it.
    assert [p["replica"] for p in decision["placed"]] == ["qwen-7b-0", "qwen-7b-1", "qwen-7b-2"]


def test_explain_says_the_gaudi_trial_is_not_accepted_for_unsupported_devices(
    api: Api, datacenter: list[dict[str, Any]]
) -> None:
    api.apply(datacenter)
    api.reconcile()

    explained = api.get("/api/v1/deployments/gaudi-trial/explain")

    accepted = next(c for c in explained["status"]["conditions"] if c["type"] == "Accepted")
    assert (accepted["status"], accepted["reason"]) == (False, "UnsupportedDevices")
    assert "gaudi.intel.com" in accepted["message"]
    assert explained["status"]["replicas"] == []
    assert explained["decision"]["placed"] == []
    assert len(explained["decision"]["unplaced"]) == 1
    assert api.get("/api/v1/replicas?deployment=gaudi-trial") == []


def test_decisions_are_listed_newest_first_and_filtered(api: Api, datacenter: list[dict[str, Any]]) -> None:
    api.apply(datacenter)
    api.reconcile()
    every = api.get("/api/v1/decisions")
    assert {d["deployment"] for d in every} == {"gaudi-trial", "llama-405b", "llama-70b", "qwen-7b"}
    only = api.get("/api/v1/decisions?deployment=qwen-7b&limit=1")
    assert [d["deployment"] for d in only] == ["qwen-7b"]
    assert_error(api.client.get("/api/v1/decisions?limit=0", headers=api.admin), 422)
