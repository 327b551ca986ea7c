"""A tiny llama-architecture GGUF written with the ``gguf`` package, so tests and the quickstart
never download a model.

Two layers, 64 wide, 4 heads, 256 tokens of context, F32 weights from a seeded generator; a
SentencePiece-style vocabulary of the 256 byte-fallback tokens plus ``<unk>``/``<s>``/``</s>``,
the two ChatML control tokens and printable pieces; a ChatML chat template. About 0.8 MB. It
generates gibberish, fast — which is what a control plane's tests need.

``write_tiny_model(path, shape)`` writes the same vocabulary and template with another shape
(``TinyShape``): ``bench/gpu_check.py`` serves a larger random one (``LARGER``, about 0.8 GB)
beside the tiny one, so that a GPU has real work. ``write_tiny_embedding_model`` and
``write_tiny_reranker`` write the tiny model declaring mean or rank pooling, what llama-server's
``--embeddings`` and ``--reranking`` serve. ``write_draft_model`` writes a draft for
speculative decoding: the tiny model's first layer only, with its vocabulary, embeddings and
output (a layer-skipping draft, about 0.37 MB), so it guesses most of the tiny model's tokens.

Named sizes (``SIZES``, ``fleetserve dev tiny-model --size``): ``tiny`` (the default) and
``prefill-1s``, 8 layers 256 wide (4 heads, 512 feed-forward, 4,096 tokens of context, about
6.5 M weights, 26 MB), whose prefill of a 2,000-token prompt takes about a second on one CPU
core (llama-server ``--threads 1``): shared-prefix effects are then measurable on a CPU
(``bench/routing.py``). ``shape_for`` makes a shape from a size and explicit dimensions.
"""

from __future__ import annotations

import string
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

EMBED = 64
HEADS = 4
LAYERS = 2
CONTEXT = 256
FEED_FORWARD = 128
SEED = 20261202


@dataclass(frozen=True)
class TinyShape:
    """A model's shape: layers, width (embedding), attention heads, feed-forward width, context."""

    layers: int = LAYERS
    embed: int = EMBED
    heads: int = HEADS
    feed_forward: int = FEED_FORWARD
    context: int = CONTEXT

    def __post_init__(self) -> None:
        if min(self.layers, self.embed, self.heads, self.feed_forward, self.context) < 1:
            raise ValueError(f"every dimension of a model shape is at least 1: {self}")
        if self.embed % self.heads:
            raise ValueError(f"the width {self.embed} is not a multiple of the {self.heads} heads")

    def parameters(self, vocab: int) -> int:
        """Weights in the model (F32 each): embeddings, output, and per layer attention and MLP."""
        per_layer = 4 * self.embed * self.embed + 3 * self.embed * self.feed_forward + 2 * self.embed
        return 2 * vocab * self.embed + self.layers * per_layer + self.embed


TINY = TinyShape()
# 12 layers 1024 wide (16 heads, 4096 feed-forward, 2048 tokens of context): ~200 M F32 weights.
LARGER = TinyShape(layers=12, embed=1024, heads=16, feed_forward=4096, context=2048)

PREFILL_1S = TinyShape(layers=8, embed=256, heads=4, feed_forward=512, context=4096)
"""Prefill of a 2,053-token prompt at llama-server ``--threads 1`` (the bundled CPU build): 0.88,
1.04, 1.05 and 1.24 s, four runs on one core of the 2-core AMD EPYC development VM (2026-12-07,
shared with other work; 1.4-2.0 s when that work held both cores). ``bench/routing.py`` prints
the figure of the machine it runs on."""

SIZES: dict[str, TinyShape] = {"tiny": TINY, "prefill-1s": PREFILL_1S}
"""The named sizes ``fleetserve dev tiny-model --size`` writes."""


def shape_for(
    size: str = "tiny",
    *,
    layers: int | None = None,
    width: int | None = None,
    context: int | None = None,
) -> TinyShape:
    """The named ``size``'s shape with the dimensions given replacing its own. A width given
    keeps the size's heads and makes the feed-forward twice the width (as both named sizes are);
    ValueError for an unknown size or an impossible shape."""
    base = SIZES.get(size)
    if base is None:
        raise ValueError(f"unknown model size {size!r}: one of {', '.join(SIZES)}")
    embed = base.embed if width is None else width
    return TinyShape(
        layers=base.layers if layers is None else layers,
        embed=embed,
        heads=base.heads,
        feed_forward=base.feed_forward if width is None else 2 * width,
        context=base.context if context is None else context,
    )


CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_WORDS = (
    "the", "and", "fleet", "serve", "model", "node", "gpu", "cpu", "hello", "world", "token",
    "replica", "place", "you", "is", "of", "to", "a", "in", "it",
)  # fmt: skip


def vocabulary() -> tuple[list[str], list[float], list[int]]:
    """Tokens, scores and token types of the tiny SentencePiece-style vocabulary."""
    tokens: list[str] = ["<unk>", "<s>", "</s>"]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    scores = [0.0, 0.0, 0.0]
    for byte in range(256):
        tokens.append(f"<0x{byte:02X}>")
        types.append(gguf.TokenType.BYTE)
        scores.append(0.0)
    for control in ("<|im_start|>", "<|im_end|>"):
        tokens.append(control)
        types.append(gguf.TokenType.CONTROL)
        scores.append(0.0)
    characters = list(string.ascii_letters + string.digits + string.punctuation)
    pieces = ["▁", *(f"▁{w}" for w in _WORDS), *characters]
    for rank, piece in enumerate(pieces):
        tokens.append(piece)
        types.append(gguf.TokenType.NORMAL)
        # Longer pieces first when merging; ties broken by order.
        scores.append(-float(rank) / 100.0 + len(piece))
    return tokens, scores, [int(t) for t in types]


def write_draft_model(path: Path, layers: int = 1) -> Path:
    """Write a draft of the tiny model to ``path``: its first ``layers`` layers (fewer than its
    own), every other weight the tiny model's; return the path."""
    if not 1 <= layers < TINY.layers:
        raise ValueError(f"a draft keeps 1 to {TINY.layers - 1} of the tiny model's {TINY.layers} layers")
    return write_tiny_model(path, TINY, keep_layers=layers)


def write_tiny_model(
    path: Path,
    shape: TinyShape = TINY,
    pooling: gguf.PoolingType | None = None,
    keep_layers: int | None = None,
) -> Path:
    """Write the tiny model (or one of another ``shape``) to ``path`` (parent folders created);
    return the path. ``pooling``: the pooling type its metadata declares (an embedding model's
    ``MEAN``, a reranker's ``RANK``), which llama-server uses where ``--pooling`` does not say.
    ``keep_layers``: the same weights drawn, only the first that many layers written (a draft,
    ``write_draft_model``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tokens, scores, types = vocabulary()
    rng = np.random.default_rng(SEED)

    def weights(*dims: int) -> np.ndarray:
        return (rng.standard_normal(dims) * 0.02).astype(np.float32)

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("fleetserve-tiny")
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.embed)
    kept = shape.layers if keep_layers is None else keep_layers
    writer.add_block_count(kept)
    writer.add_feed_forward_length(shape.feed_forward)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(shape.embed // shape.heads)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_eot_token_id(tokens.index("<|im_end|>"))
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML_TEMPLATE)
    if pooling is not None:
        writer.add_pooling_type(pooling)
    vocab = len(tokens)
    writer.add_tensor("token_embd.weight", weights(vocab, shape.embed))
    for i in range(shape.layers):
        layer = {f"blk.{i}.attn_norm.weight": np.ones(shape.embed, dtype=np.float32)}
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            layer[f"blk.{i}.{name}.weight"] = weights(shape.embed, shape.embed)
        layer[f"blk.{i}.ffn_norm.weight"] = np.ones(shape.embed, dtype=np.float32)
        layer[f"blk.{i}.ffn_gate.weight"] = weights(shape.feed_forward, shape.embed)
        layer[f"blk.{i}.ffn_up.weight"] = weights(shape.feed_forward, shape.embed)
        layer[f"blk.{i}.ffn_down.weight"] = weights(shape.embed, shape.feed_forward)
        if i < kept:
            for name, tensor in layer.items():
                writer.add_tensor(name, tensor)
    writer.add_tensor("output_norm.weight", np.ones(shape.embed, dtype=np.float32))
    writer.add_tensor("output.weight", weights(vocab, shape.embed))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_tiny_embedding_model(path: Path) -> Path:
    """The tiny model declaring mean pooling: llama-server ``--embeddings`` answers ``/v1/embeddings``
    with one vector of the model's width (``EMBED``) per input."""
    return write_tiny_model(path, pooling=gguf.PoolingType.MEAN)


def write_tiny_reranker(path: Path) -> Path:
    """The tiny model declaring rank pooling: llama-server ``--reranking`` answers ``/v1/rerank``
    with one score per document. The llama architecture loads no classification head (on b11434
    an added ``cls.output.weight`` fails with "wrong number of tensors"), so llama-server scores
    with what the model has; seen on b11434: a score per document, differing between documents."""
    return write_tiny_model(path, pooling=gguf.PoolingType.RANK)
