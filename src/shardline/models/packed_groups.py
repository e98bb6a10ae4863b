"""5- and 6-bit integer groups held at about their file's bits: a nibble plane and a
high-bit plane, with one scale (and offset) per group in the compute dtype; and 5-bit
groups whose integers take at most 16 values (MXFP4's, :attr:`~shardline.models.
gguf_quants.GroupQuant.codebook`) as a nibble plane of 4-bit codes alone.

GGUF's Q6_K stores 6.56 bits a weight and Q5_0, Q5_1 and Q5_K 5.5 to 6. Held as one byte a
weight with float32 scales (:class:`~shardline.models.linear.Int8Groups`) Q6_K took 12
bits, and as two int4 planes a 5-bit type took 10; here Q6_K takes 7 bits in bfloat16 (6
for the integers, 1 for a bfloat16 scale per 16) and Q5_K 6; MXFP4 (4.25 bits in its file)
takes 4.5 here where as 5-bit groups it took 5.5. The values are the file's,
computed in float32 as ``(q - center) * scale`` for the symmetric types (GGUF's own
formula, e.g. Q6_K's ``d * sc * (q - 32)``) or ``q * scale + offset``, with the scales
rounded once to the compute dtype (ggml's ``ggml-common.h`` for the block layouts; the
``gguf`` library's ``dequantize`` is the tests' oracle).

Products read this form directly through the compiled kernels
(:mod:`shardline.models.native_dequant`): decode multiplies 16 weight rows at a time into
every sequence's activations (rounded to int8 groups where AVX-512 VNNI is built, in
float32 otherwise); prefill dequantizes a block of rows into scratch for a dense GEMM.
Without a compiler the same values come from torch ops (slower).

Layout: a row's chunk of 32 weights is 16 bytes of low nibbles (byte ``j``: weight ``j``
low, weight ``j + 16`` high) and ``4 * (bits - 4)`` bytes of high bits: for 6 bits, byte
``j`` of 8 holds weights ``j``, ``j + 8``, ``j + 16``, ``j + 24`` in its bit pairs 0-1,
2-3, 4-5, 6-7; for 5 bits, weight ``i``'s bit is bit ``i`` of a little-endian 32-bit word;
with a codebook there are no high bits and a nibble is a code, the integer
``codebook[code]``.
Rows go in blocks of :data:`BLOCK_ROWS`, and a block's chunk holds its rows' bytes of that
chunk a 32-bit word at a time, word ``d`` of row ``i`` at word ``16 d + i`` (the scales
likewise, ``[blocks, groups, 16]``): the decode kernel reads a chunk of 16 rows as a few
whole 64-byte lines, already in the operand order of its 4-byte dot products.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from shardline.models import kernel_library, native_dequant
from shardline.models.gguf_quants import GroupQuant
from shardline.models.weight_products import KERNEL_MAX_ROWS, blocked_product, product_rows, scratch

CHUNK = 32
"""Weights per chunk of the layout."""

BLOCK_ROWS = 16
"""Rows a block of the layout interleaves."""


def packs(g: GroupQuant, device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether ``g`` is held as :class:`PackedGroups`: 5 or 6 bits in groups of 16 or 32,
    rows of whole chunks in whole blocks, on the CPU, in bfloat16 or float32."""
    return (
        g.bits in (5, 6)
        and g.group in (16, 32)
        and g.shape[1] % CHUNK == 0
        and (g.codebook is None or len(g.codebook) <= 16)
        and g.shape[0] % BLOCK_ROWS == 0
        and torch.device(device).type == "cpu"
        and dtype in (torch.bfloat16, torch.float32)
    )


