"""Weights held as one or two int4 planes in torch's CPU int4 layout
(``torch._weight_int4pack_mm_for_cpu``: ``w = (p - 8) * scale + zero`` per group of 32
inputs, the layout torchao and gpt-fast use), and how this machine's torch lays out their
rows (found by packing probe matrices), so that rows can be read back for prefill and for
embedding lookups.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from shardline.models import kernel_library, native_dequant
from shardline.models.gguf_quants import GroupQuant
from shardline.models.weight_products import (
    KERNEL_MAX_ROWS,
    blocked_product,
    gemm_dtype,
    in_dtype,
    native,
    product_rows,
    scratch,
)

INT4_GROUP = 32


@dataclass
class Int4Planes:
    """One or two int4 planes: ``packed[i]`` (torch's CPU int4 layout of ``[out, in]``)
    with ``scales_zeros[i]`` ``[in // 32, out, 2]`` in the compute dtype. The weight is
    the sum of the planes' ``(p - 8) * scale + zero``."""

    packed: list[torch.Tensor]
    scales_zeros: list[torch.Tensor]
    out_features: int
    in_features: int
    gemv: native_dequant.Int4Gemv | bool = field(default=True, repr=False, compare=False)
    """The compiled decode product (:meth:`_gemv`): True until the first decode product,
    False where it does not take this weight."""

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.packed + self.scales_zeros)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T`` for ``x`` ``[rows, in]``. Up to :data:`KERNEL_MAX_ROWS` rows (decode):
        the compiled decode product (:class:`~shardline.models.native_dequant.Int4Gemv`:
        ``x`` rounded to int8 groups, each weight group unpacked once for all rows, each
        row's result independent of the others) where it is built, else
        torch's int4 kernel for a 16-bit ``x``. Larger products (prefill chunks) take the
        AMX product where :func:`~shardline.models.native_dequant.amx_prefill` (AMX tiles,
        chunks from 96 rows), else the compiled int8 product where
        :func:`~shardline.models.native_dequant.int8_prefill`; else they, and float32
        where the compiled product is not built, dequantize the weight block by block into
        scratch for a dense GEMM (torch's kernel is 2.8x slower than that for 512 rows of a
        576 x 3072 product, and in float32 has no fast path at all: 20x slower for one
        row)."""
        rows = product_rows(x.shape[0])
        if rows > KERNEL_MAX_ROWS and x.dtype == torch.bfloat16 and native_dequant.amx_prefill(rows):
            gemv = self._gemv()
            if gemv is not None:
                return gemv.prefill(x)
        if x.dtype in (torch.bfloat16, torch.float32) and (
            rows <= KERNEL_MAX_ROWS or native_dequant.int8_prefill(rows)
        ):
            gemv = self._gemv()
            if gemv is not None:
                return gemv(x)
        x = x.contiguous()
        dense = rows > KERNEL_MAX_ROWS or x.dtype == torch.float32
        if dense and self.rows_readable():
            # the kernel writes the output; else float32 work, plane and nibbles
            work = 0 if self._kernel_half(gemm_dtype(x.dtype)) else 9
            return blocked_product(x, self.out_features, self._columns, work)
        y = None
        for packed, sz in zip(self.packed, self.scales_zeros):
            part = torch._weight_int4pack_mm_for_cpu(x, packed, INT4_GROUP, sz.to(x.dtype))
            y = part if y is None else y + part
        assert y is not None  # at least one plane
        return y

    def _gemv(self) -> native_dequant.Int4Gemv | None:
        """The compiled decode product of this weight (made on first use), or None where
        it does not take it: not built here, another layout than blocks of 64 rows in the
        "halves" order, or planes it refuses (:meth:`~shardline.models.native_dequant.
        Int4Gemv.refusal`: scales not in bfloat16, ...)."""
        if self.gemv is True:
            planes = list(zip(self.packed, self.scales_zeros))
            takes = (
                native_dequant.int4_gemv_built()
                and self._kernel_half(torch.bfloat16) == 32
                and self.rows_readable()
                and native_dequant.Int4Gemv.refusal(planes) is None
            )
            self.gemv = native_dequant.Int4Gemv(planes) if takes else False
        return self.gemv if isinstance(self.gemv, native_dequant.Int4Gemv) else None

    def _plane(self, i: int, start: int, end: int, out: torch.Tensor) -> None:
        """Write plane ``i``'s rows ``[start, end)`` (multiples of the layout's block) into
        float32 ``out`` ``[rows, in]`` as ``(p - 8) * scale + zero``."""
        block, position = int4pack_layout()  # type: ignore[misc]
        rows, k, half = end - start, self.in_features, block // 2
        packed = self.packed[i].view(-1, k, half)[start // block : -(-end // block)]
        # The nibbles into row order (uint8 scratch), then one contiguous conversion:
        # 0.63 ms for a 3072 x 576 plane against 1.0 ms converting the strided view.
        nibbles = scratch("nibbles", rows, k, torch.uint8).view(-1, block, k)
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
        work = scratch("work", rows, k, torch.float32)
        self._plane(0, start, end, work)
        if len(self.packed) > 1:
            other = scratch("plane", rows, k, torch.float32)
            self._plane(1, start, end, other)
            work += other
        return in_dtype(work, dtype)

    def _kernel_half(self, dtype: torch.dtype) -> int | None:
        """The compiled kernel's half block (16 or 32) for this machine's layout, or None
        where the eager code runs (no kernels, another nibble order, or scales or
        ``dtype`` in float16)."""
        layout = int4pack_layout()
        if (
            native(dtype) is None
            or layout is None
            or _nibble_row_order() != "halves"
            or self.scales_zeros[0].dtype != torch.bfloat16
        ):
            return None
        return layout[0] // 2 if layout[0] in (32, 64) else None

    def _columns(self, start: int, end: int, dtype: torch.dtype) -> torch.Tensor:
        """``W.T``'s columns ``[start, end)``, ``[in, end - start]`` in ``dtype`` (a scratch
        view, maybe transposed): the compiled kernel where there is one, else :meth:`_rows`."""
        half = self._kernel_half(dtype)
        if half is None:
            return self._rows(start, end, dtype).t()
        out = scratch("out", self.in_features, end - start, dtype)
        return native_dequant.int4_planes_t(list(zip(self.packed, self.scales_zeros)), half, start, out)

    def _plane_rows(self, i: int, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        block, position = int4pack_layout()  # type: ignore[misc]
        p = _gather_rows(self.packed[i], self.in_features, block, position, ids)
        sz = self.scales_zeros[i][:, ids].to(dtype)  # [in / 32, len(ids), 2]
        scale = sz[..., 0].t().repeat_interleave(INT4_GROUP, dim=1)
        zero = sz[..., 1].t().repeat_interleave(INT4_GROUP, dim=1)
        return (p.to(dtype) - 8) * scale + zero

    def embed(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``ids`` (int64 ``[T]``) of the weight, ``[T, in]`` in ``dtype``: computed in
        float32 as each plane's ``(p - 8) * scale + zero``, summed, rounded once; by the
        compiled kernel (:func:`~shardline.models.native_dequant.int4_planes_rows`) where it
        is built (a decode step's lookup: ~25 torch ops otherwise), else by torch ops.

        Raises:
            IndexError: an id outside ``[0, out)`` (as torch's indexing raises).
        """
        if (
            kernel_library.kernels() is not None
            and self.rows_readable()
            and all(sz.dtype == torch.bfloat16 for sz in self.scales_zeros)
        ):
            if ids.numel() and not 0 <= int(ids.min()) <= int(ids.max()) < self.out_features:
                raise IndexError(f"row ids {ids.tolist()[:8]} outside 0-{self.out_features - 1}")
            block, position = int4pack_layout()  # type: ignore[misc]
            out = torch.empty(ids.numel(), self.in_features)
            native_dequant.int4_planes_rows(
                list(zip(self.packed, self.scales_zeros)), block, position, ids.reshape(-1).long(), out
            )
            return out if dtype == torch.float32 else out.to(dtype)
        rows = self._plane_rows(0, ids, torch.float32)
        for i in range(1, len(self.packed)):
            rows = rows + self._plane_rows(i, ids, torch.float32)
        return rows.to(dtype)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight ``[out, in]`` in ``dtype`` (a new tensor)."""
        if self.rows_readable():
            return self._rows(0, self.out_features, dtype).clone()
        # The kernel's product with the identity: W.T, exactly (float32).
        planes = Int4Planes(self.packed, [sz.float() for sz in self.scales_zeros], self.out_features, self.in_features)
        return planes.matmul(torch.eye(self.in_features)).t().to(dtype)

    def rows_readable(self) -> bool:
        """Whether rows can be read from this layout on this machine (else products of
        any size take the kernel, and the embedding keeps its own copy)."""
        layout = int4pack_layout()
        return layout is not None and self.out_features % layout[0] == 0


def pack_int4_planes(g: GroupQuant, dtype: torch.dtype, into: Int4Planes | None = None, start: int = 0) -> Int4Planes:
    """Split integer groups of 32 into one (<= 4 bits) or two int4 planes, packed by the
    compiled :func:`~shardline.models.native_dequant.int4_pack_halves` where this machine's
    layout is the one it writes, else by torch. With ``into`` (an :class:`Int4Planes` of the
    same planes, columns and dtype), written into its rows ``[start, start + rows)``
    (``start`` a multiple of the layout's block) and returned; else into a new one."""
    rows, cols = g.shape
    scale = torch.from_numpy(g.scale)  # [rows, cols / 32] float32
    offset = torch.from_numpy(g.offset)
    q = torch.from_numpy(g.q)
    # (shift, add, scale, zero): the plane's p = ((q >> shift) & 15) + add
    planes: list[tuple[int, int, torch.Tensor, torch.Tensor]] = []
    if g.bits <= 4:
        # w = q * s + o = (q - 8) * s + (o + 8 s)
        planes.append((0, 0, scale, offset + 8 * scale))
    else:
        # q = 16 h + l: w = l * s + 16 h s + o. The low plane is centred, (l - 8) s with no
        # zero, and the high plane takes the rest: (p - 8) 16 s + 8 s (+ o). Decode adds the
        # two planes' products, each rounded to the compute dtype; a centred low plane's
        # product stays small, where an uncentred one (l s, all positive) grows with the
        # sum of the inputs and the two large products cancel (int8 on load in bfloat16:
        # SmolLM2 answered "L'Etoile" for the capital of France).
        planes.append((0, 0, scale, torch.zeros_like(scale)))
        if g.symmetric_center is not None:
            # o = -c s: the high plane takes it, p = h + 8 - c / 16 (in 0..15 for Q5_0,
            # Q8_0 and Q6_K), so every zero is 8 s or 0: exact in any float format.
            planes.append((4, 8 - g.symmetric_center // 16, 16 * scale, 8 * scale))
        else:
            planes.append((4, 8, 16 * scale, offset + 8 * scale))
    if into is None:
        into = Int4Planes(
            [torch.empty(rows, cols // 2, dtype=torch.uint8) for _ in planes],
            [torch.empty(cols // INT4_GROUP, rows, 2, dtype=dtype) for _ in planes],
            rows,
            cols,
        )
    assert len(into.packed) == len(planes) and into.in_features == cols
    layout = int4pack_layout()
    compiled = (
        kernel_library.kernels() is not None
        and layout is not None
        and rows % layout[0] == 0
        and _nibble_row_order() == "halves"
    )
    for i, (shift, add, s, z) in enumerate(planes):
        out = into.packed[i][start : start + rows]
        if compiled:
            native_dequant.int4_pack_halves(q, shift, add, layout[0], out=out)  # type: ignore[index]
        else:
            p = ((q >> shift) & 15) + add
            out.copy_(torch._convert_weight_to_int4pack_for_cpu(p.to(torch.int32).contiguous(), 1))
        native_dequant.scales_zeros_into(s, z, into.scales_zeros[i], start)
    return into


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


def _gather_rows(
    packed: torch.Tensor, in_features: int, block: int, position: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """The 4-bit values of rows ``ids`` (int64 ``[T]``) of a packed plane, uint8
    ``[T, in_features]``, for the layout ``(block, position)`` of :func:`int4pack_layout`."""
    packed = packed.view(-1, in_features, block // 2)
    pos = position[ids % block]
    nibbles = packed[(ids // block)[:, None], torch.arange(in_features)[None, :], (pos // 2)[:, None]]
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
