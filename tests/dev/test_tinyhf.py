"""The tiny safetensors model: written in well under a second, never downloaded, and read by the
loaders vLLM itself uses (transformers' AutoConfig and AutoTokenizer, safetensors)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from safetensors.numpy import load_file

from fleetserve.cli.main import app
from fleetserve.dev.tinyhf import write_tiny_hf_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    started = time.perf_counter()
    path = write_tiny_hf_model(tmp_path_factory.mktemp("tiny") / "model")
    print(f"written in {(time.perf_counter() - started) * 1000:.0f} ms")
    return path


def test_the_directory_holds_weights_config_generation_config_and_tokenizer(tiny: Path) -> None:
    assert {p.name for p in tiny.iterdir()} == {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "special_tokens_map.json",
        "tokenizer.json",
        "tokenizer_config.json",
    }
    assert sum(p.stat().st_size for p in tiny.iterdir()) < 4_000_000


def test_transformers_autoconfig_reads_a_llama_with_a_head_dimension_of_64(tiny: Path) -> None:
    from transformers import AutoConfig, GenerationConfig

    config = AutoConfig.from_pretrained(tiny, local_files_only=True)
    assert config.model_type == "llama"
    assert config.architectures == ["LlamaForCausalLM"]
    assert config.hidden_size // config.num_attention_heads == config.head_dim == 64
    assert config.max_position_embeddings == 256
    generation = GenerationConfig.from_pretrained(tiny, local_files_only=True)
    assert generation.eos_token_id == config.eos_token_id


def test_the_weights_match_the_config_shapes(tiny: Path) -> None:
    config = json.loads((tiny / "config.json").read_text())
    tensors = load_file(tiny / "model.safetensors")
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    assert tensors["model.embed_tokens.weight"].shape == (vocab, hidden)
    assert tensors["lm_head.weight"].shape == (vocab, hidden)
    layers = {name.split(".")[2] for name in tensors if name.startswith("model.layers.")}
    assert len(layers) == config["num_hidden_layers"]
    assert tensors["model.layers.0.mlp.down_proj.weight"].shape == (hidden, config["intermediate_size"])


def test_the_tokenizer_round_trips_text_and_renders_the_chatml_template(tiny: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny, local_files_only=True)
    text = "Héllo, fleet! 123"
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    assert rendered == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") < tokenizer.vocab_size + len(
        tokenizer.get_added_vocab()
    )


def test_the_writer_is_deterministic(tmp_path: Path, tiny: Path) -> None:
    again = write_tiny_hf_model(tmp_path / "again")
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        assert (again / name).read_bytes() == (tiny / name).read_bytes(), name


def test_the_cli_writes_either_format(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    runner = CliRunner()
    out = runner.invoke(app, ["dev", "tiny-model", "--format", "safetensors", str(tmp_path / "hf")])
    assert out.exit_code == 0, out.output
    assert (tmp_path / "hf" / "model.safetensors").is_file() and "wrote" in out.output
    out = runner.invoke(app, ["dev", "tiny-model", str(tmp_path / "tiny.gguf")])
    assert out.exit_code == 0, out.output
    assert (tmp_path / "tiny.gguf").read_bytes()[:4] == b"GGUF"
    out = runner.invoke(app, ["dev", "tiny-model", "--format", "onnx", str(tmp_path / "x")])
    assert out.exit_code == 2 and "onnx" in out.output
