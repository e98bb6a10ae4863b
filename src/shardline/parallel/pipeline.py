"""Pipeline parallelism: rank r holds a layer range and passes hidden states to rank r+1.

One engine step on a pipeline instance of world size P runs a list of micro-batches (the
decode batch and prefill chunks), each through every stage in order:

    rank 0:       token ids -> embedding -> its layers -> isend hidden to rank 1
    rank 0<r<P-1: irecv hidden from r-1  -> its layers -> isend to r+1
    rank P-1:     irecv hidden from P-2  -> its layers -> norm -> LM head -> logits

Sends are asynchronous and each rank posts the receives of all the step's micro-batches
before it computes, so stage r computes micro-batch i+1 while stage r+1 computes
micro-batch i and the transfer between them proceeds in the background: a step of W
micro-batches takes about W + P - 1 stage times instead of W * P (GPipe's schedule,
Huang et al., 2019, without the backward pass). Stages on one machine's CPUs overlap only
as far as its cores give threads for: each computes a micro-batch holding a compute slot
(:mod:`shardline.parallel.compute_slots`), and a micro-batch computed while the others
have none (:func:`alone`: the fill's first, the drain's last) on the free ones too.

Every rank derives the step's micro-batches (their count and shapes) from state that is
identical on all ranks, so each send is matched by exactly one receive of the same shape,
tagged with the micro-batch's index in the step. A rank waits for all its sends before the
step ends, so no transfer outlives its step; cancellations only take effect between steps.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from shardline.models.config import Sharding
from shardline.models.kv_cache import KVCache
from shardline.models.llama import DecoderShard, ForwardBatch
from shardline.parallel.compute_slots import ComputeSlots, host_id, stages_at_once
from shardline.parallel.progress import Progress
from shardline.parallel.stage import Stage


def alone(rank: int, tag: int, stages: int, microbatches: int) -> bool:
    """Whether stage ``rank`` of ``stages`` computes micro-batch ``tag`` of a step of
    ``microbatches`` while no other stage has one to compute, in the schedule's stage
    times (stage r computes micro-batch m at time r + m): the pipeline's fill and drain,
    the first micro-batch on rank 0 and the last on the last rank (each micro-batch on
    each stage where there is one; every micro-batch where there is one stage)."""
    t = rank + tag
    return max(0, t - microbatches + 1) == rank == min(stages - 1, t)


def use_threads(count: int) -> None:
    """Run torch's next operations on ``count`` threads (no call where it already does:
    each sets up OpenMP's team again)."""
    if torch.get_num_threads() != count:
        torch.set_num_threads(count)


