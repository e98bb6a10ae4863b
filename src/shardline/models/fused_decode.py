"""Fused decode layers: every decoder layer of a decode step in one call to compiled code
(``kernels/decode_layer.c``), where the torch path makes ~65 small torch ops a layer.

A SmolLM2-135M decode step on the torch path is ~2,000 torch ops of 2-75 us each (norms,
views, RoPE, the cache writes, one attention call per sequence, residual adds) around 121
weight products; the products are a quarter of the step. The fused path runs, for each
layer and each row of the step, the same computation as :class:`~shardline.models.llama.
DecoderLayer` with the same bfloat16 rounding points (RMSNorm normalized in float32,
rounded, scaled; the int4-plane products of :class:`~shardline.models.native_dequant.
Int4Gemv` and, for the weights a file stores in 5- or 6-bit types (a Q4_K_M model's
Q6_K ``attn_v`` and ``ffn_down``), the products of :class:`~shardline.models.
packed_groups.PackedGroups` (:func:`~shardline.models.native_dequant.packed_groups_gemv`),
and for dense bfloat16 weights (a safetensors model's) the compiled dense product
(:func:`~shardline.models.native_dequant.dense_gemv`, which the torch path's decode
products call too), rounded to bfloat16, part by part as :class:`~shardline.models.linear.Linear` does,
called from C; RoPE; the cache write; one-query attention in float32 over the slot's
prefix, with gpt-oss's sliding window and sink logits; the residual adds; SwiGLU, or
gpt-oss's clamped one, and the biases gpt-oss adds). It differs from the torch path mainly in
the attention: torch's bfloat16 attention rounds its probabilities to bfloat16, the
fused one keeps them in float32 (against the torch path with float32 attention the tiny
test models' outputs are the same bits). Each row is computed by the same instructions
whatever the other rows, so a sequence's tokens do not depend on its batch.

It runs only where everything in the shard is supported (:func:`refusal`); elsewhere,
and for prefill chunks of more than
:data:`~shardline.models.llama.FUSED_PREFILL_MAX_ROWS` tokens, the torch path (the
reference) runs. A shorter chunk is a row per token at its own position of the one slot:
the kernel writes every row's key and value before any row attends, so each row sees the
chunk's rows before it, and the chunk's logits and cache are the bits its tokens decoded
one by one would give. The decision is made once per
shard at load (:func:`for_shard`), and logged.
"""

from __future__ import annotations

import ctypes
import logging
import weakref
from typing import TYPE_CHECKING, cast

import torch

from shardline.models import kernel_library, native_dequant
from shardline.models.feed_forward import MLP, MixtureOfExperts
from shardline.models.int4_planes import Int4Planes
from shardline.models.kv_cache import KVCache
from shardline.models.linear import DenseWeight, Linear
from shardline.models.llama import DecoderLayer
from shardline.models.packed_groups import PackedGroups

if TYPE_CHECKING:
    from shardline.models.llama import DecoderShard, ForwardBatch

log = logging.getLogger(__name__)

MAX_HEAD_DIM = 256
"""``MAX_HD`` of the C source."""

MAX_GROUP = 16
"""``MAX_GROUP`` of the C source: query heads per KV head."""

MAX_PARTS = 3
"""``MAX_PARTS`` of the C source: row blocks of one product's weight."""

_P = ctypes.c_void_p
_I = ctypes.c_int64
_POINTERS = (
    "qkv",
    "o",
    "gate_up",
    "down",
    "attn_norm",
    "mlp_norm",
    "qkv_bias",
    "q_norm",
    "k_norm",
    "k_cache",
    "v_cache",
    "router",
    "experts",
    "sinks",
    "router_bias",
    "o_bias",
    "gate_up_bias",
    "down_bias",
)


class _Part(ctypes.Structure):
    """``product_part_t`` of the C source."""

    _fields_ = [("int4", _P), ("packed", _P), ("dense", _P)]


class _Product(ctypes.Structure):
    """``product_t`` of the C source."""

    _fields_ = [("count", _I), ("part", _Part * MAX_PARTS)]


class _Layer(ctypes.Structure):
    """``decode_layer_t`` of the C source."""

    _fields_ = [*((name, _P) for name in _POINTERS), ("window", _I)]


