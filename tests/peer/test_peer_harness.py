"""The peer suite's pieces that need no engine: how a test's llama-server argv maps onto a
fleetserve stack, which tests are left out, and the loopback Hub llama-server downloads from."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from peer_exclusions import excluded
from peer_hub import PeerHub
from peer_wrap import deployment_name, split_argv


def test_the_tests_argv_maps_onto_listener_model_context_key_and_engine_args() -> None:
    argv = [
        "--port",
        "8123",
        "--temp",
        "0.8",
        "--seed",
        "42",
        "--host",
        "127.0.0.1",
        "--hf-repo",
        "ggml-org/models",
        "--hf-file",
        "tinyllamas/stories260K.gguf",
        "--batch-size",
        "32",
        "--no-slots",
        "--alias",
        "tinyllama-2",
        "--ctx-size",
        "512",
        "--parallel",
        "2",
        "--n-predict",
        "64",
        "--api-key",
        "sk-x",
        "--offline",
        "-fa",
        "on",
        "--no-jinja",
        "--cors-origins",
        "http://a.example,http://b.example",
    ]
    req = split_argv(argv)
    assert (req.host, req.port, req.alias, req.context, req.api_key) == (
        "127.0.0.1",
        8123,
        "tinyllama-2",
        512,
        "sk-x",
    )
    assert (req.hf_repo, req.hf_file) == ("ggml-org/models", "tinyllamas/stories260K.gguf")
    assert req.cors_origins == ("http://a.example", "http://b.example")
    assert req.engine_args == [
        "--temp", "0.8", "--seed", "42", "--batch-size", "32", "--n-predict", "64", "--flash-attn", "on", "--no-jinja",
    ]  # fmt: skip
    assert req.dropped == ["--no-slots", "--parallel", "2"]


def test_a_template_file_is_passed_by_absolute_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    req = split_argv(["--chat-template-file", "../t.jinja"])
    assert req.engine_args == ["--chat-template-file", str((tmp_path / "../t.jinja").absolute())]


def test_the_deployment_is_named_by_the_alias_else_the_file() -> None:
    assert deployment_name(split_argv(["--alias", "tinyllama-2"])) == "tinyllama-2"
    assert (
        deployment_name(split_argv(["--hf-repo", "r/x", "--hf-file", "dir/Stories_260K.gguf"]))
        == "stories-260k"
    )


def test_exclusions_cover_files_and_every_parametrization_of_a_test() -> None:
    assert excluded("unit/test_embedding.py::test_embedding_single") is not None
    assert excluded("unit/test_security.py::test_local_media_file[a-b]") is not None
    assert excluded("unit/test_security.py::test_correct_api_key") is None
    assert excluded("unit/test_basic.py::test_load_split_model_x") is None


@pytest.fixture
def hub() -> Iterator[PeerHub]:
    served = PeerHub({"org/repo": {"dir/m.gguf": b"0123456789"}})
    try:
        yield served
    finally:
        served.close()


def test_the_hub_answers_llama_cpps_refs_tree_and_ranged_resolve(hub: PeerHub) -> None:
    with httpx.Client(base_url=hub.endpoint) as client:
        commit = client.get("/api/models/org/repo/refs").json()["branches"][0]["targetCommit"]
        assert len(commit) == 40
        (entry,) = client.get(f"/api/models/org/repo/tree/{commit}", params={"recursive": "true"}).json()
        assert (entry["path"], entry["lfs"]["oid"]) == (
            "dir/m.gguf",
            hashlib.sha256(b"0123456789").hexdigest(),
        )
        part = client.get(f"/org/repo/resolve/{commit}/dir/m.gguf", headers={"Range": "bytes=4-"})
        assert (part.status_code, part.content) == (206, b"456789")
        assert client.get("/api/models/org/other/refs").status_code == 404
