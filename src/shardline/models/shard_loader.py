"""Building one rank's :class:`~shardline.models.llama.DecoderShard` from a weight file.

A rank reads only the tensors of its layer range (and the embedding or head where its
shard holds them), tensor by tensor from the memory-mapped file, and turns each into its
resident form (:mod:`shardline.models.linear`) before reading the next, so no more than one
tensor is ever held in a temporary form. A quantized GGUF weight stays in its own
quantization (exact); a 16-bit or float32 weight is held in the compute dtype.

A tensor-parallel rank reads only its slice of each split tensor: a range of rows (q/k/v,
gate/up: whole heads, MLP columns) or of columns (o, down; the range falls on the
format's groups of 32, as :mod:`shardline.placement.tensor` makes it, else that tensor is
read as exact floats), so no rank holds the whole of a tensor it splits.

llama.cpp's converter stores the q and k projections of ``llama`` models permuted for
interleaved RoPE; their rows are put back here so one RoPE (rotate-half) serves both
formats.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from shardline.models.config import Quantize, TensorShare
from shardline.models.gguf_quants import GroupQuant
from shardline.models.int4_planes import Int4Planes
from shardline.models.linear import Linear, ResidentWeight, RowBlocks, resident_weight
from shardline.models.quantize import quantizable, quantize_groups
from shardline.models.weights import GGUFSource, Span, WeightFormatError, WeightSource
from shardline.process_memory import release_free_memory

Part = torch.Tensor | GroupQuant


def _unpermute_index(rows: int, heads: int) -> np.ndarray:
    """Row order that undoes llama.cpp's q/k permutation (interleaved -> rotate-half)."""
    head_dim = rows // heads
    return np.arange(rows).reshape(heads, head_dim // 2, 2).transpose(0, 2, 1).reshape(rows)


def _take_rows(part: Part, index: np.ndarray) -> Part:
    if isinstance(part, GroupQuant):
        return part.take_rows(index)
    return part[torch.from_numpy(index)]


def _names(source: WeightSource, layer: int | None, part: str) -> str:
    """Source tensor name of ``part`` (shardline's name) in global ``layer`` (None: top)."""
    if layer is None:
        return source.TOP_NAMES[part]
    return source.LAYER_FORMAT.format(layer=layer, name=source.LAYER_NAMES[part])


def _stack(parts: list[Part]) -> list[Part | RowBlocks]:
    """Adjacent row blocks merged where they share a form (a fused q/k/v of one type is
    one block; a v stored in another type stays its own): float tensors concatenated,
    integer groups as one :class:`RowBlocks` over the parts (no copy of the whole)."""
    runs: list[list[Part]] = []
    for part in parts:
        last = runs[-1][-1] if runs else None
        if (isinstance(part, torch.Tensor) and isinstance(last, torch.Tensor)) or (
            isinstance(part, GroupQuant) and isinstance(last, GroupQuant) and part.form == last.form
        ):
            runs[-1].append(part)
        else:
            runs.append([part])
    out: list[Part | RowBlocks] = []
    for run in runs:
        if len(run) == 1:
            out.append(run[0])
        elif isinstance(run[0], torch.Tensor):
            out.append(torch.cat([t.to(run[0].dtype) for t in run]))  # type: ignore[union-attr]
        else:
            out.append(_stacked_groups(run))  # type: ignore[arg-type]
    return out


def _stacked_groups(parts: list[GroupQuant]) -> RowBlocks:
    """``parts`` (one form and width) one after another as one weight: rows within one
    part are a view of it, rows across parts a copy of just those rows."""
    starts = np.cumsum([0] + [p.shape[0] for p in parts])

    def read(start: int, end: int) -> GroupQuant:
        pieces = [
            p.rows(max(start, a) - a, min(end, b) - a)
            for p, a, b in zip(parts, starts[:-1], starts[1:])
            if start < b and end > a
        ]
        return pieces[0] if len(pieces) == 1 else GroupQuant.concat(pieces)

    return RowBlocks(read, (int(starts[-1]), parts[0].shape[1]))


_Tensors = Iterator[tuple[str, list[Part | RowBlocks] | torch.Tensor]]


def shard_tensors(
    source: WeightSource, layer_start: int, layer_end: int, share: TensorShare | None = None, head: bool = True
) -> _Tensors:
    """The weights of a :class:`~shardline.models.llama.DecoderShard`, one at a time.

    Yields ``(name, value)``: for a linear module (``layers.<i>.attn.qkv``, ``...o``,
    ``...mlp.gate_up``, ``...down``; of an MoE layer ``...mlp.experts.<e>.gate_up`` and
    ``...down``) a list of row blocks (float tensors or
    :class:`GroupQuant`, as the file stores them; fused parts of one form as one
    :class:`~shardline.models.linear.RowBlocks` over them); for ``embed`` and ``lm_head`` one
    :class:`~shardline.models.linear.RowBlocks` (read when converted, a block of rows at
    a time); for a norm or bias
    parameter its float tensor (an MoE router, ``...mlp.router``, float32). Reads layers ``[layer_start, layer_end)``, the embedding
    when ``layer_start == 0`` and, with ``head``, the final norm and head (the embedding
    when tied) when the range ends at the last layer.

    With a tensor ``share`` (the range must be the whole model) each layer's split tensors
    are read as slices: q rows of the share's heads, k/v rows of its KV heads, gate/up rows
    of its MLP columns, o columns of its heads and down columns of its MLP columns; of an
    MoE layer the same columns of every expert, and the whole router.

    Raises:
        WeightFormatError: a tensor is missing or has an unexpected shape.
    """
    reader = _ShardReader(source, share)
    config = source.config
    if layer_start == 0:
        yield "embed", [reader.row_blocks("embedding", "embed", (config.vocab_size, config.hidden_size))]
    for local, layer in enumerate(range(layer_start, layer_end)):
        p = f"layers.{local}."
        yield from reader.attention(p, layer)
        yield p + "attn_norm.weight", reader.vector(layer, "attn_norm")
        yield p + "mlp_norm.weight", reader.vector(layer, "mlp_norm")
        if config.is_moe:
            yield from reader.experts(p, layer)
        else:
            yield from reader.mlp(p, layer)
    if layer_end == config.num_layers and head:
        yield "norm.weight", reader.vector(None, "norm")
        tied = config.tie_word_embeddings
        if not (tied and layer_start == 0):  # a tied head on the first shard reuses embed
            yield (
                "lm_head",
                [reader.row_blocks("LM head", "embed" if tied else "head", (config.vocab_size, config.hidden_size))],
            )


class _ShardReader:
    """:func:`shard_tensors`' reads from ``source``, of a tensor ``share``'s slices (None:
    whole tensors), each checked against the shape the model config gives it."""

    def __init__(self, source: WeightSource, share: TensorShare | None) -> None:
        """Raises ValueError (``TensorShare.check``) for a share that does not fit the
        model's shapes."""
        self.source, self.share = source, share
        config = self.config = source.config
        self.permuted = isinstance(source, GGUFSource) and config.architecture == "llama"
        self.d, self.hd, self.inter = config.hidden_size, config.head_dim, config.intermediate_size
        hd = self.hd
        self.q_rows, self.kv_rows = config.num_heads * hd, config.num_kv_heads * hd

        def span(start: int, end: int, full: int) -> Span:
            return None if (start, end) == (0, full) else (start, end)

        self.q_span: Span
        self.kv_span: Span
        self.col_span: Span
        if share is None:
            self.heads, self.kv_heads = config.num_heads, config.num_kv_heads
            self.q_span = self.kv_span = self.col_span = None
        else:
            share.check(config)
            self.heads, self.kv_heads = share.num_heads, share.num_kv_heads
            self.q_span = span(share.heads[0] * hd, share.heads[1] * hd, self.q_rows)
            kv0 = share.kv_heads[0]
            self.kv_span = span(kv0 * hd, (kv0 + self.kv_heads) * hd, self.kv_rows)
            self.col_span = span(*share.columns, self.inter)

    def weight(
        self, label: str, layer: int | None, part: str, shape: tuple[int, ...], rows: Span = None, cols: Span = None
    ) -> Part:
        """Check the file's whole shape, then read the slice as the file stores it."""
        name = self.checked(label, _names(self.source, layer, part), shape)
        return self.source.read_weight(name, rows, cols)

    def checked(self, label: str, name: str, shape: tuple[int, ...], expert: int | None = None) -> str:
        """``name``, once the file's tensor (its expert's slice) has ``shape``.

        Raises:
            WeightFormatError: it has another shape (the message begins with ``label``)."""
        found = self.source.shape(name, expert)
        if found != shape:
            raise WeightFormatError(f"{label} has shape {found}, expected {shape}")
        return name

    def row_blocks(self, label: str, part: str, shape: tuple[int, int]) -> RowBlocks:
        """A whole top-level weight (embedding, head), to read a block of rows at a time."""
        name = self.checked(label, _names(self.source, None, part), shape)
        return RowBlocks(lambda start, end: self.source.read_weight(name, (start, end)), shape)

    def vector(self, layer: int | None, part: str, rows: Span = None) -> torch.Tensor:
        return self.source.read(_names(self.source, layer, part), rows)

    def attention(self, p: str, layer: int) -> _Tensors:
        """A layer's attention (prefix ``p``): the fused qkv (GGUF llama's q and k rows
        unpermuted), its bias, o and its bias (on rank 0 only), sinks, q/k norms."""
        config, d, hd, share = self.config, self.d, self.hd, self.share
        q_span, kv_span = self.q_span, self.kv_span
        heads, kv_heads = self.heads, self.kv_heads
        q = self.weight(f"layer {layer} q", layer, "q", (self.q_rows, d), q_span)
        k = self.weight(f"layer {layer} k", layer, "k", (self.kv_rows, d), kv_span)
        v = self.weight(f"layer {layer} v", layer, "v", (self.kv_rows, d), kv_span)
        if self.permuted:
            q = _take_rows(q, _unpermute_index(heads * hd, heads))
            k = _take_rows(k, _unpermute_index(kv_heads * hd, kv_heads))
        yield p + "attn.qkv", _stack([q, k, v])
        if config.attention_bias:
            qb, kb, vb = (
                self.vector(layer, n, s) for n, s in (("q_bias", q_span), ("k_bias", kv_span), ("v_bias", kv_span))
            )
            if self.permuted:
                qb = qb[torch.from_numpy(_unpermute_index(heads * hd, heads))]
                kb = kb[torch.from_numpy(_unpermute_index(kv_heads * hd, kv_heads))]
            yield p + "attn.qkv.bias", torch.cat((qb, kb, vb))
        yield p + "attn.o", [self.weight(f"layer {layer} o", layer, "o", (d, self.q_rows), cols=q_span)]
        if config.output_bias and (share is None or share.rank == 0):  # added once
            yield p + "attn.o.bias", self.vector(layer, "o_bias")
        if config.attention_sinks:
            yield p + "attn.sinks", self.vector(layer, "sinks", q_span and (q_span[0] // hd, q_span[1] // hd))
        if config.qk_norm:
            yield p + "attn.q_norm.weight", self.vector(layer, "q_norm")
            yield p + "attn.k_norm.weight", self.vector(layer, "k_norm")

    def mlp(self, p: str, layer: int) -> _Tensors:
        """A dense layer's MLP (prefix ``p``): the fused gate/up and down, of the share's
        columns."""
        d, inter, col_span = self.d, self.inter, self.col_span
        gate = self.weight(f"layer {layer} gate", layer, "gate", (inter, d), col_span)
        up = self.weight(f"layer {layer} up", layer, "up", (inter, d), col_span)
        yield p + "mlp.gate_up", _stack([gate, up])
        yield p + "mlp.down", [self.weight(f"layer {layer} down", layer, "down", (d, inter), cols=col_span)]

    def experts(self, p: str, layer: int) -> _Tensors:
        """An MoE layer's router (float32 here, whole on every rank) and each expert's
        gate/up and down, of the share's columns (under expert sharding: the share's whole
        experts only)."""
        config, source, share, d, inter = self.config, self.source, self.share, self.d, self.inter
        col_span = self.col_span
        router = source.router_tensor(layer)
        self.checked(f"layer {layer} router {router!r}", router, (config.num_experts, d))
        yield p + "mlp.router", source.read(router).float()
        whole = share is not None and share.experts is not None  # expert sharding
        if config.expert_bias:
            yield p + "mlp.router_bias", source.read(router.removesuffix(".weight") + ".bias").float()
            biases = {
                part: source.read(source.expert_bias_tensor(layer, part)).float() for part in ("gate", "up", "down")
            }  # [experts, rows], small
            c0, c1 = share.columns if share else (0, inter)
        first, last = share.expert_range(config) if share else (0, config.num_experts)

        def expert(e: int, part: str, shape: tuple[int, int], rows: Span = None, cols: Span = None) -> Part:
            name, index = source.expert_tensor(layer, part, e)
            self.checked(f"layer {layer} expert {e} {part} ({name!r})", name, shape, index)
            return source.read_weight(name, rows, cols, index)

        for e in range(first, last):
            q = f"{p}mlp.experts.{e - first}."
            yield (
                q + "gate_up",
                _stack([expert(e, "gate", (inter, d), col_span), expert(e, "up", (inter, d), col_span)]),
            )
            yield q + "down", [expert(e, "down", (d, inter), cols=col_span)]
            if config.expert_bias:
                yield q + "gate_up.bias", torch.cat((biases["gate"][e, c0:c1], biases["up"][e, c0:c1]))
                if share is None or share.rank == 0 or whole:  # added once
                    yield q + "down.bias", biases["down"][e]


_DENSE_DTYPES = {"router": torch.float32, "router_bias": torch.float64, "sinks": torch.float32}
"""Parameters held in their own dtype, not the compute dtype (see
:class:`~shardline.models.feed_forward.MixtureOfExperts`; attention sinks are logits that
join a float32 softmax)."""


def load_shard(
    source: WeightSource,
    layer_start: int,
    layer_end: int,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
    quantize: Quantize | None = None,
):
    """Build a :class:`~shardline.models.llama.DecoderShard` holding only its own weights,
    each in its resident form (see :mod:`shardline.models.linear`); with ``quantize`` the
    linear weights and embedding a file stores in 16 or 32 bits are quantized on load
    (:mod:`shardline.models.quantize`; a file's quantized weights stay as they are).

    Raises:
        WeightFormatError: a tensor is missing or misshapen.
    """
    return _build_shard(source, layer_start, layer_end, dtype, device, quantize=quantize)


def load_tensor_shard(
    source: WeightSource,
    share: TensorShare,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
    head: bool | None = None,
    quantize: Quantize | None = None,
):
    """Build one tensor-parallel rank's :class:`~shardline.models.llama.DecoderShard`
    (``quantize`` as for :func:`load_shard`).

    It holds every layer, but of each only the share's heads, KV heads and MLP columns
    (read as slices, see :func:`shard_tensors`), plus the whole token embedding on every
    rank and the final norm and LM head where ``head`` (default: on rank 0, the rank that
    samples; a tied head reuses the embedding). Its layers' outputs are partial sums until
    :class:`~shardline.parallel.tensor.TensorStage` sets the all-reduce. The slices hold
    exactly the values of the same rows and columns of the whole tensor.

    Raises:
        WeightFormatError: a tensor is missing or misshapen.
        ValueError: the share does not fit the model.
    """
    if head is None:
        head = share.rank == 0
    return _build_shard(source, 0, source.config.num_layers, dtype, device, share=share, head=head, quantize=quantize)


def _int4_for(dtype: torch.dtype) -> bool:
    """Whether weights are held as int4 planes: in bfloat16 and float16. A float32
    instance (a precision mode) holds one byte a weight (:class:`Int8Groups`), which it
    dequantizes faster per product (SmolLM2 decode 18.9 tok/s against 7.6 with planes)."""
    return dtype != torch.float32


def _embedding_weights(
    part: Part | RowBlocks, dtype: torch.dtype, device: torch.device | str
) -> tuple[ResidentWeight, ResidentWeight]:
    """The embedding's resident form and a tied LM head's: both the form the weight takes
    as a linear layer, one object (so a first pipeline rank's rows equal a one-node
    shard's), unless rows cannot be read from torch's int4 layout on this machine: then
    the embedding is held as int8 groups and the head keeps the int4 planes decode wants."""
    held = resident_weight(part, dtype, device, int4=_int4_for(dtype))
    if isinstance(held, Int4Planes) and not held.rows_readable():
        return resident_weight(part, dtype, device, int4=False), held
    return held, held


def _build_shard(
    source: WeightSource,
    layer_start: int,
    layer_end: int,
    dtype: torch.dtype,
    device: torch.device | str,
    share: TensorShare | None = None,
    head: bool = True,
    quantize: Quantize | None = None,
):
    from shardline.models import decode_graphs, fused_decode
    from shardline.models.llama import DecoderShard, rope_inverse_frequencies

    def held(part: Part | RowBlocks, vocab: bool = False) -> Part | RowBlocks:
        """The part as the loader holds it: quantized on load where asked and it can be
        (the embedding and LM head as :attr:`Quantize.vocab` says; block by block)."""
        if isinstance(part, RowBlocks):
            read = part.read
            return RowBlocks(lambda start, end: held(read(start, end), vocab), part.shape)  # type: ignore[arg-type,return-value]
        if quantize is not None and isinstance(part, torch.Tensor) and quantizable(part):
            return quantize_groups(part, quantize.vocab if vocab else quantize)
        return part

    config = source.config
    # Built on the CPU: it holds only norms and biases until the weights are attached
    # (the meta device would import torch's meta kernels, ~80 MB for nothing).
    shard = DecoderShard(config, layer_start, layer_end, share=share, head=head)
    tied_here = config.tie_word_embeddings and layer_start == 0 and shard.lm_head is not None
    modules = dict(shard.named_modules())
    dense: dict[str, torch.Tensor] = {}
    for name, value in shard_tensors(source, layer_start, layer_end, share=share, head=head):
        if isinstance(value, torch.Tensor):  # a norm, a bias, sinks, an MoE router
            dense[name] = value.to(device=device, dtype=_DENSE_DTYPES.get(name.rsplit(".", 1)[-1], dtype))
            continue
        if name == "embed":
            assert shard.embed is not None and (shard.lm_head is not None or not tied_here)
            embed_weight, head_weight = _embedding_weights(held(value[0], vocab=True), dtype, device)
            shard.embed.weight = embed_weight
            shard.embed.dtype = dtype
            if tied_here and shard.lm_head is not None:
                shard.lm_head.set_parts([head_weight])
            del value, head_weight
            release_free_memory()
            continue
        module = modules[name]
        assert isinstance(module, Linear)
        module.set_parts(
            [resident_weight(held(p, vocab=name == "lm_head"), dtype, device, int4=_int4_for(dtype)) for p in value]
        )
        del value
        release_free_memory()  # keeps the load's peak near the weights held so far
    missing, unexpected = shard.load_state_dict(dense, strict=False, assign=True)
    if missing or unexpected:
        raise WeightFormatError(f"shard weights do not match: missing {missing}, unexpected {unexpected}")
    shard.inv_freq = rope_inverse_frequencies(config, source.rope_freq_factors).to(device)
    for module in shard.modules():  # index buffers built on the CPU (see Attention)
        for name, buffer in module.named_buffers(recurse=False):
            if buffer.device != torch.device(device):
                setattr(module, name, buffer.to(device))
    for name, module in shard.named_modules():
        if isinstance(module, Linear) and not module.parts:
            raise WeightFormatError(f"no weight was read for {name}")
    shard.eval()
    shard.fused = fused_decode.for_shard(shard)
    shard.graphs = decode_graphs.for_shard(shard)
    return shard
