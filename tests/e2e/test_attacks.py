"""Attacks from the same network, against a real ``fleetserve server`` and real ``fleetserve
agent`` processes: one test per attack of issue 13's first paragraph. Each attacker holds a valid
join token (or another node's credential, read from that agent's credential file) and speaks
plain HTTP to the agents' API; each test shows the refusal (status and error type), that nothing
changed, and that the real node is unaffected.

    (a) report another node's replica Running on a port of the attacker's choosing
    (b) re-register an existing node name
    (c) enrol a made-up 1,000-core node; restart an approved node claiming 1,000 cores (issue 34)
    (d) heartbeat without an epoch, for a dead node
    (e) 10,000 GPU series labelled as another node
    (f) a 41 MB node document

Servers run over SQLite with short deadlines (NotReady after 2 s, Lost after 4 s); agents report
every 0.5 s. Every process is stopped at teardown.
"""

from __future__ import annotations

import json
import signal
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from e2e_support import (
    AgentFactory,
    AgentProcess,
    ServerFactory,
    ServerProcess,
    cli_env,
    run_cli,
    short_deadline_args,
    tiny_documents,
    wait_for,
)

pytestmark = pytest.mark.slow

AGENT_API = "/api/v1/agent"


def start_server(servers: ServerFactory, tmp_path: Path, *, approve_new_nodes: bool = True) -> ServerProcess:
    return servers.start(
        f"sqlite:///{tmp_path / 'state.db'}",
        name="server",
        extra_args=short_deadline_args(tmp_path),
        approve_new_nodes=approve_new_nodes,
    )


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def node_doc(name: str, cores: int = 8, **extra: Any) -> dict[str, Any]:
    return {
        "kind": "Node",
        "name": name,
        "address": "127.0.0.1",
        "cpu": {"cores": cores, "memory": "32GiB"},
        **extra,
    }


def admin_get(server: ServerProcess, path: str) -> Any:
    with server.client(timeout=10) as api:
        response = api.get(path)
    assert response.status_code == 200, response.text
    return response.json()


def ready_node(server: ServerProcess, name: str) -> dict[str, Any]:
    result: dict[str, Any] = wait_for(
        lambda: next(
            (n for n in admin_get(server, "/nodes") if n["name"] == name and n["state"] == "Ready"), None
        ),
        timeout=60,
        what=f"{name} to be Ready",
        interval=0.2,
    )
    return result


def start_ready(agents: AgentFactory, server: ServerProcess, name: str) -> AgentProcess:
    agent = agents.start(server.url, server.join_token, name)
    ready_node(server, name)
    return agent


def attack(
    server: ServerProcess,
    method: str,
    path: str,
    token: str,
    headers: dict[str, str] | None = None,
    **kwargs: Any,
) -> httpx.Response:
    """One request to the agents' API with ``token``, as a script on the network would send it."""
    with httpx.Client(base_url=server.url + AGENT_API, timeout=60) as http:
        return http.request(method, path, headers={**bearer(token), **(headers or {})}, **kwargs)


def refused(response: httpx.Response, status: int, kind: str) -> str:
    """The response is a refusal of ``status`` and error ``kind``; its message."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["type"] == kind, error
    message: str = error["message"]
    return message


def enrol_attacker(server: ServerProcess, name: str = "evil") -> tuple[str, int]:
    """The attacker's own node, enrolled with the join token (the server approves new names):
    its credential and epoch."""
    response = attack(server, "POST", "/register", server.join_token, json=node_doc(name))
    assert response.status_code == 200, response.text
    return response.json()["credential"], response.json()["epoch"]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("model") / "tiny.gguf"
    out = run_cli("dev", "tiny-model", str(path))
    assert out.returncode == 0 and path.exists(), out.stderr
    return path


class FakeEngine:
    """The attacker's engine: answers every chat completion "pwned", and counts them."""

    def __init__(self) -> None:
        self.hits = 0
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                owner.hits += 1
                body = json.dumps(
                    {"choices": [{"message": {"role": "assistant", "content": "pwned"}}]}
                ).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = int(self.http.server_address[1])
        self.thread = threading.Thread(
            target=self.http.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True
        )
        self.thread.start()

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()


@pytest.fixture
def fake_engine() -> Iterator[FakeEngine]:
    engine = FakeEngine()
    try:
        yield engine
    finally:
        engine.close()


# --- (a) another node's replica reported Running on the attacker's port ----------------------------


