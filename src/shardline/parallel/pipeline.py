"""Pipeline parallelism: rank r holds a layer range and passes hidden states to rank r+1.

A forward pass on a pipeline instance of world size P:

    rank 0:      token ids -> embedding -> its layers -> send hidden to rank 1
    rank 0<r<P-1: recv hidden from r-1 -> its layers -> send to r+1
    rank P-1:    recv hidden from P-2 -> its layers -> norm -> LM head -> logits

Every rank knows the shape of each transfer from the step plan it shares with the others,
so each send is matched by exactly one receive of the same shape.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardline.models.llama import DecoderShard, ForwardBatch, KVCache


class PipelineStage:
    """This rank's part of the pipeline; world size 1 is a plain single-node model."""

    def __init__(self, shard: DecoderShard, cache: KVCache, rank: int, world_size: int) -> None:
        self.shard = shard
        self.cache = cache
        self.rank = rank
        self.world_size = world_size
        self.is_last = rank == world_size - 1

    def forward(self, token_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor | None:
        """Run this stage for ``token_ids`` (int64 ``[N]``, known on every rank).

        Returns float32 logits ``[len(batch.logit_rows), vocab]`` on the last rank, None
        elsewhere.
        """
        if self.rank == 0:
            inputs = token_ids.to(self.shard.device)
        else:
            inputs = torch.empty(
                (token_ids.shape[0], self.shard.config.hidden_size),
                dtype=self.shard.dtype,
                device=self.shard.device,
            )
            dist.recv(inputs, src=self.rank - 1)
        out = self.shard(inputs, batch, self.cache)
        if self.is_last:
            return out
        dist.send(out.contiguous(), dst=self.rank + 1)
        return None

    def share_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """Broadcast the sampled token ids (int64 ``[M]``) from the last rank to all."""
        if self.world_size > 1:
            dist.broadcast(tokens, src=self.world_size - 1)
        return tokens