class PipelineStage(Stage):
    """This rank's part of the pipeline; world size 1 is a plain single-node model.

    The last rank holds the logits and samples. See :class:`Stage` for the other
    arguments; ``wire_device``: where hidden states travel between ranks (default the
    shard's device; the CPU where ranks on one GPU talk gloo, which NCCL refuses them).
    ``slots``: the machine's compute slots a CPU stage computes each micro-batch in
    (:mod:`shardline.parallel.compute_slots`; None: it computes whenever it can).
    """

    def __init__(
        self,
        shard: DecoderShard,
        cache: KVCache,
        rank: int,
        world_size: int,
        progress: Progress | None = None,
        wire_device: torch.device | None = None,
        slots: ComputeSlots | None = None,
    ) -> None:
        super().__init__(
            shard, cache, rank, world_size, sampler=Sharding.PIPELINE.sampling_rank(world_size), progress=progress
        )
        self.wire_device = wire_device or shard.device
        self.stages = world_size
        self.slots = slots

    def stages_at_once(self, device: torch.device) -> int:
        """The stages that can compute at once: :attr:`stages`, or fewer where ranks share a
        machine's compute slots (:func:`~shardline.parallel.compute_slots.stages_at_once`
        over every rank's, exchanged by a sum over the group: every rank calls this at the
        same point). A step cut in more micro-batches than that gains no overlap and pays
        each one's fixed costs (a 1.5B Q4_K_M model's dequantized weights, a forward's
        ~120 ms on 2 vCPUs): its 3-node local pipeline's 296-row cached turn took 1,238 ms
        in 3 pieces, 1,106 in 2, 1,093 in 1, and its 251-row first prompt 833, 811 and
        1,141 ms (2-vCPU VM, ``shardline bench --turns 8``, one round each)."""
        if self.world_size == 1:
            return self.stages
        self.progress.mark("telling every rank this machine's compute slots")
        table = torch.zeros((self.world_size, 2), dtype=torch.int64, device=device)
        if self.slots is not None:
            table[self.rank, 0] = int(host_id(), 16) >> 1  # 64 bits of hex, as an int64 > 0
            table[self.rank, 1] = self.slots.count
        rows = self.collectives.all_reduce(table).cpu().tolist()  # [machine, slots] a rank, 0s: none
        return min(self.stages, stages_at_once([(machine, count) for machine, count in rows]))

    def run(
        self, microbatches: list[tuple[torch.Tensor, ForwardBatch]], computed: Callable[[int], None] | None = None
    ) -> list[torch.Tensor | None]:
        """See :meth:`Stage.run`; only rank 0 reads the token ids, the others receive
        hidden states ``[N, hidden_size]`` from the previous rank. Each micro-batch asks
        for torch's thread count as ``computed`` left it after the one before (the first,
        as the call found it), and the call leaves the count it found."""
        shard, progress = self.shard, self.progress
        received = []
        if self.rank > 0:
            for tag, (tokens, _) in enumerate(microbatches):
                buffer = torch.empty(
                    (tokens.shape[0], shard.config.hidden_size), dtype=shard.dtype, device=self.wire_device
                )
                received.append((buffer, dist.irecv(buffer, src=self.rank - 1, tag=tag)))
        sends = []
        outputs: list[torch.Tensor | None] = []
        found = wanted = torch.get_num_threads()
        for tag, (tokens, batch) in enumerate(microbatches):
            if self.rank == 0:
                inputs = tokens.to(shard.device)
            else:
                progress.mark(f"receiving micro-batch {tag} from rank {self.rank - 1}")
                inputs, work = received[tag]
                assert work is not None  # irecv returns its work outside a coalescing context
                work.wait()
                inputs = inputs.to(shard.device)
            if self.slots is not None:
                progress.mark(
                    f"waiting for a compute slot for micro-batch {tag} (cores shared "
                    "with the other runners of this machine)"
                )
            with self._threads_held(wanted, alone(self.rank, tag, self.world_size, len(microbatches))):
                progress.mark(f"computing micro-batch {tag}")
                out = shard(inputs, batch, self.cache)
            if computed is not None:
                computed(tag)
                wanted = torch.get_num_threads()
            if self.samples:
                outputs.append(out)
            else:
                out = out.to(self.wire_device).contiguous()  # kept referenced until its send completes
                sends.append((out, dist.isend(out, dst=self.rank + 1, tag=tag)))
                outputs.append(None)
        use_threads(found)
        for tag, (_, work) in enumerate(sends):
            progress.mark(f"sending micro-batch {tag} to rank {self.rank + 1}")
            assert work is not None  # isend returns its work outside a coalescing context
            work.wait()
        progress.mark("step done")
        return outputs

    @contextlib.contextmanager
    def _threads_held(self, wanted: int, alone: bool) -> Iterator[None]:
        """Compute the block on up to ``wanted`` threads, as far as the machine's compute
        slots give them: one slot (waiting for it), and where the stage computes
        :func:`alone`, more of those free at once while one holds fewer threads than
        wanted; torch's count where the stage takes no slots. Torch's count is ``wanted``
        again after the block."""
        if self.slots is None:
            yield
            return
        per = self.slots.threads
        with self.slots.held(-(-wanted // per) if alone else 1) as taken:
            use_threads(min(wanted, taken * per))
            try:
                yield
            finally:
                use_threads(wanted)
