"""The Llama-family decoder (Llama, Mistral, SmolLM, Qwen2, Qwen3), one shard of it.

A :class:`DecoderShard` holds a contiguous layer range ``[layer_start, layer_end)`` of the
model; the first shard also holds the token embedding, the last the final norm and the LM
head. A one-node instance is the shard ``[0, num_layers)`` with both.

Tokens are processed as a flat batch of rows, shape ``[N, hidden_size]``:

- a prefill chunk is N consecutive positions of one sequence;
- a decode step is one new position for each of N sequences.

Attention reads and writes a preallocated, slot-indexed KV cache (:class:`KVCache`), so
no cache memory is allocated per token. RoPE uses the rotate-half convention of the
Hugging Face implementation (Su et al., RoFormer, 2021); GGUF weights are un-permuted on
load to match it (see ``shardline.models.weights``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from shardline.models.config import ModelConfig
from shardline.models.linear import Linear


class KVCache:
    """Key/value cache for the layers of one shard.

    Per local layer two tensors of shape ``[slots, num_kv_heads, context, head_dim]`` in
    ``dtype``. A sequence owns one slot for its lifetime; position p of it lives at
    ``[slot, :, p]``. Bytes: ``2 * layers * slots * num_kv_heads * context * head_dim *
    element_size``.
    """

    def __init__(
        self,
        config: ModelConfig,
        num_layers: int,
        slots: int,
        context: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = (slots, config.num_kv_heads, context, config.head_dim)
        self.slots = slots
        self.context = context
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


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


def rope_inverse_frequencies(
    config: ModelConfig, freq_factors: torch.Tensor | None = None
) -> torch.Tensor:
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
    return inv.float()


class Attention(nn.Module):
    """Grouped-query self-attention with fused q/k/v projection and a slot KV cache."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        q_out = config.num_heads * config.head_dim
        kv_out = config.num_kv_heads * config.head_dim
        self.qkv = Linear(config.hidden_size, q_out + 2 * kv_out, bias=config.attention_bias)
        self.o = Linear(q_out, config.hidden_size, bias=False)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.split = (q_out, kv_out, kv_out)

    def forward(
        self, x: torch.Tensor, batch: ForwardBatch, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> torch.Tensor:
        n, heads, kv_heads, hd = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv(x)
        qk = qkv[:, : (heads + kv_heads) * hd].view(n, heads + kv_heads, hd)
        v = qkv[:, (heads + kv_heads) * hd :].view(n, kv_heads, hd)
        if self.q_norm is not None:
            qk = torch.cat((self.q_norm(qk[:, :heads]), self.k_norm(qk[:, heads:])), dim=1)
        # RoPE on q and k at once: x * cos + rotate_half(x) * sin, where rotate_half swaps
        # the two halves of each head (flip) and batch.sin carries rotate_half's sign.
        swapped = qk.view(n, heads + kv_heads, 2, hd // 2).flip(2).view(n, heads + kv_heads, hd)
        qk = qk * batch.cos + swapped * batch.sin
        q, k = qk[:, :heads], qk[:, heads:]

        if batch.prefill:
            slot, start = batch.slot, batch.start
            k_cache[slot, :, start : start + n] = k.transpose(0, 1)
            v_cache[slot, :, start : start + n] = v.transpose(0, 1)
            out = F.scaled_dot_product_attention(
                q.transpose(0, 1).unsqueeze(0),
                k_cache[slot : slot + 1, :, : batch.kv_len],
                v_cache[slot : slot + 1, :, : batch.kv_len],
                attn_mask=batch.attn_mask,
                is_causal=batch.attn_mask is None,
                enable_gqa=True,
            )  # [1, H, n, hd]
            out = out.squeeze(0).transpose(0, 1).reshape(n, heads * hd)
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
                )  # [1, H, 1, hd]
                for i, (slot, length) in enumerate(batch.rows)
            ]
            out = (outs[0] if n == 1 else torch.cat(outs)).reshape(n, heads * hd)
        return self.o(out)


