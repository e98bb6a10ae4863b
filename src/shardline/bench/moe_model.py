"""A mixture-of-experts GGUF of random weights in the layer shape of a real model, for
benchmarks (issue 42: shardline against llama.cpp on the same file).

::

    python -m shardline.bench.moe_model OUT.gguf --shape qwen3-30b-a3b --layers 4
    python -m shardline.bench.moe_model OUT.gguf --shape mixtral-tiny --layers 4 --mix q4_k
    python -m shardline.bench.moe_model OUT.gguf --shape gpt-oss-20b --layers 4
    python -m shardline.bench.moe_model OUT.gguf --shape qwen2-1.5b --layers 28

One dense shape sits beside the MoE ones (``qwen2-1.5b``: a 1.5B-class dense model, its
feed-forward ``ffn_gate`` / ``ffn_up`` / ``ffn_down``, its q/k/v biases), for the
benchmarks that want a model of that size (issue 43's multi-turn figures).

What is real and what is random:

- **The shape of every layer is the real model's** (:data:`SHAPES`): hidden size, query
  and KV heads, head_dim, the expert count, the experts a token uses, an expert's width,
  q/k norms, RoPE base, the GGUF architecture and metadata keys llama.cpp's converter
  writes. Only the layer count is yours (``--layers``; Qwen3-30B-A3B has 48): a decode step
  reads what ``layers`` of the real model's layers read, so tokens/s scale by about
  48 / ``layers`` for the attention and experts (not for the LM head).
- **The vocabulary and tokenizer are SmolLM2's** (49,152 tokens: every ``tokenizer.*`` key,
  the chat template included, copied from the embedded default model's GGUF,
  :func:`shardline.models.store.default_model_path`), so llama.cpp and shardline both
  load, template and tokenize it. Qwen3's vocabulary is 151,936: the embedding and the LM
  head here are 0.32x the real ones' size.
- **The weights are random** (seeded, reproducible): the quantized blocks hold uniform random
  quants; each block's scales are set so that the weights are zero-mean with a standard
  deviation chosen per tensor (:func:`weight_stds`: ~1/sqrt(fan-in) for the projections,
  so activations stay of order 1 through the layers; a unit-variance embedding; an LM head
  whose logits have a standard deviation of about 2.5). The f16 block scales are finite
  and normal or small subnormal (never inf or NaN). Norm weights are F32 near 1
  (1 + 0.02 N(0, 1)); the router (``ffn_gate_inp``) is F32 N(0, (1.5 / sqrt(hidden))^2), so a
  token's router logits have a standard deviation of ~1.5: routing spreads over all
  experts, each token's top-k differing from its neighbours' (:func:`check_model` counts
  it), as a trained router with a load-balancing loss spreads it. Text generated is
  random tokens: this is a model to time, not to read.
- **Quantization types** (``--mix``): ``q4_k_m`` (default) is what llama.cpp's
  ``llama-quantize ... Q4_K_M`` gives such a model (``llama_tensor_get_type`` in its
  src/llama-quant.cpp): Q4_K for the embedding and every other weight matrix, the experts
  included, except Q6_K for the LM head and for ``attn_v`` and ``ffn_down_exps`` in the
  layers its ``use_more_bits`` picks (half of them: with 4 layers, layers 2 and 3); for an
  8-expert model (Mixtral) ``attn_k`` and ``attn_v`` are Q8_0 and ``attn_output`` Q5_K.
  ``q4_k`` is Q4_K for every weight matrix, experts included, with a Q6_K embedding and LM
  head. In both, a matrix whose rows are not whole 256-weight K-quant blocks (the small
  shapes' narrow experts, every gpt-oss-20b matrix: rows of 2,880) is Q8_0, as llama.cpp
  falls back for such rows. gpt-oss's experts are MXFP4 under either mix (its release's
  own format), with its biases, sinks and post-attention norms F32 (biases N(0, 0.02^2),
  sinks N(0, 1)).

A tensor is generated, written and dropped one at a time (the writer is given every
tensor's shape up front), so memory holds a few copies of one expert tensor at most (113 MB
for Qwen3-30B-A3B's shape): 4 layers of that shape make a 1.6 GB file in 9 s with a peak
RSS of 370 MB (2-vCPU EPYC VM). The same arguments write the same bytes.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# --- shapes ---------------------------------------------------------------------------


@dataclass(frozen=True)
class MoeShape:
    """One MoE model's layer shape and GGUF architecture.

    Attributes:
        arch: GGUF ``general.architecture``: ``qwen3moe`` (q/k norms, experts of
            ``expert_feed_forward_length``), or ``llama`` with ``llama.expert_count``
            (Mixtral: experts of ``feed_forward_length``).
        hidden, heads, kv_heads, head_dim: the attention's shape.
        experts, experts_used, expert_width: every layer's experts, those a token uses,
            and the intermediate size of each (``experts`` 0: a dense model, its one
            feed-forward ``expert_width`` wide).
        qk_norm: RMSNorm over each head of q and k (Qwen3).
        rope_theta, context_length, rms_eps: as the model's config says.
        real_layers: the real model's layer count (for the documentation and the report).
        source: where the figures come from.
    """

    arch: str
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    experts: int
    experts_used: int
    expert_width: int
    qk_norm: bool
    rope_theta: float
    context_length: int
    rms_eps: float
    real_layers: int
    source: str
    sliding_window: int = 0
    yarn: tuple[float, int] | None = None

    @property
    def dense(self) -> bool:
        """No experts: one feed-forward a layer (``ffn_gate``, ``ffn_up``, ``ffn_down``)."""
        return self.experts == 0

    @property
    def qkv_bias(self) -> bool:
        """Biases on q, k and v (Qwen2)."""
        return self.arch == "qwen2"

    @property
    def gpt_oss(self) -> bool:
        """gpt-oss's layout: biases on the attention, router and experts, a learned sink a
        head, ``post_attention_norm`` before the experts, sliding-window attention on
        alternate layers, YaRN RoPE."""
        return self.arch == "gpt-oss"


SHAPES: dict[str, MoeShape] = {
    # Qwen/Qwen3-30B-A3B config.json: hidden_size 2048, num_attention_heads 32,
    # num_key_value_heads 4, head_dim 128, num_experts 128, num_experts_per_tok 8,
    # moe_intermediate_size 768, norm_topk_prob true, rope_theta 1e6, rms_norm_eps 1e-6,
    # max_position_embeddings 40960, num_hidden_layers 48, decoder_sparse_step 1 (every
    # layer MoE), tie_word_embeddings false.
    "qwen3-30b-a3b": MoeShape(
        arch="qwen3moe",
        hidden=2048,
        heads=32,
        kv_heads=4,
        head_dim=128,
        experts=128,
        experts_used=8,
        expert_width=768,
        qk_norm=True,
        rope_theta=1e6,
        context_length=40960,
        rms_eps=1e-6,
        real_layers=48,
        source="Qwen/Qwen3-30B-A3B config.json",
    ),
    # Mixtral-8x7B (mistralai/Mixtral-8x7B-v0.1 config.json: hidden 4096, 32 heads, 8 KV
    # heads, head_dim 128, 8 experts, 2 a token, intermediate 14336, rope_theta 1e6, 32
    # layers), each width a quarter (hidden 1024, 8 heads / 2 KV heads of 128, experts
    # 3584 wide), the expert count and routing kept: a layer is 1/16 of Mixtral's.
    "mixtral-tiny": MoeShape(
        arch="llama",
        hidden=1024,
        heads=8,
        kv_heads=2,
        head_dim=128,
        experts=8,
        experts_used=2,
        expert_width=3584,
        qk_norm=False,
        rope_theta=1e6,
        context_length=32768,
        rms_eps=1e-5,
        real_layers=32,
        source="mistralai/Mixtral-8x7B-v0.1 config.json, every width / 4",
    ),
    # openai/gpt-oss-20b config.json: hidden_size 2880, num_attention_heads 64,
    # num_key_value_heads 8, head_dim 64, num_local_experts 32, num_experts_per_tok 4,
    # intermediate_size 2880, rope_theta 150000, rope_scaling yarn factor 32 from 4096,
    # sliding_window 128, rms_norm_eps 1e-5, max_position_embeddings 131072, 24 layers.
    # Its rows of 2880 are not whole K-quant blocks: MXFP4 experts, Q8_0 elsewhere, as
    # llama.cpp's MXFP4 file of it holds them.
    "gpt-oss-20b": MoeShape(
        arch="gpt-oss",
        hidden=2880,
        heads=64,
        kv_heads=8,
        head_dim=64,
        experts=32,
        experts_used=4,
        expert_width=2880,
        qk_norm=False,
        rope_theta=150000.0,
        context_length=131072,
        rms_eps=1e-5,
        real_layers=24,
        source="openai/gpt-oss-20b config.json",
        sliding_window=128,
        yarn=(32.0, 4096),
    ),
    # Qwen/Qwen2.5-1.5B-Instruct config.json: hidden_size 1536, num_attention_heads 12,
    # num_key_value_heads 2 (head_dim 128), intermediate_size 8960, rope_theta 1e6,
    # rms_norm_eps 1e-6, max_position_embeddings 32768, 28 layers, q/k/v biases. Dense; its
    # embeddings are tied, here an output matrix of its own (Q6_K, as llama.cpp's Q4_K_M
    # gives the tied one).
    "qwen2-1.5b": MoeShape(
        arch="qwen2",
        hidden=1536,
        heads=12,
        kv_heads=2,
        head_dim=128,
        experts=0,
        experts_used=0,
        expert_width=8960,
        qk_norm=False,
        rope_theta=1e6,
        context_length=32768,
        rms_eps=1e-6,
        real_layers=28,
        source="Qwen/Qwen2.5-1.5B-Instruct config.json",
    ),
    # Small, for tests and smoke runs: Qwen3-MoE's layout (q/k norms, 4 of 16 experts), a
    # few MB a layer. Its ffn_down_exps rows (an expert's 128 columns) are not whole K-quant
    # blocks: Q8_0.
    "qwen3moe-small": MoeShape(
        arch="qwen3moe",
        hidden=256,
        heads=4,
        kv_heads=2,
        head_dim=64,
        experts=16,
        experts_used=4,
        expert_width=128,
        qk_norm=True,
        rope_theta=1e6,
        context_length=4096,
        rms_eps=1e-6,
        real_layers=4,
        source="small test shape",
    ),
    # gpt-oss's layout at test size: 2 of 8 MXFP4 experts 256 wide, 4 heads of 64 over 2
    # KV heads, a window of 128, YaRN from 4096 (rows of 256: Q4_K beside the experts).
    "gpt-oss-small": MoeShape(
        arch="gpt-oss",
        hidden=256,
        heads=4,
        kv_heads=2,
        head_dim=64,
        experts=8,
        experts_used=2,
        expert_width=256,
        qk_norm=False,
        rope_theta=150000.0,
        context_length=8192,
        rms_eps=1e-5,
        real_layers=4,
        source="small test shape",
        sliding_window=128,
        yarn=(2.0, 4096),
    ),
}

MIXES = ("q4_k_m", "q4_k")


# --- random quantized blocks -------------------------------------------------------------

# GGUF block byte offsets of each type's f16 scale fields.
F16_FIELDS = {
    "Q4_0": [0],
    "Q4_1": [0, 2],
    "Q5_0": [0],
    "Q5_1": [0, 2],
    "Q8_0": [0],
    "Q4_K": [0, 2],
    "Q5_K": [0, 2],
    "Q6_K": [208],
}


def random_quant_blocks(type_name: str, rows: int, blocks: int, seed: int = 0, scale: float = 0.01) -> np.ndarray:
    """uint8 ``[rows, blocks * block_bytes]`` of GGUF type ``type_name``: random quants and
    group scales, finite f16 super-block scales (about ``scale``, normal-distributed, so
    of either sign). Each block's values have a nonzero mean (random group minimums): for
    exactness tests; :func:`weight_blocks` gives zero-mean weights of a chosen spread."""
    import gguf

    rng = np.random.default_rng(seed)
    _, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]]
    data = rng.integers(0, 256, (rows, blocks, size), dtype=np.uint8)
    if type_name == "MXFP4":  # an E8M0 exponent byte: 2**(e - 128) about ``scale``
        center = 128 + int(np.round(np.log2(scale)))
        data[..., 0] = rng.integers(center - 3, center + 4, (rows, blocks), dtype=np.uint8)
        return data.reshape(rows, blocks * size)
    for at in F16_FIELDS[type_name]:
        scales = (rng.standard_normal((rows, blocks)) * scale).astype(np.float16)
        data[..., at : at + 2] = scales[..., None].view(np.uint8).reshape(rows, blocks, 2)
    return data.reshape(rows, blocks * size)


# K-quant group scales drawn uniformly from these (6-bit for Q4_K / Q5_K, int8 for Q6_K).
_K_SCALES = (32, 64)
_Q6_K_SCALES = (8, 64)


def _set_f16(data: np.ndarray, at: int, values: np.ndarray) -> None:
    """Write float ``values`` ``[n]`` as f16 at byte ``at`` of each block ``data[n, size]``."""
    data[:, at : at + 2] = values.astype(np.float16)[:, None].view(np.uint8)


def weight_blocks(type_name: str, rows: int, cols: int, std: float, rng: np.random.Generator) -> np.ndarray:
    """uint8 ``[rows, cols / block * block_bytes]``: blocks of GGUF type ``type_name``
    (Q8_0, Q4_K, Q5_K, Q6_K or MXFP4) whose weights are zero-mean (Q8_0, Q6_K: -0.5 quantum)
    with standard deviation ``std``: uniform random quants, each block's f16 scale drawn
    around the value that gives ``std`` (x U(0.75, 1.25)), so rows and blocks differ in
    spread as real ones do.

    - Q8_0: ``w = d * q``, q uniform int8.
    - Q4_K / Q5_K: ``w = d * sc_j * q - dmin * m_j`` with each group's minimum ``m_j``
      equal to its scale ``sc_j`` (U{32..63}) and ``dmin = d * center`` (7.5 / 15.5), so
      ``w = d * sc_j * (q - center)``.
    - Q6_K: ``w = d * sc_j * (q - 32)``, sc_j int8 U{8..63}.
    """
    import gguf

    qtype = gguf.GGMLQuantizationType[type_name]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    if cols % block:
        raise ValueError(f"{cols} columns are not whole {type_name} blocks of {block}")
    n = rows * (cols // block)
    data = np.frombuffer(rng.bytes(n * size), dtype=np.uint8).reshape(n, size).copy()
    jitter = rng.uniform(0.75, 1.25, n)
    if type_name == "Q8_0":
        q_std = math.sqrt((256**2 - 1) / 12)
        _set_f16(data, 0, std / q_std * jitter)
    elif type_name in ("Q4_K", "Q5_K"):
        levels = 16 if type_name == "Q4_K" else 32
        center = (levels - 1) / 2
        lo, hi = _K_SCALES
        c = rng.integers(lo, hi, (n, 8), dtype=np.uint8)  # each group's scale = its minimum
        # The 12 scale bytes (get_scale_min_k4 in ggml): groups 0-3 in the low 6 bits of
        # bytes 0-3 (scale) and 4-7 (minimum); groups 4-7 low nibbles in bytes 8-11 (scale
        # low, minimum high), their top 2 bits in the top bits of bytes 0-3 and 4-7.
        low, high = c[:, :4], c[:, 4:]
        data[:, 4:8] = (low & 63) | ((high >> 4) << 6)
        data[:, 8:12] = (low & 63) | ((high >> 4) << 6)
        data[:, 12:16] = (high & 0xF) | ((high & 0xF) << 4)
        rms_scale = math.sqrt(np.mean(np.arange(lo, hi, dtype=np.float64) ** 2))
        q_std = math.sqrt((levels**2 - 1) / 12)
        d = std / (rms_scale * q_std) * jitter
        _set_f16(data, 0, d)
        _set_f16(data, 2, d * center)
    elif type_name == "Q6_K":
        lo, hi = _Q6_K_SCALES
        data[:, 192:208] = rng.integers(lo, hi, (n, 16), dtype=np.uint8)
        rms_scale = math.sqrt(np.mean(np.arange(lo, hi, dtype=np.float64) ** 2))
        q_std = math.sqrt((64**2 - 1) / 12)
        _set_f16(data, 208, std / (rms_scale * q_std) * jitter)
    elif type_name == "MXFP4":
        # 32 E2M1 nibbles (ggml's kvalues_mxfp4: 0, 1, 2, 3, 4, 6, 8, 12 and their
        # negatives, halved) times 2 ** (e - 127): uniform nibbles are zero-mean, their
        # halved values' rms sqrt(8.5625); the exponent byte the nearest power of two.
        e = 127 + np.round(np.log2(std / math.sqrt(8.5625) * jitter))
        data[:, 0] = e.astype(np.uint8)
    else:
        raise ValueError(f"no zero-mean block generator for {type_name}")
    return data.reshape(rows, (cols // block) * size)


# --- the model's tensors ---------------------------------------------------------------


def _use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's ``use_more_bits`` (src/llama-quant.cpp): the layers its Q4_K_M gives
    more bits to (the first and last eighth, and every third between)."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def tensor_type(name: str, shape: MoeShape, layers: int, mix: str, cols: int) -> str:
    """The GGUF type of weight matrix ``name`` (rows of ``cols`` weights) under ``mix``."""
    kind = name.split(".")[-2]  # "token_embd", "output", "attn_v", "ffn_down_exps", ...
    if shape.gpt_oss and kind.endswith("_exps"):
        return "MXFP4"
    if mix == "q4_k":
        chosen = "Q6_K" if kind in ("token_embd", "output") else "Q4_K"
    elif mix == "q4_k_m":
        layer = int(name.split(".")[1]) if name.startswith("blk.") else -1
        eight = shape.experts == 8
        if kind == "output":
            chosen = "Q6_K"
        elif kind in ("attn_v", "attn_k") and eight:
            chosen = "Q8_0"
        elif kind == "attn_output" and eight:
            chosen = "Q5_K"
        elif kind in ("attn_v", "ffn_down_exps", "ffn_down") and _use_more_bits(layer, layers):
            chosen = "Q6_K"
        else:
            chosen = "Q4_K"
    else:
        raise ValueError(f"mix {mix!r} is not one of {', '.join(MIXES)}")
    return chosen if cols % 256 == 0 else "Q8_0"


@dataclass(frozen=True)
class TensorPlan:
    """One tensor to write: its GGUF name, its shape (outermost first, as numpy and
    :meth:`shardline.models.weights.WeightSource.shape` give it), type and spread."""

    name: str
    shape: tuple[int, ...]
    type_name: str  # "F32" for vectors and the router
    std: float
    near_one: bool = False  # a norm weight: 1 + std * N(0, 1)


def weight_stds(shape: MoeShape) -> dict[str, float]:
    """Each kind of tensor's weight standard deviation (see the module docstring)."""
    d, q = shape.hidden, shape.heads * shape.head_dim
    return {
        "token_embd": 1.0,
        "attn_q": 1 / math.sqrt(d),
        "attn_k": 1 / math.sqrt(d),
        "attn_v": 1 / math.sqrt(d),
        "attn_output": 0.5 / math.sqrt(q),
        "ffn_gate_inp": 1.5 / math.sqrt(d),
        "ffn_gate_exps": 1 / math.sqrt(d),
        "ffn_up_exps": 1 / math.sqrt(d),
        "ffn_down_exps": 1 / math.sqrt(shape.expert_width),
        "ffn_gate": 1 / math.sqrt(d),
        "ffn_up": 1 / math.sqrt(d),
        "ffn_down": 1 / math.sqrt(shape.expert_width),
        "output": 2.5 / math.sqrt(d),
        "norm": 0.02,
        "bias": 0.02,
    }


