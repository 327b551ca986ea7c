"""What a deployment serves (``task: generate | embed | rerank``): how each engine row starts each
task, what apply refuses, the revision, and the gateway's word on a route of another task (the
live engines answer in tests/e2e/test_tasks_live.py)."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest

from builders import deployment
from fleetserve.drivers import Driver, RuntimeVariant
from fleetserve.engines.launch import LaunchContext
from fleetserve.engines.registry import ENGINES
from fleetserve.engines.routes import RouteKind, task_refusal
from fleetserve.engines.spec import EngineKind, Task
from fleetserve.gateway.accounting import BYTES_PER_TOKEN, reservation
from fleetserve.gateway.modelinfo import merged
from fleetserve.protocol import Assignment
from fleetserve.spec.resources import DeviceClass, Model, Profile, Replica, Shard
from fleetserve.validation import validate_deployment

CLASSES = {
    "h100": DeviceClass.model_validate({"name": "h100", "driver": "nvidia", "memory": "80GB"}),
}
LLAMA_CPU = {"name": "cpu", "engine": "llama.cpp", "cpu": {"cores": 1}}
VLLM_CPU = {"name": "vcpu", "engine": "vllm", "runtime": "cpu", "cpu": {"cores": 1}}
VLLM_GPU = {"name": "gpu", "engine": "vllm", "deviceClass": "h100"}


def argv(engine: EngineKind, variant: RuntimeVariant, task: Task) -> tuple[str, ...]:
    driver = ENGINES[engine].variants[variant]
    on_cpu = driver is Driver.CPU
    replica = Replica(
        name="d-0",
        deployment="d",
        profile="p",
        device_class=None if on_cpu else "gpu",
        shards=(Shard(node="n", devices=() if on_cpu else (0,), cpu_cores=1, memory=1 << 30),),
    )
    profile = Profile(name="p", engine=engine, runtime=variant, device_class=None if on_cpu else "gpu")
    ctx = LaunchContext(
        replica=replica,
        shard_index=0,
        profile=profile,
        variant=variant,
        driver=driver,
        model_path=Path("/models/m"),
        binary="/opt/bin/vllm" if engine is EngineKind.VLLM else "/opt/bin/llama-server",
        host="127.0.0.1",
        port=18000,
        context=None,
        task=task,
    )
    return ENGINES[engine].adapter.launch(ctx).argv


@pytest.mark.parametrize("variant", list(ENGINES[EngineKind.LLAMACPP].variants))
@pytest.mark.parametrize(
    ("task", "flags"),
    [(Task.GENERATE, ()), (Task.EMBED, ("--embeddings",)), (Task.RERANK, ("--reranking",))],
)
def test_llama_server_starts_each_task_with_its_flag_on_every_variant(variant, task, flags):
    args = argv(EngineKind.LLAMACPP, variant, task)
    assert [a for a in args if a in ("--embeddings", "--reranking")] == list(flags)


@pytest.mark.parametrize("variant", list(ENGINES[EngineKind.VLLM].variants))
@pytest.mark.parametrize(
    ("task", "convert"), [(Task.GENERATE, None), (Task.EMBED, "embed"), (Task.RERANK, "classify")]
)
def test_vllm_starts_a_pooling_model_converted_for_embed_or_classify(variant, task, convert):
    args = argv(EngineKind.VLLM, variant, task)
    if convert is None:
        assert "--runner" not in args and "--convert" not in args
    else:
        assert args[args.index("--runner") + 1] == "pooling"
        assert args[args.index("--convert") + 1] == convert


@pytest.mark.parametrize("task", list(Task))
@pytest.mark.parametrize("profile", [LLAMA_CPU, VLLM_CPU, VLLM_GPU], ids=lambda p: p["name"])
def test_every_engine_variant_is_accepted_for_every_task(task, profile):
    assert validate_deployment(deployment("d", 1, profile, task=task.value), CLASSES) == []


@pytest.mark.parametrize(
    ("profile", "flag", "task"),
    [
        ({**LLAMA_CPU, "engineArgs": ["--embeddings"]}, "--embeddings", "embed"),
        ({**LLAMA_CPU, "engineArgs": ["--embedding"]}, "--embedding", "embed"),
        ({**LLAMA_CPU, "engineArgs": ["--rerank"]}, "--rerank", "rerank"),
        ({**VLLM_GPU, "engineArgs": ["--convert", "embed"]}, "--convert", "embed or rerank"),
        ({**VLLM_CPU, "engineArgs": ["--runner=pooling"]}, "--runner", "embed or rerank"),
    ],
)
def test_a_task_flag_in_engine_args_is_refused_naming_the_task_that_sets_it(profile, flag, task):
    problems = validate_deployment(deployment("d", 1, profile), CLASSES)
    assert [(p.field, p.message) for p in problems] == [
        (
            f"profiles.{profile['name']}.engineArgs",
            f"{flag} is set by the deployment's task: say task: {task} and leave it out of engineArgs",
        )
    ]


def test_pooling_stays_an_engine_arg_of_an_embedding_deployment():
    profile = {**LLAMA_CPU, "engineArgs": ["--pooling", "last"]}
    assert validate_deployment(deployment("d", 1, profile, task="embed"), CLASSES) == []


def test_an_unknown_task_is_refused_by_the_document():
    with pytest.raises(ValueError, match="task"):
        deployment("d", 1, LLAMA_CPU, task="classify")


def test_the_task_is_part_of_the_revision_and_generate_serialises_as_before():
    plain = deployment("d", 1, LLAMA_CPU)
    generate = deployment("d", 1, LLAMA_CPU, task="generate")
    embed = deployment("d", 1, LLAMA_CPU, task="embed")
    assert "task" not in plain.model_dump(by_alias=True)
    assert plain.template_revision() == generate.template_revision() != embed.template_revision()
    assert embed.model_dump(mode="json", by_alias=True)["task"] == "embed"


def test_an_assignment_carries_the_task_and_leaves_generate_out():
    replica = Replica(name="d-0", deployment="d", profile="cpu", shards=(Shard(node="n"),))
    model = Model(name="m", source="/m.gguf")
    fields = {"replica": replica, "profile": Profile.model_validate(LLAMA_CPU), "model": model}
    base = {**fields, "runtime": RuntimeVariant.CPU, "driver": Driver.CPU}
    assert "task" not in Assignment(**base).model_dump(by_alias=True)
    sent = Assignment(**base, task=Task.RERANK).model_dump_json(by_alias=True)
    assert Assignment.model_validate_json(sent).task is Task.RERANK


@pytest.mark.parametrize(
    ("kind", "task", "refused"),
    [
        (RouteKind.GENERATION, Task.EMBED, True),
        (RouteKind.GENERATION, Task.RERANK, True),
        (RouteKind.TEMPLATING, Task.EMBED, True),
        (RouteKind.EMBEDDINGS, Task.GENERATE, True),
        (RouteKind.EMBEDDINGS, Task.RERANK, True),
        (RouteKind.RERANK, Task.EMBED, True),
        (RouteKind.EMBEDDINGS, Task.EMBED, False),
        (RouteKind.RERANK, Task.RERANK, False),
        (RouteKind.GENERATION, Task.GENERATE, False),
        (RouteKind.TOKENIZATION, Task.EMBED, False),
        (RouteKind.HEALTH, Task.RERANK, False),
        (RouteKind.GENERATION, None, False),  # an Endpoint's model: its server says
    ],
)
def test_a_route_of_another_task_is_refused(kind, task, refused):
    said = task_refusal(kind, task, "m", "POST", "/v1/x")
    assert (said is not None) is refused, said


def test_a_chat_request_to_an_embedding_model_is_told_what_it_serves():
    said = task_refusal(RouteKind.GENERATION, Task.EMBED, "emb", "POST", "/v1/chat/completions")
    assert said == (
        "`emb` is deployed for task embed (it serves embeddings): "
        "POST /v1/chat/completions needs a deployment of task generate."
    )


def test_embeddings_and_rerank_reserve_their_input_and_no_completion():
    body = b'{"model":"m","input":["' + b"x" * 400 + b'"]}'
    for kind in (RouteKind.EMBEDDINGS, RouteKind.RERANK):
        assert (
            reservation({}, body, (EngineKind.LLAMACPP,), 256, b"/v1/embeddings", kind)
            == len(body) // BYTES_PER_TOKEN
        )
    # A generation of the same body reserves what it may generate besides.
    assert (
        reservation({}, body, (EngineKind.LLAMACPP,), 256, b"/v1/completions") > len(body) // BYTES_PER_TOKEN
    )


def test_the_model_list_says_each_models_task_over_the_engines_word():
    entry = merged("emb", 1, {"id": "x", "task": "chat", "meta": {"n_embd": 64}}, Task.EMBED)
    assert entry["task"] == "embed" and entry["meta"] == {"n_embd": 64}
    assert "task" not in merged("ep", 1, None, None)


def test_the_tiny_fixtures_declare_their_pooling(tmp_path):
    from fleetserve.dev.tinymodel import EMBED, write_tiny_embedding_model, write_tiny_reranker

    for write, pooling in ((write_tiny_embedding_model, 1), (write_tiny_reranker, 4)):
        reader = gguf.GGUFReader(write(tmp_path / f"{write.__name__}.gguf"))
        field = reader.fields["llama.pooling_type"]
        assert int(field.parts[field.data[0]][0]) == pooling
        width = reader.fields["llama.embedding_length"]
        assert int(width.parts[width.data[0]][0]) == EMBED


@pytest.fixture
def embed_gateway(tmp_path):
    import time

    from fake_engine import ServedGateway, engines_on
    from fleetserve.store.sql import SqlStore

    with SqlStore.open(tmp_path / "state.db") as store, ServedGateway(store, engines=1) as gw:
        engines_on(store, [e.port for e in gw.engines], tmp_path / "tiny.gguf", task="embed")
        deadline = time.monotonic() + 10
        while not (gw.gateway.table.routes.get("tiny") and gw.gateway.table.routes["tiny"].endpoints):
            assert time.monotonic() < deadline, "the replica never reached the routes"
            time.sleep(0.02)
        yield gw


def test_the_gateway_refuses_a_chat_request_to_an_embedding_deployment_and_lists_its_task(embed_gateway):
    import asyncio
    from datetime import UTC, datetime, timedelta

    import httpx

    gw = embed_gateway
    _, token = gw.store.create_api_key("k", ["*"], None, None, datetime.now(UTC))
    headers = {"Authorization": f"Bearer {token}"}
    chat = httpx.post(
        f"{gw.url}/v1/chat/completions",
        json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]},
        headers=headers,
        timeout=30,
    )
    assert chat.status_code == 400, chat.text
    error = chat.json()["error"]
    assert (error["code"], error["param"], error["type"]) == (
        "model_task_mismatch",
        "model",
        "invalid_request_error",
    )
    assert "task embed" in error["message"] and "task generate" in error["message"]
    # An embeddings request passes the gateway: what comes back is the engine's, not the refusal.
    embeddings = httpx.post(
        f"{gw.url}/v1/embeddings", json={"model": "tiny", "input": "hi"}, headers=headers, timeout=30
    )
    assert embeddings.status_code == 200, embeddings.text
    used = embeddings.json()["usage"]["prompt_tokens"]
    # The embedding's tokens are counted as the key's usage, as a completion's are.
    flusher = gw.gateway.usage_flusher
    assert flusher is not None
    asyncio.run_coroutine_threadsafe(flusher.flush(), gw.loop).result(30)
    now = datetime.now(UTC)
    totals = gw.store.usage_totals(now - timedelta(minutes=2), now + timedelta(minutes=1), "key")
    [counted] = totals.values()
    assert (counted.requests, counted.errors, counted.prompt_tokens) == (2, 1, used) and used > 0
    listed = httpx.get(f"{gw.url}/v1/models", headers=headers, timeout=30).json()["data"]
    assert [(m["id"], m["task"]) for m in listed] == [("tiny", "embed")]


def test_a_variant_or_engine_a_row_leaves_out_of_a_task_is_refused_at_apply(monkeypatch):
    """Every variant of both engines serves every task today; a row that leaves one out (as a
    new engine or variant may) is refused with its reason, naming the field."""
    import dataclasses

    import fleetserve.validation as validation
    from fleetserve.engines.spec import TaskStart

    llama = ENGINES[EngineKind.LLAMACPP]
    gpu_only = TaskStart(
        args=("--embeddings",), variants=frozenset({RuntimeVariant.CUDA}), why_not="use runtime cuda"
    )
    rows = dict(ENGINES)
    # Embeddings on the CUDA variant only, no reranking at all.
    rows[EngineKind.LLAMACPP] = dataclasses.replace(
        llama, tasks={Task.GENERATE: llama.tasks[Task.GENERATE], Task.EMBED: gpu_only}
    )
    monkeypatch.setattr(validation, "ENGINES", rows)
    embed = validate_deployment(deployment("d", 1, LLAMA_CPU, task="embed"), CLASSES)
    assert [(p.field, p.message) for p in embed] == [
        ("task", "llama.cpp's cpu variant (profiles.cpu) does not serve task embed: use runtime cuda")
    ]
    rerank = validate_deployment(deployment("d", 1, LLAMA_CPU, task="rerank"), CLASSES)
    assert [(p.field, p.message) for p in rerank] == [
        (
            "task",
            "engine llama.cpp (profiles.cpu) does not serve task rerank; use engine vllm, or task generate",
        )
    ]
