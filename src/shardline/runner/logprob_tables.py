"""The log-probability tables the sampling rank of an instance broadcasts to the others
(a step's sampled tokens', :func:`logprob_table`; a prefill chunk's prompt tokens',
:func:`prompt_logprob_table`) and their reading (:func:`read_logprobs`): float32 rows
``[1 + 2 k]`` of the token's log-probability, k top token ids (exact in float32 below
2**24) and their log-probabilities. Pure functions over tensors."""

from __future__ import annotations

import torch

from shardline.runner.sampling import MAX_TOP_LOGPROBS, Choice


def logprob_width(wanted: list[int | None]) -> int | None:
    """Top entries per row of a step's log-probability table: the most any sequence of
    the step asks for (at most :data:`MAX_TOP_LOGPROBS`), or None when none asks (no
    table, no broadcast). ``wanted``: each sequence's ``sampling.logprobs``."""
    asked = [min(k, MAX_TOP_LOGPROBS) for k in wanted if k is not None]
    return max(asked) if asked else None


def logprob_table(choices: list[Choice], width: int) -> torch.Tensor:
    """The float32 ``[len(choices), 1 + 2 * width]`` table the sampling rank broadcasts:
    per row the chosen token's log-probability, then ``width`` top token ids (exact in
    float32 below 2**24), then their log-probabilities; unused entries NaN."""
    table = torch.full((len(choices), 1 + 2 * width), float("nan"), dtype=torch.float32)
    for row, choice in enumerate(choices):
        if choice.logprob is None:
            continue
        table[row, 0] = choice.logprob
        for j, (token, logprob) in enumerate(choice.top[:width]):
            table[row, 1 + j] = float(token)
            table[row, 1 + width + j] = logprob
    return table


def prompt_logprob_table(logits: torch.Tensor, targets: torch.Tensor, k: int) -> torch.Tensor:
    """The table of a prefill chunk's prompt log-probabilities, as :func:`logprob_table`
    lays it out (``k`` wide, at most :data:`MAX_TOP_LOGPROBS`): row i holds the
    log-probability of ``targets[i]`` under the log-softmax of ``logits[i]`` and the ``k``
    most likely tokens there. ``logits``: float32 ``[n, vocab]``; ``targets``: int64
    ``[n]``; returns float32 ``[n, 1 + 2 k]`` on ``logits``' device."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    k = min(k, MAX_TOP_LOGPROBS)
    table = torch.full((logits.shape[0], 1 + 2 * k), float("nan"), dtype=torch.float32, device=logits.device)
    table[:, 0] = logprobs.gather(1, targets.to(logits.device).view(-1, 1)).squeeze(1)
    shown = min(k, logits.shape[1])
    if shown:
        values, ids = torch.topk(logprobs, shown, dim=-1)
        table[:, 1 : 1 + shown] = ids.float()
        table[:, 1 + k : 1 + k + shown] = values
    return table


def read_logprobs(row: list[float], width: int, k: int) -> tuple[float, tuple[tuple[int, float], ...]]:
    """A row of :func:`logprob_table` back as the chosen token's log-probability and its
    ``k`` top entries."""
    k = min(k, width)
    top = tuple(
        (int(row[1 + j]), row[1 + width + j]) for j in range(k) if row[1 + j] == row[1 + j]
    )  # NaN: the vocabulary has fewer tokens
    return row[0], top
