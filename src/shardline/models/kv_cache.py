"""The KV cache of a decoder shard: keys and values of every slot's positions, held as
address space that takes memory only as positions are written (see :class:`KVCache`)."""

from __future__ import annotations

import math
import mmap
import platform
import sys

import torch

from shardline.models.config import ModelConfig

MAP_NORESERVE = getattr(
    mmap, "MAP_NORESERVE", 0x4000 if sys.platform == "linux" and platform.machine() in ("x86_64", "aarch64") else 0
)
"""mmap's flag (Python 3.13 names it): 0x4000 in Linux's asm-generic/mman-common.h, which
x86-64 and arm64 use; 0 (no flag) elsewhere."""

KV_BLOCK_BYTES = 4096
"""Bytes of one head's block of positions: the unit the engine counts KV memory in (a
4 KiB page on Linux x86-64; fixed, so every rank of an instance counts the same)."""


SLOTS_PER_SEQUENCE = 4
"""KV-cache slots a CPU rank maps for each sequence of its batch (:func:`cache_slots`)."""


def cache_slots(max_batch: int, device: torch.device | str) -> int:
    """KV-cache slots of a rank whose instance decodes ``max_batch`` sequences together.

    A slot that holds no running sequence may hold a finished one's cached prompt
    (:mod:`shardline.runner.prefix_cache`), so the slots bound how many conversations stay
    cached: with ``max_batch`` of them, 12 conversations taking turns on an instance of 8
    found about half their turns evicted (the first 29 tokens cached, 2 s to prefill the
    rest alone and 7-13 s beside others, against 0.2-0.5 s) while the KV pool's tokens
    had room for all 12. On the CPU a slot is address space until written, so
    :data:`SLOTS_PER_SEQUENCE` times as many cost nothing (the KV pool still bounds the
    tokens written); elsewhere (a GPU's cache is allocated whole) ``max_batch``. The
    engine uses the extra slots where every rank has them
    (:class:`~shardline.runner.engine.Engine`)."""
    return max_batch * (SLOTS_PER_SEQUENCE if torch.device(device).type == "cpu" else 1)