def test_a_a_join_token_cannot_report_another_nodes_replica_and_prompts_still_reach_the_real_engine(
    servers: ServerFactory, agents: AgentFactory, tmp_path: Path, tiny_model: Path, fake_engine: FakeEngine
) -> None:
    server = start_server(servers, tmp_path)
    start_ready(agents, server, "real")
    server.apply(tiny_documents(tiny_model))

    def running() -> dict[str, Any] | None:
        for replica in admin_get(server, "/replicas"):
            detail = admin_get(server, f"/replicas/{replica['name']}")
            if detail["state"] == "Running" and detail["status"].get("port"):
                return detail
        return None

    replica = wait_for(running, timeout=120, what="the tiny replica to be Running", interval=0.3)
    name, port = replica["name"], replica["status"]["port"]
    lie = {"state": "Running", "port": fake_engine.port}

    # With the join token alone: refused before anything is read.
    for epoch in (1, 2, 3):
        body = {"node": "real", "epoch": epoch, "replicas": {name: lie}}
        message = refused(
            attack(server, "POST", "/status", server.join_token, json=body), 401, "unauthorized"
        )
        assert "only enrols" in message
    # Enrolled as a node of its own: it may not speak for "real" ...
    credential, epoch = enrol_attacker(server)
    body = {"node": "real", "epoch": 1, "replicas": {name: lie}}
    message = refused(attack(server, "POST", "/status", credential, json=body), 403, "forbidden")
    assert message == "this credential is node evil's; it cannot speak for node real"
    # ... and what it says of a replica that is not its own is not recorded (it is told to stop it).
    own = attack(
        server, "POST", "/status", credential, json={"node": "evil", "epoch": epoch, "replicas": {name: lie}}
    )
    assert own.status_code == 200, own.text
    assert own.json() == {"stop": [name]}

    after = admin_get(server, f"/replicas/{name}")
    assert after["status"]["port"] == port and after["state"] == "Running"
    with server.client() as api:
        key = api.post("/keys", json={"name": "user", "models": ["*"]}).json()["key"]
    request = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    with httpx.Client(base_url=server.url, headers=bearer(key), timeout=60) as http:
        answers = [http.post("/v1/chat/completions", json=request) for _ in range(20)]
    assert [a.status_code for a in answers] == [200] * 20, [a.text for a in answers if a.status_code != 200]
    assert all(a.json()["choices"][0]["message"]["content"] != "pwned" for a in answers)
    assert all(a.json()["usage"]["completion_tokens"] >= 1 for a in answers)  # llama-server's answers
    assert fake_engine.hits == 0


# --- (b) an existing node name re-registered ---------------------------------------------------------


def test_b_re_registering_an_existing_name_is_refused_and_the_real_node_is_unaffected(
    servers: ServerFactory, agents: AgentFactory, tmp_path: Path
) -> None:
    server = start_server(servers, tmp_path)
    start_ready(agents, server, "real")
    before = ready_node(server, "real")

    takeover = node_doc("real", cores=1000, labels={"owned": "true"})
    message = refused(
        attack(server, "POST", "/register", server.join_token, json=takeover), 409, "name_taken"
    )
    assert message.startswith("node real is enrolled already; a second enrolment under this name needs")
    assert "fleetserve nodes approve real" in message
    # With another node's credential: refused too.
    credential, _ = enrol_attacker(server)
    refused(attack(server, "POST", "/register", credential, json=takeover), 403, "forbidden")

    # A second real agent under the same name says why on its log, and takes nothing over.
    twin = agents.start(
        server.url, server.join_token, "real", extra_args=("--credential-file", str(tmp_path / "twin-cred"))
    )
    wait_for(
        lambda: "is enrolled already" in twin.log(), timeout=60, what="the twin agent to log the refusal"
    )
    assert "enrolment refused: node real is enrolled already" in twin.log()
    twin.signal(signal.SIGTERM)

    after = ready_node(server, "real")
    assert (after["status"]["epoch"], after["cpu"]["cores"], after["labels"]) == (
        before["status"]["epoch"],
        before["cpu"]["cores"],
        before["labels"],
    )
    # Still heard from: the real agent's credential works.
    wait_for(
        lambda: (
            admin_get(server, "/nodes/real")["status"]["lastHeartbeat"] > after["status"]["lastHeartbeat"]
        ),
        timeout=10,
        what="the real node's next heartbeat",
    )


# --- (c) a made-up 1,000-core node -----------------------------------------------------------------


