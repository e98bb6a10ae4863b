"""What the engine needs from one rank of an instance, whatever its sharding.

A stage holds this rank's model shard and KV cache. The engine asks it to describe prefill
chunks and decode steps (:meth:`Stage.prefill_batch`, :meth:`Stage.decode_batch`), runs a
step's micro-batches with :meth:`run` (every rank of the instance runs the same list, the
collectives inside depend on the sharding), lets the sampling rank sample, and shares the
sampled ids with :meth:`share_tokens`.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from shardline.models.llama import DecoderShard, ForwardBatch, KVCache
from shardline.parallel.progress import Progress


class Stage:
    """Base of the pipeline, tensor and ring stages.

    Args:
        shard, cache: this rank's model shard and KV cache.
        rank, world_size: this rank within ``group`` and the group's size.
        sampler: the group rank that holds the logits and samples.
        group: the instance's process group (None: the default group).
        progress: marked after every transfer, collective and micro-batch (the runner's
            progress watchdog reads it).

    Attributes:
        samples: True on the sampling rank.
    """

    def __init__(self, shard: DecoderShard, cache: KVCache, rank: int, world_size: int,
                 sampler: int, group: dist.ProcessGroup | None = None,
                 progress: Progress | None = None) -> None:
        self.shard = shard
        self.cache = cache
        self.rank = rank
        self.world_size = world_size
        self.group = group
        self.sampler = sampler
        self.samples = rank == sampler
        self.progress = progress or Progress()

    def prefill_batch(self, slot: int, start: int, length: int, want_logits: bool) -> ForwardBatch:
        """A prefill chunk: positions ``start .. start+length-1`` of ``slot``; logits of
        its last position on the sampling rank when ``want_logits``."""
        return self.shard.prefill_batch(slot, start, length, want_logits)

    def decode_batch(self, slots: list[int], positions: list[int]) -> ForwardBatch:
        """A decode step: one token at ``positions[i]`` for the sequence in ``slots[i]``."""
        return self.shard.decode_batch(slots, positions)

    def run(
        self,
        microbatches: list[tuple[torch.Tensor, ForwardBatch]],
        computed: Callable[[int], None] | None = None,
    ) -> list[torch.Tensor | None]:
        """Run each ``(token ids, batch)`` in order; ``token ids`` is int64 ``[N]``, the same
        on every rank. ``computed(i)`` is called once this rank has computed micro-batch
        i. Returns, per micro-batch, float32 logits ``[len(batch.logit_rows), vocab]`` on
        the sampling rank and None elsewhere.

        Raises:
            RuntimeError: a transfer or collective failed or timed out (a peer rank is
                gone or stalled).
        """
        raise NotImplementedError

    def share_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        """Broadcast the sampled token ids (int64 ``[M]``, on the communication device:
        the CPU for gloo, the GPU for NCCL) from the sampling rank to all; in place."""
        if self.world_size > 1:
            self.progress.mark(f"receiving {ids.shape[0]} sampled tokens from rank {self.sampler}")
            root = self.sampler if self.group is None else dist.get_global_rank(self.group, self.sampler)
            dist.broadcast(ids, src=root, group=self.group)
            self.progress.mark("tokens shared")
        return ids
