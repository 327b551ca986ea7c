"""The tiny GGUF's shape: the default is the tiny model the tests serve; another shape (the GPU
check's larger model) is written with the same vocabulary and template, and reads back as given."""

from __future__ import annotations

import hashlib
from pathlib import Path

import gguf
import pytest

from fleetserve.dev.tinymodel import LARGER, TINY, TinyShape, vocabulary, write_tiny_model


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
