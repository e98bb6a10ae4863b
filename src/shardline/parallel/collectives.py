"""The collectives of one rank in its instance's process group, each taken the way that
is cheapest on the group's backend: on gloo, small ones by point-to-point sends
(:mod:`shardline.parallel.point_to_point`: gloo's collectives cost more than its sends on
small tensors), larger sums by gloo's ring; on NCCL, ``torch.distributed``'s own (its
point-to-point sends would each open a communicator per pair of ranks). The one place that
chooses."""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardline.parallel import point_to_point
from shardline.placement.speed import POINT_TO_POINT_BYTES


class Collectives:
    """Rank ``rank`` of ``world_size`` in ``group`` (None: the default group). The
    backend is read at the first call (a stage of one rank calls none, and needs no
    process group). Every rank of the group calls the same collectives in the same order;
    each returns once its transfers are done.

    Raises (every method):
        RuntimeError: a send, receive or collective failed or timed out (a peer rank is
            gone).
    """

    def __init__(self, group: dist.ProcessGroup | None, rank: int, world_size: int) -> None:
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self._sends: bool | None = None
        self._posted: point_to_point.GatherReceives | None = None  # the next gather_at's

    @property
    def sends(self) -> bool:
        """Whether small collectives go by point-to-point sends: the group's backend is not
        NCCL (gloo, under torch's name or :data:`shardline.runner.rendezvous.GLOO_BACKEND`)."""
        if self._sends is None:
            self._sends = dist.get_backend(self.group) != "nccl"
        return self._sends

    def expect_gather_at(self, root: int, like: torch.Tensor) -> None:
        """Say that the next :meth:`gather_at` is rooted at group rank ``root`` and gathers
        tensors shaped as ``like`` (on the CPU): on gloo the root posts its receives now
        (:func:`point_to_point.post_gather`), so that the others' tensors, sent before
        the root calls it, arrive meanwhile; elsewhere nothing. The next ``gather_at``
        must be that one: another root, shape or dtype raises."""
        if self.sends and self.rank == root and self.world_size > 1:
            self._posted = point_to_point.post_gather(root, like, self.world_size, self.group)

    def gather_at(self, root: int, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's ``tensor`` (the same shape and dtype on every rank), stacked in
        group rank order, ``[world_size, *tensor.shape]``, on every rank: gathered at group
        rank ``root``, which sends the table back (:func:`point_to_point.gather_at`, into
        the receives :meth:`expect_gather_at` posted, if it did), or NCCL's all-gather."""
        if self.sends:
            posted, self._posted = self._posted, None
            return point_to_point.gather_at(root, tensor, self.rank, self.world_size, self.group, posted)
        gathered = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(gathered, tensor, group=self.group)
        return torch.stack(gathered)

    def broadcast(self, tensor: torch.Tensor, root: int) -> torch.Tensor:
        """Group rank ``root``'s ``tensor`` (contiguous, the same shape and dtype on every
        rank), written into ``tensor`` on the others and returned."""
        if self.sends:
            return point_to_point.broadcast(tensor, root, self.rank, self.world_size, self.group)
        src = root if self.group is None else dist.get_global_rank(self.group, root)
        dist.broadcast(tensor, src=src, group=self.group)
        return tensor

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's ``tensor``, written into it and returned: on gloo, a
        tensor of at most :data:`~shardline.placement.speed.POINT_TO_POINT_BYTES` by sends
        (:func:`point_to_point.all_reduce`, one hop, bit-identical on every rank), a larger
        one by gloo's ring all-reduce."""
        if self.sends and tensor.numel() * tensor.element_size() <= POINT_TO_POINT_BYTES:
            return point_to_point.all_reduce(tensor, self.rank, self.world_size, self.group)
        dist.all_reduce(tensor, group=self.group)
        return tensor