class MLP(nn.Module):
    """SwiGLU feed-forward (Shazeer, 2020) with fused gate/up projection."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_up = Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down = Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = Attention(config)
        self.mlp_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self, x: torch.Tensor, batch: ForwardBatch, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), batch, k_cache, v_cache)
        return x + self.mlp(self.mlp_norm(x))


class DecoderShard(nn.Module):
    """Layers ``[layer_start, layer_end)`` of a decoder, plus embedding and/or head.

    Args:
        config: the whole model's configuration.
        layer_start, layer_end: global layer indices of this shard (end exclusive).
        rope_freq_factors: GGUF ``rope_freqs.weight`` (float32 ``[head_dim // 2]``) or None.

    ``forward`` takes int64 token ids ``[N]`` on the first shard and hidden states
    ``[N, hidden_size]`` (compute dtype) on the others; it returns hidden states, or on
    the last shard float32 logits ``[len(batch.logit_rows), vocab_size]``.
    """

    def __init__(
        self,
        config: ModelConfig,
        layer_start: int,
        layer_end: int,
        rope_freq_factors: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        if not 0 <= layer_start < layer_end <= config.num_layers:
            raise ValueError(
                f"layer range [{layer_start}, {layer_end}) is not inside "
                f"[0, {config.num_layers})"
            )
        self.config = config
        self.layer_start = layer_start
        self.layer_end = layer_end
        self.is_first = layer_start == 0
        self.is_last = layer_end == config.num_layers
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size) if self.is_first else None
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(layer_end - layer_start))
        if self.is_last:
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        else:
            self.norm = None
            self.lm_head = None
        self.register_buffer(
            "inv_freq", rope_inverse_frequencies(config, rope_freq_factors), persistent=False
        )

    @property
    def dtype(self) -> torch.dtype:
        return self.layers[0].attn.qkv.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.layers[0].attn.qkv.weight.device

    def prefill_batch(self, slot: int, start: int, length: int, want_logits: bool) -> ForwardBatch:
        """Describe a prefill chunk: positions ``start .. start+length-1`` of ``slot``."""
        device = self.device
        positions = torch.arange(start, start + length, device=device)
        mask = None
        if start > 0:
            keys = torch.arange(start + length, device=device)
            mask = keys.unsqueeze(0) <= positions.unsqueeze(1)  # [length, start+length]
        rows = torch.tensor([length - 1] if want_logits else [], dtype=torch.long, device=device)
        cos, sin = self._rope(positions)
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
        )

    def decode_batch(self, slots: list[int], positions: list[int]) -> ForwardBatch:
        """Describe a decode step: one token at ``positions[i]`` for the sequence in ``slots[i]``."""
        device = self.device
        pos = torch.tensor(positions, dtype=torch.long, device=device)
        cos, sin = self._rope(pos)
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
            rows=[(slot, p + 1) for slot, p in zip(slots, positions)],
            logit_rows=torch.arange(len(positions), device=device),
        )

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float().unsqueeze(1) * self.inv_freq.unsqueeze(0)  # [N, hd/2]
        cos = torch.cat((freqs.cos(), freqs.cos()), dim=-1)
        sin = torch.cat((-freqs.sin(), freqs.sin()), dim=-1)
        return cos.unsqueeze(1).to(self.dtype), sin.unsqueeze(1).to(self.dtype)

    @torch.inference_mode()
    def forward(self, inputs: torch.Tensor, batch: ForwardBatch, cache: KVCache) -> torch.Tensor:
        h = self.embed(inputs) if self.embed is not None else inputs
        for i, layer in enumerate(self.layers):
            h = layer(h, batch, cache.k[i], cache.v[i])
        if self.lm_head is None:
            return h
        h = self.norm(h.index_select(0, batch.logit_rows))
        return self.lm_head(h).float()
