"""Model size facts: from a GGUF header (tensor data never loaded) or from the document."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from fleetserve.errors import ConfigError
from fleetserve.gguf_facts import model_facts, read_gguf_facts
from fleetserve.spec.resources import Model


def write_gguf(path: Path, layers: int = 2, embed: int = 64, heads: int = 4, kv_heads: int = 2) -> int:
    """A small llama-shaped GGUF; returns the bytes of its tensors."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(layers)
    writer.add_context_length(256)
    writer.add_embedding_length(embed)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_feed_forward_length(128)
    tensors = {"token_embd.weight": np.zeros((32, embed), dtype=np.float32)}
    for i in range(layers):
        tensors[f"blk.{i}.attn_q.weight"] = np.zeros((embed, embed), dtype=np.float32)
    for name, data in tensors.items():
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return sum(t.nbytes for t in tensors.values())


def test_gguf_header_gives_weights_kv_per_token_and_context(tmp_path: Path):
    path = tmp_path / "m.gguf"
    weights = write_gguf(path)
    facts = read_gguf_facts(path, "m")
    # 2 layers x 2 KV heads x (16 + 16 head dims) x 2 bytes (f16 cache)
    assert facts.kv_bytes_per_token == 2 * 2 * 32 * 2
    assert facts.weight_bytes == weights
    assert facts.context_length == 256


def test_a_local_gguf_source_wins_over_the_documented_size(tmp_path: Path):
    path = tmp_path / "m.gguf"
    weights = write_gguf(path)
    facts = model_facts(Model(name="m", source="./m.gguf", size=10**12), base_dir=tmp_path)
    assert facts.weight_bytes == weights


@pytest.mark.parametrize("source", ["m/m.gguf", ".cache/m.gguf", "file://{dir}/m/m.gguf", "{dir}/m/m.gguf"])
def test_every_local_path_the_agent_reads_is_read_for_its_header(tmp_path: Path, source: str):
    # The same rule as the agent's sources: anything without a scheme is a path (`fleetserve up`'s
    # default data dir, .fleetserve/, is one without ./ in front).
    for folder in ("m", ".cache"):
        (tmp_path / folder).mkdir()
        weights = write_gguf(tmp_path / folder / "m.gguf")
    facts = model_facts(Model(name="m", source=source.format(dir=tmp_path)), base_dir=tmp_path)
    assert facts.weight_bytes == weights


def test_architecture_in_the_document_gives_kv_size():
    model = Model.model_validate(
        {
            "name": "m",
            "size": "1GB",
            "architecture": {"layers": 10, "kvHeads": 8, "headDim": 128, "contextLength": 1000},
        }
    )
    facts = model_facts(model)
    assert facts.kv_bytes_per_token == 2 * 10 * 8 * 128 * 2
    assert (facts.weight_bytes, facts.context_length) == (10**9, 1000)


def test_a_model_without_size_or_readable_file_is_an_error_naming_the_fix():
    with pytest.raises(ConfigError, match="give size"):
        model_facts(Model(name="m", source="hf://org/repo"))


def test_a_corrupt_gguf_file_is_a_config_error(tmp_path: Path):
    path = tmp_path / "bad.gguf"
    path.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ConfigError, match="cannot read GGUF"):
        read_gguf_facts(path, "bad")
