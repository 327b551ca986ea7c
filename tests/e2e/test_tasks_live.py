"""Embedding and reranking deployments for real, on both engines' CPU builds, through the gateway:
a real ``fleetserve server`` (SQLite) and ``fleetserve agent`` serve four deployments, one per
task and engine, from the tiny fixtures written here (never downloaded):

- ``emb-llama`` (task embed): the tiny GGUF declaring mean pooling, llama-server ``--embeddings``;
- ``rr-llama`` (task rerank): the tiny GGUF declaring rank pooling, llama-server ``--reranking``;
- ``emb-vllm`` (task embed): the tiny Llama safetensors, vLLM ``--runner pooling --convert embed``;
- ``rr-vllm`` (task rerank): the tiny Llama as a one-label ``LlamaForSequenceClassification``,
  vLLM ``--runner pooling --convert classify``.

The official openai client asks for a batch of embeddings (a vector of the model's width per
input), a rerank request scores documents against a query, a chat request to an embedding model
gets the gateway's 400, and ``/v1/models`` says each model's task. The vLLM repositories reach the
agent from an offline Hugging Face mirror (``--hf-mirror``). Every process is stopped at teardown.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from e2e_support import LiveFleet, hf_cache_repo, live_fleet, wait_for

from fleetserve.dev.tinyhf import HIDDEN, write_tiny_hf_model
from fleetserve.dev.tinymodel import EMBED, write_tiny_embedding_model, write_tiny_reranker

pytestmark = pytest.mark.slow

NODE = "cpu-tasks"
COMMIT = "7a5c" * 10
EMB_LLAMA, RR_LLAMA, EMB_VLLM, RR_VLLM = "emb-llama", "rr-llama", "emb-vllm", "rr-vllm"
# Two vLLM starts on a shared 2-core machine: imports, the model, the warm-up, one after the other.
START_TIMEOUT = 900.0
INPUTS = ["the fleet serves models", "hello world", "a node with a gpu"]
QUERY = "which node has a gpu?"
DOCUMENTS = ["the fleet serves models", "a node with a gpu", "hello world"]


def hf_repo(root: Path, repo: str, *, classifier: bool) -> None:
    """The tiny safetensors model as ``hf://REPO`` in an offline huggingface_hub cache at ``root``."""
    hf_cache_repo(root, repo, lambda snapshot: write_tiny_hf_model(snapshot, classifier=classifier), COMMIT)


def safetensors(name: str, repo: str) -> dict[str, Any]:
    return {
        "kind": "Model",
        "name": name,
        "source": f"hf://{repo}",
        "format": "safetensors",
        "size": "2MB",
        "architecture": {"layers": 2, "kvHeads": 2, "headDim": 64, "contextLength": 256},
    }


def documents(embedder: Path, reranker: Path) -> list[dict[str, Any]]:
    llama = {"name": "cpu", "engine": "llama.cpp", "cpu": {"cores": 1}, "context": 256}
    vllm = {"name": "vcpu", "engine": "vllm", "runtime": "cpu", "cpu": {"cores": 1}, "context": 256}
    models = [
        {"kind": "Model", "name": "m-emb", "source": str(embedder), "format": "gguf"},
        {"kind": "Model", "name": "m-rr", "source": str(reranker), "format": "gguf"},
        safetensors("m-emb-hf", "fleetserve/tiny-embed"),
        safetensors("m-rr-hf", "fleetserve/tiny-rerank"),
    ]
    served = [
        (EMB_LLAMA, "m-emb", llama, "embed"),
        (RR_LLAMA, "m-rr", llama, "rerank"),
        (EMB_VLLM, "m-emb-hf", vllm, "embed"),
        (RR_VLLM, "m-rr-hf", vllm, "rerank"),
    ]
    deployments = [
        {"kind": "Deployment", "name": n, "model": m, "task": t, "profiles": [p], "drainSeconds": 0}
        for n, m, p, t in served
    ]
    return models + deployments


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveFleet]:
    tmp = tmp_path_factory.mktemp("tasks")
    mirror = tmp / "mirror"
    hf_repo(mirror, "fleetserve/tiny-embed", classifier=False)
    hf_repo(mirror, "fleetserve/tiny-rerank", classifier=True)
    embedder = write_tiny_embedding_model(tmp / "emb.gguf")
    reranker = write_tiny_reranker(tmp / "rr.gguf")
    with live_fleet(tmp, NODE, mirror, cores=4) as fleet:
        server = fleet.server
        started = time.monotonic()
        server.apply(documents(embedder, reranker))
        for name in (EMB_LLAMA, RR_LLAMA, EMB_VLLM, RR_VLLM):
            wait_for(
                lambda n=name: fleet.running(n), timeout=START_TIMEOUT, what=f"{name} Running", interval=1.0
            )
            print(f"{name} Running {time.monotonic() - started:.1f} s after apply")

        def routed() -> bool:
            listed = httpx.get(
                f"{server.url}/v1/models", headers={"Authorization": f"Bearer {fleet.key}"}, timeout=10
            ).json()
            return len(listed["data"]) == 4

        wait_for(routed, timeout=30, what="the gateway to route the four deployments")
        yield fleet


