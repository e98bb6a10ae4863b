"""Choosing the next token from logits: greedy, temperature, top-k and top-p (nucleus).

Top-p follows Holtzman et al., "The Curious Case of Neural Text Degeneration" (2019): keep
the smallest set of most likely tokens whose probabilities sum to at least p.
"""

from __future__ import annotations

import torch

from shardline.runner.protocol import SamplingParams


class Sampler:
    """Samples one sequence's tokens; its own generator makes a seeded request reproducible
    whatever else runs in the same batch."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.generator = None
        if params.temperature > 0:
            self.generator = torch.Generator()
            seed = params.seed if params.seed is not None else self.generator.seed()
            self.generator.manual_seed(seed % (2**63))

    def sample(self, logits: torch.Tensor) -> int:
        """Pick a token id from float32 logits ``[vocab]``."""
        p = self.params
        if p.temperature <= 0 or p.top_k == 1:
            return int(torch.argmax(logits))
        logits = logits.float() / p.temperature
        if p.top_k > 0:
            k = min(p.top_k, logits.shape[-1])
            values, indices = torch.topk(logits, k)
        else:
            values, indices = torch.sort(logits, descending=True)
        probs = torch.softmax(values, dim=-1)
        if p.top_p < 1.0:
            cumulative = torch.cumsum(probs, dim=-1)
            keep = cumulative - probs < p.top_p  # always keeps the most likely token
            probs = torch.where(keep, probs, torch.zeros_like(probs))
        choice = torch.multinomial(probs, 1, generator=self.generator)
        return int(indices[choice])
