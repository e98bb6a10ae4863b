"""Small collectives built from point-to-point sends, for process groups on gloo.

gloo's collectives on small tensors cost far more than its sends. Three ranks on
127.0.0.1 of a 2-vCPU VM (``scripts/collective_costs.py``, medians per call): an
all-gather of 20 int64 values took 1.09 ms and 0.86 ms of each rank's CPU, :func:`gather_at`
0.35 and 0.27; an all-reduce of one float32 row of 576 took 1.67 ms and 1.14 of CPU,
:func:`all_reduce` 0.53 and 0.78 (2 ranks: 0.34 against 0.18 ms, 0.50 against 0.22). A
gloo collective wakes gloo's work thread and its transport thread for each of its
rounds; the CPU it takes is taken from the ranks that compute. NCCL's collectives have no
such cost, and its point-to-point sends would each open a communicator per pair of ranks:
NCCL groups keep ``torch.distributed``'s collectives (the choice is
:class:`shardline.parallel.collectives.Collectives`).

Every function here posts all its receives and sends before it waits on any, so ranks
that call it in the same order cannot deadlock, and it waits for all of them before it
returns, so no transfer outlives the call. Each uses its own tag (:data:`GATHER_TAG`,
:data:`BROADCAST_TAG`, :data:`ALL_REDUCE_TAG`), apart from the pipeline's (a micro-batch's
index in its step).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

GATHER_TAG = 1 << 20
BROADCAST_TAG = GATHER_TAG + 1
ALL_REDUCE_TAG = GATHER_TAG + 2


def _global(group: dist.ProcessGroup | None, rank: int) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


def _wait(works: list[dist.Work | None]) -> None:
    for work in works:
        assert work is not None  # isend and irecv return their work outside a coalescing context
        work.wait()


def broadcast(
    tensor: torch.Tensor, root: int, rank: int, world_size: int, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Group rank ``root``'s ``tensor`` (contiguous, the same shape and dtype on every
    rank), written into ``tensor`` on the others and returned: ``root`` sends it to each
    (P - 1 messages, one hop).

    Raises:
        RuntimeError: a send or receive failed or timed out (a peer rank is gone).
    """
    if rank == root:
        _wait(
            [
                dist.isend(tensor, dst=_global(group, r), group=group, tag=BROADCAST_TAG)
                for r in range(world_size)
                if r != root
            ]
        )
    else:
        _wait([dist.irecv(tensor, src=_global(group, root), group=group, tag=BROADCAST_TAG)])
    return tensor


class GatherReceives:
    """The receives of a :func:`gather_at` at group rank ``root``, posted ahead by
    :func:`post_gather`: ``parts`` (one buffer per group rank, None at the root) and the
    receives' work."""

    def __init__(self, root: int, parts: list[torch.Tensor | None], works: list[dist.Work | None]) -> None:
        self.root = root
        self.parts = parts
        self.works = works


def post_gather(
    root: int, like: torch.Tensor, world_size: int, group: dist.ProcessGroup | None = None
) -> GatherReceives:
    """Post, at group rank ``root``, the receives of a :func:`gather_at` of tensors shaped
    as ``like``, for :func:`gather_at` to wait on (``posted``). gloo sends a message whose
    receive is not posted yet only once the receiver asks for it: a round trip to the
    sender's transport thread when the receive comes (2 ranks on a loaded 2-vCPU VM,
    ``irecv`` posted after the message was sent: 1.7 ms median, 0.01 ms posted before). A
    root that posts before it computes takes the others' tensors while it computes."""
    parts: list[torch.Tensor | None] = [None if r == root else torch.empty_like(like) for r in range(world_size)]
    works = [
        dist.irecv(part, src=_global(group, r), group=group, tag=GATHER_TAG)
        for r, part in enumerate(parts)
        if part is not None
    ]
    return GatherReceives(root, parts, works)


def gather_at(
    root: int,
    tensor: torch.Tensor,
    rank: int,
    world_size: int,
    group: dist.ProcessGroup | None = None,
    posted: GatherReceives | None = None,
) -> torch.Tensor:
    """Every rank's ``tensor`` (the same shape and dtype on every rank), stacked in group
    rank order: ``[world_size, *tensor.shape]``, on every rank.

    The ranks send theirs to group rank ``root``, which :func:`broadcast` s the stacked
    table: 2 (P - 1) messages. A rank that ``root`` waits for reaches every rank one
    message after it arrives, so where ``root`` is the last to arrive (the sampling rank
    at the end of a pipeline's step) it costs the others one hop, as a broadcast would.
    ``posted``: at the root, its receives posted ahead (:func:`post_gather`), else posted
    here.

    Raises:
        RuntimeError: a send or receive failed or timed out (a peer rank is gone), or the
            receives posted ahead are for another root, or tensors of another shape or
            dtype (they would take this gather's messages, or the next one's).
    """
    if posted is not None and (posted.root != root or rank != root):
        raise RuntimeError(
            f"a gather rooted at rank {root} (this rank {rank}) met receives posted at rank {posted.root}"
        )
    if rank == root:
        posted = posted or post_gather(root, tensor, world_size, group)
        parts = [tensor if part is None else part for part in posted.parts]
        if any(p.shape != tensor.shape or p.dtype != tensor.dtype for p in parts):
            raise RuntimeError(
                f"a gather of {tensor.dtype} {list(tensor.shape)} met receives posted "
                f"for {[(p.dtype, list(p.shape)) for p in parts]}"
            )
        _wait(posted.works)
        return broadcast(torch.stack(parts), root, rank, world_size, group)
    sent = tensor.contiguous()  # referenced until its send completes
    send = dist.isend(sent, dst=_global(group, root), group=group, tag=GATHER_TAG)
    table = torch.empty((world_size, *tensor.shape), dtype=tensor.dtype, device=tensor.device)
    broadcast(table, root, rank, world_size, group)
    _wait([send])
    return table


def all_reduce(
    tensor: torch.Tensor, rank: int, world_size: int, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """The sum of every rank's ``tensor`` (any shape, the same on every rank), written
    into ``tensor`` and returned: bit-identical on every rank.

    Each rank sends its tensor to every other (P (P - 1) messages, one hop) and adds the
    P tensors in group rank order. Each rank sends P - 1 copies, where a ring all-reduce
    sends 2 (P - 1) / P of one: for the small tensors of a decode step (a few rows of
    the hidden size) the one hop is what counts; see
    :data:`shardline.placement.speed.POINT_TO_POINT_BYTES`.

    Raises:
        RuntimeError: a send or receive failed or timed out (a peer rank is gone).
    """
    sent = tensor.contiguous()  # referenced until its sends complete
    parts = [sent if r == rank else torch.empty_like(sent) for r in range(world_size)]
    _wait(
        [
            dist.irecv(parts[r], src=_global(group, r), group=group, tag=ALL_REDUCE_TAG)
            for r in range(world_size)
            if r != rank
        ]
        + [
            dist.isend(sent, dst=_global(group, r), group=group, tag=ALL_REDUCE_TAG)
            for r in range(world_size)
            if r != rank
        ]
    )
    total = parts[0].clone()
    for part in parts[1:]:
        total += part
    return tensor.copy_(total)