def plan_tensors(shape: MoeShape, layers: int, vocab: int, mix: str) -> list[TensorPlan]:
    """Every tensor of the file, in llama.cpp's converter's order."""
    std = weight_stds(shape)
    d, q, kv = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    e, w = shape.experts, shape.expert_width

    def matrix(name: str, dims: tuple[int, ...]) -> TensorPlan:
        kind = name.split(".")[-2]
        return TensorPlan(name, dims, tensor_type(name, shape, layers, mix, dims[-1]), std[kind])

    def norm(name: str, size: int) -> TensorPlan:
        return TensorPlan(name, (size,), "F32", std["norm"], near_one=True)

    def bias(name: str, dims: tuple[int, ...]) -> TensorPlan:
        return TensorPlan(name, dims, "F32", std["bias"])

    oss = shape.gpt_oss
    plans = [matrix("token_embd.weight", (vocab, d))]
    for i in range(layers):
        b = f"blk.{i}."
        plans += [norm(b + "attn_norm.weight", d)]
        for kind, rows, cols in (("attn_q", q, d), ("attn_k", kv, d), ("attn_v", kv, d), ("attn_output", d, q)):
            plans += [matrix(b + kind + ".weight", (rows, cols))]
            plans += [bias(b + kind + ".bias", (rows,))] if oss or (shape.qkv_bias and kind != "attn_output") else []
        if oss:
            plans += [TensorPlan(b + "attn_sinks.weight", (shape.heads,), "F32", 1.0)]
        if shape.qk_norm:
            plans += [norm(b + "attn_q_norm.weight", shape.head_dim), norm(b + "attn_k_norm.weight", shape.head_dim)]
        plans += [norm(b + ("post_attention_norm.weight" if oss else "ffn_norm.weight"), d)]
        if shape.dense:
            plans += [
                matrix(b + kind + ".weight", dims)
                for kind, dims in (("ffn_gate", (w, d)), ("ffn_up", (w, d)), ("ffn_down", (d, w)))
            ]
            continue
        plans += [TensorPlan(b + "ffn_gate_inp.weight", (e, d), "F32", std["ffn_gate_inp"])]
        plans += [bias(b + "ffn_gate_inp.bias", (e,))] if oss else []
        for kind, dims in (("ffn_gate_exps", (e, w, d)), ("ffn_up_exps", (e, w, d)), ("ffn_down_exps", (e, d, w))):
            plans += [matrix(b + kind + ".weight", dims)]
            plans += [bias(b + kind + ".bias", dims[:2])] if oss else []
    plans += [norm("output_norm.weight", d), matrix("output.weight", (vocab, d))]
    return plans


