"""Agreement among the ranks of an instance on which tasks start and which are cancelled.

Each rank receives tasks and cancellations on its own, in whatever order the network
delivers them. Before any collective that belongs to a task, all ranks must take the same
tasks in the same order, or their collectives pair up across different requests and the
instance hangs. Every engine step each rank all-gathers a fixed-size int64 vector:

    [n_tasks, n_cancels, task ids (k slots), cancelled ids (k slots)]

- a task is agreed when every rank lists it (intersection); agreed tasks are taken in
  ascending task-id order, identical on every rank;
- a cancellation is agreed when any rank lists it (union): only its id is needed.

Every rank computes the result from the same gathered data, so all agree at the same step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Agreement:
    """Task ids to start (ascending) and task ids cancelled (ascending), this step."""

    tasks: tuple[int, ...]
    cancels: tuple[int, ...]


def encode_proposal(task_ids: list[int], cancel_ids: list[int], k: int) -> torch.Tensor:
    """int64 ``[2 + 2k]``: the k smallest of each list; later ones wait for a later step."""
    tasks = sorted(task_ids)[:k]
    cancels = sorted(cancel_ids)[:k]
    vec = torch.zeros(2 + 2 * k, dtype=torch.int64)
    vec[0], vec[1] = len(tasks), len(cancels)
    vec[2 : 2 + len(tasks)] = torch.tensor(tasks, dtype=torch.int64)
    vec[2 + k : 2 + k + len(cancels)] = torch.tensor(cancels, dtype=torch.int64)
    return vec


def decide(proposals: list[torch.Tensor], k: int) -> Agreement:
    """The agreement implied by every rank's proposal (same input -> same output)."""
    held = None
    cancels: set[int] = set()
    for vec in proposals:
        n_tasks, n_cancels = int(vec[0]), int(vec[1])
        ids = set(vec[2 : 2 + n_tasks].tolist())
        held = ids if held is None else held & ids
        cancels.update(vec[2 + k : 2 + k + n_cancels].tolist())
    return Agreement(tuple(sorted(held or ())), tuple(sorted(cancels)))


def agree(
    task_ids: list[int], cancel_ids: list[int], group: dist.ProcessGroup | None, k: int = 32
) -> Agreement:
    """All-gather this rank's held task ids and cancellations; return what all agree on.

    With no process group (one rank) everything held is agreed at once.
    Raises whatever the collective raises on timeout or a lost peer (the instance fails).
    """
    mine = encode_proposal(task_ids, cancel_ids, k)
    if group is None:
        return decide([mine], k)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    return decide(gathered, k)