class _Shape(ctypes.Structure):
    """``decode_shape_t`` of the C source."""

    _fields_ = [
        *(
            (name, _I)
            for name in (
                "hidden",
                "heads",
                "kv_heads",
                "hd",
                "inter",
                "slots",
                "positions",
                "experts",
                "top_k",
                "norm_topk",
            )
        ),
        *((name, ctypes.c_float) for name in ("eps", "swiglu_limit", "swiglu_alpha")),
    ]


def _built() -> bool:
    lib = kernel_library.kernels()
    return lib is not None and native_dequant.int4_gemv_built() and bool(lib.decode_layers_built())


def _product_refusal(linear: Linear) -> str | None:
    """Why the fused layers cannot take ``linear``'s product, or None: up to
    :data:`MAX_PARTS` parts, each int4 planes that the compiled decode product takes,
    packed 5/6-bit groups with bfloat16 scales, or dense bfloat16 values (contiguous,
    where the compiled dense product is built), returned in the compute dtype."""
    if linear.partial or linear.logits:
        return "a partial or logits product"
    forms = [type(p).__name__ for p in linear.parts]
    if len(linear.parts) > MAX_PARTS or not all(
        (isinstance(p, PackedGroups) and p.scale.dtype == torch.bfloat16)
        or (isinstance(p, Int4Planes) and p._gemv() is not None)
        or (isinstance(p, DenseWeight) and p.compiled())
        for p in linear.parts
    ):
        return (
            f"weight held as {forms} (up to {MAX_PARTS} parts of int4 planes the compiled "
            "decode product takes, packed 5/6-bit groups, or dense bfloat16 values)"
        )
    return None


def _product(linear: Linear, held: list[object]) -> _Product:
    """``linear``'s weight as the C ``product_t`` (trusts :func:`_product_refusal`); what
    its pointers point into is appended to ``held``."""
    product = _Product(len(linear.parts))
    for entry, part in zip(product.part, linear.parts):
        if isinstance(part, Int4Planes):
            gemv = part._gemv()
            assert gemv is not None, "taken by _product_refusal()"
            entry.int4 = gemv.address
            held.append(gemv)
        elif isinstance(part, DenseWeight):
            dense = native_dequant.DenseT.of(part.weight)
            entry.dense = ctypes.addressof(dense)
            held += [part, dense]
        else:
            assert isinstance(part, PackedGroups), "taken by _product_refusal()"
            weight = native_dequant.PackedWeight.of(part)
            entry.packed = ctypes.addressof(weight)
            held += [part, weight]
    held.append(product)
    return product


def _feed_forward_products(mlp: MLP | MixtureOfExperts) -> list[tuple[str, Linear]]:
    """The named products of a layer's feed-forward block: an MLP's gate_up and down, or
    each expert's."""
    if isinstance(mlp, MLP):
        return [("gate_up", mlp.gate_up), ("down", mlp.down)]
    return [
        (f"expert {e} {name}", linear)
        for e, expert in enumerate(mlp.experts)
        for name, linear in (("gate_up", cast(MLP, expert).gate_up), ("down", cast(MLP, expert).down))
    ]