def whole_blocks(tokens: int, block: int) -> int:
    """``tokens`` rounded up to whole blocks of ``block`` tokens: the positions their pages
    hold."""
    return -(-tokens // block) * block


class KVCache:
    """Key/value cache for the layers of one shard.

    Per local layer two tensors of shape ``[slots, num_kv_heads, positions, head_dim]`` in
    ``dtype`` (``positions``: ``context`` rounded up to :attr:`block_tokens`). A sequence
    owns one slot while it runs; position p of it lives at ``[slot, :, p]``, so attention
    reads a sequence's keys as one view.

    On the CPU the cache is one anonymous mapping that the kernel backs with memory only
    as it is written, a page at a time: a block of :attr:`block_tokens` positions of one
    head (:data:`KV_BLOCK_BYTES`: 32 positions of a 64-wide bfloat16 head), the way a paged KV cache hands out blocks
    as sequences grow, with the blocks of a sequence contiguous in virtual memory
    (vAttention, Prabhu et al. 2024, arXiv:2405.04437). :meth:`release` returns a slot's
    pages to the system when its sequence ends; how many tokens may be written at once is
    the engine's KV budget (:class:`~shardline.runner.engine.Engine`). Elsewhere (CUDA)
    the whole cache is allocated up front.

    ``num_kv_heads`` defaults to the model's; a tensor-parallel shard passes its own count
    (``DecoderShard.num_kv_heads``), as it caches only its KV heads.
    """

    def __init__(
        self,
        config: ModelConfig,
        num_layers: int,
        slots: int,
        context: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        num_kv_heads: int | None = None,
    ) -> None:
        heads = config.num_kv_heads if num_kv_heads is None else num_kv_heads
        element = torch.empty((), dtype=dtype).element_size()
        self.block_tokens = max(1, KV_BLOCK_BYTES // (config.head_dim * element))
        positions = whole_blocks(context, self.block_tokens)
        shape = (2, num_layers, slots, heads, positions, config.head_dim)
        self.slots = slots
        self.context = context
        self.bytes_per_token = 2 * num_layers * heads * config.head_dim * element
        self._slot_bytes = heads * positions * config.head_dim * element  # one layer's K (or V)
        self._mapping = None
        if torch.device(device).type == "cpu":
            size = math.prod(shape) * element
            # A private anonymous mapping: zero pages until written, a page at a time, and
            # MADV_DONTNEED frees them (a shared one keeps them). Not huge pages: with them
            # one written position took 2 MiB (numpy's large arrays ask for them: 864 MiB
            # resident for SmolLM2 with 4 short requests, against ~400).
            # MAP_NORESERVE: address space beyond RAM is taken (every slot at full context,
            # where admission bounds what is written); without it the kernel's overcommit
            # check refused a mapping larger than RAM + swap (256 slots x 4,096 positions of
            # a 1.5B model: 30 GB on a 24 GB machine).
            self._mapping = mmap.mmap(-1, max(size, 1), flags=mmap.MAP_PRIVATE | MAP_NORESERVE)
            if hasattr(mmap, "MADV_NOHUGEPAGE"):
                self._mapping.madvise(mmap.MADV_NOHUGEPAGE)
            both = torch.frombuffer(self._mapping, dtype=torch.uint8, count=size)
            both = both.view(dtype).view(shape)
        else:
            both = torch.zeros(shape, dtype=dtype, device=device)
        self.k = list(both[0].unbind(0))
        self.v = list(both[1].unbind(0))

    def nbytes(self) -> int:
        """Bytes of address space reserved (every slot at full context)."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def blocks_for(self, tokens: int) -> int:
        """Tokens rounded up to whole blocks: what ``tokens`` positions of a sequence take."""
        return whole_blocks(tokens, self.block_tokens)

    def copy(self, source: int, slot: int, tokens: int) -> None:
        """Copy the keys and values of ``source``'s first ``tokens`` positions into ``slot``
        (a cached prefix another sequence shares: :mod:`shardline.runner.prefix_cache`)."""
        for t in self.k + self.v:
            t[slot, :, :tokens].copy_(t[source, :, :tokens])

    def release(self, slot: int, start: int = 0, end: int | None = None) -> None:
        """Give the memory of ``slot``'s positions ``start`` to ``end`` (each rounded up to a
        whole block; None: to the end of the context) back to the system: its sequence
        ended, or only its first ``start`` positions are kept (a cached prefix,
        :mod:`shardline.runner.prefix_cache`); they read as zeros until written again. A
        no-op off the CPU and where the system has no ``MADV_DONTNEED``.

        ``end``: where the slot's written positions end, where the caller knows it (a
        cached prefix's tokens, a sequence's ``touched``): past it nothing is called. Each
        (layer, K or V, KV head) with pages to give is a system call, 180 for SmolLM2: on
        a 2-vCPU VM (8 slots of 8,192 positions) giving back 7 blocks of each took 3.9
        ms, the same calls over pages never written 0.3 ms.
        """
        advice = getattr(mmap, "MADV_DONTNEED", None)
        if self._mapping is None or advice is None:
            return
        if self._slot_bytes % mmap.PAGESIZE:  # not page-aligned: nothing whole to give back
            return
        base, step = slot * self._slot_bytes, self.slots * self._slot_bytes
        regions = 2 * len(self.k)  # (K, V) x layers, each [slots, heads, positions, head_dim]
        heads, positions, _ = self.k[0].shape[1:]
        head_bytes = self._slot_bytes // heads
        first = self.blocks_for(max(start, 0)) * head_bytes // positions  # bytes of the kept positions, a head
        last = head_bytes if end is None else min(head_bytes, self.blocks_for(end) * head_bytes // positions)
        if first >= last or first % mmap.PAGESIZE or last % mmap.PAGESIZE:
            return
        if first == 0 and last == head_bytes:  # the slot's heads lie together: one call a region
            for region in range(regions):
                self._mapping.madvise(advice, region * step + base, self._slot_bytes)
            return
        for region in range(regions):
            for head in range(heads):
                self._mapping.madvise(advice, region * step + base + head * head_bytes + first, last - first)