def _tensor_data(plan: TensorPlan, rng: np.random.Generator) -> np.ndarray:
    """The tensor's bytes (uint8 ``[..., row bytes]``) or F32 values."""
    if plan.type_name == "F32":
        values = rng.standard_normal(plan.shape, dtype=np.float32) * np.float32(plan.std)
        return values + np.float32(1.0) if plan.near_one else values
    *outer, cols = plan.shape
    data = weight_blocks(plan.type_name, math.prod(outer), cols, plan.std, rng)
    return data.reshape(*outer, data.shape[-1])


# GGUF metadata value types (the spec's gguf_metadata_value_type): struct formats of the
# fixed-size ones; 8 is a string, 9 an array.
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def _tokenizer_fields(path: Path) -> tuple[list[tuple[str, Any, Any, Any]], int]:
    """The ``tokenizer.*`` key/values of the GGUF at ``path`` (as ``add_key_value``
    arguments: key, value, type, array item type) and its vocabulary size.

    The key/value section is parsed here, in one pass over its bytes: the ``gguf``
    library's reader takes seconds over a 49,152-token vocabulary (a view per element)."""
    import struct

    size = 4 << 20
    while True:
        with open(path, "rb") as f:
            data = f.read(size)
        try:
            fields = _parse_tokenizer_fields(data, path)
            break
        except struct.error:  # the section goes on past ``size`` bytes
            if len(data) < size:
                raise ValueError(f"{path} is cut short in its metadata") from None
            size *= 4
    tokens = next(len(v) for k, v, _, _ in fields if k == "tokenizer.ggml.tokens")
    return fields, tokens


