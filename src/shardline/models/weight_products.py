"""Products of an activation with a resident weight that share one machinery: reused
scratch buffers, the GEMM's dtype on this CPU, and the blocked product that dequantizes a
weight a block of output rows at a time into scratch for a dense GEMM (prefill).

Used by every resident form (:mod:`shardline.models.linear`,
:mod:`shardline.models.int4_planes`, :mod:`shardline.models.packed_groups`).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Iterator

import torch

from shardline.models import kernel_library
from shardline.models.budgets import DEQUANT_SCRATCH_BYTES

KERNEL_MAX_ROWS = 64
"""Products of at most this many rows (a decode step's sequences) take a decode kernel
that computes each row on its own (the compiled int4-plane product,
:class:`~shardline.models.native_dequant.Int4Gemv`, else torch's int4 kernel; the packed
and int8 groups' compiled products): up to this batch size a sequence's output does not
depend on what else is in its batch."""

_COMPUTED_AS: contextvars.ContextVar[int] = contextvars.ContextVar("computed_as", default=0)


@contextlib.contextmanager
def computed_as(rows: int) -> Iterator[None]:
    """Within the block, products choose their kernel as for at least ``rows`` rows
    (:func:`product_rows`): a prefill piece resumed from a cached prefix is computed as
    the whole chunk a cold prefill computes those rows in, so each row gets that chunk's
    bits (the kernels below give each row the same bits whatever the rows beside it;
    :mod:`shardline.runner.prefix_cache`). 0: as many rows as the product has."""
    token = _COMPUTED_AS.set(rows)
    try:
        yield
    finally:
        _COMPUTED_AS.reset(token)


def product_rows(rows: int) -> int:
    """The rows a product of ``rows`` rows chooses its kernel for: at least those of the
    enclosing :func:`computed_as`."""
    return max(rows, _COMPUTED_AS.get())


SCRATCH_BUFFERS: dict[tuple[str, torch.dtype], torch.Tensor] = {}


def scratch(name: str, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """A reused ``[rows, cols]`` buffer (one per name and dtype, grown as needed), so a
    dequantized weight block is written into memory already mapped, not fresh pages."""
    # Normal tensors and views, made outside inference mode even when called inside it:
    # the buffer is written both in and out of inference mode (a view made in inference
    # mode may not be updated in place outside it).
    with torch.inference_mode(False):
        buf = SCRATCH_BUFFERS.get((name, dtype))
        if buf is None or buf.numel() < rows * cols:
            raw = torch.empty(rows * cols * dtype.itemsize + 4096, dtype=torch.uint8)
            skip = -raw.data_ptr() % 4096
            buf = raw[skip : skip + rows * cols * dtype.itemsize].view(dtype)
            SCRATCH_BUFFERS[(name, dtype)] = buf
        return buf[: rows * cols].view(rows, cols)


def release_scratch() -> None:
    """Drop every scratch buffer (an idle rank's; the next product allocates afresh)."""
    SCRATCH_BUFFERS.clear()


def in_dtype(work: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 scratch ``work`` in ``dtype``: itself, or rounded once into scratch."""
    if dtype == torch.float32:
        return work
    return scratch("out", work.shape[0], work.shape[1], dtype).copy_(work)


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


def blocked_product(x: torch.Tensor, out_features: int, columns, work_per_weight: int = 0) -> torch.Tensor:
    """``x @ W.T`` with ``W``'s output rows dequantized a block at a time by
    ``columns(start, end, dtype)``, which returns ``W.T``'s columns ``[in, end - start]``
    in the GEMM's dtype (:func:`gemm_dtype`; a scratch view, valid until the next call,
    possibly a transposed one: the GEMM reads either layout) using that dtype's bytes
    plus ``work_per_weight`` bytes of scratch a weight: blocks of a multiple of 256 rows
    within :data:`DEQUANT_SCRATCH_BYTES`; ``x``'s rows padded with zeros to a multiple of
    :data:`GEMM_ROWS` (:func:`padded_rows`). Returns ``[rows, out_features]`` in ``x``'s
    dtype."""
    gemm = gemm_dtype(x.dtype)
    per_weight = gemm.itemsize + work_per_weight
    block = max(256, DEQUANT_SCRATCH_BYTES // (per_weight * x.shape[1]) // 256 * 256)
    rows = x.shape[0]
    xin = padded_rows(x, gemm)
    if out_features <= block:
        return torch.mm(xin, columns(0, out_features, gemm))[:rows].to(x.dtype)
    out = torch.empty(xin.shape[0], out_features, dtype=x.dtype)
    for start in range(0, out_features, block):
        end = min(start + block, out_features)
        out[:, start:end] = torch.mm(xin, columns(start, end, gemm))
    return out[:rows]


GEMM_ROWS = 16
"""A prefill GEMM's rows are padded to a multiple of this. oneDNN's bfloat16 GEMM took
up to 1.6x as long for some row counts as for the multiple of 16 above them (a 1.5B
Q4_K_M model's 8,960 x 1,536 down projection, 2 threads of an AMD EPYC VM: 259 rows 20-22
ms, 287 19.5, 301 20.5-21.6, 511 27.3, against 12.8-13.8 and 19.5 padded), where a
row's bits are its own (the padded rows are zeros, thrown away)."""


def padded_rows(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` ``[rows, in]`` in ``dtype`` with zero rows after it to a multiple of
    :data:`GEMM_ROWS` (a scratch buffer where any are added, valid until the next call);
    off the CPU (another GEMM, and the scratch is the CPU's) unpadded."""
    rows = -(-x.shape[0] // GEMM_ROWS) * GEMM_ROWS
    if rows == x.shape[0] or x.device.type != "cpu":
        return x.to(dtype)
    out = scratch("gemm_in", rows, x.shape[1], dtype)
    out[: x.shape[0]].copy_(x)
    out[x.shape[0] :].zero_()
    return out


def native(dtype: torch.dtype):
    """The compiled kernels when they can write ``dtype``, else None (eager torch ops)."""
    return kernel_library.kernels() if dtype in (torch.bfloat16, torch.float32) else None
