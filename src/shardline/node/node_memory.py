"""Memory as the coordinator places by it: what each node offers to models, what the
ranks of the instance table hold on it, and what is free; a role that reads the node
through :class:`MemoryView` (the rules themselves are pure, in
:mod:`shardline.placement.memory`).

Units: bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol

import psutil

from shardline.node.status import InstanceStatus
from shardline.node.table import Instance, Peer
from shardline.placement.memory import committed_bytes, free_bytes, gpu_bytes, runtime_baseline


class MemoryView(Protocol):
    """What the memory role reads of its node (read-only)."""

    @property
    def node_id(self) -> str: ...
    @property
    def memory_limit_bytes(self) -> int | None: ...
    @property
    def profile(self) -> dict | None: ...
    @property
    def peers(self) -> Mapping[str, Peer]: ...
    @property
    def instances(self) -> Mapping[str, Instance]: ...
    def profile_of(self, node_id: str) -> dict: ...


class NodeMemory:
    """The node's view of every live node's memory, from its own table (so placements in
    a row never count the same bytes twice) and the offers its peers report."""

    def __init__(
        self,
        view: MemoryView,
        runner_bytes: Callable[[], int],
        available_bytes: Callable[[], int] = lambda: int(psutil.virtual_memory().available),
    ) -> None:
        self.view = view
        self.runner_bytes = runner_bytes  # what this node's runners hold (theirs to keep)
        self.available_bytes = available_bytes  # what the system has available

    def offered(self) -> int:
        """Bytes this node offers to models in all: its memory limit, else, where its
        runners compute on a CUDA GPU (its profile says so), the GPU's memory, else the
        memory the system has available plus what its own runners hold (theirs to
        keep)."""
        if self.view.memory_limit_bytes is not None:
            return self.view.memory_limit_bytes
        gpu = gpu_bytes(self.view.profile)
        if gpu is not None:
            return gpu
        return self.available_bytes() + self.runner_bytes()

    def of(self, node_id: str) -> dict:
        """``offered_bytes``, ``committed_bytes`` (what placement counts the ranks placed
        on it, of every instance not failed, to hold) and ``free_bytes`` (what the next
        placement may give it) of a live node."""
        offered = self.offered() if node_id == self.view.node_id else self.view.peers[node_id].offered_bytes
        ranks = (
            (r.node_id, r.estimated_bytes)
            for inst in self.view.instances.values()
            if inst.status != InstanceStatus.FAILED
            for r in inst.ranks
        )
        committed = committed_bytes(ranks, node_id)
        return {"offered_bytes": offered, "committed_bytes": committed, "free_bytes": free_bytes(offered, committed)}

    def free(self, node_id: str) -> int:
        """Bytes a live node can give the next placement (``of(node_id)["free_bytes"]``)."""
        return self.of(node_id)["free_bytes"]

    def runtime_baseline(self, node_ids: list[str]) -> int:
        """Runtime bytes to count per rank on these live nodes, from their profiles."""
        return runtime_baseline([self.view.profile_of(n).get("runtime_baseline_bytes") or 0 for n in node_ids])