def _parse_tokenizer_fields(data: bytes, path: Path) -> list[tuple[str, Any, Any, Any]]:
    """The ``tokenizer.*`` fields of a GGUF file whose first bytes are ``data``.

    Raises:
        struct.error: the key/value section goes on past ``data``.
    """
    import struct

    import gguf

    magic, version, _, count = struct.unpack_from("<IIQQ", data, 0)
    if magic != gguf.GGUF_MAGIC or version < 2:
        raise ValueError(f"{path} is not a GGUF v2+ file")
    at = 24

    def read(fmt: str) -> Any:
        nonlocal at
        value = struct.unpack_from("<" + fmt, data, at)[0]
        at += struct.calcsize(fmt)
        return value

    def string() -> bytes:
        nonlocal at
        size = read("Q")
        at += size
        if at > len(data):
            raise struct.error("past the bytes read")
        return data[at - size : at]

    def value(vtype: int) -> Any:
        nonlocal at
        if vtype == 8:
            return string()
        if vtype == 9:
            item, n = read("I"), read("Q")
            if item in _SCALAR_FORMATS:
                fmt = _SCALAR_FORMATS[item]
                items = list(struct.unpack_from(f"<{n}{fmt}", data, at))
                at += n * struct.calcsize(fmt)
                return items
            return [value(item) for _ in range(n)]
        return read(_SCALAR_FORMATS[vtype])

    fields = []
    for _ in range(count):
        key = string().decode()
        vtype = read("I")
        sub = struct.unpack_from("<I", data, at)[0] if vtype == 9 else None
        val = value(vtype)
        if key.startswith("tokenizer."):
            if vtype == 8:
                val = val.decode()
            fields.append((key, val, gguf.GGUFValueType(vtype), None if sub is None else gguf.GGUFValueType(sub)))
    return fields