def test_c_a_made_up_1000_core_node_waits_for_approval_and_attracts_no_replica(
    servers: ServerFactory, agents: AgentFactory, tmp_path: Path, tiny_model: Path
) -> None:
    # The default policy: a new name enrols only after `fleetserve nodes approve NAME`.
    server = start_server(servers, tmp_path, approve_new_nodes=False)
    agent = agents.start(server.url, server.join_token, "real")
    wait_for(lambda: "waits for approval" in agent.log(), timeout=60, what="the agent to wait for approval")
    approved = run_cli("nodes", "approve", "real", env=cli_env(server, tmp_path))
    assert approved.returncode == 0, approved.stderr
    assert "node/real: the next enrolment is approved" in approved.stdout
    ready_node(server, "real")

    fake = node_doc("fake-1000", cores=1000, labels={"gpu": "lots"})
    message = refused(
        attack(server, "POST", "/register", server.join_token, json=fake), 403, "approval_required"
    )
    assert (
        message
        == "node fake-1000 is new and waits for approval: an operator must approve it: `fleetserve nodes approve fake-1000`"
    )
    server.apply(tiny_documents(tiny_model, cores=2, replicas=2))
    wait_for(lambda: len(admin_get(server, "/replicas")) >= 1, timeout=60, what="replicas to be placed")
    assert [n["name"] for n in admin_get(server, "/nodes")] == ["real"]
    assert {s["node"] for r in admin_get(server, "/replicas") for s in r["shards"]} == {"real"}
    listed = run_cli("nodes", "enrolments", "-o", "json", env=cli_env(server, tmp_path))
    assert listed.returncode == 0, listed.stderr
    waiting = {e["node"]: e for e in json.loads(listed.stdout)}
    assert (waiting["fake-1000"]["enrolled"], waiting["fake-1000"]["requestedFrom"]) == (False, "127.0.0.1")
    assert waiting["real"]["enrolled"] is True


# --- (c') an approved node restarted claiming 1,000 cores ---------------------------------------------


def test_c_an_approved_node_restarted_claiming_1000_cores_is_held_and_draws_nothing(
    servers: ServerFactory, agents: AgentFactory, tmp_path: Path, tiny_model: Path
) -> None:
    """Issue 34's audit: an enrolled node's agent restarted with an inventory file claiming 1,000
    cores drew 2 of 3 new replicas. Now its claim waits for the operator: the node stays at the
    cores it was approved with, `nodes enrolments` shows both, and the replicas are not placed."""
    server = start_server(servers, tmp_path)
    agent = start_ready(agents, server, "real")
    cores = int(ready_node(server, "real")["cpu"]["cores"])
    assert agent.stop(timeout=15) == 0
    inflated = tmp_path / "inflated.yaml"
    inflated.write_text("kind: Node\ncpu: {cores: 1000}\n", encoding="utf-8")

    restarted = agents.start(
        server.url, server.join_token, "real", extra_args=("--inventory-file", str(inflated))
    )
    wait_for(
        lambda: "more than the operator approved" in restarted.log(), timeout=60, what="the held claim logged"
    )
    print(next(line for line in restarted.log().splitlines() if "more than the operator approved" in line))
    assert "node real claims 1000 cores" in restarted.log()
    assert int(ready_node(server, "real")["cpu"]["cores"]) == cores
    listed = run_cli("nodes", "enrolments", env=cli_env(server, tmp_path))
    assert listed.returncode == 0, listed.stderr
    print(listed.stdout)
    header, row = listed.stdout.splitlines()[:2]
    assert "APPROVED HARDWARE" in header and "CLAIMED (WAITS)" in header
    assert row.split()[0] == "real" and f"{cores} cores" in row and "1000 cores" in row

    # Three replicas each needing one core more than approved: the 1,000 claimed would take them all.
    server.apply(tiny_documents(tiny_model, cores=cores + 1, replicas=3))
    explained = wait_for(
        lambda: (
            "too few free CPU cores"
            in (out := run_cli("explain", "tiny", env=cli_env(server, tmp_path)).stdout)
            and out
        ),
        timeout=60,
        what="the deployment explained as unplaced",
    )
    print(explained)
    assert admin_get(server, "/replicas") == []  # 0 of 3 drawn
    held = [e for e in admin_get(server, "/events?action=node.hardware.held") if e["target"] == "Node/real"]
    assert [e["actor"] for e in held] == ["node real"]

    # The operator approves the claim (the deployment gone first: no engine needs to start here).
    assert run_cli("delete", "deployment", "tiny", env=cli_env(server, tmp_path)).returncode == 0
    approved = run_cli("nodes", "approve", "real", env=cli_env(server, tmp_path))
    assert approved.returncode == 0, approved.stderr
    print(approved.stdout)
    assert approved.stdout.startswith("node/real: the hardware it claims is approved: 1000 cores")
    assert admin_get(server, "/nodes/real")["cpu"]["cores"] == 1000


# --- (d) a heartbeat without an epoch for a dead node -------------------------------------------------


