"""The Llama-family decoder (Llama, Mistral, SmolLM, Qwen2, Qwen3, and the mixtures of
experts Mixtral and Qwen3-MoE), one shard of it.

A :class:`DecoderShard` holds a contiguous layer range ``[layer_start, layer_end)`` of the
model; the first shard also holds the token embedding, the last the final norm and the LM
head. A one-node instance is the shard ``[0, num_layers)`` with both.

Under tensor parallelism (``share``, a :class:`~shardline.models.config.TensorShare`) a
shard holds every layer but only its heads and MLP columns of each (Megatron-LM's split,
Shoeybi et al., 2019); the attention and MLP outputs are partial sums that the layer's
``all_reduce`` (set by :class:`~shardline.parallel.tensor.TensorStage`) completes.

Tokens are processed as a flat batch of rows, shape ``[N, hidden_size]``:

- a prefill chunk is N consecutive positions of one sequence;
- a decode step is one new position for each of N sequences.

Attention reads and writes a preallocated, slot-indexed KV cache (:class:`~shardline.models.kv_cache.KVCache`), so
no cache memory is allocated per token. RoPE uses the rotate-half convention of the
Hugging Face implementation (Su et al., RoFormer, 2021); GGUF weights are un-permuted on
load to match it (see ``shardline.models.weights``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn

from shardline.models import prefill_attention
from shardline.models.config import ModelConfig, TensorShare
from shardline.models.decode_graphs import GRAPH_MAX_ROWS
from shardline.models.feed_forward import MLP, MixtureOfExperts
from shardline.models.kv_cache import KVCache
from shardline.models.linear import Embedding, Linear
from shardline.models.weight_products import KERNEL_MAX_ROWS, computed_as

FUSED_PREFILL_MAX_ROWS = 64
"""Prefill chunks of up to this many tokens run through the fused decode layers too (each
token a row at its own position of the one slot: the kernel writes every row's key and
value before any row attends, so row i sees the chunk's rows before it)."""

if TYPE_CHECKING:
    from shardline.models.decode_graphs import DecodeGraphs
    from shardline.models.fused_decode import FusedDecode


class RingAttention(Protocol):
    """What a ring prefill chunk's attention is to the model
    (:class:`shardline.parallel.ring.RingContext`, a floor above): this rank's queries
    ``[n, H, d]``, keys and values ``[n, KVH, d]`` and the layer's caches in; ``[n, H * d]``
    out."""

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> torch.Tensor: ...


@dataclass
class ForwardBatch:
    """What one forward pass computes, shared by every layer of the shard.

    Attributes:
        prefill: True for a chunk of one sequence, False for one decode token per sequence.
        slot: the KV-cache slot of a prefill chunk (-1 for decode).
        start: the position of a prefill chunk's first row (0 for decode).
        slots: int64 ``[N]``: KV-cache slot of each row (decode) or ``[1]`` (prefill).
        positions: int64 ``[N]``: position of each row.
        cos, sin: ``[N, 1, head_dim]`` RoPE tables for the rows in the compute dtype; the
            first half of ``sin`` is negated (rotate-half's sign).
        attn_mask: prefill only: bool mask ``[q_len, kv_len]`` (True = attend), or None for
            a plain causal prefill from position 0.
        kv_len: prefill only: keys the chunk's last query sees (the cache prefix to read).
        rows: decode only: ``(slot, keys to read)`` of each row's sequence.
        logit_rows: rows whose logits the last shard returns, int64 ``[M]``.
        ring: a ring prefill chunk's :class:`~shardline.parallel.ring.RingContext` (the
            rows are this rank's zig-zag share of the chunk; attention goes round the
            ring), else None.
        hidden_out: the last shard returns the ``logit_rows``' final-norm hidden states
            ``[M, hidden]`` (compute dtype) for :meth:`DecoderShard.logits` to take a
            block at a time: a prompt scored whole (``[M, vocab]`` float32 logits at
            once would be 100 MB for 512 rows of a 49,152-token vocabulary).
        key_span, key_mask: a decode step of fixed shapes (one a CUDA graph captures,
            :func:`~shardline.models.decode_graphs.padded_decode`): each row attends the
            first ``key_span`` positions of its slot where bool ``key_mask``
            ``[N, key_span]`` is True; 0 and None otherwise (each row attends exactly its
            ``rows`` prefix).
        graphed: a decode step the shard's CUDA graphs take whole
            (:meth:`DecoderShard.decode_batch`): only ``rows`` and ``kv_len`` are set, the
            tensors are empty.
        computed_as: prefill only: the layers (fused or torch) and the products'
            kernels are chosen as for a chunk of at least this many rows
            (:func:`~shardline.models.weight_products.computed_as`; the experts of a
            mixture of experts as for their own rows): a prompt resumed from a cached
            prefix computes its rows as the whole chunk a cold prefill does (a ring
            rank's share too). 0: the chunk's own rows. Set by the engine.
    """

    prefill: bool
    slot: int
    start: int
    slots: torch.Tensor
    positions: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    attn_mask: torch.Tensor | None
    kv_len: int
    rows: list[tuple[int, int]]
    logit_rows: torch.Tensor
    ring: RingAttention | None = None
    hidden_out: bool = False
    key_span: int = 0
    key_mask: torch.Tensor | None = None
    graphed: bool = False
    computed_as: int = 0


class RMSNorm(nn.Module):
    """Root-mean-square layer norm (Zhang & Sennrich, 2019), normalized in float32.

    As in the Hugging Face implementation: normalize in float32, round to the compute
    dtype, then scale. torch's fused bfloat16 kernel is not precise enough for models with
    large activations (SmolLM2 answers nonsense with it).
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype)


def rope_inverse_frequencies(config: ModelConfig, freq_factors: torch.Tensor | None = None) -> torch.Tensor:
    """RoPE inverse frequencies, float32 ``[head_dim // 2]``.

    Applies Llama 3 frequency scaling when ``config.rope_scaling`` asks for it (as in
    Meta's reference ``apply_scaling``), or GGUF's precomputed ``rope_freqs`` divisors.
    """
    dim = config.head_dim
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type") or scaling.get("type")
    if freq_factors is not None:
        inv = inv / freq_factors.to(torch.float64)
    elif kind == "llama3":
        factor = scaling["factor"]
        low = scaling.get("low_freq_factor", 1.0)
        high = scaling.get("high_freq_factor", 4.0)
        old_ctx = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv
        smooth = (old_ctx / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
        inv = torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    elif kind == "linear":
        inv = inv / scaling["factor"]
    elif kind == "yarn":
        inv = _yarn_inverse_frequencies(config, scaling)
    return inv.float()


def _yarn_inverse_frequencies(config: ModelConfig, scaling: dict) -> torch.Tensor:
    """YaRN's inverse frequencies (Peng et al., 2023, "YaRN: Efficient Context Window
    Extension of Large Language Models", as transformers' ``_compute_yarn_parameters``
    computes them, in float32): interpolated by ``factor`` below the low-frequency edge,
    kept above the high one, a linear ramp between."""
    dim, base, factor = config.head_dim, config.rope_theta, scaling["factor"]
    old_ctx = scaling["original_max_position_embeddings"]

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_ctx / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = correction_dim(scaling.get("beta_fast") or 32.0)
    high = correction_dim(scaling.get("beta_slow") or 1.0)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def rope_attention_factor(config: ModelConfig) -> float:
    """The factor YaRN scales cos and sin by (``0.1 ln(factor) + 1``; 1 without YaRN)."""
    scaling = config.rope_scaling or {}
    if (scaling.get("rope_type") or scaling.get("type")) != "yarn":
        return 1.0
    if scaling.get("attention_factor"):
        return float(scaling["attention_factor"])
    factor = scaling["factor"]
    return 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0


class Attention(nn.Module):
    """Grouped-query self-attention with fused q/k/v projection and a slot KV cache.

    With a tensor ``share`` it holds only the share's query heads and KV heads: ``qkv``
    has ``(heads + 2 * kv_heads) * head_dim`` output rows, ``o`` takes
    ``heads * head_dim`` inputs, and the output ``[N, hidden_size]`` is this rank's partial
    sum. When the local query heads do not group evenly over the local KV heads (an uneven
    split such as SmolLM2's 9 heads / 3 KV heads on 2 ranks: 5 query heads over KV heads
    with 3 and 2 of them), the queries are padded to the largest group (``q_index``, a
    padding query repeats a real one) so one ``enable_gqa`` attention call still serves
    all heads, and the padding heads' outputs are dropped (``out_index``).
    """

    q_index: torch.Tensor | None  # buffers (see __init__)
    out_index: torch.Tensor | None

    def __init__(self, config: ModelConfig, share: TensorShare | None = None, window: int = 0) -> None:
        super().__init__()
        self.num_heads = share.num_heads if share else config.num_heads
        self.num_kv_heads = share.num_kv_heads if share else config.num_kv_heads
        self.head_dim = config.head_dim
        q_out = self.num_heads * config.head_dim
        kv_out = self.num_kv_heads * config.head_dim
        self.qkv = Linear(config.hidden_size, q_out + 2 * kv_out, bias=config.attention_bias)
        self.o = Linear(
            q_out,
            config.hidden_size,
            partial=share is not None,
            bias=config.output_bias and (share is None or share.rank == 0),
        )
        self.window = window
        self.sinks = nn.Parameter(torch.empty(self.num_heads), requires_grad=False) if config.attention_sinks else None
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.split = (q_out, kv_out, kv_out)
        q_index, out_index = _gqa_padding(share.local_kv_heads(config) if share else None, self.num_kv_heads)
        self.attn_heads = len(q_index) if q_index is not None else self.num_heads
        # Explicitly on the CPU (not the meta device shards are built on); the loader moves
        # them to the shard's device.
        self.register_buffer("q_index", q_index, persistent=False)
        self.register_buffer("out_index", out_index, persistent=False)

    def forward(
        self, x: torch.Tensor, batch: ForwardBatch, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> torch.Tensor:
        n, heads, kv_heads, hd = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv(x)
        qk = qkv[:, : (heads + kv_heads) * hd].view(n, heads + kv_heads, hd)
        v = qkv[:, (heads + kv_heads) * hd :].view(n, kv_heads, hd)
        if self.q_norm is not None and self.k_norm is not None:
            qk = torch.cat((self.q_norm(qk[:, :heads]), self.k_norm(qk[:, heads:])), dim=1)
        # RoPE on q and k at once: x * cos + rotate_half(x) * sin, where rotate_half swaps
        # the two halves of each head (flip) and batch.sin carries rotate_half's sign.
        swapped = qk.view(n, heads + kv_heads, 2, hd // 2).flip(2).view(n, heads + kv_heads, hd)
        qk = qk * batch.cos + swapped * batch.sin
        q, k = qk[:, :heads], qk[:, heads:]
        if self.q_index is not None:
            q = q.index_select(1, self.q_index)  # [n, attn_heads, hd]
        attn_heads = self.attn_heads

        if self.sinks is not None or self.window:
            if batch.ring is not None or batch.key_mask is not None:
                raise ValueError(
                    "attention sinks and sliding windows run neither ring prefill nor fixed-shape decode steps"
                )
            out = self._windowed(q, k, v, batch, k_cache, v_cache)
        elif batch.ring is not None:
            out = batch.ring.attend(q, k, v, k_cache, v_cache).view(n, attn_heads, hd)
        elif batch.prefill:
            slot, start = batch.slot, batch.start
            k_cache[slot, :, start : start + n] = k.transpose(0, 1)
            v_cache[slot, :, start : start + n] = v.transpose(0, 1)
            if prefill_attention.takes(q, k_cache):
                out = prefill_attention.attend(q, k_cache, v_cache, slot, start)
            else:
                out = self._prefill_sdpa(q, batch, k_cache, v_cache)
        elif batch.key_mask is not None:
            k_cache[batch.slots, :, batch.positions] = k
            v_cache[batch.slots, :, batch.positions] = v
            out = _masked_decode_attention(q, k_cache, v_cache, batch.slots, batch.key_mask)
        else:
            k_cache[batch.slots, :, batch.positions] = k
            v_cache[batch.slots, :, batch.positions] = v
            # One attention call per sequence over exactly its own cache prefix (a view, no
            # gather): a padded, masked batch call gives different bits for different
            # padding, and a sequence's output must not depend on its batch.
            outs = [
                F.scaled_dot_product_attention(
                    q[i : i + 1].unsqueeze(2),
                    k_cache[slot : slot + 1, :, :length],
                    v_cache[slot : slot + 1, :, :length],
                    enable_gqa=True,
                )  # [1, attn_heads, 1, hd]
                for i, (slot, length) in enumerate(batch.rows)
            ]
            out = (outs[0] if n == 1 else torch.cat(outs)).reshape(n, attn_heads, hd)
        if self.out_index is not None:
            out = out.index_select(1, self.out_index)
        return self.o(out.reshape(n, heads * hd))

    @staticmethod
    def _prefill_sdpa(
        q: torch.Tensor, batch: ForwardBatch, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> torch.Tensor:
        """A prefill chunk's attention with torch's: queries ``q`` ``[n, attn_heads, hd]``
        over the first ``batch.kv_len`` positions of its slot (its keys and values
        written), under ``batch.attn_mask`` or causal. Returns ``[n, attn_heads, hd]``."""
        slot = batch.slot
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),
            k_cache[slot : slot + 1, :, : batch.kv_len],
            v_cache[slot : slot + 1, :, : batch.kv_len],
            attn_mask=batch.attn_mask,
            is_causal=batch.attn_mask is None,
            enable_gqa=True,
        )  # [1, attn_heads, n, hd]
        return out.squeeze(0).transpose(0, 1)

    def _windowed(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        batch: ForwardBatch,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        """Attention with gpt-oss's sinks and sliding window (transformers' eager
        ``GptOssAttention``), each row over its own keys: the rows' keys and values
        written, then for each sequence (a prefill chunk is one) its queries ``[n, heads,
        hd]`` against the positions each may see, in float32, blocks of
        :data:`WINDOWED_QUERY_BLOCK` queries at a time. Returns ``[n, attn_heads, hd]``."""
        if batch.prefill:
            slot, start, n = batch.slot, batch.start, len(q)
            k_cache[slot, :, start : start + n] = k.transpose(0, 1)
            v_cache[slot, :, start : start + n] = v.transpose(0, 1)
            spans = [(slot, start, 0, n)]
        else:
            k_cache[batch.slots, :, batch.positions] = k
            v_cache[batch.slots, :, batch.positions] = v
            spans = [(slot, length - 1, i, i + 1) for i, (slot, length) in enumerate(batch.rows)]
        sinks = None
        if self.sinks is not None:
            sinks = self.sinks if self.q_index is None else self.sinks.index_select(0, self.q_index)
        outs = []
        for slot, first, a, b in spans:
            for lo in range(a, b, WINDOWED_QUERY_BLOCK):
                hi = min(b, lo + WINDOWED_QUERY_BLOCK)
                positions = torch.arange(first + lo - a, first + hi - a, device=q.device)
                begin = max(0, int(positions[0]) - self.window + 1) if self.window else 0
                end = int(positions[-1]) + 1
                keys = torch.arange(begin, end, device=q.device)
                seen = keys[None, :] <= positions[:, None]
                if self.window:
                    seen &= keys[None, :] > positions[:, None] - self.window
                outs.append(
                    _sink_attention(q[lo:hi], k_cache[slot, :, begin:end], v_cache[slot, :, begin:end], seen, sinks)
                )
        return torch.cat(outs) if len(outs) > 1 else outs[0]


WINDOWED_QUERY_BLOCK = 64
"""Queries of a prefill chunk attended at a time by :meth:`Attention._windowed` (bounding
its float32 scores to ``heads x 64 x keys``)."""


def _sink_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seen: torch.Tensor, sinks: torch.Tensor | None
) -> torch.Tensor:
    """Softmax attention of queries ``q`` ``[n, heads, hd]`` over keys and values ``k``,
    ``v`` ``[kv_heads, S, hd]`` where bool ``seen`` ``[n, S]`` is True, with float32
    ``sinks`` ``[heads]`` (a logit per head that joins each query's softmax and is
    dropped: its weight goes to no value) or None; computed in float32, returned
    ``[n, heads, hd]`` in ``q``'s dtype. Query head h reads KV head ``h // (heads //
    kv_heads)``."""
    n, heads, hd = q.shape
    group = heads // k.shape[0]
    keys = k.float().repeat_interleave(group, 0)  # [heads, S, hd]
    values = v.float().repeat_interleave(group, 0)
    scores = torch.matmul(q.float().transpose(0, 1), keys.transpose(1, 2)) * hd**-0.5
    scores = scores.masked_fill(~seen, float("-inf"))  # [heads, n, S]
    if sinks is not None:
        scores = torch.cat((scores, sinks.float()[:, None, None].expand(heads, n, 1)), dim=-1)
    probs = scores.softmax(dim=-1)[..., : keys.shape[1]]
    return torch.matmul(probs, values).transpose(0, 1).to(q.dtype)


class DecoderLayer(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x)).

    ``all_reduce`` (None: identity) completes the partial attention and MLP outputs of a
    tensor-parallel layer: it takes ``[N, hidden_size]`` float32 partial sums (see
    ``Linear.partial``) and returns the sum over the ranks; the sum is rounded to the
    compute dtype once, as the one-rank layer rounds its whole output once.
    """

    def __init__(self, config: ModelConfig, share: TensorShare | None = None, layer: int = 0) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = Attention(config, share, window=config.window_of(layer))
        self.mlp_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp: MLP | MixtureOfExperts = MixtureOfExperts(config, share) if config.is_moe else MLP(config, share)
        self.all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(
        self, x: torch.Tensor, batch: ForwardBatch, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> torch.Tensor:
        if self.all_reduce is None:
            x = x + self.attn(self.attn_norm(x), batch, k_cache, v_cache)
            return x + self.mlp(self.mlp_norm(x))
        x = x + self.all_reduce(self.attn(self.attn_norm(x), batch, k_cache, v_cache)).to(x.dtype)
        return x + self.all_reduce(self.mlp(self.mlp_norm(x))).to(x.dtype)


class DecoderShard(nn.Module):
    """Layers ``[layer_start, layer_end)`` of a decoder, plus embedding and/or head.

    Args:
        config: the whole model's configuration.
        layer_start, layer_end: global layer indices of this shard (end exclusive).
        rope_freq_factors: GGUF ``rope_freqs.weight`` (float32 ``[head_dim // 2]``) or None.
        share: under tensor parallelism, this rank's heads and MLP columns of every layer
            (the layer range must then be the whole model); None holds whole layers.
        head: whether the last shard holds the final norm and LM head (default True).
            A tensor-parallel rank that does not sample leaves them out: its hidden states
            after the last layer are the same on every rank, and only the sampling rank
            needs logits.

    ``forward`` takes int64 token ids ``[N]`` on the first shard and hidden states
    ``[N, hidden_size]`` (compute dtype) on the others; it returns hidden states, or on
    the last shard with a head float32 logits ``[len(batch.logit_rows), vocab_size]``
    (of a ``hidden_out`` batch, those rows' final-norm hidden states).

    ``fused`` (set by the loader, :func:`shardline.models.fused_decode.for_shard`): the
    compiled decode layers that run its decode steps (of up to ``KERNEL_MAX_ROWS`` rows)
    and prefill chunks (of up to :data:`FUSED_PREFILL_MAX_ROWS` tokens), or None (the
    layers' torch ops run every step).

    ``graphs`` (set by the loader on CUDA, :func:`shardline.models.decode_graphs.for_shard`):
    the CUDA graphs that run its decode steps of up to
    :data:`~shardline.models.decode_graphs.GRAPH_MAX_ROWS` rows, or None.
    """

    inv_freq: torch.Tensor  # a buffer: RoPE inverse frequencies, float32 [head_dim // 2]
    fused: FusedDecode | None = None
    graphs: DecodeGraphs | None = None

    def __init__(
        self,
        config: ModelConfig,
        layer_start: int,
        layer_end: int,
        rope_freq_factors: torch.Tensor | None = None,
        share: TensorShare | None = None,
        head: bool = True,
    ) -> None:
        super().__init__()
        if not 0 <= layer_start < layer_end <= config.num_layers:
            raise ValueError(f"layer range [{layer_start}, {layer_end}) is not inside [0, {config.num_layers})")
        if share is not None:
            share.check(config)
            if (layer_start, layer_end) != (0, config.num_layers):
                raise ValueError("a tensor-parallel shard holds every layer")
        self.config = config
        self.share = share
        self.layer_start = layer_start
        self.layer_end = layer_end
        self.is_first = layer_start == 0
        self.is_last = layer_end == config.num_layers
        self.embed = Embedding() if self.is_first else None
        self.layers = nn.ModuleList(DecoderLayer(config, share, layer) for layer in range(layer_start, layer_end))
        self.norm: RMSNorm | None = None
        self.lm_head: Linear | None = None
        if self.is_last and head:
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False, logits=True)
        self.register_buffer("inv_freq", rope_inverse_frequencies(config, rope_freq_factors), persistent=False)
        self.rope_factor = rope_attention_factor(config)

    @property
    def num_kv_heads(self) -> int:
        """KV heads this shard caches per layer (all of them unless tensor-parallel)."""
        return self._layer(0).attn.num_kv_heads

    def prefill_rows_apart(self, cache: KVCache) -> bool:
        """Whether its prefill forward gives each row the bits it would have beside any
        other rows, given the row count it is computed as (``ForwardBatch.computed_as``:
        the products' kernels by that count, whose rows are their own): every layer's
        attention over ``cache`` is the compiled prefill attention
        (:func:`~shardline.models.prefill_attention.takes`, each row over the keys up to
        its own), none has attention sinks or a sliding window, and none is a mixture of
        experts (whose experts compute their rows by their own count). Torch's prefill
        attention's bits depend on the keys its chunk reads."""
        if self.config.is_moe:
            return False
        for i in range(len(self.layers)):
            attn = self._layer(i).attn
            if attn.sinks is not None or attn.window:
                return False
            q = torch.empty((1, attn.attn_heads, self.config.head_dim), dtype=self.dtype, device=self.device)
            if not prefill_attention.takes(q, cache.k[i]):
                return False
        return True

    def set_all_reduce(self, fn: Callable[[torch.Tensor], torch.Tensor] | None) -> None:
        """Set every layer's all-reduce (see :class:`DecoderLayer`)."""
        for i in range(len(self.layers)):
            self._layer(i).all_reduce = fn

    def _layer(self, i: int) -> DecoderLayer:
        """Layer ``i`` of this shard (0: its first), typed."""
        return cast(DecoderLayer, self.layers[i])

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype (the norms' weights are held in it)."""
        return self._layer(0).attn_norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self._layer(0).attn_norm.weight.device

    def prefill_batch(
        self, slot: int, start: int, length: int, want_logits: bool, every_row: bool = False
    ) -> ForwardBatch:
        """Describe a prefill chunk: positions ``start .. start+length-1`` of ``slot``;
        with ``want_logits`` the logits of its last position, or with ``every_row`` the
        final-norm hidden states of each (``hidden_out``: a prompt's log-probabilities)."""
        device = self.device
        positions = torch.arange(start, start + length, device=device)
        mask = None
        if start > 0:
            keys = torch.arange(start + length, device=device)
            mask = keys.unsqueeze(0) <= positions.unsqueeze(1)  # [length, start+length]
        rows = (
            torch.arange(length, device=device)
            if want_logits and every_row
            else torch.tensor([length - 1] if want_logits else [], dtype=torch.long, device=device)
        )
        cos, sin = self.rope(positions)
        return ForwardBatch(
            prefill=True,
            slot=slot,
            start=start,
            slots=torch.tensor([slot], device=device),
            positions=positions,
            cos=cos,
            sin=sin,
            attn_mask=mask,
            kv_len=start + length,
            rows=[],
            logit_rows=rows,
            hidden_out=want_logits and every_row,
        )

    def decode_batch(self, slots: list[int], positions: list[int]) -> ForwardBatch:
        """Describe a decode step: one token at ``positions[i]`` for the sequence in ``slots[i]``.

        A step the decode graphs take whole (up to the logits, or on a shard without a
        head) is ``graphed``: it carries only ``rows`` (the graph computes the rest from
        them), so building it launches nothing on the GPU."""
        device = self.device
        rows = [(slot, p + 1) for slot, p in zip(slots, positions)]
        if self.graphs is not None and len(slots) <= GRAPH_MAX_ROWS and (self.graphs.head or self.lm_head is None):
            empty = torch.empty(0)
            return ForwardBatch(
                prefill=False,
                slot=-1,
                start=0,
                slots=empty,
                positions=empty,
                cos=empty,
                sin=empty,
                attn_mask=None,
                kv_len=max(positions) + 1,
                rows=rows,
                logit_rows=empty,
                graphed=True,
            )
        pos = torch.tensor(positions, dtype=torch.long, device=device)
        cos, sin = self.rope(pos)
        return ForwardBatch(
            prefill=False,
            slot=-1,
            start=0,
            slots=torch.tensor(slots, dtype=torch.long, device=device),
            positions=pos,
            cos=cos,
            sin=sin,
            attn_mask=None,
            kv_len=max(positions) + 1,
            rows=rows,
            logit_rows=torch.arange(len(positions), device=device),
        )

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE tables for int64 ``positions [N]``: cos and sin ``[N, 1, head_dim]`` in the
        compute dtype, the first half of sin negated (see :class:`ForwardBatch`)."""
        freqs = positions.float().unsqueeze(1) * self.inv_freq.unsqueeze(0)  # [N, hd/2]
        cos, sin = freqs.cos(), freqs.sin()
        if self.rope_factor != 1.0:  # YaRN's attention factor
            cos, sin = cos * self.rope_factor, sin * self.rope_factor
        cos = torch.cat((cos, cos), dim=-1)
        sin = torch.cat((-sin, sin), dim=-1)
        return cos.unsqueeze(1).to(self.dtype), sin.unsqueeze(1).to(self.dtype)

    @torch.inference_mode()
    def forward(self, inputs: torch.Tensor, batch: ForwardBatch, cache: KVCache) -> torch.Tensor:
        if batch.graphed or (self.graphs is not None and not batch.prefill and len(batch.rows) <= GRAPH_MAX_ROWS):
            assert self.graphs is not None
            h = self.graphs.run(inputs, batch.rows, cache)  # embedding and layers
            if self.graphs.head:
                return h  # and the final norm and LM head: logits
        elif (
            self.fused is not None
            and batch.ring is None
            and max(len(inputs), batch.computed_as) <= (FUSED_PREFILL_MAX_ROWS if batch.prefill else KERNEL_MAX_ROWS)
        ):
            h = self.fused(self.embed(inputs) if self.embed is not None else inputs, batch, cache)
        else:
            h = self.embed(inputs) if self.embed is not None else inputs
            with computed_as(batch.computed_as):
                for i, layer in enumerate(self.layers):
                    h = layer(h, batch, cache.k[i], cache.v[i])
        if self.lm_head is None or self.norm is None:
            return h
        h = self.norm(h.index_select(0, batch.logit_rows))
        return h if batch.hidden_out else self.logits(h)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits ``[M, vocab]`` of final-norm hidden states ``[M, hidden]`` (what
        :meth:`forward` returns for a ``hidden_out`` batch); the last shard only."""
        assert self.lm_head is not None
        return self.lm_head(hidden).float()


def _masked_decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Decode attention of fixed shapes: query rows ``q`` ``[N, heads, head_dim]``, each
    over the first ``S`` positions of its slot (int64 ``slots`` ``[N]``) of the caches
    ``[slots, kv_heads, positions, head_dim]`` where bool ``mask`` ``[N, S]`` is True.
    Query head j reads KV head ``j // (heads // kv_heads)`` as in ``enable_gqa``: a KV
    head's queries attend as that many query positions of one head, so no key is
    repeated. Returns ``[N, heads, head_dim]`` in the caches' dtype."""
    n, heads, hd = q.shape
    span, kv_heads = mask.shape[1], k_cache.shape[1]
    keys = k_cache[:, :, :span].index_select(0, slots)  # [N, kv_heads, S, hd]
    values = v_cache[:, :, :span].index_select(0, slots)
    out = F.scaled_dot_product_attention(
        q.reshape(n, kv_heads, heads // kv_heads, hd), keys, values, attn_mask=mask[:, None, None, :]
    )  # [N, kv_heads, group, hd]
    return out.reshape(n, heads, hd)


def _gqa_padding(local_kv: list[int] | None, num_kv_heads: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Index tensors that pad uneven query groups to one group size (see :class:`Attention`).

    ``local_kv[i]`` is the local KV head of local query head i (ascending). Returns
    ``(q_index, out_index)``, int64 on the CPU: ``q_index`` ``[num_kv_heads * group]``
    picks, for padded head j, the query head it copies (KV head ``j // group`` attends it,
    as ``enable_gqa`` repeats each KV head ``group`` times); ``out_index``
    ``[len(local_kv)]`` picks the real heads' outputs back. Both None when the groups
    are already even.
    """
    if local_kv is None:
        return None, None
    counts = [local_kv.count(j) for j in range(num_kv_heads)]
    group = max(counts)
    if all(c == group for c in counts):
        return None, None
    q_index: list[int] = []
    out_index: list[int] = []
    for j in range(num_kv_heads):
        mine = [i for i, kv in enumerate(local_kv) if kv == j]
        out_index.extend(len(q_index) + k for k in range(len(mine)))
        q_index.extend(mine + [mine[0]] * (group - len(mine)))
    as_tensor = lambda v: torch.tensor(v, dtype=torch.long, device="cpu")  # noqa: E731
    return as_tensor(q_index), as_tensor(out_index)