def test_each_engine_is_started_for_its_deployments_task(fleet: LiveFleet) -> None:
    llama_embed, llama_rerank = fleet.argv(EMB_LLAMA), fleet.argv(RR_LLAMA)
    assert "--embeddings" in llama_embed and "--reranking" not in llama_embed
    assert "--reranking" in llama_rerank and "--embeddings" not in llama_rerank
    for name, convert in ((EMB_VLLM, "embed"), (RR_VLLM, "classify")):
        argv = fleet.argv(name)
        print(f"{name} argv:", " ".join(argv))
        assert argv[argv.index("--runner") + 1] == "pooling"
        assert argv[argv.index("--convert") + 1] == convert


@pytest.mark.parametrize(("deployment", "width"), [(EMB_LLAMA, EMBED), (EMB_VLLM, HIDDEN)])
def test_the_official_client_gets_a_vector_of_the_models_width_per_input(
    fleet: LiveFleet, deployment: str, width: int
) -> None:
    with fleet.openai() as client:
        answer = client.embeddings.create(model=deployment, input=INPUTS)
    print(
        f"POST /v1/embeddings model={deployment} input={INPUTS} -> {len(answer.data)} vectors of "
        f"{[len(d.embedding) for d in answer.data]}, first {answer.data[0].embedding[:4]}, usage {answer.usage}"
    )
    assert [d.index for d in answer.data] == [0, 1, 2]
    assert [len(d.embedding) for d in answer.data] == [width] * 3
    assert answer.data[0].embedding != answer.data[1].embedding
    assert answer.usage.prompt_tokens > 0


@pytest.mark.parametrize("deployment", [RR_LLAMA, RR_VLLM])
def test_rerank_scores_every_document_against_the_query(fleet: LiveFleet, deployment: str) -> None:
    body = {"model": deployment, "query": QUERY, "documents": DOCUMENTS}
    response = fleet.post("/v1/rerank", body)
    print(f"POST /v1/rerank {json.dumps(body)} -> {response.status_code} {response.text}")
    assert response.status_code == 200, response.text
    results = response.json()["results"]
    assert sorted(r["index"] for r in results) == [0, 1, 2]
    scores = [r["relevance_score"] for r in results]
    assert all(isinstance(s, float) for s in scores) and len(set(scores)) > 1
    # Best first, as both engines order them.
    assert scores == sorted(scores, reverse=True)
    assert response.json()["usage"]["prompt_tokens"] > 0


@pytest.mark.parametrize("deployment", [EMB_LLAMA, EMB_VLLM, RR_LLAMA, RR_VLLM])
def test_a_chat_request_to_a_pooling_model_is_the_gateways_400(fleet: LiveFleet, deployment: str) -> None:
    with fleet.openai() as client, pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=deployment, messages=[{"role": "user", "content": "hi"}])
    print(f"chat to {deployment}: {raised.value.status_code} {raised.value.message}")
    assert raised.value.code == "model_task_mismatch" and "task generate" in raised.value.message


def test_embeddings_and_rerank_go_only_to_deployments_of_that_task(fleet: LiveFleet) -> None:
    to_reranker = fleet.post("/v1/embeddings", {"model": RR_LLAMA, "input": "hi"})
    to_embedder = fleet.post("/v1/rerank", {"model": EMB_VLLM, "query": "q", "documents": ["a"]})
    for response, needs in ((to_reranker, "task embed"), (to_embedder, "task rerank")):
        assert response.status_code == 400, response.text
        assert needs in response.json()["error"]["message"]


def test_the_model_list_says_each_models_task(fleet: LiveFleet) -> None:
    listed = httpx.get(
        f"{fleet.server.url}/v1/models", headers={"Authorization": f"Bearer {fleet.key}"}, timeout=30
    ).json()["data"]
    tasks = {m["id"]: m["task"] for m in listed}
    print("GET /v1/models tasks:", tasks)
    assert tasks == {EMB_LLAMA: "embed", RR_LLAMA: "rerank", EMB_VLLM: "embed", RR_VLLM: "rerank"}
