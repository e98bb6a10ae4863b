"""Prefill attention compiled for the CPU (``kernels/prefill_attention.c``): a prefill
chunk's rows, each over its slot's keys up to its own position, where torch's
scaled_dot_product_attention ran.

A row's bits depend on its query, its position and the keys and values up to it alone
(key blocks counted from position 0, each row computed by the same instructions whatever
rows share its chunk), where torch's CPU flash attention's depend on how many keys the
chunk reads: so a prompt resumed from a cached prefix gives a cold prefill's bits with
no key span (:func:`~shardline.parallel.stage.span_keys`), and no chunk reads a key past
its last row. Scores are bfloat16 products summed in float32 (vdpbf16ps), the softmax in
float32, its weights rounded to bfloat16 (as torch's bfloat16 attention rounds its
probabilities) and summed into the values in float32, the output rounded to bfloat16.

Speed, one layer, one thread (a 2-vCPU AMD EPYC VM, AVX-512 BF16, ``python -m
shardline.bench.prefill_attention --threads 1``; 2026-12-07): SmolLM2-135M's heads, 232
rows at positions 2,089-2,320, 3.7 ms against torch's 14.7; 512 rows from position 0,
1.1 against 7.1; a 1.5B Qwen2's (12 heads over 2 KV heads of 128, two threads), 4.3-7.0x.
The loops are bound by the products (vdpbf16ps) and the softmax's exponentials, at about
60% of the products' peak on that CPU.

It runs where the kernels are built for a CPU with AVX-512 BF16, the cache is bfloat16
on the CPU and the head size is a multiple of 32 (at most 256); elsewhere torch's
attention runs.
"""

from __future__ import annotations

import ctypes
import functools
import math

import torch

from shardline.models import kernel_library


@functools.cache
def built() -> bool:
    """Whether the compiled prefill attention runs on this machine (decided once)."""
    lib = kernel_library.kernels()
    return lib is not None and bool(lib.prefill_attention_built())


def takes(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether :func:`attend` takes queries ``q`` ``[n, heads, hd]`` over ``k_cache``."""
    hd = q.shape[-1]
    return (
        k_cache.device.type == "cpu"
        and k_cache.dtype == torch.bfloat16
        and q.dtype == torch.bfloat16
        and hd % 32 == 0
        and hd <= 256
        and q.shape[1] % k_cache.shape[1] == 0
        and q.shape[1] // k_cache.shape[1] <= 32
        and built()
    )


def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot: int, start: int) -> torch.Tensor:
    """Causal attention of a prefill chunk: bfloat16 ``q`` ``[n, heads, hd]`` (row i at
    position ``start + i``; its last dim contiguous, its rows evenly strided) over slot
    ``slot`` of the caches ``[slots, kv_heads, positions, hd]`` (bfloat16, contiguous),
    where the chunk's keys and values are already written; query head h reads KV head
    ``h // (heads // kv_heads)`` (``enable_gqa``). Returns bfloat16 ``[n, heads, hd]``.

    Raises:
        ValueError: a shape :func:`takes` refuses, or caches not contiguous.
    """
    n, heads, hd = q.shape
    if not (k_cache.is_contiguous() and v_cache.is_contiguous() and q.stride(2) == 1 and q.stride(1) == hd):
        raise ValueError("prefill attention needs contiguous caches and heads")
    out = torch.empty(n, heads, hd, dtype=torch.bfloat16)
    lib = kernel_library.loaded()
    failed = lib.prefill_attention(
        q.data_ptr(),
        n,
        q.stride(0),
        heads,
        k_cache[slot].data_ptr(),
        v_cache[slot].data_ptr(),
        k_cache.shape[1],
        k_cache.stride(1),
        start,
        hd,
        ctypes.c_float(1.0 / math.sqrt(hd)),
        out.data_ptr(),
    )
    if failed:
        raise ValueError(f"prefill attention takes no {heads} heads over {k_cache.shape[1]} KV heads of {hd}")
    return out
