"""Quantization on load, for weights a file stores in 16 or 32 bits (``"quantize"`` when
placing): trade some quality for memory, as vLLM's and exo's 4-bit models do.

Each row is cut into groups of :data:`GROUP` inputs, as ggml's formats do (the GGUF
spec's Q8_0 and Q4_1 blocks, https://github.com/ggml-org/ggml/blob/master/docs/gguf.md):

- ``int8``: symmetric, ``w ~ d * (q - 128)`` with ``d = max|w| / 127`` per group (Q8_0's
  rule): held as two int4 planes, 10 bits a weight.
- ``int4``: asymmetric, ``w ~ d * q + m`` with ``m = min(w)``, ``d = (max(w) - m) / 15``
  per group (Q4_1's rule): one int4 plane, 5 bits a weight.

The embedding and LM head are quantized in int8 either way (``Quantize.vocab``), as
llama.cpp's 4-bit mixes keep them in more bits. The result is a
:class:`~shardline.models.gguf_quants.GroupQuant`, which the loader holds
like a GGUF file's own groups (:func:`~shardline.models.linear.resident_weight`). Groups
lie along a row, so a tensor-parallel rank's slice (whole heads, MLP columns in blocks of
32) quantizes to exactly the groups one node has for the same weights.
"""

from __future__ import annotations

import numpy as np
import torch

from shardline.models.config import Quantize
from shardline.models.gguf_quants import GroupQuant

GROUP = 32

ROWS_AT_A_TIME = 4096
"""Rows quantized at a time, bounding the float32 temporaries to that many rows."""


def quantizable(weight: torch.Tensor) -> bool:
    """Whether a 2-D weight's rows cut into whole groups."""
    return weight.dim() == 2 and weight.shape[1] % GROUP == 0


def quantize_groups(weight: torch.Tensor, mode: Quantize) -> GroupQuant:
    """Groups of ``weight`` (float ``[rows, cols]``, ``cols`` a multiple of :data:`GROUP`)
    under ``mode``: q uint8 ``[rows, cols]``, float32 scale and offset ``[rows, cols / 32]``.

    Raises:
        ValueError: ``cols`` is not a multiple of :data:`GROUP`.
    """
    if not quantizable(weight):
        raise ValueError(f"a weight of shape {tuple(weight.shape)} does not cut into groups of {GROUP}")
    rows, cols = weight.shape
    q = np.empty((rows, cols), dtype=np.uint8)
    scale = np.empty((rows, cols // GROUP), dtype=np.float32)
    offset = np.empty_like(scale)
    for start in range(0, rows, ROWS_AT_A_TIME):
        end = min(start + ROWS_AT_A_TIME, rows)
        w = weight[start:end].float().view(end - start, cols // GROUP, GROUP)
        if mode is Quantize.INT8:
            d = w.abs().amax(dim=-1) / 127
            codes = torch.round(w / torch.where(d > 0, d, 1)[..., None]).clamp(-127, 127) + 128
            m = -128 * d
        else:
            m = w.amin(dim=-1)
            d = (w.amax(dim=-1) - m) / 15
            codes = torch.round((w - m[..., None]) / torch.where(d > 0, d, 1)[..., None]).clamp(0, 15)
        q[start:end] = codes.to(torch.uint8).view(end - start, cols).numpy()
        scale[start:end] = d.numpy()
        offset[start:end] = m.numpy()
    bits, center = (8, 128) if mode is Quantize.INT8 else (4, None)
    return GroupQuant(q, scale, offset, bits, GROUP, center)