def _interleaved(rows: torch.Tensor, words: int) -> torch.Tensor:
    """uint8 ``[rows, chunks * 4 words]`` (each row's chunks, ``words`` 32-bit words each)
    in the block layout, uint8 ``[rows / 16, rows' bytes * 16]``; :func:`_row_major`
    undoes it."""
    n = rows.shape[0]
    w = rows.contiguous().view(torch.int32).view(n // BLOCK_ROWS, BLOCK_ROWS, -1, words)
    return w.permute(0, 2, 3, 1).contiguous().view(-1).view(torch.uint8).view(n // BLOCK_ROWS, -1)


def _row_major(blocks: torch.Tensor, words: int) -> torch.Tensor:
    """:func:`_interleaved`'s input from its output."""
    b = blocks.shape[0]
    w = blocks.contiguous().view(torch.int32).view(b, -1, words, BLOCK_ROWS)
    return w.permute(0, 3, 1, 2).contiguous().view(-1).view(torch.uint8).view(b * BLOCK_ROWS, -1)


@dataclass
class PackedGroups:
    """A weight ``[out, in]`` of ``bits``-bit integers (5 or 6), ``out`` a multiple of
    :data:`BLOCK_ROWS`, in the module's layout.

    Attributes:
        low: uint8 ``[out / 16, in * 8]``, the low nibbles (16 rows' ``in / 2`` bytes).
        high: uint8 ``[out / 16, in * 2 * high_bits]``, the high bits.
        scale: ``[out / 16, in / group, 16]`` in the compute dtype (bfloat16 or float32).
        offset: like ``scale``, or None for a symmetric type: ``w = (q - center) * scale``.
        center: the symmetric types' centre (32 for Q6_K, 16 for Q5_0); 0 with an offset.
        codebook: uint8 ``[16]`` or None: the integer of each 4-bit code, where the
            nibbles are codes (MXFP4) and there are no high bits.
    """

    low: torch.Tensor
    high: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor | None
    center: int
    bits: int
    group: int
    codebook: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return (self.low.shape[0] * BLOCK_ROWS, self.low.shape[1] // 8)

    @property
    def high_bits(self) -> int:
        """Bits a weight holds in the high plane: ``bits - 4``, 0 with a codebook."""
        return 0 if self.codebook is not None else self.bits - 4

    def nbytes(self) -> int:
        held = [self.low, self.high, self.scale] + ([self.offset] if self.offset is not None else [])
        return sum(t.numel() * t.element_size() for t in held)

    def rows(self, start: int, end: int) -> PackedGroups:
        """Rows ``[start, end)`` (views), both multiples of :data:`BLOCK_ROWS`.

        Raises:
            ValueError: a bound inside a block.
        """
        if start % BLOCK_ROWS or end % BLOCK_ROWS:
            raise ValueError(f"rows [{start}, {end}) of packed groups: bounds are multiples of {BLOCK_ROWS}")
        a, b = start // BLOCK_ROWS, end // BLOCK_ROWS
        return PackedGroups(
            self.low[a:b],
            self.high[a:b],
            self.scale[a:b],
            None if self.offset is None else self.offset[a:b],
            self.center,
            self.bits,
            self.group,
            self.codebook,
        )

    def empty_rows(self, rows: int) -> PackedGroups:
        """An unfilled weight of this form and columns with ``rows`` rows (a multiple of
        :data:`BLOCK_ROWS`)."""

        def grown(t: torch.Tensor) -> torch.Tensor:
            return torch.empty((rows // BLOCK_ROWS, *t.shape[1:]), dtype=t.dtype)

        return PackedGroups(
            grown(self.low),
            grown(self.high),
            grown(self.scale),
            None if self.offset is None else grown(self.offset),
            self.center,
            self.bits,
            self.group,
            self.codebook,
        )

    def set_rows(self, start: int, part: PackedGroups) -> None:
        """Copy ``part`` into rows ``[start, start + part rows)``."""
        mine = self.rows(start, start + part.shape[0])
        for into, values in (
            (mine.low, part.low),
            (mine.high, part.high),
            (mine.scale, part.scale),
            (mine.offset, part.offset),
        ):
            if into is not None and values is not None:
                into.copy_(values)

    def _eager_rows(self, dtype: torch.dtype, ids: torch.Tensor | None = None) -> torch.Tensor:
        """Rows ``ids`` (all where None) in ``dtype`` by torch ops: float32 values as the
        kernel computes them (no fused multiply-add), rounded once."""
        hb = self.high_bits
        low, high = _row_major(self.low, 4), _row_major(self.high, hb) if hb else self.high
        scale = self.scale.permute(0, 2, 1).reshape(self.shape[0], -1)
        offset = None if self.offset is None else self.offset.permute(0, 2, 1).reshape(self.shape[0], -1)
        if ids is not None:
            index = ids.long()
            low, high, scale = low[index], high[index], scale[index]
            offset = None if offset is None else offset[index]
        rows, cols = low.shape[0], self.shape[1]
        nibbles = low.view(rows, cols // CHUNK, CHUNK // 2)
        q = torch.cat((nibbles & 15, nibbles >> 4), dim=-1)  # [rows, chunks, 32]
        if self.codebook is not None:
            top = torch.zeros_like(q)
            q = self.codebook[q.long()]
        elif self.bits == 6:  # [rows, chunks, 8] bytes -> bit pair p of byte j: weight j + 8 p
            top = high.view(rows, cols // CHUNK, 1, 8)
            top = (top >> (2 * torch.arange(4, dtype=torch.uint8))[:, None]) & 3
        else:  # 4 bytes -> bit b of byte j: weight 8 j + b
            top = high.view(rows, cols // CHUNK, 4, 1)
            top = (top >> torch.arange(8, dtype=torch.uint8)) & 1
        work = (q | (top.reshape(rows, cols // CHUNK, CHUNK) << 4)).view(rows, cols).float()
        groups = work.view(rows, cols // self.group, self.group)
        if offset is None:
            groups.sub_(self.center).mul_(scale.float()[..., None])
        else:
            groups.mul_(scale.float()[..., None]).add_(offset.float()[..., None])
        return work.to(dtype)

    def _rows_into(self, out: torch.Tensor, ids: torch.Tensor | None = None) -> torch.Tensor:
        if kernel_library.kernels() is None:
            return out.copy_(self._eager_rows(out.dtype, ids))
        return native_dequant.packed_groups_rows(self, out, ids)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight ``[out, in]`` in ``dtype`` (a new tensor)."""
        if dtype not in (torch.bfloat16, torch.float32):
            return self.dequantize(torch.float32).to(dtype)
        return self._rows_into(torch.empty(self.shape, dtype=dtype))

    def embed(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``ids`` (int64 ``[T]``), ``[T, in]`` in ``dtype``.

        Raises:
            IndexError: an id outside the rows.
        """
        if dtype not in (torch.bfloat16, torch.float32):
            return self.embed(ids, torch.float32).to(dtype)
        return self._rows_into(torch.empty(len(ids), self.shape[1], dtype=dtype), ids)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T`` for ``x`` ``[rows, in]``: up to :data:`~shardline.models.weight_products.KERNEL_MAX_ROWS` rows (decode)
        the kernel's product (:func:`~shardline.models.native_dequant.packed_groups_gemv`),
        else blocks of rows dequantized into scratch and a dense GEMM (prefill)."""
        if product_rows(x.shape[0]) <= KERNEL_MAX_ROWS and kernel_library.kernels():
            return native_dequant.packed_groups_gemv(self, x).to(x.dtype)

        def columns(start: int, end: int, dtype: torch.dtype) -> torch.Tensor:
            if kernel_library.kernels() is None:
                return self.rows(start, end)._eager_rows(dtype).t()
            out = scratch("out", self.shape[1], end - start, dtype)
            return native_dequant.packed_groups_cols(self.rows(start, end), out)

        work = 4 if kernel_library.kernels() is None else 0  # the eager float32 values
        return blocked_product(x, self.shape[0], columns, work)


def pack_groups(g: GroupQuant, dtype: torch.dtype) -> PackedGroups:
    """``g`` (5- or 6-bit, :func:`packs`) in the packed layout, scales and offsets rounded
    to ``dtype``; no other value changes. With a codebook the nibbles are each integer's
    code (the first where two codes give one integer: MXFP4's +0 and -0).

    Raises:
        ValueError: an integer the codebook does not hold.
    """
    q = np.ascontiguousarray(g.q)
    codebook = None
    if g.codebook is not None:
        code_of = np.full(256, 255, np.uint8)
        for code, value in reversed(list(enumerate(g.codebook))):
            code_of[value] = code
        q = code_of[q]
        if q.size and q.max() == 255:
            raise ValueError(f"an integer outside the codebook {g.codebook}")
        codebook = torch.tensor(g.codebook, dtype=torch.uint8)
    low_bytes, high_bytes = _packed_bits(q, 4 if codebook is not None else g.bits)
    symmetric = g.symmetric_center is not None

    def blocked(values: np.ndarray) -> torch.Tensor:  # [rows, groups] -> [blocks, groups, 16]
        t = torch.from_numpy(np.ascontiguousarray(values)).to(dtype)
        return t.view(-1, BLOCK_ROWS, t.shape[1]).permute(0, 2, 1).contiguous()

    return PackedGroups(
        torch.from_numpy(low_bytes),
        torch.from_numpy(high_bytes),
        blocked(g.scale),
        None if symmetric else blocked(g.offset),
        g.symmetric_center or 0,
        g.bits,
        g.group,
        codebook,
    )


def _packed_bits(q: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """The low-nibble and high-bit planes of uint8 ``q`` ``[rows, cols]`` (4, 5 or 6 bits)
    in the block layout: uint8 ``[rows / 16, cols * 8]`` and ``[rows / 16, cols * 2 * (bits -
    4)]``, by the compiled ``pack_groups_bits`` where it is built, else by numpy (the same
    bytes)."""
    rows, cols = q.shape
    hb = bits - 4
    lib = kernel_library.kernels()
    if lib is not None:
        low = np.empty((rows // BLOCK_ROWS, cols * 8), np.uint8)
        high = np.empty((rows // BLOCK_ROWS, cols * 2 * hb), np.uint8)
        lib.pack_groups_bits(
            q.ctypes.data, rows, cols, bits, low.ctypes.data, high.ctypes.data, native_dequant.load_threads()
        )
        return low, high
    chunks = q.reshape(rows, cols // CHUNK, CHUNK)
    low = (chunks[..., : CHUNK // 2] & 15) | ((chunks[..., CHUNK // 2 :] & 15) << 4)
    top = chunks >> 4
    if bits == 4:
        high = np.empty((rows, 0), np.uint8)
    elif bits == 6:  # byte j: weights j, j + 8, j + 16, j + 24 in bit pairs 0-1 .. 6-7
        pairs = top.reshape(rows, cols // CHUNK, 4, 8) << (2 * np.arange(4, dtype=np.uint8))[:, None]
        high = np.bitwise_or.reduce(pairs, axis=2)
    else:  # bit i of the word: weight i
        high = np.bitwise_or.reduce(top.reshape(rows, cols // CHUNK, 4, 8) << np.arange(8, dtype=np.uint8), axis=3)
    planes = (
        torch.from_numpy(np.ascontiguousarray(low).reshape(rows, -1)),
        torch.from_numpy(np.ascontiguousarray(high).reshape(rows, -1)),
    )
    high_blocks = _interleaved(planes[1], hb).numpy() if hb else np.empty((rows // BLOCK_ROWS, 0), np.uint8)
    return _interleaved(planes[0], 4).numpy(), high_blocks