def test_d_a_heartbeat_without_an_epoch_is_a_422_and_a_dead_node_stays_dead_without_its_epoch_told(
    servers: ServerFactory, agents: AgentFactory, tmp_path: Path
) -> None:
    server = start_server(servers, tmp_path)
    doomed = start_ready(agents, server, "doomed")
    stolen = doomed.credential()  # the attacker read the dead node's credential file
    doomed.signal(signal.SIGKILL)
    wait_for(
        lambda: admin_get(server, "/nodes/doomed")["state"] != "Ready",
        timeout=30,
        what="doomed to be NotReady",
    )

    refused(
        attack(server, "POST", "/heartbeat", server.join_token, json={"node": "doomed"}), 401, "unauthorized"
    )
    no_epoch = attack(server, "POST", "/heartbeat", stolen, json={"node": "doomed"})
    assert no_epoch.status_code == 422, no_epoch.text
    assert [p["field"] for p in no_epoch.json()["error"]["problems"]] == ["epoch"]
    # Once Lost (its replicas re-placed), only a registration brings it back: a heartbeat at any
    # epoch is refused without the epoch told. (While merely NotReady, nothing was moved away from
    # it, and a call at its epoch with its credential is a heartbeat like any other: a stolen
    # credential is revoked with `fleetserve delete node` or a new approved enrolment, not fenced.)
    wait_for(
        lambda: admin_get(server, "/nodes/doomed")["state"] == "Lost", timeout=30, what="doomed to be Lost"
    )
    for guess in (1, 2):
        response = attack(server, "POST", "/heartbeat", stolen, json={"node": "doomed", "epoch": guess})
        message = refused(response, 409, "stale_epoch")
        assert "register again" in message
        assert "epoch" not in json.dumps(response.json()).replace("stale_epoch", "")
    assert admin_get(server, "/nodes/doomed")["state"] == "Lost"


# --- (e) 10,000 GPU series labelled as another node ---------------------------------------------------


def test_e_gpu_series_labelled_as_another_node_are_refused_and_never_published(
    servers: ServerFactory, agents: AgentFactory, tmp_path: Path
) -> None:
    server = start_server(servers, tmp_path)
    start_ready(agents, server, "real")
    credential, epoch = enrol_attacker(server)

    def series(count: int) -> list[dict[str, Any]]:
        return [
            {
                "name": "fleetserve_gpu_utilization_ratio",
                "labels": {"node": "real", "device": str(i), "driver": "nvidia", "class": "h100"},
                "value": 1.0,
            }
            for i in range(count)
        ]

    flood = {"node": "evil", "epoch": epoch, "gpuMetrics": series(10_000)}
    response = attack(server, "POST", "/status", credential, json=flood)
    assert response.status_code == 422, response.text
    (problem,) = response.json()["error"]["problems"]
    assert problem["field"] == "gpuMetrics" and "at most 4096 " in problem["message"]

    few = {"node": "evil", "epoch": epoch, "gpuMetrics": series(3)}
    response = attack(server, "POST", "/status", credential, json=few)
    assert response.status_code == 422, response.text
    fields = [p["field"] for p in response.json()["error"]["problems"]]
    assert fields == ["gpuMetrics[0].labels.node", "gpuMetrics[1].labels.node", "gpuMetrics[2].labels.node"]
    as_real = {"node": "real", "epoch": 1, "gpuMetrics": series(3)}
    refused(attack(server, "POST", "/status", credential, json=as_real), 403, "forbidden")

    metrics = httpx.get(server.url + "/metrics", timeout=30).text
    assert 'node="real"' not in "\n".join(
        line for line in metrics.splitlines() if line.startswith("fleetserve_gpu_")
    )


# --- (f) a 41 MB node document ----------------------------------------------------------------------


def test_f_a_41_mb_node_document_is_a_413_naming_the_limit(
    servers: ServerFactory, agents: AgentFactory, tmp_path: Path
) -> None:
    server = start_server(servers, tmp_path)
    start_ready(agents, server, "real")
    huge = node_doc("huge", labels={f"k{i}": "v" * 4000 for i in range(10_250)})
    body = json.dumps(huge).encode()
    assert len(body) > 41_000_000
    message = refused(
        attack(
            server,
            "POST",
            "/register",
            server.join_token,
            content=body,
            headers={"Content-Type": "application/json"},
        ),
        413,
        "body_too_large",
    )
    assert message == "the body of POST /api/v1/agent/register is over its limit of 256 KiB (262144 bytes)"
    assert [n["name"] for n in admin_get(server, "/nodes")] == ["real"]
    assert server.alive()
    ready_node(server, "real")
