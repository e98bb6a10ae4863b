"""The compiled kernels' products, called through ctypes (the library:
:mod:`shardline.models.kernel_library`): the dequantization and small decode products of
``dequant.c``, the int8-activation product of int4 planes of ``int4_gemv.c`` and their
prefill product on AMX tiles of ``amx_prefill.c``, what reads packed 5/6-bit groups in
``packed_groups.c``, the load's passes of ``repack.c`` (the fused decode layers of
``decode_layer.c`` are :mod:`shardline.models.fused_decode`'s).

A prefill chunk's product dequantizes each weight block into scratch and runs a dense GEMM
(:mod:`shardline.models.linear`). Done with torch's element-wise ops, that takes five
passes over float32 scratch (nibbles, convert, scale, offset, round): 19% of a 512-row
GEMM's time for a 4-bit weight, 36% for two planes. The kernel does it in one pass and
writes the compute dtype directly: 0.20 ms against 0.47 ms for a 1536 x 576 plane on the
development machine (one thread), bit for bit the same values (it is built without fused
multiply-adds, so it rounds as the eager code does).

Where no compiler works (or the platform's int4 layout is not the one the kernel reads),
``kernel_library.kernels()`` is None and the eager code runs: same values, slower prefill.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
from collections.abc import Iterator

import numpy as np
import torch

from shardline.models import gguf_quants, kernel_library

log = logging.getLogger(__name__)

_P = ctypes.c_void_p
_I = ctypes.c_int64


def _ptr(t: torch.Tensor | None) -> int | None:
    if t is None:
        return None
    assert t.is_contiguous() and t.device.type == "cpu", "kernel operands are contiguous CPU tensors"
    return t.data_ptr()


def _plane_pointers(planes: list[tuple[torch.Tensor, torch.Tensor]], byte_offset: int = 0) -> list[int | None]:
    """``p0, sz0, p1, sz1`` for the C kernels: each int4 plane's packed bytes (from
    ``byte_offset``) and its bfloat16 scales, None for a second plane where there is one."""
    pointers: list[int | None] = []
    for packed, sz in planes:
        assert packed.dtype == torch.uint8 and sz.dtype == torch.bfloat16
        pointers += [_ptr(packed) + byte_offset, _ptr(sz)]  # type: ignore[operator]
    return pointers + [None, None] * (2 - len(planes))


def int4_planes_t(
    planes: list[tuple[torch.Tensor, torch.Tensor]], half: int, start: int, out: torch.Tensor
) -> torch.Tensor:
    """Fill ``out`` ``[K, rows]`` (bfloat16 or float32) with rows ``[start, start + rows)``
    of ``W`` transposed, ``W`` the sum of one or two int4 planes in torch's CPU layout
    with ``half`` = block rows / 2 (16 or 32) and the "halves" nibble order
    (:func:`shardline.models.int4_planes.int4pack_layout`).

    Args:
        planes: per plane ``(packed uint8 [out / (2 half), K, half], scales_zeros bfloat16
            [K / 32, out, 2])``: ``w = (p - 8) * scale + zero``.
        start: the first row, a multiple of ``2 * half`` (as is ``rows``).

    Raises:
        RuntimeError: the kernels are not built (:func:`kernels` is None).
    """
    lib = kernel_library.loaded()
    K, rows = out.shape
    block = 2 * half
    assert out.dtype in (torch.bfloat16, torch.float32) and rows % block == 0 == start % block
    pointers = _plane_pointers(planes, start // block * K * half)
    out_features = planes[0][1].shape[1]
    getattr(lib, f"int4_planes_t_{half}")(
        *pointers, out_features, start, rows, K, _ptr(out), int(out.dtype == torch.bfloat16)
    )
    return out


def int4_planes_rows(
    planes: list[tuple[torch.Tensor, torch.Tensor]],
    block: int,
    position: torch.Tensor,
    ids: torch.Tensor,
    out: torch.Tensor,
) -> torch.Tensor:
    """Fill float32 ``out`` ``[len(ids), K]`` with rows ``ids`` of ``W``, the sum of one or
    two int4 planes in torch's CPU layout of blocks of ``block`` rows, a block's row ``r``
    at nibble ``position[r]`` (:func:`shardline.models.int4_planes.int4pack_layout`):
    per plane ``(p - 8) * scale + zero`` in float32, planes summed; the same bits as
    :meth:`~shardline.models.int4_planes.Int4Planes.embed`'s torch code.

    Args:
        planes: per plane ``(packed uint8 [out / block, K, block / 2], scales_zeros
            bfloat16 [K / 32, out, 2])``.
        position: int64 ``[block]``; ids: int64 ``[T]``, each below ``out``.

    Raises:
        RuntimeError: the kernels are not built (:func:`kernels` is None).
    """
    lib = kernel_library.loaded()
    K = out.shape[1]
    assert out.dtype == torch.float32 and out.shape[0] == ids.numel() and K % 32 == 0
    assert ids.dtype == position.dtype == torch.int64
    lib.int4_planes_rows(
        *_plane_pointers(planes),
        planes[0][1].shape[1],
        K,
        block,
        _ptr(position.contiguous()),
        _ptr(ids.contiguous()),
        ids.numel(),
        _ptr(out),
    )
    return out


_load_threads = 1


def load_threads() -> int:
    """Threads of a load's compiled passes (:func:`unpack_blocks`, :func:`int4_pack_halves`,
    the 5/6-bit packing): 1, or what :func:`loading_with` sets."""
    return _load_threads


@contextlib.contextmanager
def loading_with(threads: int) -> Iterator[None]:
    """Within the block, a load's compiled passes run on ``threads`` threads (OpenMP); the
    load's torch ops keep torch's own setting. Each pass splits rows, so the bytes are the
    same with any count."""
    global _load_threads
    before, _load_threads = _load_threads, max(1, threads)
    try:
        yield
    finally:
        _load_threads = before


def int4_pack_halves(
    q: torch.Tensor, shift: int, add: int, block: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Pack ``((q >> shift) & 15) + add`` of uint8 ``q`` ``[rows, cols]`` (values the
    caller keeps in 0..15) into torch's CPU int4 layout for blocks of ``block`` rows in the
    "halves" nibble order (:func:`shardline.models.int4_planes.int4pack_layout`): uint8
    ``[rows, cols / 2]``, the bytes ``torch._convert_weight_to_int4pack_for_cpu`` makes of
    those values as int32 (without that int32 copy of every weight); written into ``out``
    (contiguous, that shape) where given.

    Raises:
        RuntimeError: the kernels are not built (:func:`kernels` is None).
    """
    lib = kernel_library.loaded()
    rows, cols = q.shape
    assert q.dtype == torch.uint8 and rows % block == 0 and cols % 2 == 0
    q = q.contiguous()  # held while the kernel reads it
    if out is None:
        out = torch.empty(rows, cols // 2, dtype=torch.uint8)
    assert out.shape == (rows, cols // 2) and out.dtype == torch.uint8 and out.is_contiguous()
    lib.int4_pack_halves(_ptr(q), rows, cols, shift, add, block // 2, _ptr(out), load_threads())
    return out


def scales_zeros_into(scale: torch.Tensor, zero: torch.Tensor, out: torch.Tensor, start: int) -> None:
    """Write a plane's float32 ``scale`` and ``zero`` ``[rows, groups]`` into rows
    ``[start, start + rows)`` of ``out`` ``[groups, out_rows, 2]`` (torch's int4 layout of
    scales and zeros), rounded to ``out``'s dtype as torch rounds: compiled for bfloat16
    where the kernels are built, else by torch."""
    rows, groups = scale.shape
    lib = kernel_library.kernels()
    if lib is None or out.dtype != torch.bfloat16 or not out.is_contiguous():
        out[:, start : start + rows] = torch.stack((scale, zero), dim=-1).to(out.dtype).transpose(0, 1)
        return
    assert out.shape[0] == groups and out.shape[2] == 2 and start + rows <= out.shape[1]
    scale, zero = scale.contiguous(), zero.contiguous()  # held while the kernel reads them
    lib.scales_zeros_bf16(_ptr(scale), _ptr(zero), rows, groups, _ptr(out), out.shape[1], start, load_threads())


_UNPACKED = ("Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
"""GGUF types ``unpack_blocks`` in ``repack.c`` unpacks, in the order of its kinds."""


def unpack_blocks(type_name: str, data: np.ndarray) -> gguf_quants.GroupQuant:
    """:func:`shardline.models.gguf_quants.unpack_blocks` (same arguments, the same
    values bit for bit), in one compiled pass where the kernels are built.

    Raises:
        UnsupportedQuantization: the type has no integer-group form.
    """
    lib = kernel_library.kernels()
    if lib is None or type_name not in _UNPACKED:
        return gguf_quants.unpack_blocks(type_name, data)
    form = gguf_quants.group_form(type_name)
    rows = data.shape[0]
    blocks = data.reshape(rows, -1).shape[1] // gguf_quants.block_bytes(type_name)
    cols = blocks * gguf_quants.block_weights(type_name)
    data = np.ascontiguousarray(data)
    q = np.empty((rows, cols), np.uint8)
    scale = np.empty((rows, cols // form.group), np.float32)
    offset = np.empty((rows, cols // form.group), np.float32)
    lib.unpack_blocks(
        data.ctypes.data,
        rows,
        blocks,
        _UNPACKED.index(type_name),
        q.ctypes.data,
        scale.ctypes.data,
        offset.ctypes.data,
        load_threads(),
    )
    return gguf_quants.GroupQuant(q, scale, offset, *form)


@functools.cache
def int4_gemv_built() -> bool:
    """Whether :class:`Int4Gemv` runs here: the kernels are built for a CPU with
    AVX-512 VNNI and VBMI (else decode keeps torch's int4 kernel)."""
    lib = kernel_library.kernels()
    return lib is not None and bool(lib.int4_planes_gemv_built())


@functools.cache
def dense_gemv_built() -> bool:
    """Whether :func:`dense_gemv` runs here: the kernels are built for a CPU with
    AVX-512 BF16."""
    lib = kernel_library.kernels()
    return lib is not None and bool(lib.dense_gemv_built())


class DenseT(ctypes.Structure):
    """``dense_t`` of the C source: a dense bfloat16 weight ``[N, K]``."""

    _fields_ = [("w", ctypes.c_void_p), ("N", ctypes.c_int64), ("K", ctypes.c_int64)]

    @classmethod
    def of(cls, weight: torch.Tensor) -> DenseT:
        """``weight`` (contiguous bfloat16 ``[N, K]`` on the CPU, kept alive by the
        caller) as the C struct."""
        assert weight.dtype == torch.bfloat16 and weight.is_contiguous() and weight.dim() == 2
        return cls(weight.data_ptr(), weight.shape[0], weight.shape[1])


def dense_gemv(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` in float32 ``[M, N]`` for ``x`` ``[M, K]`` and ``weight``
    ``[N, K]``, both bfloat16 on the CPU, ``weight`` contiguous (a decode step's rows): the
    compiled ``dense_bf16_gemv`` (``kernels/dense_gemv.c``), AVX-512 BF16 dot products
    whose order is fixed per output, so an output depends only on its row of ``x`` and
    of the weight; threads (torch's count) split the weight's rows.

    Raises:
        RuntimeError: the kernels are not built (:func:`dense_gemv_built` is False).
    """
    if not dense_gemv_built():
        raise RuntimeError("the dense bfloat16 decode product is not built here (AVX-512 BF16)")
    x = x.contiguous()
    y = torch.empty(x.shape[0], weight.shape[0])
    held = DenseT.of(weight)  # alive through the call (addressof keeps no reference)
    kernel_library.loaded().dense_bf16_gemv(ctypes.addressof(held), _ptr(x), x.shape[0], _ptr(y))
    return y


AMX_PREFILL_MIN_ROWS = 96
"""Prefill chunks of at least this many rows take :meth:`Int4Gemv.prefill` where
:func:`amx_ready`; shorter ones the int8 product. Measured on a 2-vCPU Sapphire Rapids VM
(SmolLM2 prefill, interleaved, ``tiles / before`` ms, before: the int8 product up to 384
rows, oneDNN's GEMM of the dequantized weight beyond): 80 tokens 97 / 93, 96 97 / 105,
128 122 / 135, 192 183 / 220, 384 265 / 360, 512 415 / 424 (the same logits as oneDNN's
bit for bit)."""


def int8_prefill_takes(rows: int, amx: bool) -> bool:
    """Whether a prefill chunk of ``rows`` rows (more than
    :data:`~shardline.models.weight_products.KERNEL_MAX_ROWS`) takes the int8 product, given the
    product is built and whether the AMX prefill product is ready (``amx``)."""
    return not amx or rows < AMX_PREFILL_MIN_ROWS


def int8_prefill(rows: int) -> bool:
    """Whether a prefill chunk of ``rows`` rows (more than
    :data:`~shardline.models.weight_products.KERNEL_MAX_ROWS`) takes :class:`Int4Gemv` too,
    rather than a dequantized block and torch's GEMM: where it is built, unless the chunk
    takes :meth:`Int4Gemv.prefill` (:func:`amx_prefill`; :func:`int8_prefill_takes`). On a
    2-core Zen 4 (AVX-512 BF16, no AMX) a SmolLM2 prefill of 128 tokens took 111 ms
    against 179 ms with the GEMM, 512 tokens 610 against 743 ms, 2048 tokens 2.75
    against 3.03 s."""
    return int4_gemv_built() and int8_prefill_takes(rows, amx_ready())


def amx_prefill(rows: int) -> bool:
    """Whether a bfloat16 prefill chunk of ``rows`` rows (more than
    :data:`~shardline.models.weight_products.KERNEL_MAX_ROWS`) takes :meth:`Int4Gemv.prefill`:
    where :func:`amx_ready`, from :data:`AMX_PREFILL_MIN_ROWS` rows."""
    return rows >= AMX_PREFILL_MIN_ROWS and amx_ready()


@functools.cache
def amx_ready() -> bool:
    """Whether :meth:`Int4Gemv.prefill` runs here: the kernels are built with AMX-BF16
    tiles (a CPU that has them, a compiler that knows them) and Linux lets this process use
    them."""
    lib = kernel_library.kernels()
    return int4_gemv_built() and lib is not None and bool(lib.amx_tiles_ready())


class _Int4Weight(ctypes.Structure):
    """``int4_gemv_t`` of the C source."""

    _fields_ = [("p0", _P), ("sz0", _P), ("p1", _P), ("sz1", _P), ("N", _I), ("K", _I)]


class Int4Gemv:
    """``x @ W.T`` for a decode step's rows (and a prefill chunk's where
    :func:`int8_prefill`) of ``W`` ``[N, K]``, the sum of one or two int4
    planes in torch's CPU layout with blocks of 64 rows in the "halves" nibble order
    (:func:`shardline.models.int4_planes.int4pack_layout`), each ``(packed uint8
    [N / 64, K, 32], scales_zeros bfloat16 [K / 32, N, 2])``, ``w = (p - 8) * scale +
    zero``: the compiled ``int4_planes_gemv``. Each row of ``x`` is rounded to int8 in
    groups of 32 (``d = max |x| / 127`` per group, ``q = round(x / d)``: llama.cpp's Q8_1
    blocks) and the result is ``(d q) @ W.T`` up to float32 rounding: each weight group is
    unpacked once into bytes for all rows, its products with ``q`` summed exactly in int32
    (``vpdpbusd``) and scaled once per group in float32, in an order that does not depend
    on the number of rows, so an output row is the same bits whatever rows run beside it.
    Checked once here, so that a call costs little more than the kernel (a decode step
    makes 121 of them for SmolLM2).

    Raises:
        RuntimeError: the kernels are not built with this product
            (:func:`int4_gemv_built` is False).
        ValueError: planes the kernel does not take.
    """

    def __init__(self, planes: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        if not int4_gemv_built():
            raise RuntimeError("the int4 decode kernel is not built on this machine")
        refusal = self.refusal(planes)
        if refusal:
            raise ValueError(f"int4 decode product: {refusal}")
        self.N, self.K = planes[0][1].shape[1], planes[0][1].shape[0] * 32
        self._weight = _Int4Weight(*_plane_pointers(planes), self.N, self.K)
        self.address = ctypes.addressof(self._weight)
        """Where the C ``int4_gemv_t`` lies (the fused decode layers take it)."""
        self._planes = planes  # held: the kernel reads their memory
        self._kernel = kernel_library.loaded().int4_planes_gemv

    @staticmethod
    def refusal(planes: list[tuple[torch.Tensor, torch.Tensor]]) -> str | None:
        """Why the kernel does not take ``planes``, or None: it takes one or two planes of
        ``N`` (a multiple of 64) by ``K`` uint8 nibbles with bfloat16 scales and zeros
        ``[K / 32, N, 2]``, a second plane's scales 16 times the first's (as
        :func:`~shardline.models.int4_planes.pack_int4_planes` makes them: one sum holds
        both planes)."""
        if not 1 <= len(planes) <= 2:
            return f"{len(planes)} planes (one or two)"
        groups, N, _ = planes[0][1].shape
        if N % 64:
            return f"{N} rows (a multiple of 64)"
        for packed, sz in planes:
            if (
                packed.dtype != torch.uint8
                or packed.numel() != N * groups * 16
                or sz.dtype != torch.bfloat16
                or sz.shape != (groups, N, 2)
            ):
                return "planes of N * K / 2 bytes with bfloat16 [K / 32, N, 2] scales and zeros"
        if len(planes) == 2 and not torch.equal(planes[1][1][..., 0].float(), 16 * planes[0][1][..., 0].float()):
            return "a second plane whose scales are not 16 times the first's"
        return None

    def prefill(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[M, K]`` bfloat16 -> ``[M, N]`` bfloat16 on AMX tiles (where
        :func:`amx_ready`; the compiled ``int4_planes_amx_prefill``): each block of 64
        outputs dequantized once to bfloat16 (the values the dequantized-weight GEMM
        multiplies), multiplied with ``x`` as it is in float32 sums, rounded to bfloat16:
        the GEMM's result up to the order of float32 sums, without writing the whole
        dequantized weight to memory.

        Raises:
            ValueError: another dtype or width.
            RuntimeError: the tiles may not be used here.
        """
        M, K = x.shape
        if K != self.K or x.dtype != torch.bfloat16:
            raise ValueError(
                f"int4 prefill product of {x.dtype} x {tuple(x.shape)} with [{self.N}, {self.K}] (bfloat16)"
            )
        y = torch.empty(M, self.N, dtype=x.dtype)
        rc = kernel_library.loaded().int4_planes_amx_prefill(self.address, x.contiguous().data_ptr(), M, y.data_ptr())
        if rc == -1:
            raise MemoryError("int4 prefill product: no memory for its scratch")
        if rc:
            raise RuntimeError("int4 prefill product: AMX tiles are not available")
        return y

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[M, K]`` bfloat16 or float32 -> ``[M, N]`` in its dtype.

        Raises:
            ValueError: another dtype or width.
        """
        M, K = x.shape
        if K != self.K or x.dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(
                f"int4 decode product of {x.dtype} x {tuple(x.shape)} with [{self.N}, {self.K}] (bfloat16 or float32)"
            )
        y = torch.empty(M, self.N, dtype=x.dtype)
        if self._kernel(self.address, x.contiguous().data_ptr(), x.dtype == torch.float32, M, y.data_ptr()):
            raise MemoryError("int4 decode product: no memory for the activations' int8 copy")
        return y


def int8_groups(
    q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, group: int, out: torch.Tensor
) -> torch.Tensor:
    """Fill ``out`` ``[rows, K]`` (bfloat16 or float32) with ``q * scale + offset`` for
    ``q`` uint8 ``[rows, K]`` and float32 ``scale``, ``offset`` ``[rows, K / group]``.

    Raises:
        RuntimeError: the kernels are not built (:func:`kernels` is None).
    """
    lib = kernel_library.loaded()
    rows, K = q.shape
    assert out.shape == q.shape and out.dtype in (torch.bfloat16, torch.float32)
    lib.int8_groups(_ptr(q), _ptr(scale), _ptr(offset), rows, K, group, _ptr(out), int(out.dtype == torch.bfloat16))
    return out


def int8_groups_gemv(
    q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, group: int, x: torch.Tensor
) -> torch.Tensor:
    """``x @ W.T`` in float32 ``[M, rows]`` for a few rows of float32 ``x`` ``[M, K]`` and
    ``W = q * scale + offset`` (``q`` uint8 ``[rows, K]``, float32 ``scale`` and
    ``offset`` ``[rows, K / group]``, ``group`` a multiple of 8), reading one byte a
    weight and never dequantizing it (decode). Each output row depends only on its row of
    ``x``; sums are in float32 (another order than a GEMM's: within float32 rounding).

    Raises:
        RuntimeError: the kernels are not built (:func:`kernels` is None).
    """
    lib = kernel_library.loaded()
    rows, K = q.shape
    M = x.shape[0]
    assert x.dtype == torch.float32 and x.shape[1] == K and group % 8 == 0
    x = x.contiguous()
    xsum = x.view(M, K // group, group).sum(-1).contiguous()
    y = torch.empty(M, rows)
    lib.int8_groups_gemv(_ptr(q), _ptr(scale), _ptr(offset), rows, K, group, _ptr(x), _ptr(xsum), M, _ptr(y))
    return y


def packed_groups_rows(w, out: torch.Tensor, ids: torch.Tensor | None = None) -> torch.Tensor:
    """Fill ``out`` ``[n, K]`` (bfloat16 or float32) with rows ``ids`` (int64 ``[n]``; all
    rows where None) of ``w``, a :class:`~shardline.models.packed_groups.PackedGroups`.

    Raises:
        RuntimeError: the kernels are not built (:func:`kernels` is None).
    """
    lib = kernel_library.loaded()
    n = w.shape[0] if ids is None else len(ids)
    assert tuple(out.shape) == (n, w.shape[1]) and out.dtype in (torch.bfloat16, torch.float32)
    if ids is not None:
        ids = ids.to(torch.int64).contiguous()
        if len(ids) and not (0 <= int(ids.min()) and int(ids.max()) < w.shape[0]):
            raise IndexError(f"rows {ids.tolist()} of a weight of {w.shape[0]}")
    work = torch.empty(w.shape[1])
    weight = PackedWeight.of(w)  # held through the call
    lib.packed_groups_rows(
        ctypes.addressof(weight), _ptr(ids), n, _ptr(out), int(out.dtype == torch.bfloat16), _ptr(work)
    )
    return out


def packed_groups_cols(w, out: torch.Tensor) -> torch.Tensor:
    """Fill ``out`` ``[K, rows]`` (bfloat16 or float32) with ``W.T`` for ``w``, a
    :class:`~shardline.models.packed_groups.PackedGroups` ``[rows, K]`` (a prefill GEMM's
    operand): the values :func:`packed_groups_rows` writes, transposed, 16 rows at a time
    where AVX-512 is built.

    Raises:
        RuntimeError: the kernels are not built (:func:`kernels` is None).
    """
    lib = kernel_library.loaded()
    assert tuple(out.shape) == (w.shape[1], w.shape[0]) and out.dtype in (torch.bfloat16, torch.float32)
    weight = PackedWeight.of(w)  # held through the call
    lib.packed_groups_cols(ctypes.addressof(weight), _ptr(out), int(out.dtype == torch.bfloat16))
    return out


class PackedWeight(ctypes.Structure):
    """``packed_groups_t`` of the C source: a :class:`~shardline.models.packed_groups.
    PackedGroups` weight as its products (``packed_groups_gemv``, and the fused decode
    layers) take it. It points into the weight's tensors: hold the weight while it is
    used."""

    _fields_ = [
        ("low", _P),
        ("high", _P),
        ("scale", _P),
        ("offset", _P),
        ("center", ctypes.c_int32),
        ("hb", ctypes.c_int32),
        ("scales_bf16", ctypes.c_int32),
        ("group", _I),
        ("rows", _I),
        ("K", _I),
        ("codebook", _P),
    ]

    @classmethod
    def of(cls, w) -> PackedWeight:
        assert w.scale.dtype in (torch.bfloat16, torch.float32)
        return cls(
            _ptr(w.low),
            _ptr(w.high),
            _ptr(w.scale),
            _ptr(w.offset),
            w.center,
            w.high_bits,
            int(w.scale.dtype == torch.bfloat16),
            w.group,
            *w.shape,
            _ptr(w.codebook),
        )


def packed_groups_gemv(w, x: torch.Tensor) -> torch.Tensor:
    """``x @ W.T`` in float32 ``[M, rows]`` for ``x`` ``[M, K]`` (bfloat16 or float32)
    and ``W`` a :class:`~shardline.models.packed_groups.PackedGroups` ``[rows, K]``
    (decode); an output row depends only on its row of ``x``, and threads (torch's count)
    split the weight's rows.

    With bfloat16 scales, where AVX-512 VNNI is built (:func:`int4_gemv_built`), the
    compiled ``packed_groups_q8_gemv``: each row of ``x`` rounded to int8 groups of 32
    (llama.cpp's Q8_1 blocks, as :class:`Int4Gemv` does) and each weight group's products
    with them summed exactly in int32 (``vpdpbusd``), 16 weight rows at a time, then scaled
    once per group in float32. Else (float32 scales: a float32 instance) the compiled
    float32 product: per group the integers' products with ``x`` summed in float32 and
    scaled once, the offset's share from the group's sum of ``x`` (summed in order).

    Raises:
        RuntimeError: the kernels are not built (:func:`kernels` is None).
        MemoryError: the kernel's scratch could not be allocated.
    """
    lib = kernel_library.loaded()
    M, K = x.shape
    assert x.dtype in (torch.bfloat16, torch.float32) and K == w.shape[1] and K % 32 == 0
    y = torch.empty(M, w.shape[0])
    weight = PackedWeight.of(w)  # held through the call
    if w.scale.dtype == torch.bfloat16 and int4_gemv_built():
        x = x.contiguous()
        rc = lib.packed_groups_q8_gemv(ctypes.addressof(weight), _ptr(x), x.dtype == torch.float32, M, _ptr(y))
    else:
        x = x.float().contiguous()
        rc = lib.packed_groups_gemv(ctypes.addressof(weight), _ptr(x), M, _ptr(y))
    if rc:
        raise MemoryError("the packed-groups product could not allocate its scratch")
    return y


def top_k_rows(y: torch.Tensor, k: int) -> torch.Tensor:
    """The indices (int64 ``[rows, k]``, in no set order) of the ``k`` largest entries of
    each row of float32 ``y`` ``[rows, n]`` (CPU, ``k <= min(64, n)``): the compiled
    one-pass selection (``top_k.c``); a row's indices depend on that row alone.

    Raises:
        RuntimeError: the kernels are not built (:func:`kernels` is None).
    """
    lib = kernel_library.loaded()
    rows, n = y.shape
    assert y.dtype == torch.float32 and y.device.type == "cpu" and 0 < k <= min(64, n)
    y = y.contiguous()
    ids = torch.empty(rows, k, dtype=torch.int64)
    lib.top_k_rows(_ptr(y), rows, n, k, _ptr(ids))
    return ids


def packed_groups_refine(w, x: torch.Tensor, y: torch.Tensor, k: int) -> torch.Tensor:
    """``y`` (float32 ``[M, rows]``, contiguous, changed in place and returned) with each
    row's ``k`` largest entries (:func:`top_k_rows`) recomputed as float32 products of
    ``x`` (float32 ``[M, K]``) and the rows of ``w``, a
    :class:`~shardline.models.packed_groups.PackedGroups` ``[rows, K]``: its values as
    :func:`packed_groups_rows` gives them, summed in 16 lanes, then the lanes (the same
    operations for a row whatever the rows beside it).

    Raises:
        RuntimeError: the kernels are not built (:func:`kernels` is None).
    """
    lib = kernel_library.loaded()
    M, K = x.shape
    assert x.dtype == y.dtype == torch.float32 and y.is_contiguous() and tuple(y.shape) == (M, w.shape[0])
    assert K == w.shape[1] and 0 < k <= min(64, w.shape[0])
    x = x.contiguous()
    ids = torch.empty(M, k, dtype=torch.int64)
    work = torch.empty(K)
    weight = PackedWeight.of(w)  # held through the call
    lib.packed_groups_refine(ctypes.addressof(weight), _ptr(x), M, _ptr(y), k, _ptr(ids), _ptr(work))
    return y
