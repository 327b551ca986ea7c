"""One metric surface for a fleet that mixes engines: a real ``fleetserve server`` (SQLite,
reconcile every 0.2 s) scraping a real ``llama-server`` (the tiny model, started by a real
``fleetserve agent`` on node ``cpu-a``) and vLLM replicas whose engine is a small local HTTP server
replaying a recorded vLLM ``/metrics`` body (tests/fixtures/metrics).

The vLLM replicas get there the way any replica does: a second node, ``gpu-v``, enrols through
the agents' API with the join token (address 127.0.0.1, ten ``nvidia-h200-141gb`` GPUs) and speaks
with the credential it is given from then on; vLLM deployments on that class are applied; the reconciler places them on ``gpu-v``; the test's
stand-in agent reads its assignments and keeps reporting each one Running on its fake engine's
port (POST /api/v1/agent/status every 0.5 s: the node's heartbeats too). The server's observer
then scrapes those ports as it scrapes the llama-server's.

The expected vLLM values are read from the fixture files with ``prometheus_client``'s parser and
mapped by design.md's table (not by fleetserve's code); the llama.cpp values are compared with the
llama-server's own ``/metrics`` on its port.

Every process (server, agent, llama-server) is stopped at teardown, and the fake engines' HTTP
servers and the reporting thread with them.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from e2e_support import (
    ROOT,
    AgentFactory,
    AgentProcess,
    ServerFactory,
    ServerProcess,
    engine_headers,
    run_cli,
    tiny_documents,
    wait_for,
)
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from fleetserve.metrics.exposition import ENGINE_METRICS

pytestmark = pytest.mark.slow

CPU_NODE = "cpu-a"
GPU_NODE = "gpu-v"
GPU_CLASS = "nvidia-h200-141gb"
FIXTURES = ROOT / "tests" / "fixtures" / "metrics"
QWEN = FIXTURES / "vllm_2025-01_qwen2.5-coder-1.5b.prom"  # V0 engine: old KV name, running, waiting
GLM = FIXTURES / "vllm_0.10_glm-4.5_excerpt.prom"  # vLLM 0.10: current KV name only
BLOOM = FIXTURES / "vllm_2024-04_bloom-560m_ttft_excerpt.prom"  # token counters and a TTFT histogram

RUNNING, WAITING = "fleetserve_requests_running", "fleetserve_requests_waiting"
KV = "fleetserve_kv_cache_usage_ratio"
PROMPT, GENERATION = "fleetserve_prompt_tokens_total", "fleetserve_generation_tokens_total"
TTFT = "fleetserve_time_to_first_token_seconds"
ENGINE_LABELS = {"deployment", "replica", "node", "engine", "model"}

# design.md, "Metrics": the engine metric feeding each canonical one (preferred name first).
DESIGN_TABLE: dict[str, dict[str, tuple[str, ...]]] = {
    "vllm": {
        RUNNING: ("vllm:num_requests_running",),
        WAITING: ("vllm:num_requests_waiting",),
        KV: ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
        PROMPT: ("vllm:prompt_tokens_total",),
        GENERATION: ("vllm:generation_tokens_total",),
    },
    "llama.cpp": {
        RUNNING: ("llamacpp:requests_processing",),
        WAITING: ("llamacpp:requests_deferred",),
        KV: ("llamacpp:kv_cache_usage_ratio",),
        PROMPT: ("llamacpp:prompt_tokens_total",),
        GENERATION: ("llamacpp:tokens_predicted_total",),
    },
}
# A grammar whose parse stacks grow with every token: one stream lasts seconds (test_gateway.py).
GROWING = {"grammar": "root ::= x\nx ::= [a-z] x? x?", "ignore_eos": True}

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse(text: str) -> Samples:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def expected_from(text: str, engine: str) -> dict[str, float]:
    """The canonical values an engine's scrape should give, by design.md's table."""
    raw: dict[str, float] = {}
    for (name, _), value in parse(text).items():
        raw[name] = raw.get(name, 0.0) + value
    out = {}
    for canonical, names in DESIGN_TABLE[engine].items():
        found = next((raw[n] for n in names if n in raw), None)
        if found is not None:
            out[canonical] = found
    return out


def engine_series(samples: Samples, replica: str) -> dict[str, tuple[dict[str, str], float]]:
    """The canonical engine series of one replica: name → (labels, value)."""
    out = {}
    for (name, labels), value in samples.items():
        as_dict = dict(labels)
        # The engine's own series: the gateway's per-replica histograms (TTFT, ITL) are not.
        if as_dict.get("replica") == replica and name in ENGINE_METRICS:
            assert name not in out, f"two {name} series for {replica}"
            out[name] = (as_dict, value)
    return out


def values_of(series: dict[str, tuple[dict[str, str], float]]) -> dict[str, float]:
    return {name: value for name, (_, value) in series.items()}


def value(samples: Samples, name: str, **labels: str) -> float:
    """The value of one series, 0 when it does not exist (yet)."""
    return samples.get((name, frozenset(labels.items())), 0.0)


class FakeEngine:
    """A local HTTP server that answers /health and replays one recorded /metrics body."""

    def __init__(self, body: bytes) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path == "/metrics":
                    payload, kind = body, "text/plain; version=0.0.4; charset=utf-8"
                elif self.path == "/health":
                    payload, kind = b'{"status":"ok"}', "application/json"
                else:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.http.daemon_threads = True
        self.port = int(self.http.server_address[1])
        self.thread = threading.Thread(target=self.http.serve_forever, kwargs={"poll_interval": 0.1})
        self.thread.start()

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()
        self.thread.join(timeout=10)


@dataclass
class StandInAgent:
    """Node ``gpu-v``: registered through the agents' API, reporting its assigned replicas of the
    deployments in ``engines`` Running on those ports, every 0.5 s (its heartbeats)."""

    server: ServerProcess
    epoch: int = 0
    credential: str = ""  # issued at enrolment; every call after it uses it
    engines: dict[str, int] = field(default_factory=dict)  # deployment → fake engine port
    reported: dict[str, str] = field(default_factory=dict)  # replica → deployment
    errors: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None

    def client(self) -> httpx.Client:
        return httpx.Client(
            base_url=f"{self.server.url}/api/v1/agent",
            headers={"Authorization": f"Bearer {self.credential or self.server.join_token}"},
            timeout=10,
        )

    def register(self) -> None:
        node = {
            "kind": "Node",
            "name": GPU_NODE,
            "address": "127.0.0.1",
            "labels": {"stand-in": "true"},
            "cpu": {"cores": 64, "memory": "1TiB"},
            "gpus": [{"class": GPU_CLASS, "count": 10}],
        }
        with self.client() as api:
            response = api.post("/register", json=node)
        assert response.status_code == 200, response.text
        self.epoch = int(response.json()["epoch"])
        self.credential = str(response.json()["credential"])
        self.thread = threading.Thread(target=self._loop, name="stand-in-agent", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        with self.client() as api:
            while not self.stop.is_set():
                try:
                    self.report(api)
                except Exception as exc:  # every failure is kept for the test to see
                    self.errors.append(repr(exc))
                self.stop.wait(0.5)

    def report(self, api: httpx.Client) -> None:
        got = api.get("/assignments", params={"node": GPU_NODE, "epoch": self.epoch})
        if got.status_code != 200:
            self.errors.append(f"assignments: {got.status_code} {got.text}")
            return
        replicas = {}
        for entry in got.json()["assignments"]:
            replica = entry["replica"]
            port = self.engines.get(replica["deployment"])
            if port is not None:
                replicas[replica["name"]] = {"state": "Running", "port": port}
                self.reported[replica["name"]] = replica["deployment"]
        sent = api.post("/status", json={"node": GPU_NODE, "epoch": self.epoch, "replicas": replicas})
        if sent.status_code != 200 or sent.json().get("stop"):
            self.errors.append(f"status: {sent.status_code} {sent.text}")

    def close(self) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join(timeout=15)


def vllm_documents(name: str, model: dict[str, Any], devices: int, context: int) -> list[dict[str, Any]]:
    return [
        {"kind": "Model", "format": "safetensors", **model},
        {
            "kind": "Deployment",
            "name": name,
            "model": model["name"],
            "replicas": 1,
            "profiles": [
                {
                    "name": "h200",
                    "engine": "vllm",
                    "deviceClass": GPU_CLASS,
                    "devicesPerNode": devices,
                    "context": context,
                }
            ],
        },
    ]


QWEN_MODEL = {
    "name": "qwen2.5-coder-1.5b",
    "source": "hf://Qwen/Qwen2.5-Coder-1.5B-Instruct",
    "size": "3.1GB",
    "architecture": {"layers": 28, "kvHeads": 2, "headDim": 128, "contextLength": 32768},
}
GLM_MODEL = {
    "name": "glm-4.5",
    "source": "hf://zai-org/GLM-4.5",
    "size": "717GB",
    "architecture": {"layers": 92, "kvHeads": 8, "headDim": 128, "contextLength": 131072},
}
BLOOM_MODEL = {
    "name": "bloom-560m",
    "source": "hf://bigscience/bloom-560m",
    "size": "1.1GB",
    "architecture": {"layers": 24, "kvHeads": 16, "headDim": 64, "contextLength": 2048},
}


@dataclass
class Surface:
    server: ServerProcess
    agent: AgentProcess
    stand_in: StandInAgent
    fakes: list[FakeEngine]
    key: str
    tmp: Path

    def metrics(self) -> Samples:
        with httpx.Client(timeout=10) as http:
            response = http.get(f"{self.server.url}/metrics")
        assert response.status_code == 200, response.text
        assert response.headers["content-type"].startswith("text/plain"), response.headers
        return parse(response.text)

    def replicas(self, deployment: str) -> list[dict[str, Any]]:
        with self.server.client(timeout=10) as api:
            listed = api.get("/replicas", params={"deployment": deployment})
            assert listed.status_code == 200, listed.text
            return [api.get(f"/replicas/{r['name']}").json() for r in listed.json()]

    def running(self, deployment: str) -> dict[str, Any] | None:
        """The one Running replica of ``deployment`` that reported a port, if any."""
        rows = [r for r in self.replicas(deployment) if r["state"] == "Running" and r["status"].get("port")]
        return rows[0] if len(rows) == 1 else None

    def serve_vllm(self, name: str, model: dict[str, Any], devices: int, context: int, fixture: Path) -> str:
        """A vLLM deployment placed on gpu-v, its engine the fixture's replay; its replica's name."""
        fake = FakeEngine(fixture.read_bytes())
        self.fakes.append(fake)
        self.server.apply(vllm_documents(name, model, devices, context))
        self.stand_in.engines[name] = fake.port
        replica = wait_for(lambda: self.running(name), timeout=30, what=f"{name} to be placed and Running")
        assert [s["node"] for s in replica["shards"]] == [GPU_NODE], replica
        assert int(replica["status"]["port"]) == fake.port
        return str(replica["name"])

    def openai(self, key: str | None = None) -> OpenAI:
        return OpenAI(base_url=f"{self.server.url}/v1", api_key=key or self.key, max_retries=0, timeout=60)

    def create_key(self, name: str, models: list[str], rpm: int | None = None) -> str:
        with self.server.client(timeout=10) as api:
            response = api.post("/keys", json={"name": name, "models": models, "rpm": rpm})
        assert response.status_code == 200, response.text
        return str(response.json()["key"])


def llamacpp_own(port: int, headers: dict[str, str]) -> dict[str, float]:
    """The llama-server's own metrics, scraped from its port with its key, under design.md's
    canonical names."""
    with httpx.Client(timeout=10) as http:
        response = http.get(f"http://127.0.0.1:{port}/metrics", headers=headers)
        assert response.status_code == 200, response.text
        return expected_from(response.text, "llama.cpp")


@pytest.fixture(scope="module")
def surface(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Surface]:
    tmp = tmp_path_factory.mktemp("surface")
    servers = ServerFactory(tmp)
    agents = AgentFactory(tmp)
    fakes: list[FakeEngine] = []
    stand_in: StandInAgent | None = None
    orphans: list[str] = []
    try:
        server = servers.start(
            f"sqlite:///{tmp / 'state.db'}",
            name="server",
            reconcile_interval=0.2,
            extra_args=("--not-ready-after", "5", "--lost-after", "10", "--models-dir", str(tmp / "models")),
        )
        agent = agents.start(server.url, server.join_token, CPU_NODE)
        model = tmp / "tiny.gguf"
        out = run_cli("dev", "tiny-model", str(model))
        assert out.returncode == 0 and model.exists(), out.stderr
        gpu_class = {"kind": "DeviceClass", "name": GPU_CLASS, "driver": "gpu.nvidia.com", "memory": "141GB"}
        server.apply([gpu_class, *tiny_documents(model)])
        stand_in = StandInAgent(server)
        stand_in.register()
        key_holder = Surface(server, agent, stand_in, fakes, "", tmp)
        key_holder.key = key_holder.create_key("everything", ["*"])
        yield key_holder
    finally:
        if stand_in is not None:
            stand_in.close()
        for fake in fakes:
            with contextlib.suppress(Exception):
                fake.close()
        orphans = agents.close()
        servers.close()
    if orphans:
        pytest.fail("llama-server processes outlived their agents (killed now):\n" + "\n".join(orphans))


def test_llamacpp_and_vllm_replicas_share_one_canonical_surface(surface: Surface) -> None:
    started = time.monotonic()
    tiny = wait_for(lambda: surface.running("tiny"), timeout=90, what="the tiny replica to be Running")
    assert [s["node"] for s in tiny["shards"]] == [CPU_NODE]
    tiny_name, tiny_port = tiny["name"], int(tiny["status"]["port"])
    tiny_key = engine_headers(surface.server.database_url, tiny_name)
    coder = surface.serve_vllm("coder", QWEN_MODEL, 1, 8192, QWEN)
    glm = surface.serve_vllm("glm", GLM_MODEL, 8, 32768, GLM)

    def all_scraped() -> Samples | None:
        samples = surface.metrics()
        present = {dict(labels).get("replica") for (name, labels) in samples if name in (KV, GENERATION)}
        return samples if {tiny_name, coder, glm} <= present else None

    samples = wait_for(all_scraped, timeout=30, what="the server's /metrics to show all three replicas")
    print(f"\nllama.cpp and two vLLM replicas on the server's /metrics {time.monotonic() - started:.1f} s in")
    assert surface.stand_in.errors == [], surface.stand_in.errors

    # --- vLLM: exactly the fixture's values, under fleetserve's labels ---------------------------
    for replica, deployment, model, fixture in (
        (coder, "coder", QWEN_MODEL["name"], QWEN),
        (glm, "glm", GLM_MODEL["name"], GLM),
    ):
        series = engine_series(samples, replica)
        want = expected_from(fixture.read_text(encoding="utf-8"), "vllm")
        print(f"{deployment} ({fixture.name}): {values_of(series)}")
        assert values_of(series) == want, (deployment, series, want)
        labels = {
            "deployment": deployment,
            "replica": replica,
            "node": GPU_NODE,
            "engine": "vllm",
            "model": model,
        }
        assert all(lbl == labels for lbl, _ in series.values()), series
    # The V0 engine's older KV name feeds the ratio; vLLM 0.10's current name does too.
    assert values_of(engine_series(samples, coder))[KV] == 0.0
    assert values_of(engine_series(samples, glm)) == {KV: 9.75010481363281e-06}

    # --- llama.cpp: its own names only; no KV, no TTFT; values as the engine reports them -------
    tiny_series = engine_series(samples, tiny_name)
    assert set(tiny_series) == {RUNNING, WAITING, PROMPT, GENERATION}, tiny_series
    tiny_labels = {
        "deployment": "tiny",
        "replica": tiny_name,
        "node": CPU_NODE,
        "engine": "llama.cpp",
        "model": "tiny",
    }
    assert all(lbl == tiny_labels for lbl, _ in tiny_series.values()), tiny_series
    assert not [n for (n, _) in samples if n.startswith(("vllm:", "llamacpp:"))], "engine names leaked"
    assert not [n for (n, lbl) in samples if n.startswith(TTFT) and dict(lbl).get("engine") == "llama.cpp"]
    assert {dict(lbl)["engine"] for (n, lbl) in samples if n == KV} == {"vllm"}

    def tiny_matches_engine() -> dict[str, float] | None:
        mine = values_of(engine_series(surface.metrics(), tiny_name))
        return mine if mine == llamacpp_own(tiny_port, tiny_key) else None

    before = wait_for(tiny_matches_engine, timeout=10, what="tiny's series to equal the engine's own")

    # Requests through the gateway advance the llama.cpp counters, and only tiny's.
    completion_tokens = prompt_tokens = 0
    with surface.openai() as client:
        for i in range(3):
            answer = client.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": f"Count to {i + 3}."}],
                max_tokens=16,
                extra_body={"ignore_eos": True},
            )
            assert answer.usage is not None
            completion_tokens += answer.usage.completion_tokens
            prompt_tokens += answer.usage.prompt_tokens
    after = wait_for(
        lambda: (
            (m := tiny_matches_engine()) and m[GENERATION] == before[GENERATION] + completion_tokens and m
        ),
        timeout=10,
        what=f"tiny's generation counter to advance by {completion_tokens}",
    )
    print(
        f"tiny before {before}; after 3 requests ({completion_tokens} completion, {prompt_tokens} prompt "
        f"tokens by usage): {after}"
    )
    assert completion_tokens == 48
    assert 0 < after[PROMPT] - before[PROMPT] <= prompt_tokens
    samples = surface.metrics()
    for replica, fixture in ((coder, QWEN), (glm, GLM)):
        assert values_of(engine_series(samples, replica)) == expected_from(fixture.read_text(), "vllm")

    # A request in flight: running 1 on the llama.cpp replica, the vLLM ones untouched.
    seen_running = threading.Event()
    streamed: list[int] = []

    def long_stream() -> None:
        with surface.openai() as client:
            stream = client.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": "Tell me a long story."}],
                max_tokens=220,
                stream=True,
                extra_body=GROWING,
            )
            with stream:
                for chunk in stream:
                    streamed.append(len(chunk.choices))
                    if seen_running.is_set():
                        break

    streaming = threading.Thread(target=long_stream, daemon=True)
    streaming.start()
    try:
        busy = wait_for(
            lambda: (s := surface.metrics()) and value(s, RUNNING, **tiny_labels) == 1 and s,
            timeout=15,
            what="tiny's running gauge to read 1 during a long stream",
            interval=0.1,
        )
    finally:
        seen_running.set()
        streaming.join(timeout=30)
    assert values_of(engine_series(busy, coder)) == expected_from(QWEN.read_text(), "vllm")
    idle = wait_for(
        lambda: (s := surface.metrics()) and value(s, RUNNING, **tiny_labels) == 0 and s,
        timeout=15,
        what="tiny's running gauge back to 0 after the client went away",
    )
    print(
        f"during a stream ({len(streamed)} chunks read): tiny running "
        f"{value(busy, RUNNING, **tiny_labels):g}; after it: {value(idle, RUNNING, **tiny_labels):g}"
    )
    assert surface.stand_in.errors == [], surface.stand_in.errors


def test_fleetserves_own_metrics_count_gateway_requests_by_code_and_reconcile_cycles(
    surface: Surface,
) -> None:
    wait_for(lambda: surface.running("tiny"), timeout=90, what="the tiny replica to be Running")
    before = surface.metrics()
    reconciles_before = value(before, "fleetserve_reconcile_seconds_count")
    quiet_before = value(before, "fleetserve_reconcile_quiet_total")
    t_before = time.monotonic()

    only_coder = surface.create_key("coder-only", ["coder"])
    one_a_minute = surface.create_key("one-a-minute", ["tiny"], rpm=1)
    codes: list[int] = []
    with httpx.Client(base_url=f"{surface.server.url}/v1", timeout=60) as http:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        for key in (
            surface.key,
            surface.key,
            surface.key,
            one_a_minute,
            one_a_minute,
            only_coder,
            only_coder,
        ):
            codes.append(
                http.post(
                    "/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
                ).status_code
            )
        # Refused before a deployment is known (a model the key may not use is answered as one that
        # does not exist): not counted under any deployment.
        codes.append(
            http.post(
                "/chat/completions",
                json={**body, "model": "no-such-model"},
                headers={"Authorization": f"Bearer {surface.key}"},
            ).status_code
        )
    assert codes == [200, 200, 200, 200, 429, 404, 404, 404], codes

    time.sleep(1.0)
    after = surface.metrics()
    t_after = time.monotonic()
    requests = "fleetserve_gateway_requests_total"
    delta = {
        code: value(after, requests, deployment="tiny", code=code)
        - value(before, requests, deployment="tiny", code=code)
        for code in ("200", "403", "429", "404")
    }
    seconds_count = "fleetserve_gateway_request_seconds_count"
    counted = value(after, seconds_count, deployment="tiny") - value(before, seconds_count, deployment="tiny")
    rejected = value(
        after, "fleetserve_gateway_rejections_total", deployment="tiny", reason="RateLimited"
    ) - value(before, "fleetserve_gateway_rejections_total", deployment="tiny", reason="RateLimited")
    reconciles = value(after, "fleetserve_reconcile_seconds_count") - reconciles_before
    # A settled fleet's cycles are mostly quiet: they read nothing and are counted apart.
    quiet = value(after, "fleetserve_reconcile_quiet_total") - quiet_before
    print(
        f"\ngateway requests counted for tiny by code: {delta}; request-seconds count +{counted:g}; "
        f"RateLimited rejections +{rejected:g}; reconcile cycles +{reconciles:g} full, +{quiet:g} quiet in "
        f"{t_after - t_before:.1f} s (interval 0.2 s), reconcile seconds sum "
        f"{value(after, 'fleetserve_reconcile_seconds_sum'):.3f}"
    )
    assert delta == {"200": 4, "403": 0, "429": 1, "404": 0}, delta
    assert not [lbl for (n, lbl) in after if n == requests and dict(lbl).get("deployment") == "no-such-model"]
    assert counted == 5 and rejected == 1
    assert reconciles + quiet >= 3, (reconciles, quiet)
    assert value(after, "fleetserve_reconcile_seconds_bucket", le="+Inf") == value(
        after, "fleetserve_reconcile_seconds_count"
    )
    desired = {
        dict(lbl)["deployment"]: v
        for (n, lbl), v in after.items()
        if n == "fleetserve_autoscaler_desired_replicas"
    }
    assert desired.get("tiny") == 1, desired


def test_a_vllm_replica_that_exports_ttft_leaves_the_surface_live(surface: Surface) -> None:
    """Every real vLLM exports ``vllm:time_to_first_token_seconds`` (a histogram); the BLOOM
    fixture has it. Once such a replica runs, its own counters must show, and the other replicas'
    series must go on following their engines."""
    tiny = wait_for(lambda: surface.running("tiny"), timeout=90, what="the tiny replica to be Running")
    tiny_name, tiny_port = tiny["name"], int(tiny["status"]["port"])
    tiny_key = engine_headers(surface.server.database_url, tiny_name)
    wait_for(
        lambda: surface.running("coder") and surface.running("glm"),
        timeout=30,
        what="coder and glm to be Running",
    )
    bloom = surface.serve_vllm("bloom", BLOOM_MODEL, 1, 2048, BLOOM)
    running_at = time.monotonic()

    def refusals() -> list[str]:
        return [line for line in surface.server.log().splitlines() if "engine metrics refused" in line]

    # Once the observer has scraped bloom (its series show, or the server says it refused them) …
    wait_for(
        lambda: engine_series(surface.metrics(), bloom) or refusals(),
        timeout=15,
        what="the observer to scrape bloom",
        interval=0.2,
    )
    scraped_at = time.monotonic()
    # … tiny's counters move: the surface must follow them.
    with surface.openai() as client:
        answer = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "One more."}],
            max_tokens=8,
            extra_body={"ignore_eos": True},
        )
    assert answer.usage is not None and answer.usage.completion_tokens == 8

    def state() -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
        samples = surface.metrics()
        return (
            values_of(engine_series(samples, bloom)),
            values_of(engine_series(samples, tiny_name)),
            llamacpp_own(tiny_port, tiny_key),
        )

    def live() -> bool:
        bloom_values, tiny_values, tiny_engine = state()
        return bool(bloom_values) and tiny_values == tiny_engine

    deadline = time.monotonic() + 8  # eight observer cycles
    while time.monotonic() < deadline and not live():
        time.sleep(0.2)
    bloom_values, tiny_values, tiny_engine = state()
    refused = refusals()
    print(
        f"\nbloom Running, scraped {scraped_at - running_at:.1f} s later; "
        f"{time.monotonic() - scraped_at:.1f} s after that: bloom's series {bloom_values}; "
        f"tiny on /metrics {tiny_values} vs its engine {tiny_engine}; server log: "
        f"{len(refused)} refusals, last {refused[-1:]}"
    )
    want = expected_from(BLOOM.read_text(encoding="utf-8"), "vllm")
    got = {n: v for n, v in bloom_values.items() if not n.startswith(TTFT)}
    assert got == want and tiny_values == tiny_engine, (
        f"bloom's series {got} (want {want}); tiny's series on /metrics {tiny_values} while its engine "
        f"reports {tiny_engine} (frozen at the last cycle before bloom); server log: {refused[-1:]}"
    )
