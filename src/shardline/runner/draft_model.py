"""Speculative decoding's drafts from a draft model: a small model of the target's
tokenizer, held whole on the instance's sampling rank beside its shard, guesses each
decoding sequence's next tokens greedily (llama.cpp's ``--model-draft``, vLLM's draft
model proposer; Leviathan et al. 2023, "Fast Inference from Transformers via Speculative
Decoding", arXiv:2211.17192). The guesses are checked as prompt lookup's are
(:mod:`shardline.runner.speculation`): the step's rows carry them, the sampling rank takes
the tokens decoding would have given, so the text is the text without drafts.

Unlike prompt lookup's, these drafts are not a function of the agreed tokens every rank
holds: only the sampling rank computes them, and they reach the other ranks in the step's
exchange, after the sampled ids (:meth:`Engine._sample_and_advance
<shardline.runner.engine.Engine._sample_and_advance>`), as :data:`NO_TOKEN`-padded rows of
a sequence's ``k`` (:class:`ModelDrafts`).
"""

from __future__ import annotations

import torch

from shardline.models.kv_cache import KVCache
from shardline.models.llama import DecoderShard
from shardline.runner.speculation import accepted

P_MIN = 0.0
"""A draft ends before its first guess the draft model gives less probability than this,
where a request names no ``speculative.p_min``: none (llama.cpp's default since it
drafts :data:`~shardline.runner.speculation.DRAFT_MODEL_TOKENS` tokens; 0.75 before).
With a draft model that guesses well the doubted guesses are taken too: SmolLM2 in
bfloat16 drafted by its Q4_1 file, 1 node, chat: 1.14x decode at 0.75 and 16 tokens
(most steps drafted nothing), 1.97x at 0 and 3."""

NO_TOKEN = -1
"""A draft's place past its end in the exchange."""


