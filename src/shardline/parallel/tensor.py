"""Tensor parallelism: every rank holds every layer, each only its heads and MLP columns.

The split of Megatron-LM (Shoeybi et al., 2019, "Megatron-LM: Training Multi-Billion
Parameter Language Models Using Model Parallelism", section 3), for inference:

    every rank:  token ids [N] -> embedding (replicated) -> h [N, hidden]
    each layer:  a = o(attention(q/k/v of my heads))   partial [N, hidden]
                 h = h + all_reduce(a)
                 m = down(silu(gate) * up of my columns) partial [N, hidden]
                 h = h + all_reduce(m)
    rank 0:      final norm -> LM head -> float32 logits [rows, vocab]; samples
    all ranks:   receive the sampled token ids by broadcast from rank 0

q/k/v and gate/up are split by output (heads, columns), o and down by input (the same heads
and columns), so a layer needs no communication but the two all-reduces; after each one
every rank holds the same hidden states. Which heads and columns a rank holds is
:mod:`shardline.placement.tensor`'s decision (uneven splits and replicated KV heads for
grouped-query attention included); :func:`shardline.models.weights.load_tensor_shard`
reads just those slices from the files.

The embedding is replicated on every rank (each needs the layer input); the final norm and
LM head only on rank 0, the one that samples (the hidden states after the last all-reduce
are the same everywhere, so other ranks would compute the same logits for nothing).

All-reduces run on the tensors' device with the process group's backend: gloo on CPU, NCCL
on CUDA; ranks that share one GPU (NCCL refuses them) sum over gloo through host memory
(``wire_device``). The partial sums are summed in float32 by default (``reduce_dtype``): each rank's
partial output is rounded to the compute dtype once by its projection, and a bfloat16 sum
rounds again after every addition (gloo sums bfloat16 correctly, rounding each partial
sum). Measured on SmolLM2-135M Q4_1 in bfloat16 against the one-rank model (max |logit
difference| over a prefill and 6 decode steps, logits up to 34; tests/test_tensor_parallel.py):
2 ranks 0.76 either way (two bfloat16 partials round once either way: bit-identical), 3
ranks 0.67 in float32 and 0.80 in bfloat16; greedy tokens identical in all four. On one
2-core machine a [1, 576] gloo all-reduce between 2 processes took 0.3-0.65 ms in either
dtype, so the float32 sum costs nothing measurable.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from shardline.models.config import Sharding, TensorShare
from shardline.models.kv_cache import KVCache
from shardline.models.llama import DecoderShard
from shardline.parallel.collectives import Collectives
from shardline.parallel.progress import Progress
from shardline.parallel.stage import Stage


def make_all_reduce(
    group: dist.ProcessGroup | None,
    reduce_dtype: torch.dtype | None = torch.float32,
    wire_device: torch.device | None = None,
) -> Callable[[torch.Tensor], torch.Tensor]:
    """A sum over ``group``'s ranks of ``[N, hidden]`` partial outputs, in place where it can.

    ``reduce_dtype`` (None: the tensor's own dtype) is the dtype the sum is taken in; the
    result is cast back to the input's dtype and device. ``wire_device`` (None: the
    tensor's own) is where the sum is taken: the CPU for gloo between ranks on one GPU.
    The sum is :meth:`Collectives.all_reduce`'s (on gloo a decode step's by sends).
    """

    collectives = Collectives(group, dist.get_rank(group), dist.get_world_size(group))

    def all_reduce(x: torch.Tensor) -> torch.Tensor:
        wide = x.to(device=wire_device or x.device, dtype=reduce_dtype or x.dtype)
        return collectives.all_reduce(wide).to(device=x.device, dtype=x.dtype)

    return all_reduce


class TensorStage(Stage):
    """This rank's part of a tensor-parallel instance; world size 1 is a plain model.

    Rank 0 holds the logits and samples. :meth:`Stage.run` runs the micro-batches: every
    rank embeds all the token ids and each layer all-reduces twice, so the micro-batches run
    one after another on every rank. Args as for :class:`Stage`, and:
        shard: from :func:`~shardline.models.shard_loader.load_tensor_shard` (every layer, this
            rank's heads and columns; the LM head on rank 0).
        cache: a :class:`KVCache` with ``num_kv_heads=shard.num_kv_heads``.
        reduce_dtype: dtype of the all-reduced sums (default float32; None: the compute
            dtype).
        wire_device: where the sums are taken (None: the shard's device; the CPU for
            gloo between ranks on one GPU).
    """

    computing_waits_on = " (all-reduces with every rank)"

    def __init__(
        self,
        shard: DecoderShard,
        cache: KVCache,
        rank: int,
        world_size: int,
        group: dist.ProcessGroup | None = None,
        reduce_dtype: torch.dtype | None = torch.float32,
        progress: Progress | None = None,
        wire_device: torch.device | None = None,
    ) -> None:
        if world_size > 1 and shard.share is None:
            raise ValueError("a tensor stage of several ranks needs a tensor-parallel shard")
        if cache.k and cache.k[0].shape[1] != shard.num_kv_heads:
            raise ValueError(f"the KV cache holds {cache.k[0].shape[1]} KV heads, the shard {shard.num_kv_heads}")
        super().__init__(
            shard, cache, rank, world_size, Sharding.TENSOR.sampling_rank(world_size), group=group, progress=progress
        )
        if self.samples and shard.lm_head is None:
            raise ValueError("the sampling rank's shard has no LM head")
        shard.set_all_reduce(make_all_reduce(group, reduce_dtype, wire_device) if world_size > 1 else None)

    def prefill_rows_apart(self) -> bool:
        """Not on three ranks or more either: a prefill piece's sums go by gloo's ring
        all-reduce, whose segments (cut by the buffer's size) add the ranks' parts in
        another order each, so a row's sum depends on the rows beside it; two ranks' sum
        is one addition whatever the order."""
        return self.world_size <= 2 and super().prefill_rows_apart()


def load_tensor_stage(
    source,
    rank: int,
    world_size: int,
    *,
    slots: int,
    context: int,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
    share: TensorShare | None = None,
    group: dist.ProcessGroup | None = None,
    reduce_dtype: torch.dtype | None = torch.float32,
    progress: Progress | None = None,
    quantize=None,
    wire_device: torch.device | None = None,
) -> TensorStage:
    """Load this rank's shard and KV cache and wrap them in a :class:`TensorStage`.

    ``source`` is a :class:`~shardline.models.weights.WeightSource`; ``share`` defaults to
    :func:`shardline.placement.tensor.tensor_shares` ``(source.config, world_size)[rank]``
    (every rank must use the same split). ``slots`` and ``context``: the KV cache's
    sequences and tokens per sequence. Other arguments (``quantize`` among them) as for
    :func:`~shardline.models.shard_loader.load_tensor_shard` and :class:`TensorStage`.
    """
    from shardline.models.shard_loader import load_tensor_shard
    from shardline.placement.tensor import tensor_shares

    if share is None:
        share = tensor_shares(source.config, world_size)[rank]
    if (share.rank, share.world_size) != (rank, world_size):
        raise ValueError(f"share of rank {share.rank}/{share.world_size} given to rank {rank}/{world_size}")
    shard = load_tensor_shard(source, share, dtype=dtype, device=device, quantize=quantize)
    cache = KVCache(source.config, len(shard.layers), slots, context, dtype, device, num_kv_heads=shard.num_kv_heads)
    return TensorStage(
        shard,
        cache,
        rank,
        world_size,
        group=group,
        reduce_dtype=reduce_dtype,
        progress=progress,
        wire_device=wire_device,
    )
