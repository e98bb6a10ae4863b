"""Linear weights held once, in the file's own quantization, and the kernels that read them.

A weight is one of four resident forms (:data:`ResidentWeight`), chosen at load from what
the file stores, never by quantizing again:

- :class:`DenseWeight`: 16-bit (or float32) values, for F16/BF16/F32 tensors
  (safetensors models, GGUF norms); ``F.linear``.
- :class:`~shardline.models.packed_groups.PackedGroups`: the 5- and 6-bit types (Q5_0,
  Q5_1, Q5_K, Q6_K) in about their file's bits, read by the compiled kernels.
- :class:`Int4Planes`: other GGUF types with one scale per 32 weights (Q4_0, Q4_1, Q4_K,
  Q8_0). A 4-bit type is one plane in torch's CPU int4 layout
  (``torch._weight_int4pack_mm_for_cpu``: ``w = (p - 8) * scale + zero``, per group of 32
  inputs, the layout torchao and gpt-fast use); an 8-bit type is two planes, its
  low and high nibbles (``q = 16 * high + low``), whose products add up. Each plane's
  zero is an exact power-of-two multiple of its scale for the symmetric types, so only
  the rounding of each scale (and a Q4_1/K-type minimum) to the compute dtype differs
  from the file's values.
- :class:`Int8Groups`: the rest (shapes torch's int4 kernel does not take, float32
  instances, CUDA): one byte a weight plus a float32 scale and offset per
  group, dequantized into reused scratch for each product.

On CPU torch's int4 kernel reads about half a byte per weight and is fast for the few rows
of a decode step (SmolLM2's 30 layers of one-row GEMMs: int4 4.4 ms against int8 11.5 ms on
the development machine); it serves every product of up to :data:`KERNEL_MAX_ROWS` rows,
so a decoding sequence's output does not depend on its batch (the kernel computes each row
alone). Larger products (prefill chunks) dequantize the weight, a block of rows at a time,
into reused scratch (:data:`DEQUANT_SCRATCH_BYTES`) and run a dense GEMM: with the compiled
kernel of :mod:`shardline.models.native_dequant` where it builds, else with torch ops
(the reference: the kernel's values are the same bit for bit). On CUDA every
quantized form is dequantized per product (the CPU int4 layout is not CUDA's).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from shardline.models import native_dequant
from shardline.models.gguf_quants import GroupQuant
from shardline.models.packed_groups import PackedGroups, pack_groups, packs
from shardline.placement.memory import DEQUANT_SCRATCH_BYTES

INT4_GROUP = 32

REFINED_LOGITS = 16
"""Outputs per row of the LM head recomputed in float32 (:attr:`Linear.logits`)."""

KERNEL_MAX_ROWS = 64
"""Products of at most this many rows (a decode step's sequences) take torch's int4
kernel, which computes each row on its own: up to this batch size a sequence's output does
not depend on what else is in its batch."""


@dataclass
class DenseWeight:
    """``weight`` ``[out, in]`` in the compute dtype."""

    weight: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.weight.shape)  # type: ignore[return-value]

    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ weight.T`` for ``x`` ``[rows, in]`` in the weight's dtype: a prefill
        product whose GEMM runs in another dtype (:func:`gemm_dtype`) converts the weight
        a block of rows at a time into scratch."""
        if x.shape[0] <= KERNEL_MAX_ROWS or gemm_dtype(x.dtype) == x.dtype:
            return F.linear(x, self.weight.to(x.dtype))

        def columns(start: int, end: int, dtype: torch.dtype) -> torch.Tensor:
            out = _scratch("out", end - start, self.weight.shape[1], dtype)
            return out.copy_(self.weight[start:end]).t()

        return _blocked_product(x, self.weight.shape[0], columns)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return self.weight.to(dtype)

    def embed(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self.weight.index_select(0, ids).to(dtype)



_SCRATCH: dict[tuple[str, torch.dtype], torch.Tensor] = {}


def _scratch(name: str, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """A reused ``[rows, cols]`` buffer (one per name and dtype, grown as needed), so a
    dequantized weight block is written into memory already mapped, not fresh pages."""
    buf = _SCRATCH.get((name, dtype))
    if buf is None or buf.numel() < rows * cols:
        with torch.inference_mode(False):  # a normal tensor: written in and out of inference mode
            raw = torch.empty(rows * cols * dtype.itemsize + 4096, dtype=torch.uint8)
        skip = -raw.data_ptr() % 4096
        buf = raw[skip: skip + rows * cols * dtype.itemsize].view(dtype)
        _SCRATCH[(name, dtype)] = buf
    return buf[: rows * cols].view(rows, cols)


def _in_dtype(work: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 scratch ``work`` in ``dtype``: itself, or rounded once into scratch."""
    if dtype == torch.float32:
        return work
    return _scratch("out", work.shape[0], work.shape[1], dtype).copy_(work)


@functools.cache
def gemm_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a prefill GEMM with activations in ``dtype`` runs in: float32 for bfloat16
    on a CPU whose oneDNN has no bfloat16 GEMM (AVX2 without AVX-512: torch's fallback
    ran a 512 x 576 x 1536 product at 15 GFLOP/s against 89 in float32 on a 2-core AMD
    EPYC), else ``dtype``. The inputs are bfloat16 values either way and a bfloat16 GEMM
    accumulates in float32 too; the output is rounded to ``dtype`` once."""
    if dtype != torch.bfloat16:
        return dtype
    try:
        fast = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a build without oneDNN's query
        fast = True
    return dtype if fast else torch.float32


def _blocked_product(x: torch.Tensor, out_features: int, columns,
                     work_per_weight: int = 0) -> torch.Tensor:
    """``x @ W.T`` with ``W``'s output rows dequantized a block at a time by
    ``columns(start, end, dtype)``, which returns ``W.T``'s columns ``[in, end - start]``
    in the GEMM's dtype (:func:`gemm_dtype`; a scratch view, valid until the next call,
    possibly a transposed one: the GEMM reads either layout) using that dtype's bytes
    plus ``work_per_weight`` bytes of scratch a weight: blocks of a multiple of 256 rows
    within :data:`DEQUANT_SCRATCH_BYTES`. Returns ``[rows, out_features]`` in ``x``'s dtype."""
    gemm = gemm_dtype(x.dtype)
    per_weight = gemm.itemsize + work_per_weight
    block = max(256, DEQUANT_SCRATCH_BYTES // (per_weight * x.shape[1]) // 256 * 256)
    xin = x.to(gemm)
    if out_features <= block:
        return torch.mm(xin, columns(0, out_features, gemm)).to(x.dtype)
    out = torch.empty(x.shape[0], out_features, dtype=x.dtype)
    for start in range(0, out_features, block):
        end = min(start + block, out_features)
        out[:, start:end] = torch.mm(xin, columns(start, end, gemm))
    return out


def _native(dtype: torch.dtype):
    """The compiled kernels when they can write ``dtype``, else None (eager torch ops)."""
    return native_dequant.kernels() if dtype in (torch.bfloat16, torch.float32) else None


@dataclass
class Int8Groups:
    """``q`` uint8 ``[out, in]`` with ``scale`` and ``offset`` ``[out, in // group]``
    in float32: ``w = q * scale + offset``, computed in float32 and rounded once to the
    compute dtype when used."""

    q: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor
    group: int

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)  # type: ignore[return-value]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.scale, self.offset))

    def _fill(self, work: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
              offset: torch.Tensor) -> torch.Tensor:
        # In float32 (rounded once afterwards): in bfloat16, ``q * scale`` would round
        # before the offset (often -128 * scale) cancels most of it. Three plain passes
        # beat one mixed-dtype addcmul, which converts its inputs first.
        rows, cols = q.shape
        groups = work.copy_(q).view(rows, cols // self.group, self.group)
        groups.mul_(scale[..., None]).add_(offset[..., None])
        return work

    def _rows(self, start: int, end: int, dtype: torch.dtype) -> torch.Tensor:
        rows, cols = end - start, self.q.shape[1]
        work = _scratch("work", rows, cols, torch.float32)
        self._fill(work, self.q[start:end], self.scale[start:end], self.offset[start:end])
        return _in_dtype(work, dtype)

    def _columns(self, start: int, end: int, dtype: torch.dtype) -> torch.Tensor:
        """``W.T``'s columns ``[start, end)`` (a transposed scratch view): the compiled
        kernel where there is one, else :meth:`_rows`."""
        if _native(dtype) is None:
            return self._rows(start, end, dtype).t()
        out = _scratch("out", end - start, self.q.shape[1], dtype)
        return native_dequant.int8_groups(self.q[start:end], self.scale[start:end],
                                          self.offset[start:end], self.group, out).t()

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return self._rows(0, self.q.shape[0], dtype).clone()

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T`` for ``x`` ``[rows, in]``: up to :data:`KERNEL_MAX_ROWS` rows (decode)
        a product that reads one byte a weight (the compiled kernel, in float32, each row
        on its own), else the weight dequantized block by block and a dense GEMM."""
        if x.shape[0] <= KERNEL_MAX_ROWS and self.group % 8 == 0 and native_dequant.kernels():
            return native_dequant.int8_groups_gemv(self.q, self.scale, self.offset, self.group,
                                                   x.float()).to(x.dtype)
        work = 0 if _native(x.dtype) else 4  # float32 work
        return _blocked_product(x, self.q.shape[0], self._columns, work)

    def embed(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        work = torch.empty(len(ids), self.q.shape[1])
        return self._fill(work, self.q[ids], self.scale[ids], self.offset[ids]).to(dtype)


@dataclass
class Int4Planes:
    """One or two int4 planes: ``packed[i]`` (torch's CPU int4 layout of ``[out, in]``)
    with ``scales_zeros[i]`` ``[in // 32, out, 2]`` in the compute dtype. The weight is
    the sum of the planes' ``(p - 8) * scale + zero``."""

    packed: list[torch.Tensor]
    scales_zeros: list[torch.Tensor]
    out_features: int
    in_features: int

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.packed + self.scales_zeros)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T`` for ``x`` ``[rows, in]``: torch's int4 kernel for at most
        :data:`KERNEL_MAX_ROWS` rows of a 16-bit ``x`` (decode), else the weight
        dequantized block by block into scratch and a dense GEMM (prefill: the kernel is
        2.8x slower than dequantizing and ``F.linear`` for 512 rows of a 576 x 3072
        product; in float32 it has no fast path at all: 20x slower for one row)."""
        x = x.contiguous()
        dense = x.shape[0] > KERNEL_MAX_ROWS or x.dtype == torch.float32
        if dense and self.rows_readable():
            # the kernel writes the output; else float32 work, plane and nibbles
            work = 0 if self._kernel_half(gemm_dtype(x.dtype)) else 9
            return _blocked_product(x, self.out_features, self._columns, work)
        y = None
        for packed, sz in zip(self.packed, self.scales_zeros):
            part = torch._weight_int4pack_mm_for_cpu(x, packed, INT4_GROUP, sz.to(x.dtype))
            y = part if y is None else y + part
        return y

    def _plane(self, i: int, start: int, end: int, out: torch.Tensor) -> None:
        """Write plane ``i``'s rows ``[start, end)`` (multiples of the layout's block) into
        float32 ``out`` ``[rows, in]`` as ``(p - 8) * scale + zero``."""
        block, position = int4pack_layout()  # type: ignore[misc]
        rows, k, half = end - start, self.in_features, block // 2
        packed = self.packed[i].view(-1, k, half)[start // block : -(-end // block)]
        # The nibbles into row order (uint8 scratch), then one contiguous conversion:
        # 0.63 ms for a 3072 x 576 plane against 1.0 ms converting the strided view.
        nibbles = _scratch("nibbles", rows, k, torch.uint8).view(-1, block, k)
        order = _nibble_row_order()
        if order == "halves":  # lows hold the block's first rows, highs the rest
            nibbles[:, :half].copy_((packed & 15).transpose(1, 2))
            nibbles[:, half:].copy_((packed >> 4).transpose(1, 2))
        elif order == "alternate":  # rows alternate low, high
            pairs = nibbles.view(-1, half, 2, k)
            pairs[:, :, 0].copy_((packed & 15).transpose(1, 2))
            pairs[:, :, 1].copy_((packed >> 4).transpose(1, 2))
        else:
            both = torch.stack((packed & 15, packed >> 4), dim=-1).view(-1, k, block)
            nibbles.copy_(both.index_select(2, position).transpose(1, 2))
        out.copy_(nibbles.view(rows, k))
        sz = self.scales_zeros[i][:, start:end].float()  # [in / 32, rows, 2]
        scale, zero = sz[..., 0].t(), sz[..., 1].t()  # [rows, in / 32]
        groups = out.view(rows, k // INT4_GROUP, INT4_GROUP)
        groups.mul_(scale[..., None]).add_((zero - 8 * scale)[..., None])

    def _rows(self, start: int, end: int, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``[start, end)`` in ``dtype`` (a scratch view): the planes' values summed
        in float32 and rounded once."""
        rows, k = end - start, self.in_features
        work = _scratch("work", rows, k, torch.float32)
        self._plane(0, start, end, work)
        if len(self.packed) > 1:
            other = _scratch("plane", rows, k, torch.float32)
            self._plane(1, start, end, other)
            work += other
        return _in_dtype(work, dtype)

    def _kernel_half(self, dtype: torch.dtype) -> int | None:
        """The compiled kernel's half block (16 or 32) for this machine's layout, or None
        where the eager code runs (no kernels, another nibble order, or scales or
        ``dtype`` in float16)."""
        layout = int4pack_layout()
        if (_native(dtype) is None or layout is None or _nibble_row_order() != "halves"
                or self.scales_zeros[0].dtype != torch.bfloat16):
            return None
        return layout[0] // 2 if layout[0] in (32, 64) else None

    def _columns(self, start: int, end: int, dtype: torch.dtype) -> torch.Tensor:
        """``W.T``'s columns ``[start, end)``, ``[in, end - start]`` in ``dtype`` (a scratch
        view, maybe transposed): the compiled kernel where there is one, else :meth:`_rows`."""
        half = self._kernel_half(dtype)
        if half is None:
            return self._rows(start, end, dtype).t()
        out = _scratch("out", self.in_features, end - start, dtype)
        return native_dequant.int4_planes_t(list(zip(self.packed, self.scales_zeros)), half,
                                            start, out)

    def _plane_rows(self, i: int, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        block, position = int4pack_layout()  # type: ignore[misc]
        p = _gather_rows(self.packed[i], self.in_features, block, position, ids)
        sz = self.scales_zeros[i][:, ids].to(dtype)  # [in / 32, len(ids), 2]
        scale = sz[..., 0].t().repeat_interleave(INT4_GROUP, dim=1)
        zero = sz[..., 1].t().repeat_interleave(INT4_GROUP, dim=1)
        return (p.to(dtype) - 8) * scale + zero

    def embed(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``ids`` (int64 ``[T]``) of the weight, ``[T, in]`` in ``dtype``."""
        rows = self._plane_rows(0, ids, torch.float32)
        for i in range(1, len(self.packed)):
            rows = rows + self._plane_rows(i, ids, torch.float32)
        return rows.to(dtype)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight ``[out, in]`` in ``dtype`` (a new tensor)."""
        if self.rows_readable():
            return self._rows(0, self.out_features, dtype).clone()
        # The kernel's product with the identity: W.T, exactly (float32).
        planes = Int4Planes(self.packed, [sz.float() for sz in self.scales_zeros],
                            self.out_features, self.in_features)
        return planes.matmul(torch.eye(self.in_features)).t().to(dtype)

    def rows_readable(self) -> bool:
        """Whether rows can be read from this layout on this machine (else products of
        any size take the kernel, and the embedding keeps its own copy)."""
        layout = int4pack_layout()
        return layout is not None and self.out_features % layout[0] == 0


ResidentWeight = DenseWeight | Int8Groups | Int4Planes | PackedGroups


@dataclass
class RowBlocks:
    """A weight ``[rows, in]`` read from its file a block of rows at a time:
    ``read(start, end)`` returns rows ``[start, end)`` as the file stores them (a
    :class:`GroupQuant` or a float tensor). The loader reads the embedding and LM head,
    the largest tensors, this way, so it never holds one whole in its unpacked form."""

    read: Callable[[int, int], GroupQuant | torch.Tensor]
    shape: tuple[int, int]


PACK_ROWS = 4096
"""Rows converted at a time (a multiple of every int4 block), bounding the loader's
temporaries (unpacked groups, the packing's int32 copies) to this many rows of a tensor."""


def resident_weight(source: GroupQuant | torch.Tensor | RowBlocks, dtype: torch.dtype,
                    device: torch.device | str = "cpu", int4: bool = True) -> ResidentWeight:
    """The resident form of one weight ``[out, in]``: a float tensor stays dense in
    ``dtype``; 5- and 6-bit integer groups become :class:`PackedGroups` where
    :func:`~shardline.models.packed_groups.packs` allows; other integer groups become
    :class:`Int4Planes` where ``int4`` allows, the group is 32, the device is the CPU and
    torch's int4 kernel takes the shape (``in`` a multiple of 32, ``out`` of 16), else
    :class:`Int8Groups`. No value changes beyond
    rounding scales to ``dtype``. A weight of more than :data:`PACK_ROWS` rows is
    converted (and, from :class:`RowBlocks`, read) that many rows at a time into one
    resident weight allocated once.
    """
    if isinstance(source, RowBlocks):
        read = source.read
    elif isinstance(source, GroupQuant):
        read = source.rows
    else:
        read = lambda start, end: source[start:end]  # noqa: E731
    rows, cols = source.shape
    first = read(0, min(rows, PACK_ROWS))
    convert: Callable[[GroupQuant | torch.Tensor], ResidentWeight]
    held: ResidentWeight | None = None
    if isinstance(first, torch.Tensor):
        convert = lambda t: DenseWeight(t.to(device=device, dtype=dtype))  # type: ignore[union-attr]  # noqa: E731
    elif packs(first, device, dtype):
        convert = lambda g: pack_groups(g, dtype)  # type: ignore[arg-type]  # noqa: E731
    else:
        convert = lambda g: _int8_groups(g.contiguous(), device)  # type: ignore[union-attr]  # noqa: E731
        if (int4 and torch.device(device).type == "cpu" and first.group == INT4_GROUP
                and cols % INT4_GROUP == 0 and rows % 16 == 0):
            try:
                held = _int4_planes(first.contiguous(), dtype)
                convert = lambda g: _int4_planes(g.contiguous(), dtype)  # type: ignore[union-attr]  # noqa: E731
            except RuntimeError:  # a torch build without the CPU int4 kernel for this shape
                pass
    if held is None:
        held = convert(first)
    if rows <= PACK_ROWS:
        return held
    whole = _empty_rows(held, rows)
    _set_rows(whole, 0, held)
    del first, held
    for start in range(PACK_ROWS, rows, PACK_ROWS):
        _set_rows(whole, start, convert(read(start, min(rows, start + PACK_ROWS))))
    return whole


def _int8_groups(g: GroupQuant, device: torch.device | str) -> Int8Groups:
    return Int8Groups(torch.from_numpy(g.q).to(device), torch.from_numpy(g.scale).to(device),
                      torch.from_numpy(g.offset).to(device), g.group)


def _empty_rows(like: ResidentWeight, rows: int) -> ResidentWeight:
    """A resident weight of ``like``'s form and columns with ``rows`` rows, unfilled."""
    def grown(t: torch.Tensor, dim: int = 0) -> torch.Tensor:
        shape = list(t.shape)
        shape[dim] = rows
        return torch.empty(shape, dtype=t.dtype, device=t.device)

    if isinstance(like, DenseWeight):
        return DenseWeight(grown(like.weight))
    if isinstance(like, Int8Groups):
        return Int8Groups(grown(like.q), grown(like.scale), grown(like.offset), like.group)
    if isinstance(like, PackedGroups):
        return like.empty_rows(rows)
    # torch's packed layout is a run of row blocks along its first dimension
    return Int4Planes([grown(p) for p in like.packed], [grown(sz, 1) for sz in like.scales_zeros],
                      rows, like.in_features)


def _set_rows(whole: ResidentWeight, start: int, part: ResidentWeight) -> None:
    """Copy ``part`` (of ``whole``'s form) into ``whole``'s rows from ``start``."""
    end = start + part.shape[0]
    if isinstance(whole, DenseWeight) and isinstance(part, DenseWeight):
        whole.weight[start:end] = part.weight
    elif isinstance(whole, Int8Groups) and isinstance(part, Int8Groups):
        whole.q[start:end], whole.scale[start:end] = part.q, part.scale
        whole.offset[start:end] = part.offset
    elif isinstance(whole, PackedGroups) and isinstance(part, PackedGroups):
        whole.set_rows(start, part)
    elif isinstance(whole, Int4Planes) and isinstance(part, Int4Planes):
        for i, (packed, sz) in enumerate(zip(part.packed, part.scales_zeros)):
            whole.packed[i][start:end] = packed
            whole.scales_zeros[i][:, start:end] = sz
    else:
        raise TypeError(f"row block {type(part).__name__} into {type(whole).__name__}")


def _int4_planes(g: GroupQuant, dtype: torch.dtype) -> Int4Planes:
    """Split integer groups of 32 (at most :data:`PACK_ROWS` rows) into one (<= 4 bits)
    or two int4 planes."""
    rows, cols = g.shape
    scale = torch.from_numpy(g.scale)  # [rows, cols / 32] float32
    offset = torch.from_numpy(g.offset)
    q = torch.from_numpy(g.q)
    planes: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (p, scale, zero)
    if g.bits <= 4:
        # w = q * s + o = (q - 8) * s + (o + 8 s)
        planes.append((q, scale, offset + 8 * scale))
    else:
        # q = 16 h + l: w = l * s + 16 h s + o. The low plane is centred, (l - 8) s with no
        # zero, and the high plane takes the rest: (p - 8) 16 s + 8 s (+ o). Decode adds the
        # two planes' products, each rounded to the compute dtype; a centred low plane's
        # product stays small, where an uncentred one (l s, all positive) grows with the
        # sum of the inputs and the two large products cancel (int8 on load in bfloat16:
        # SmolLM2 answered "L'Etoile" for the capital of France).
        low, high = q & 15, q >> 4
        planes.append((low, scale, torch.zeros_like(scale)))
        if g.symmetric_center is not None:
            # o = -c s: the high plane takes it, p = h + 8 - c / 16 (in 0..15 for Q5_0,
            # Q8_0 and Q6_K), so every zero is 8 s or 0: exact in any float format.
            shift = 8 - g.symmetric_center // 16
            planes.append((high + shift, 16 * scale, 8 * scale))
        else:
            planes.append((high + 8, 16 * scale, offset + 8 * scale))
    packed, scales_zeros = [], []
    for p, s, z in planes:
        packed.append(torch._convert_weight_to_int4pack_for_cpu(p.to(torch.int32).contiguous(), 1))
        scales_zeros.append(torch.stack((s, z), dim=-1).transpose(0, 1).contiguous().to(dtype))
    return Int4Planes(packed, scales_zeros, rows, cols)


@functools.cache
def int4pack_layout() -> tuple[int, torch.Tensor] | None:
    """How torch's CPU int4 packing places rows, found by packing a probe matrix.

    The packed weight is ``[out / B, in, B / 2]`` bytes for a block of ``B`` rows (64 with
    AVX-512, 32 with AVX2 and elsewhere), and the byte ``j``'s two nibbles hold two of the
    block's rows in an order that depends on the CPU capability torch dispatched to.
    Returns ``(B, position)`` with ``position[r]`` (int64 ``[B]``) the nibble index
    ``2 * j + high`` that holds row ``r`` of a block, verified on a random matrix; None when
    no candidate block fits (then rows are not read from the packed form).
    """
    for block in (64, 32, 16, 128):
        rows = torch.arange(block * 2)
        probe_lo = (rows % 16)[:, None].expand(-1, 32).to(torch.int32).contiguous()
        probe_hi = (rows // 16)[:, None].expand(-1, 32).to(torch.int32).contiguous()
        try:
            lo = _nibble_order(torch._convert_weight_to_int4pack_for_cpu(probe_lo, 1), block)
            hi = _nibble_order(torch._convert_weight_to_int4pack_for_cpu(probe_hi, 1), block)
        except (RuntimeError, ValueError):
            continue
        found = hi * 16 + lo  # row (within the block) held by each nibble index
        if sorted(found.tolist()) != list(range(block)):
            continue
        position = torch.empty(block, dtype=torch.long)
        position[found] = torch.arange(block)
        if _layout_holds(block, position):
            return block, position
    return None


def _nibble_order(packed: torch.Tensor, block: int) -> torch.Tensor:
    """Nibble values of the first block's first column, in nibble index order."""
    first = packed.reshape(-1)[: block // 2]  # block 0, column 0: B / 2 bytes
    if first.numel() != block // 2:
        raise ValueError("probe too small")
    return torch.stack((first & 15, first >> 4), dim=1).reshape(-1).long() % block


def _gather_rows(packed: torch.Tensor, in_features: int, block: int, position: torch.Tensor,
                 ids: torch.Tensor) -> torch.Tensor:
    """The 4-bit values of rows ``ids`` (int64 ``[T]``) of a packed plane, uint8
    ``[T, in_features]``, for the layout ``(block, position)`` of :func:`int4pack_layout`."""
    packed = packed.view(-1, in_features, block // 2)
    pos = position[ids % block]
    nibbles = packed[(ids // block)[:, None], torch.arange(in_features)[None, :],
                     (pos // 2)[:, None]]
    return (nibbles >> (4 * (pos % 2))[:, None]) & 15


def _layout_holds(block: int, position: torch.Tensor) -> bool:
    """Whether ``(block, position)`` reads back a random packed matrix's rows."""
    generator = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (block * 3, 96), generator=generator, dtype=torch.int32)
    packed = torch._convert_weight_to_int4pack_for_cpu(q, 1)
    rows = _gather_rows(packed, 96, block, position, torch.arange(block * 3))
    return bool(torch.equal(rows.to(torch.int32), q))


@functools.cache
def _nibble_row_order() -> str:
    """How a layout's nibbles map to its rows, for :meth:`Int4Planes._plane`:
    ``"halves"`` (byte j: row j low, row j + B/2 high; AVX-512 and AVX2), ``"alternate"``
    (byte j: rows 2j and 2j + 1), else ``"other"``."""
    block, position = int4pack_layout()  # type: ignore[misc]
    if torch.equal(position[: block // 2], torch.arange(0, block, 2)):
        return "halves"
    if torch.equal(position, torch.arange(block)):
        return "alternate"
    return "other"


class Linear(nn.Module):
    """``y = x @ W.T (+ bias)`` for ``x`` of shape ``[rows, in_features]``, ``W`` held as
    one or more :data:`ResidentWeight` parts stacked along the output rows (a fused q/k/v
    whose v is stored in another GGUF type keeps two parts).

    Attributes:
        parts: the weight's row blocks, top to bottom (set by the loader).
        bias: ``[out_features]`` or None.
        partial: the output is one tensor-parallel rank's partial sum: computed and
            returned in float32, so that the all-reduced sum rounds to the compute dtype
            once, like the one-rank output (rounding each partial first made SmolLM2's
            2-rank logits differ from 1 rank's by up to 1.3 and change greedy tokens).
        logits: the LM head: returns float32, and each row's :data:`REFINED_LOGITS`
            largest outputs are recomputed in float32 from the weight's rows (a 16-bit
            output is a step of 0.125 apart at 25: SmolLM2's first answer token, "The"
            25.33 against "L" 25.24 in float32, tied at 25.5 in bfloat16 and lost).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 partial: bool = False, logits: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.partial = partial
        self.logits = logits
        self.parts: list[ResidentWeight] = []
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def set_parts(self, parts: list[ResidentWeight]) -> None:
        """Hold ``parts`` (their rows add up to ``out_features``).

        Raises:
            ValueError: the parts' shapes do not make ``[out_features, in_features]``.
        """
        rows = sum(p.shape[0] for p in parts)
        if rows != self.out_features or any(p.shape[1] != self.in_features for p in parts):
            raise ValueError(f"weight parts {[p.shape for p in parts]} do not make "
                             f"[{self.out_features}, {self.in_features}]")
        self.parts = parts

    def nbytes(self) -> int:
        """Bytes of the resident weight (not the bias)."""
        return sum(p.nbytes() for p in self.parts)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The whole weight ``[out_features, in_features]`` in ``dtype`` (for tests and
        checks; the forward pass never builds it)."""
        return torch.cat([p.dequantize(dtype) for p in self.parts])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[rows, in_features]`` in the compute dtype; returns ``[rows,
        out_features]`` in the compute dtype (float32 when ``partial``)."""
        if self.partial:
            x = x.float()
        outs = [p.matmul(x) for p in self.parts]
        y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        if self.logits:
            y = self._refined(y.float(), x)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def _refined(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """float32 ``y`` ``[rows, out]`` with each row's :data:`REFINED_LOGITS` largest
        entries recomputed as float32 products of ``x`` and the weight's rows."""
        if x.dtype == torch.float32 or not len(y) or self.out_features < REFINED_LOGITS or any(
                isinstance(p, Int4Planes) and not p.rows_readable() for p in self.parts):
            return y
        ids = y.topk(REFINED_LOGITS, dim=-1).indices  # [rows, k]
        weight = torch.empty(ids.numel(), self.in_features)
        flat, start = ids.reshape(-1), 0
        for part in self.parts:  # each id's row from the part that holds it
            end = start + part.shape[0]
            mine = ((flat >= start) & (flat < end)).nonzero().flatten()
            if len(mine):
                weight[mine] = part.embed(flat[mine] - start, torch.float32)
            start = end
        exact = torch.bmm(weight.view(*ids.shape, -1), x.float().unsqueeze(-1)).squeeze(-1)
        return y.scatter_(1, ids, exact)


class Embedding(nn.Module):
    """Token embedding over a resident weight ``[vocab, hidden]``: rows are dequantized
    as they are looked up. A tied LM head shares the same weight object."""

    def __init__(self) -> None:
        super().__init__()
        self.weight: ResidentWeight | None = None
        self.dtype = torch.float32

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """int64 ``ids`` ``[N]`` -> ``[N, hidden]`` in the compute dtype."""
        assert self.weight is not None
        return self.weight.embed(ids, self.dtype)


def weight_bytes(module: nn.Module) -> int:
    """Bytes the module's weights take in memory: parameters and buffers' values (norms,
    biases) plus each resident linear and embedding weight, counted once when shared (a
    tied embedding and LM head)."""
    params = {(p.data_ptr(), p.numel()): p for p in module.parameters()}.values()
    total = sum(p.numel() * p.element_size() for p in params)
    seen: set[int] = set()
    for layer in module.modules():
        held = layer.parts if isinstance(layer, Linear) else (
            [layer.weight] if isinstance(layer, Embedding) and layer.weight is not None else [])
        for part in held:
            if id(part) not in seen:
                seen.add(id(part))
                total += part.nbytes()
    return total
