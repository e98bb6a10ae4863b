"""What the engine needs from one rank of an instance, whatever its sharding.

A stage holds this rank's model shard and KV cache. The engine asks it to describe prefill
chunks and decode steps (:meth:`Stage.prefill_batch`, :meth:`Stage.decode_batch`), runs a
step's micro-batches with :meth:`run` (every rank of the instance runs the same list, the
collectives inside depend on the sharding), lets the sampling rank sample, and shares the
sampled ids and the next step's agreement with :meth:`gather`.

:meth:`Stage.run` is the loop of the shardings whose ranks all run every layer, each on its
own part, with their collectives inside the layers (tensor: its heads and columns, two
all-reduces a layer; ring: its share of a chunk's tokens, chosen by
:meth:`Stage.local_tokens`, with the k/v hops inside attention). The pipeline, whose ranks
pass hidden states to each other between their layers, overrides it.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from shardline.models.kv_cache import KVCache
from shardline.models.llama import DecoderShard, ForwardBatch
from shardline.parallel.collectives import Collectives
from shardline.parallel.progress import Progress


def span_keys(batch: ForwardBatch, span: int, positions: int) -> ForwardBatch:
    """``batch`` (a prefill chunk on the torch layers) attending to the keys up to the next
    multiple of ``span`` (at most the slot's ``positions``), those past each query masked;
    unchanged for ``span`` 0.

    The bits of a row's attention depend on how many keys its chunk reads (torch's CPU
    flash attention: SmolLM2 in bfloat16, rows 673-802 of a chunk 512..802 differed from
    the same rows of a chunk 512..1023), not on where the chunk starts. With the span the
    prefill chunk's (:mod:`shardline.runner.prefix_cache`), a chunk that ends short of a
    multiple of it reads what the whole chunk would: a prompt resumed from a cached
    prefix, and a later prompt that extends a cached one, give each row a cold prefill's
    bits. The masked keys weigh exactly 0; a chunk short of the span reads up to
    span - 1 more keys (in positions no one wrote, the zero page)."""
    end = batch.start + int(batch.positions.shape[0])
    keys = min(-(-end // span) * span, positions) if span else end
    if keys <= end or batch.ring is not None:
        return batch
    batch.attn_mask = torch.arange(keys, device=batch.positions.device).unsqueeze(0) <= batch.positions.unsqueeze(1)
    batch.kv_len = keys
    return batch


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
        stages: micro-batches of a step the instance computes at once, each on its
            own ranks: a pipeline's world size; 1 where every rank computes each
            micro-batch (tensor and ring).
    """

    #: What a micro-batch's computation waits on besides this rank, for the progress
    #: watchdog's report ("" where nothing; e.g. " (all-reduces with every rank)").
    computing_waits_on = ""

    def __init__(
        self,
        shard: DecoderShard,
        cache: KVCache,
        rank: int,
        world_size: int,
        sampler: int,
        group: dist.ProcessGroup | None = None,
        progress: Progress | None = None,
    ) -> None:
        self.shard = shard
        self.cache = cache
        self.rank = rank
        self.world_size = world_size
        self.group = group
        self.collectives = Collectives(group, rank, world_size)
        self.sampler = sampler
        self.samples = rank == sampler
        self.stages = 1
        self.progress = progress or Progress()

    def prefill_batch(
        self, slot: int, start: int, length: int, want_logits: bool, every_row: bool = False, key_span: int = 0
    ) -> ForwardBatch:
        """A prefill chunk: positions ``start .. start+length-1`` of ``slot``; logits of
        its last position on the sampling rank when ``want_logits``, of every position
        with ``every_row`` too; ``key_span``: see :func:`span_keys`."""
        return span_keys(
            self.shard.prefill_batch(slot, start, length, want_logits, every_row), key_span, self.cache.k[0].shape[2]
        )

    def decode_batch(self, slots: list[int], positions: list[int]) -> ForwardBatch:
        """A decode step: one token at ``positions[i]`` for the sequence in ``slots[i]``."""
        return self.shard.decode_batch(slots, positions)

    def prefill_rows_apart(self) -> bool:
        """Whether this rank computes each prefill row's bits apart from the rows beside
        it (:meth:`DecoderShard.prefill_rows_apart
        <shardline.models.llama.DecoderShard.prefill_rows_apart>`)."""
        return self.shard.prefill_rows_apart(self.cache)

    def stages_at_once(self, device: torch.device) -> int:
        """Micro-batches of a step the instance computes at once: :attr:`stages` (tensor
        and ring ranks compute each micro-batch together: 1). ``device``: the
        communication device (a subclass may exchange what it needs with the others:
        every rank calls this at the same point)."""
        return self.stages

    def all_agree(self, holds: bool, device: torch.device) -> bool:
        """Whether ``holds`` is true on every rank (each rank calls this at the same
        point; ``device``: the communication device), by a sum over the group."""
        if self.world_size == 1:
            return holds
        self.progress.mark("agreeing with every rank on what each computes alike")
        return int(self.collectives.all_reduce(torch.tensor([0 if holds else 1], device=device)).item()) == 0

    def local_tokens(self, tokens: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """The token ids this rank embeds for ``batch`` (int64, on the CPU): all of
        ``tokens`` ``[N]`` here; a subclass may take a part (a ring rank's share)."""
        return tokens

    def run(
        self, microbatches: list[tuple[torch.Tensor, ForwardBatch]], computed: Callable[[int], None] | None = None
    ) -> list[torch.Tensor | None]:
        """Run each ``(token ids, batch)`` in order; ``token ids`` is int64 ``[N]``, the same
        on every rank. ``computed(i)`` is called once this rank has computed micro-batch
        i. Returns, per micro-batch, float32 logits ``[len(batch.logit_rows), vocab]`` on
        the sampling rank and None elsewhere.

        Here each rank embeds its :meth:`local_tokens` and runs its shard on them, one
        micro-batch after another; the collectives, if any, are inside the shard's layers,
        so every rank runs the micro-batches in the same order.

        Raises:
            RuntimeError: a transfer or collective failed or timed out (a peer rank is
                gone or stalled).
        """
        outputs: list[torch.Tensor | None] = []
        for index, (tokens, batch) in enumerate(microbatches):
            tokens = self.local_tokens(tokens, batch)
            self.progress.mark(f"computing micro-batch {index}{self.computing_waits_on}")
            out = self.shard(tokens.to(self.shard.device), batch, self.cache)
            if computed is not None:
                computed(index)
            outputs.append(out if self.samples else None)
        self.progress.mark("step done")
        return outputs

    def expect_gather(self, length: int) -> None:
        """Say, before the step's computation, that its :meth:`gather` exchanges proposals
        of ``length`` int64 values: on gloo the sampling rank posts its receives now
        (:meth:`Collectives.expect_gather_at`), so that the proposals the other ranks send
        when they finish their part arrive while it computes, not one round trip after it
        asks (on a pipeline that round trip was on every decode step's path)."""
        if self.world_size > 1:
            self.collectives.expect_gather_at(self.sampler, torch.empty(length, dtype=torch.int64))

    def gather(self, proposal: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's proposal, on every rank (int64 ``[2 + 2k + M]``, the same length on
        every rank, on the communication device: the CPU for gloo, the GPU for NCCL;
        :mod:`shardline.runner.agreement`): the step's agreement and, from the sampling
        rank, its sampled ids. Returns the proposals in group-rank order, on the CPU.

        The proposals meet at the sampling rank, which sends them all back
        (:meth:`Collectives.gather_at`; NCCL all-gathers): on a pipeline the other ranks
        have sent theirs before the last rank has sampled, and get its tokens one hop
        later."""
        if self.world_size == 1:
            return [proposal.cpu()]
        self.progress.mark("exchanging tasks and sampled tokens with every rank")
        table = self.collectives.gather_at(self.sampler, proposal)
        self.progress.mark("exchanged")
        return list(table.cpu().unbind(0))

    def share_logprobs(self, table: torch.Tensor) -> torch.Tensor:
        """Broadcast a step's log-probability table (float32 ``[M, 1 + 2k]``,
        :func:`shardline.runner.engine.logprob_table`, on the communication device) from
        the sampling rank to all, in place (:meth:`Collectives.broadcast`). Called only in
        steps where a sequence asks for log-probabilities, on every rank alike."""
        if self.world_size > 1:
            self.progress.mark(f"receiving log-probabilities of {table.shape[0]} tokens from rank {self.sampler}")
            self.collectives.broadcast(table, self.sampler)
            self.progress.mark("log-probabilities shared")
        return table
