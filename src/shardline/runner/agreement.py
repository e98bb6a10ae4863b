"""Agreement among the ranks of an instance on which tasks start and which are cancelled,
exchanged in the same collective as a step's sampled token ids.

Each rank receives tasks and cancellations on its own, in whatever order the network
delivers them. Before any collective that belongs to a task, all ranks must take the same
tasks in the same order, or their collectives pair up across different requests and the
instance hangs. Once a step, every rank gets every rank's fixed-size int64 vector (its
*proposal*; :meth:`shardline.parallel.stage.Stage.gather`):

    [n_tasks, n_cancels, task ids (k slots), cancelled ids (k slots), sampled ids (M)]

- a task is agreed when every rank lists it (intersection); agreed tasks are taken in
  ascending task-id order, identical on every rank;
- a cancellation is agreed when any rank lists it (union): only its id is needed;
- the sampled ids (M: the sequences sampled this step, a count every rank knows) are the
  sampling rank's; the other ranks send zeros there. One exchange thus both shares the
  step's tokens and agrees on the next step's tasks: on a pipeline over gloo the other
  ranks send theirs to the last rank while it computes, and its tokens reach them one
  hop after it has sampled, as a broadcast would; no separate agreement round.

Every rank computes the result from the same gathered data, so all agree at the same step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Agreement:
    """Task ids to start (ascending) and task ids cancelled (ascending), this step."""

    tasks: tuple[int, ...]
    cancels: tuple[int, ...]


def proposal_length(k: int, sampled: int) -> int:
    """int64 values in a proposal of ``k`` slots per list carrying ``sampled`` ids."""
    return 2 + 2 * k + sampled


def encode_proposal(
    task_ids: list[int], cancel_ids: list[int], k: int, tokens: list[int] | None = None
) -> torch.Tensor:
    """int64 ``[2 + 2k + M]``: the k smallest of each list (later ones wait for a later
    step), then ``tokens`` (``M`` sampled ids; none: ``M = 0``)."""
    tasks = sorted(task_ids)[:k]
    cancels = sorted(cancel_ids)[:k]
    vec = torch.zeros(proposal_length(k, len(tokens or ())), dtype=torch.int64)
    vec[0], vec[1] = len(tasks), len(cancels)
    vec[2 : 2 + len(tasks)] = torch.tensor(tasks, dtype=torch.int64)
    vec[2 + k : 2 + k + len(cancels)] = torch.tensor(cancels, dtype=torch.int64)
    if tokens:
        vec[2 + 2 * k :] = torch.tensor(tokens, dtype=torch.int64)
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


def sampled_tokens(proposals: list[torch.Tensor], sampler: int, k: int) -> list[int]:
    """The sampled ids the sampling rank (group rank ``sampler``) put in its proposal."""
    return proposals[sampler][2 + 2 * k :].tolist()