def write_moe_gguf(
    path: str | Path,
    shape: MoeShape | str,
    layers: int,
    *,
    mix: str = "q4_k_m",
    seed: int = 0,
    tokenizer_from: str | Path | None = None,
) -> Path:
    """Write a random-weight MoE GGUF of ``shape`` (a :class:`MoeShape` or a key of
    :data:`SHAPES`) with ``layers`` layers to ``path``, with the tokenizer of the GGUF
    ``tokenizer_from`` (default: the embedded SmolLM2). Returns ``path``."""
    import gguf

    if isinstance(shape, str):
        shape = SHAPES[shape]
    if layers < 1:
        raise ValueError("a model needs at least one layer")
    if tokenizer_from is None:
        from shardline.models.store import default_model_path

        tokenizer_from = default_model_path()
    fields, vocab = _tokenizer_fields(Path(tokenizer_from))
    plans = plan_tensors(shape, layers, vocab, mix)

    path = Path(path)
    writer = gguf.GGUFWriter(str(path), shape.arch)
    writer.add_name(f"random {shape.arch}{'' if shape.dense else ' MoE'}, {layers} layers")
    writer.add_block_count(layers)
    writer.add_context_length(shape.context_length)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.expert_width)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_key_length(shape.head_dim)
    writer.add_value_length(shape.head_dim)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(shape.rms_eps)
    writer.add_vocab_size(vocab)
    if not shape.dense:
        writer.add_expert_count(shape.experts)
        writer.add_expert_used_count(shape.experts_used)
    if shape.arch in ("qwen3moe", "gpt-oss"):
        writer.add_expert_feed_forward_length(shape.expert_width)
    if shape.sliding_window:
        writer.add_sliding_window(shape.sliding_window)
    if shape.yarn is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(shape.yarn[0])
        writer.add_rope_scaling_orig_ctx_len(shape.yarn[1])
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M if mix == "q4_k_m" else gguf.LlamaFileType.MOSTLY_Q4_K_S)
    for name, value, vtype, sub in fields:
        writer.add_key_value(name, value, vtype, sub)
    for plan in plans:
        if plan.type_name == "F32":
            writer.add_tensor_info(plan.name, plan.shape, np.dtype(np.float32), 4 * math.prod(plan.shape))
        else:
            qtype = gguf.GGMLQuantizationType[plan.type_name]
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            *outer, cols = plan.shape
            byte_shape = (*outer, cols // block * size)
            writer.add_tensor_info(plan.name, byte_shape, np.dtype(np.uint8), math.prod(byte_shape), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for plan in plans:
        writer.write_tensor_data(_tensor_data(plan, rng))
    writer.close()
    return path


# --- checking it -------------------------------------------------------------------------


def check_model(path: str | Path, prompt_tokens: int = 96, seed: int = 0) -> dict[str, Any]:
    """Load the whole model in this process (shardline's loader, bfloat16), prefill a
    random prompt of ``prompt_tokens`` tokens and decode 4 more; report whether every
    logit is finite, their spread, and each layer's routing over the prompt: the
    distinct experts chosen and the normalized entropy of the counts (1.0: every expert
    chosen equally often).

    Raises:
        ValueError: a logit is NaN or infinite.
    """
    import torch

    from shardline.models.feed_forward import MixtureOfExperts
    from shardline.models.kv_cache import KVCache
    from shardline.models.shard_loader import load_shard
    from shardline.models.weights import open_weights

    source = open_weights(path)
    config = source.config
    shard = load_shard(source, 0, config.num_layers)
    shard.fused = None  # the torch ops, whose routing the hooks see (the fused layers route in C)
    chosen: list[list[torch.Tensor]] = [[] for _ in range(config.num_layers)]
    moes = [m for m in shard.modules() if isinstance(m, MixtureOfExperts)]
    for layer, moe in enumerate(moes):

        def hook(module, args, layer=layer):
            chosen[layer].append(module.route(args[0])[0])

        moe.register_forward_pre_hook(hook)
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, config.vocab_size, (prompt_tokens,), generator=g)
    cache = KVCache(config, config.num_layers, 1, prompt_tokens + 8, shard.dtype)
    with torch.no_grad():
        logits = [shard(prompt, shard.prefill_batch(0, 0, prompt_tokens, True), cache)[0]]
        for step in range(4):
            token = int(torch.argmax(logits[-1]))
            batch = shard.decode_batch([0], [prompt_tokens + step])
            logits.append(shard(torch.tensor([token]), batch, cache)[0])
    stacked = torch.stack(logits).float()
    if not torch.isfinite(stacked).all():
        raise ValueError(f"{path}: the logits are not all finite")
    routing = []
    for layer in range(config.num_layers if moes else 0):  # a dense model routes nothing
        picks = chosen[layer][0].flatten() if chosen[layer] else torch.empty(0, dtype=torch.long)
        counts = torch.bincount(picks, minlength=config.num_experts).double()
        p = counts[counts > 0] / counts.sum()
        entropy = float(-(p * p.log()).sum() / math.log(config.num_experts)) if len(p) else 0.0
        routing.append({"layer": layer, "distinct_experts": int((counts > 0).sum()), "entropy": round(entropy, 3)})
    return {
        "experts": config.num_experts,
        "experts_used": config.num_experts_per_tok,
        "prompt_tokens": prompt_tokens,
        "logit_std": float(stacked.std()),
        "logit_absmax": float(stacked.abs().max()),
        "routing": routing,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m shardline.bench.moe_model",
        description="Write a random-weight mixture-of-experts GGUF in a real model's layer shape.",
    )
    parser.add_argument("out", help="the GGUF file to write")
    parser.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument(
        "--mix",
        default="q4_k_m",
        choices=MIXES,
        help="quantization types (default %(default)s: llama.cpp's Q4_K_M choices)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--tokenizer-from", default=None, help="GGUF whose tokenizer.* keys to copy (default: the embedded SmolLM2)"
    )
    parser.add_argument(
        "--check",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="load it with shardline's loader in this process and check its logits and routing (default on)",
    )
    args = parser.parse_args(argv)
    start = time.monotonic()
    path = write_moe_gguf(
        args.out, args.shape, args.layers, mix=args.mix, seed=args.seed, tokenizer_from=args.tokenizer_from
    )
    size = path.stat().st_size
    print(
        f"wrote {path}: {args.shape}, {args.layers} layers, {args.mix}, "
        f"{size / 2**20:.0f} MiB in {time.monotonic() - start:.1f} s"
    )
    if args.check:
        start = time.monotonic()
        try:
            report = check_model(path)
        except ValueError as exc:
            print(f"check failed: {exc}", file=sys.stderr)
            return 1
        spread = ", ".join(
            f"{r['distinct_experts']}/{report['experts']} (entropy {r['entropy']})" for r in report["routing"]
        )
        routed = f"; experts chosen over a {report['prompt_tokens']}-token prompt, by layer: {spread}" if spread else ""
        print(
            f"checked in {time.monotonic() - start:.1f} s: logits finite (std "
            f"{report['logit_std']:.2f}, max |logit| {report['logit_absmax']:.1f}){routed}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
