"""5- and 6-bit integer groups held at about their file's bits: a nibble plane and a
high-bit plane per row, with one scale (and offset) per group in the compute dtype.

GGUF's Q6_K stores 6.56 bits a weight and Q5_0, Q5_1 and Q5_K 5.5 to 6. Held as one byte a
weight with float32 scales (:class:`~shardline.models.linear.Int8Groups`) Q6_K took 12
bits, and as two int4 planes a 5-bit type took 10; here Q6_K takes 7 bits in bfloat16 (6
for the integers, 1 for a bfloat16 scale per 16) and Q5_K 6. The values are the file's,
computed in float32 as ``(q - center) * scale`` for the symmetric types (GGUF's own
formula, e.g. Q6_K's ``d * sc * (q - 32)``) or ``q * scale + offset``, with the scales
rounded once to the compute dtype (ggml's ``ggml-common.h`` for the block layouts; the
``gguf`` library's ``dequantize`` is the tests' oracle).

Products read this form directly through the compiled kernels
(:mod:`shardline.models.native_dequant`): decode dequantizes one weight row at a time into
a float32 row buffer and takes its dot product with each sequence's activations; prefill
dequantizes a block of rows into scratch for a dense GEMM. Without a compiler the same
values come from torch ops (slower).

Layout per row, for each chunk of 32 weights: 16 bytes of low nibbles (byte ``j``: weight
``j`` low, weight ``j + 16`` high) and ``4 * (bits - 4)`` bytes of high bits: for 6 bits,
byte ``j`` of 8 holds weights ``j``, ``j + 8``, ``j + 16``, ``j + 24`` in its bit pairs 0-1,
2-3, 4-5, 6-7; for 5 bits, weight ``i``'s bit is bit ``i`` of a little-endian 32-bit word.
The decode kernel unpacks a chunk with a few byte-wide vector operations.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from shardline.models import native_dequant
from shardline.models.gguf_quants import GroupQuant
from shardline.models.products import KERNEL_MAX_ROWS, blocked_product, scratch

CHUNK = 32
"""Weights per chunk of the layout."""


def packs(g: GroupQuant, device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether ``g`` is held as :class:`PackedGroups`: 5 or 6 bits in groups of 16 or 32,
    rows of whole chunks, on the CPU, in bfloat16 or float32."""
    return (g.bits in (5, 6) and g.group in (16, 32) and g.shape[1] % CHUNK == 0
            and torch.device(device).type == "cpu" and dtype in (torch.bfloat16, torch.float32))