def common_prefix(a: list[int], b: list[int]) -> int:
    """Tokens ``a`` and ``b`` begin with alike (list slices compared, so a prompt of
    thousands of tokens takes microseconds, not a Python loop over it)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    low, high = 0, n - 1  # a[:low] == b[:low]; a[:high + 1] != b[:high + 1]
    while low < high:
        mid = (low + high + 1) // 2
        if a[:mid] == b[:mid]:
            low = mid
        else:
            high = mid - 1
    return low


class DraftModel:
    """The draft model of an instance, on its sampling rank: a whole-model
    :class:`~shardline.models.llama.DecoderShard` and a KV cache of its own with the
    engine's slots (a sequence drafts in its slot).

    Each slot remembers the tokens whose keys and values it holds; a draft computes only
    the sequence's tokens past those it shares with them (the last step's taken tokens,
    or after a new prompt in the slot, that prompt past what it shares with the slot's
    last one: a conversation's next turn, or a cached prefix, computes its new part). A
    refused draft's keys and values are overwritten where the text goes on.

    Args:
        shard: the draft model, every layer (embedding and head).
        cache: its KV cache: ``slots`` as the engine's, ``context`` at least the
            instance's.
        chunk: most tokens a forward computes at once while it catches up (the
            instance's prefill chunk).
        vocab: the target's vocabulary size: a draft ends before an id the target has no
            row for (a draft model's vocabulary may be padded further).
    """

    def __init__(self, shard: DecoderShard, cache: KVCache, chunk: int, vocab: int) -> None:
        self.shard = shard
        self.cache = cache
        self.chunk = chunk
        self.vocab = vocab
        self.positions = int(cache.k[0].shape[2])
        self.held: dict[int, list[int]] = {}  # slot -> tokens whose keys and values it holds

    def extend(self, slot: int, tokens: list[int]) -> None:
        """Compute the keys and values of ``tokens`` (the sequence so far) past those the
        slot holds of them: called as the target's prefill chunks end, so a prompt's
        first draft does not compute the whole prompt at once."""
        self._catch_up(slot, tokens, len(tokens))

    def draft(self, slot: int, tokens: list[int], k: int, p_min: float = P_MIN) -> list[int]:
        """Up to ``k`` tokens the draft model guesses follow ``tokens`` (the sequence so
        far, prompt and output) greedily, ending before its first guess of probability
        under ``p_min`` or where its cache ends; none for ``k`` < 1."""
        n = len(tokens)
        k = min(k, self.positions - n)
        if k < 1 or n < 1:
            return []
        logits = self._catch_up(slot, tokens, n - 1)  # the last token is fed: its logits
        assert logits is not None
        out: list[int] = []
        fed = self.held[slot]  # the tokens its keys and values hold, each guess fed appended
        while True:
            best = torch.softmax(logits[-1].float(), dim=-1).max(dim=-1)
            token = int(best.indices)
            if float(best.values) < p_min or token >= self.vocab:
                break
            out.append(token)
            if len(out) == k:
                break
            batch = self.shard.decode_batch([slot], [len(fed)])
            logits = self.shard(torch.tensor([token], dtype=torch.long, device=self.shard.device), batch, self.cache)
            fed.append(token)
        return out

    def _catch_up(self, slot: int, tokens: list[int], most: int) -> torch.Tensor | None:
        """Compute ``tokens``' keys and values from the first the slot does not hold (at
        most from ``most``) to their end, :attr:`chunk` at a time; the slot then holds
        ``tokens``. Returns the last token's float32 logits ``[1, vocab]`` where any was
        computed."""
        start = min(common_prefix(self.held.get(slot, []), tokens), most)
        n, logits = len(tokens), None
        while start < n:
            length = min(self.chunk, n - start)
            batch = self.shard.prefill_batch(slot, start, length, want_logits=start + length == n)
            ids = torch.tensor(tokens[start : start + length], dtype=torch.long, device=self.shard.device)
            logits = self.shard(ids, batch, self.cache)
            start += length
        self.held[slot] = list(tokens)
        return logits

    def copy(self, source: int, slot: int, tokens: int) -> None:
        """``slot`` takes the keys and values of ``source``'s first ``tokens`` positions, as
        the engine's slot does (a cached prefix another sequence shares,
        :meth:`KVCache.copy <shardline.models.kv_cache.KVCache.copy>`)."""
        held = self.held.get(source, [])[:tokens]
        self.cache.copy(source, slot, len(held))
        self.held[slot] = held

    def release(self, slot: int, keep: int = 0) -> None:
        """``slot``'s keys and values past its first ``keep`` positions are not needed (the
        engine's slot ended, or keeps a cached prefix of ``keep`` tokens): their memory
        goes back to the system (:meth:`KVCache.release
        <shardline.models.kv_cache.KVCache.release>`)."""
        self.cache.release(slot, keep)
        if keep:
            self.held[slot] = self.held.get(slot, [])[:keep]
        else:
            self.held.pop(slot, None)


class ModelDrafts:
    """A sequence's drafts where its instance has a draft model: the tokens the sampling
    rank drafted after the step that gave its last token (:meth:`DraftModel.draft`),
    shared in that step's exchange, on every rank alike.

    ``k``: the most it drafts a step (the exchange carries ``k`` places for it)."""

    def __init__(self, k: int) -> None:
        self.k = k
        self.pending: tuple[int, ...] = ()

    def draft(self, room: int) -> tuple[int, ...]:
        """The next draft, at most ``room`` tokens."""
        return self.pending[: max(room, 0)]

    def took(self, drafted: int, tokens: list[int] | tuple[int, ...]) -> int:
        """A step checked the first ``drafted`` tokens of the pending draft and the
        sequence took ``tokens``; returns how many of the draft it took. The next draft
        comes with the exchange (:meth:`received`)."""
        taken = accepted(self.pending[:drafted], tokens)
        self.pending = ()
        return taken

    def received(self, places: list[int]) -> None:
        """The exchange's ``k`` places for it: its next draft, :data:`NO_TOKEN` past its end."""
        self.pending = tuple(t for t in places if t != NO_TOKEN)