def refusal(shard: DecoderShard) -> str | None:
    """Why the fused decode layers do not run ``shard``'s decode steps, or None where they
    do: the kernels are built here (AVX-512 BF16, VNNI and VBMI), the compute dtype is bfloat16
    on the CPU, the shard holds whole layers (no tensor share, no all-reduce, no padded
    query groups), head_dim, hidden and intermediate sizes are multiples of 16 (head_dim at
    most :data:`MAX_HEAD_DIM`), at most :data:`MAX_GROUP` query heads a KV head, and each
    layer's four products are up to :data:`MAX_PARTS` parts of int4 planes the compiled
    decode product takes, packed 5/6-bit groups, or dense bfloat16 values (a safetensors
    model's). Qwen2's q/k/v bias, Qwen3's q/k norms,
    mixture-of-experts layers (every expert's products as above) and gpt-oss's attention
    sinks, sliding windows, biases and clamped SwiGLU are supported."""
    config = shard.config
    if not _built():
        return "the compiled decode kernels are not built here (AVX-512 BF16, VNNI and VBMI)"
    if shard.dtype != torch.bfloat16 or shard.device.type != "cpu":
        return f"compute dtype {shard.dtype} on {shard.device.type} (bfloat16 on the CPU)"
    if shard.share is not None:
        return "a tensor-parallel share"
    sizes = (config.hidden_size, config.head_dim, config.intermediate_size)
    if any(size % 16 for size in sizes) or config.head_dim > MAX_HEAD_DIM:
        return f"hidden, head_dim, intermediate {sizes} (multiples of 16, head_dim <= 256)"
    if config.num_heads % config.num_kv_heads or config.num_heads > MAX_GROUP * config.num_kv_heads:
        return f"{config.num_heads} query heads over {config.num_kv_heads} KV heads (<= 16 each)"
    for i, module in enumerate(shard.layers):
        layer = cast(DecoderLayer, module)
        if layer.all_reduce is not None or layer.attn.q_index is not None:
            return f"layer {i}: an all-reduce or padded query groups"
        for name, linear in (("qkv", layer.attn.qkv), ("o", layer.attn.o), *_feed_forward_products(layer.mlp)):
            if why := _product_refusal(linear):
                return f"layer {i} {name}: {why}"
    return None


def for_shard(shard: DecoderShard) -> FusedDecode | None:
    """The fused decode layers of ``shard``, or None where :func:`refusal` says why not;
    logs which path its decode steps take."""
    why = refusal(shard)
    where = f"layers [{shard.layer_start}, {shard.layer_end})"
    if why:
        log.info("decode of %s: torch ops per layer (%s)", where, why)
        return None
    log.info("decode of %s: fused decode layers (one compiled call a step)", where)
    return FusedDecode(shard)