@dataclass
class PackedGroups:
    """A weight ``[out, in]`` of ``bits``-bit integers (5 or 6).

    Attributes:
        low: uint8 ``[out, in / 2]``, the low nibbles.
        high: uint8 ``[out, in * (bits - 4) / 8]``, the high bits.
        scale: ``[out, in / group]`` in the compute dtype (bfloat16 or float32).
        offset: like ``scale``, or None for a symmetric type: ``w = (q - center) * scale``.
        center: the symmetric types' centre (32 for Q6_K, 16 for Q5_0); 0 with an offset.
    """

    low: torch.Tensor
    high: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor | None
    center: int
    bits: int
    group: int

    @property
    def shape(self) -> tuple[int, int]:
        return (self.low.shape[0], self.low.shape[1] * 2)

    def nbytes(self) -> int:
        held = [self.low, self.high, self.scale] + ([self.offset] if self.offset is not None else [])
        return sum(t.numel() * t.element_size() for t in held)

    def rows(self, start: int, end: int) -> PackedGroups:
        """Rows ``[start, end)`` (views)."""
        return PackedGroups(self.low[start:end], self.high[start:end], self.scale[start:end],
                            None if self.offset is None else self.offset[start:end],
                            self.center, self.bits, self.group)

    def empty_rows(self, rows: int) -> PackedGroups:
        """An unfilled weight of this form and columns with ``rows`` rows."""
        def grown(t: torch.Tensor) -> torch.Tensor:
            return torch.empty((rows, *t.shape[1:]), dtype=t.dtype)

        return PackedGroups(grown(self.low), grown(self.high), grown(self.scale),
                            None if self.offset is None else grown(self.offset),
                            self.center, self.bits, self.group)

    def set_rows(self, start: int, part: PackedGroups) -> None:
        """Copy ``part`` into rows ``[start, start + part rows)``."""
        mine = self.rows(start, start + part.shape[0])
        for into, values in ((mine.low, part.low), (mine.high, part.high),
                             (mine.scale, part.scale), (mine.offset, part.offset)):
            if into is not None and values is not None:
                into.copy_(values)

    def _q(self) -> torch.Tensor:
        """The integers, uint8 ``[out, in]`` (eager torch ops)."""
        rows, cols = self.shape
        low = self.low.view(rows, cols // CHUNK, CHUNK // 2)
        q = torch.cat((low & 15, low >> 4), dim=-1)  # [rows, chunks, 32]
        if self.bits == 6:  # [rows, chunks, 8] bytes -> bit pair p of byte j: weight j + 8 p
            high = self.high.view(rows, cols // CHUNK, 1, 8)
            high = (high >> (2 * torch.arange(4, dtype=torch.uint8))[:, None]) & 3
        else:  # 4 bytes -> bit b of byte j: weight 8 j + b
            high = self.high.view(rows, cols // CHUNK, 4, 1)
            high = (high >> torch.arange(8, dtype=torch.uint8)) & 1
        return (q | (high.reshape(rows, cols // CHUNK, CHUNK) << 4)).view(rows, cols)

    def _eager_rows(self, dtype: torch.dtype) -> torch.Tensor:
        """All rows in ``dtype`` by torch ops: float32 values as the kernel computes them
        (no fused multiply-add), rounded once."""
        rows, cols = self.shape
        work = self._q().float()
        groups = work.view(rows, cols // self.group, self.group)
        scale = self.scale.float()[..., None]
        if self.offset is None:
            groups.sub_(self.center).mul_(scale)
        else:
            groups.mul_(scale).add_(self.offset.float()[..., None])
        return work.to(dtype)

    def _rows_into(self, out: torch.Tensor) -> torch.Tensor:
        if native_dequant.kernels() is None:
            return out.copy_(self._eager_rows(out.dtype))
        return native_dequant.packed_groups_rows(self, out)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight ``[out, in]`` in ``dtype`` (a new tensor)."""
        if dtype not in (torch.bfloat16, torch.float32):
            return self.dequantize(torch.float32).to(dtype)
        return self._rows_into(torch.empty(self.shape, dtype=dtype))

    def embed(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``ids`` (int64 ``[T]``), ``[T, in]`` in ``dtype``."""
        index = ids.long()
        picked = PackedGroups(self.low[index], self.high[index], self.scale[index],
                              None if self.offset is None else self.offset[index],
                              self.center, self.bits, self.group)
        return picked.dequantize(dtype)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T`` for ``x`` ``[rows, in]``: up to :data:`~shardline.models.products.KERNEL_MAX_ROWS` rows (decode)
        the kernel's row-at-a-time product in float32, else blocks of rows dequantized into
        scratch and a dense GEMM (prefill)."""
        if x.shape[0] <= KERNEL_MAX_ROWS and native_dequant.kernels():
            return native_dequant.packed_groups_gemv(self, x.float()).to(x.dtype)

        def columns(start: int, end: int, dtype: torch.dtype) -> torch.Tensor:
            out = scratch("out", end - start, self.shape[1], dtype)
            return self.rows(start, end)._rows_into(out).t()

        work = 4 if native_dequant.kernels() is None else 0  # the eager float32 values
        return blocked_product(x, self.shape[0], columns, work)


def pack_groups(g: GroupQuant, dtype: torch.dtype) -> PackedGroups:
    """``g`` (5- or 6-bit, :func:`packs`) in the packed layout, scales and offsets rounded
    to ``dtype``; no other value changes."""
    low_bytes, high_bytes = _packed_bits(np.ascontiguousarray(g.q), g.bits)
    symmetric = g.symmetric_center is not None
    return PackedGroups(
        torch.from_numpy(low_bytes),
        torch.from_numpy(high_bytes),
        torch.from_numpy(np.ascontiguousarray(g.scale)).to(dtype),
        None if symmetric else torch.from_numpy(np.ascontiguousarray(g.offset)).to(dtype),
        g.symmetric_center or 0, g.bits, g.group)


def _packed_bits(q: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """The low-nibble and high-bit planes of uint8 ``q`` ``[rows, cols]`` (5 or 6 bits):
    uint8 ``[rows, cols / 2]`` and ``[rows, cols * (bits - 4) / 8]``, by the compiled
    ``pack_groups_bits`` where it is built, else by numpy (the same bytes)."""
    rows, cols = q.shape
    lib = native_dequant.kernels()
    if lib is not None:
        low = np.empty((rows, cols // 2), np.uint8)
        high = np.empty((rows, cols * (bits - 4) // 8), np.uint8)
        lib.pack_groups_bits(q.ctypes.data, rows, cols, bits, low.ctypes.data, high.ctypes.data,
                             native_dequant.load_threads())
        return low, high
    chunks = q.reshape(rows, cols // CHUNK, CHUNK)
    low = (chunks[..., : CHUNK // 2] & 15) | ((chunks[..., CHUNK // 2 :] & 15) << 4)
    top = chunks >> 4
    if bits == 6:  # byte j: weights j, j + 8, j + 16, j + 24 in bit pairs 0-1 .. 6-7
        pairs = top.reshape(rows, cols // CHUNK, 4, 8) << (2 * np.arange(4, dtype=np.uint8))[:, None]
        high = np.bitwise_or.reduce(pairs, axis=2)
    else:  # bit i of the word: weight i
        high = np.bitwise_or.reduce(top.reshape(rows, cols // CHUNK, 4, 8) << np.arange(8, dtype=np.uint8), axis=3)
    return np.ascontiguousarray(low).reshape(rows, cols // 2), np.ascontiguousarray(high).reshape(rows, -1)