class FusedDecode:
    """A shard's decoder layers for decode steps, as one call of ``decode_layers``.

    Holds the C description of each layer (its products' ``product_t``, bfloat16
    copies of the norms' weights and the biases, float32 sinks and router, the float64
    router bias, the layer's sliding window) and, for the last KV cache it ran with, the
    cache pointers. Build it with :func:`for_shard` (this trusts
    :func:`refusal`).
    """

    def __init__(self, shard: DecoderShard) -> None:
        config = shard.config
        self._lib = kernel_library.loaded()
        self._held: list[object] = []  # what the pointers point into
        self._layers: list[dict[str, int | None]] = []
        self._windows: list[int] = []
        for module in shard.layers:
            layer = cast(DecoderLayer, module)
            attn, mlp = layer.attn, layer.mlp
            ptrs: dict[str, int | None] = dict.fromkeys(_POINTERS)
            for name, linear in (("qkv", attn.qkv), ("o", attn.o)):
                ptrs[name] = ctypes.addressof(_product(linear, self._held))
            if isinstance(mlp, MLP):
                for name, linear in (("gate_up", mlp.gate_up), ("down", mlp.down)):
                    ptrs[name] = ctypes.addressof(_product(linear, self._held))
                experts = [mlp]
            else:  # the router (float32) and each expert's gate_up and down, in order
                products = [linear for _, linear in _feed_forward_products(mlp)]
                array = (_Product * len(products))(*(_product(p, self._held) for p in products))
                self._held.append(array)
                ptrs["experts"] = ctypes.addressof(array)
                experts = [cast(MLP, expert) for expert in mlp.experts]
            gate_up_bias, down_bias = (
                None if any(b is None for b in biases) else torch.stack(cast(list[torch.Tensor], biases))
                for biases in ([e.gate_up.bias for e in experts], [e.down.bias for e in experts])
            )
            vectors = {  # name -> (vector or None, the dtype the kernel reads)
                "attn_norm": (layer.attn_norm.weight, torch.bfloat16),
                "mlp_norm": (layer.mlp_norm.weight, torch.bfloat16),
                "qkv_bias": (attn.qkv.bias, torch.bfloat16),
                "o_bias": (attn.o.bias, torch.bfloat16),
                "q_norm": (attn.q_norm.weight if attn.q_norm else None, torch.bfloat16),
                "k_norm": (attn.k_norm.weight if attn.k_norm else None, torch.bfloat16),
                "sinks": (attn.sinks, torch.float32),
                "gate_up_bias": (gate_up_bias, torch.bfloat16),
                "down_bias": (down_bias, torch.bfloat16),
            }
            if isinstance(mlp, MixtureOfExperts):
                vectors |= {"router": (mlp.router, torch.float32), "router_bias": (mlp.router_bias, torch.float64)}
            for name, (vector, dtype) in vectors.items():
                if vector is None:
                    ptrs[name] = None
                    continue
                held = vector.detach().to(dtype).contiguous()
                self._held.append(held)
                ptrs[name] = held.data_ptr()
            self._layers.append(ptrs)
            self._windows.append(attn.window)
        self._sizes = (
            config.hidden_size,
            config.num_heads,
            config.num_kv_heads,
            config.head_dim,
            config.intermediate_size,
        )
        self._experts = (config.num_experts, config.num_experts_per_tok, int(config.norm_topk_prob))
        self._floats = (config.rms_norm_eps, config.swiglu_limit, config.swiglu_alpha)
        self._cache: weakref.ref[KVCache] | None = None
        self._array: ctypes.Array[_Layer] | None = None
        self._shape = _Shape()

    def _bind(self, cache: KVCache) -> None:
        """Point the layers at ``cache``'s tensors.

        Raises:
            ValueError: a cache of another shape or dtype than the shard's layers.
        """
        hidden, heads, kv_heads, hd, inter = self._sizes
        if len(cache.k) != len(self._layers):
            raise ValueError(f"a KV cache of {len(cache.k)} layers for {len(self._layers)}")
        array = (_Layer * len(self._layers))()
        for entry, ptrs, window, k, v in zip(array, self._layers, self._windows, cache.k, cache.v):
            for t in (k, v):
                if (
                    t.dtype != torch.bfloat16
                    or not t.is_contiguous()
                    or t.device.type != "cpu"
                    or t.shape[1] != kv_heads
                    or t.shape[3] != hd
                ):
                    raise ValueError(
                        f"KV cache {t.dtype} {tuple(t.shape)}: the fused decode "
                        f"layers take contiguous bfloat16 [slots, {kv_heads}, "
                        f"positions, {hd}]"
                    )
            values = ptrs | {"k_cache": k.data_ptr(), "v_cache": v.data_ptr()}
            for name in _POINTERS:
                setattr(entry, name, values[name])
            entry.window = window
        slots, _, positions, _ = cache.k[0].shape
        self._shape = _Shape(hidden, heads, kv_heads, hd, inter, slots, positions, *self._experts, *self._floats)
        self._array, self._cache = array, weakref.ref(cache)

    def __call__(self, h: torch.Tensor, batch: ForwardBatch, cache: KVCache) -> torch.Tensor:
        """The layers' output for a decode step: ``h`` ``[N, hidden]`` bfloat16 (N <= 64,
        one row per sequence of ``batch``, or per token of a prefill chunk ``batch``) ->
        a new ``[N, hidden]`` bfloat16; writes each row's key and value into ``cache`` at
        its slot and position.

        Raises:
            ValueError: a slot or position outside ``cache``, or a cache of another shape.
            MemoryError: no memory for the step's scratch.
        """
        if self._cache is None or self._cache() is not cache:
            self._bind(cache)
        x = h.to(torch.bfloat16, copy=True).contiguous()
        slots = batch.slots.expand(len(x)) if batch.prefill else batch.slots
        slots, positions = slots.contiguous(), batch.positions.contiguous()
        cos, sin = batch.cos.contiguous(), batch.sin.contiguous()
        assert self._array is not None
        rc = self._lib.decode_layers(
            ctypes.addressof(self._shape),
            ctypes.addressof(self._array),
            len(self._layers),
            x.data_ptr(),
            x.shape[0],
            slots.data_ptr(),
            positions.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
        )
        if rc == -2:
            raise ValueError(
                f"decode rows at slots {batch.slots.tolist()} positions "
                f"{batch.positions.tolist()}: outside the KV cache "
                f"{tuple(cache.k[0].shape)}"
            )
        if rc:
            raise MemoryError("fused decode layers: no memory for the step's scratch")
        return x
