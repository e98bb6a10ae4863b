"""Choosing the next token from logits, for one sequence.

The logits go through these steps, in this order, each skipped at its default:

1. ``logit_bias``: each ``(token id, bias)`` added (OpenAI's ``logit_bias``; -100 in
   effect bans a token);
2. ``frequency_penalty`` / ``presence_penalty``: OpenAI's definition,
   ``logit[j] -= count[j] * frequency + (count[j] > 0) * presence``, where ``count`` counts
   the *generated* tokens only (the prompt is not penalised);
3. ``repetition_penalty`` (Keskar et al., "CTRL", 2019, as Hugging Face's
   ``RepetitionPenaltyLogitsProcessor`` applies it): a token seen in the prompt or the
   output has its logit divided by the penalty when positive, multiplied when negative;
   ``repeat_last_n`` > 0 looks at the last that many tokens (prompt and output) only;
4. the grammar's mask (:mod:`shardline.runner.constraint`): tokens the grammar forbids
   get -inf;
5. ``min_p`` (Nguyen et al., "Turning Up the Heat: Min-p Sampling", 2024): tokens less
   likely than ``min_p`` times the most likely one are dropped; applied to the logits
   before the temperature, as llama.cpp's default chain does;
6. temperature 0 (or top-k 1, or top-p 0): the argmax; otherwise temperature, top-k, then top-p
   (Holtzman et al., "The Curious Case of Neural Text Degeneration", 2019: keep the
   smallest set of most likely tokens whose probabilities sum to at least p; top-p 0
   keeps the most likely token alone) and a draw from the sequence's own generator.

With every field at its default the logits are not touched (not even copied), so greedy
output is bit-identical to the plain argmax.

Log-probabilities (``logprobs``) are the log-softmax of the model's float32 logits as
they come out of the LM head, *before* any of the steps above (so they describe the
model, not the sampler; OpenAI's are likewise those of the model's distribution).

Per-token counts for the penalties are kept incrementally (O(1) per token: :class:`Tally`),
never recounted from the history, and only the logits of the tokens seen are touched.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from shardline.runner.protocol import SamplingParams

#: Most ``top_logprobs`` a token carries (OpenAI's limit).
MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class Choice:
    """A sampled token and, when asked for, its log-probability and the ``k`` most likely
    tokens' ``(token id, log-probability)``, most likely first (natural log)."""

    token: int
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] = ()


class Mask(Protocol):
    """What a sampler needs of a grammar constraint (:class:`shardline.runner.constraint.Constraint`)."""

    def apply(self, logits: torch.Tensor) -> None:
        """Set the logits ``[vocab]`` of forbidden tokens to -inf, in place."""

    def consume(self, token: int) -> None:
        """Advance past the sampled ``token``."""


# -- processors (pure functions on one row of float32 logits) -----------------------------


def apply_logit_bias(logits: torch.Tensor, bias: tuple[tuple[int, float], ...]) -> torch.Tensor:
    """``logits`` ``[vocab]`` with each ``(token id, bias)`` added (in place; returned).
    Ids outside the vocabulary are ignored (the API checks them against the tokenizer)."""
    vocab = logits.shape[-1]
    pairs = [(t, b) for t, b in bias if 0 <= t < vocab]
    if pairs:
        ids = torch.tensor([t for t, _ in pairs], dtype=torch.long, device=logits.device)
        values = torch.tensor([b for _, b in pairs], dtype=logits.dtype, device=logits.device)
        logits.index_add_(0, ids, values)
    return logits


def apply_frequency_presence(
    logits: torch.Tensor, ids: torch.Tensor, counts: torch.Tensor, frequency: float, presence: float
) -> torch.Tensor:
    """OpenAI's penalties, ``logit[j] -= count[j] * frequency + (count[j] > 0) * presence``,
    for the generated tokens ``ids`` (int64 ``[n]``, distinct) with their ``counts``
    (float32 ``[n]``, each > 0); the other logits (count 0) are unchanged. In place;
    returned. Only the seen tokens are touched: O(n), not O(vocab)."""
    logits[ids] = logits[ids] - (counts * frequency + presence)
    return logits


def apply_repetition_penalty(logits: torch.Tensor, ids: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL's rule for the seen tokens ``ids`` (int64 ``[n]``, distinct): a positive logit
    divided by ``penalty``, a negative one multiplied (so ``penalty`` > 1 always makes them
    less likely); the others unchanged. In place; returned."""
    seen = logits[ids]
    logits[ids] = torch.where(seen > 0, seen / penalty, seen * penalty)
    return logits


def apply_min_p(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """``logits`` with tokens whose probability is below ``min_p`` times the most likely
    token's set to -inf (``p_i / p_max = exp(l_i - l_max)``, so the cut is in logit
    space: no softmax). ``min_p`` in (0, 1]; the most likely token is always kept."""
    cut = torch.max(logits) + math.log(min_p)
    return logits.masked_fill(logits < cut, float("-inf"))


def token_logprobs(logits: torch.Tensor, token: int, k: int) -> tuple[float, tuple[tuple[int, float], ...]]:
    """The log-probability of ``token`` and the ``k`` most likely ``(id, log-probability)``
    (at most :data:`MAX_TOP_LOGPROBS`), from the log-softmax of float32 ``logits``."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    k = min(k, MAX_TOP_LOGPROBS, logprobs.shape[-1])
    top: tuple[tuple[int, float], ...] = ()
    if k > 0:
        values, ids = torch.topk(logprobs, k)
        top = tuple(zip(ids.tolist(), values.tolist()))
    return float(logprobs[token]), top


# -- per-sequence state -------------------------------------------------------------------


class Tally:
    """Counts of tokens in a vocabulary of ``vocab``, and the distinct tokens counted, both
    kept up to date in O(1) a token: a dense float32 count per token and the ids with a
    count > 0 in a buffer (a token whose count falls to 0 swaps with the last)."""

    def __init__(self, vocab: int) -> None:
        self.counts = np.zeros(vocab, dtype=np.float32)
        self._ids = np.zeros(64, dtype=np.int64)
        self._where: dict[int, int] = {}

    def start(self, tokens: tuple[int, ...]) -> None:
        """Count ``tokens`` into an empty tally at once (vectorised: a long prompt)."""
        vocab = self.counts.shape[0]
        array = np.asarray(tokens, dtype=np.int64)
        array = array[(array >= 0) & (array < vocab)]
        self.counts = np.bincount(array, minlength=vocab).astype(np.float32)
        ids = np.flatnonzero(self.counts)
        self._ids = np.zeros(max(64, 2 * ids.shape[0]), dtype=np.int64)
        self._ids[: ids.shape[0]] = ids
        self._where = dict(zip(ids.tolist(), range(ids.shape[0])))

    def add(self, token: int) -> None:
        if not 0 <= token < self.counts.shape[0]:
            return  # not a token of the logits (the API checks ids against the tokenizer)
        if self.counts[token] == 0:
            n = len(self._where)
            if n == self._ids.shape[0]:
                self._ids = np.resize(self._ids, 2 * n)
            self._ids[n] = token
            self._where[token] = n
        self.counts[token] += 1

    def remove(self, token: int) -> None:
        if not 0 <= token < self.counts.shape[0] or self.counts[token] == 0:
            return
        self.counts[token] -= 1
        if self.counts[token] == 0:
            at = self._where.pop(token)
            last = len(self._where)
            if at != last:
                moved = int(self._ids[last])
                self._ids[at] = moved
                self._where[moved] = at

    def ids(self) -> np.ndarray:
        """The distinct tokens counted (int64, a view: read before the next change)."""
        return self._ids[: len(self._where)]


class TokenCounts:
    """How often each token occurs, for the penalties: ``generated`` counts the output
    (frequency and presence penalties), ``window`` the prompt and the output, or their last
    ``last_n`` tokens when ``last_n`` > 0 (repetition penalty). The prompt is counted once
    (O(prompt)); each generated token after that is O(1)."""

    def __init__(self, vocab: int, prompt: tuple[int, ...], last_n: int) -> None:
        self.last_n = last_n
        self.generated = Tally(vocab)
        self.window = Tally(vocab)
        tokens = prompt[-last_n:] if last_n > 0 else prompt
        self.window.start(tokens)
        self.recent: deque[int] = deque(tokens if last_n > 0 else ())

    def add(self, token: int) -> None:
        """Count a generated token."""
        self.generated.add(token)
        self.window.add(token)
        if self.last_n > 0:
            self.recent.append(token)
            if len(self.recent) > self.last_n:
                self.window.remove(self.recent.popleft())


class Sampler:
    """Samples one sequence's tokens (the module docstring gives the steps); its own
    generator makes a seeded request reproducible whatever else runs in the same batch.

    A continuation (``params.resumed`` > 0: the prompt ends with output already given)
    starts in the state the sampler had after that output: those tokens are counted as
    generated, the generator has drawn once for each (a non-greedy token is one draw:
    :func:`draw`), the constraint has consumed them. A seeded sample so goes on as it
    would have.

    Args:
        params: the sequence's sampling parameters.
        prompt: its prompt's token ids (counted for the repetition penalty).
        constraint: its grammar's mask, or None.
    """

    def __init__(self, params: SamplingParams, prompt: tuple[int, ...] = (), constraint: Mask | None = None) -> None:
        self.params = params
        self.constraint = constraint
        self.generator = None
        resumed = min(max(params.resumed, 0), len(prompt))
        if not params.greedy:
            self.generator = torch.Generator()
            seed = params.seed if params.seed is not None else self.generator.seed()
            self.generator.manual_seed(seed % (2**63))
            for _ in range(resumed):  # the draws of the output already given
                torch.rand((), generator=self.generator, dtype=torch.float64)
        self.penalised = (
            params.frequency_penalty != 0 or params.presence_penalty != 0 or params.repetition_penalty != 1.0
        )
        self.prompt = prompt[: len(prompt) - resumed]
        self.resumed = prompt[len(prompt) - resumed :]  # output already given
        if constraint is not None:
            for token in self.resumed:
                constraint.consume(token)
        self.counts: TokenCounts | None = None  # made at the first token (the vocabulary's size)
        self.processed = self.penalised or bool(params.logit_bias) or constraint is not None

    def sample(self, logits: torch.Tensor) -> int:
        """Pick a token id from float32 logits ``[vocab]`` (left untouched)."""
        return self.choose(logits).token

    def choose(self, logits: torch.Tensor) -> Choice:
        """Pick a token from float32 logits ``[vocab]`` (left untouched), with its
        log-probabilities when the params ask for them; counts it. Logits on a GPU are
        copied to the CPU first unless the sampling is the plain argmax (which stays
        where it is: today's path)."""
        p = self.params
        if logits.device.type != "cpu" and (self.processed or p.logprobs is not None or not p.greedy):
            logits = logits.cpu()  # the counts, masks and generator are on the CPU
        x = self.process(logits) if self.processed else logits
        token = self._pick(x)
        if self.penalised:
            self._counts(logits.shape[-1]).add(token)
        if self.constraint is not None:
            self.constraint.consume(token)
        if p.logprobs is None:
            return Choice(token)
        logprob, top = token_logprobs(logits, token, p.logprobs)
        return Choice(token, logprob, top)

    def process(self, logits: torch.Tensor) -> torch.Tensor:
        """Steps 1-4 of the module docstring on a float32 copy of ``logits``."""
        p = self.params
        x = logits.float().clone()
        if p.logit_bias:
            x = apply_logit_bias(x, p.logit_bias)
        if self.penalised:
            counts = self._counts(x.shape[-1])
            if p.frequency_penalty or p.presence_penalty:
                generated = counts.generated
                ids = generated.ids()
                if ids.shape[0]:
                    x = apply_frequency_presence(
                        x,
                        torch.from_numpy(ids.copy()),
                        torch.from_numpy(generated.counts[ids]),
                        p.frequency_penalty,
                        p.presence_penalty,
                    )
            if p.repetition_penalty != 1.0:
                ids = counts.window.ids()
                if ids.shape[0]:
                    x = apply_repetition_penalty(x, torch.from_numpy(ids.copy()), p.repetition_penalty)
        if self.constraint is not None:
            self.constraint.apply(x)
        return x

    def _counts(self, vocab: int) -> TokenCounts:
        """The penalties' counts, made at the first token (the vocabulary's size): the
        prompt's, and the output already given (a continuation's) as generated."""
        if self.counts is None:
            self.counts = TokenCounts(vocab, self.prompt, self.params.repeat_last_n)
            for token in self.resumed:
                self.counts.add(token)
        return self.counts

    def _pick(self, logits: torch.Tensor) -> int:
        p = self.params
        if p.greedy:
            if logits.device.type == "cpu":
                # numpy's argmax is vectorized: 8 us for SmolLM2's 49,152 logits where
                # torch.argmax took 150 us (2-core Sapphire Rapids VM), a step's 8 rows
                # 1.2 ms. Both take the first of equal maxima, NaN counted largest.
                return int(logits.numpy().argmax())
            return int(torch.argmax(logits))
        if 0 < p.min_p <= 1:
            logits = apply_min_p(logits.float(), p.min_p)
        logits = logits.float() / p.temperature
        if p.top_k > 0:
            values, indices = torch.topk(logits, min(p.top_k, logits.shape[-1]))  # sorted
            probs = torch.softmax(values, dim=-1)
            if p.top_p < 1.0:
                keep = torch.cumsum(probs, dim=-1) - probs < p.top_p  # keeps the most likely (top_p > 0 here)
                probs, indices = probs[keep], indices[keep]
            return int(indices[draw(probs, self.generator)])
        if p.top_p < 1.0:
            probs, indices = nucleus(logits, p.top_p)
            return int(indices[draw(probs, self.generator)])
        return draw(torch.softmax(logits, dim=-1), self.generator)


NUCLEUS_CANDIDATES = 256
"""Most likely tokens :func:`nucleus` looks among first (8 times as many, up to the whole
vocabulary, when their probabilities sum to less than ``top_p``)."""


def nucleus(logits: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-p's kept tokens of float32 ``logits`` ``[vocab]`` (temperature applied): the
    smallest set of most likely tokens whose probabilities sum to at least ``top_p`` (in
    (0, 1); Holtzman et al. 2019), as ``(probabilities float64 [kept], token ids int64
    [kept])``, most likely first; the probabilities are of the whole distribution (not
    renormalised). The most likely token is always kept.

    It sorts only the :data:`NUCLEUS_CANDIDATES` most likely tokens (``torch.topk``) when
    they cover ``top_p``, which a model's nucleus almost always is: a full sort of
    SmolLM2's 49,152 logits took 6.4 ms a token (2-vCPU Sapphire Rapids VM), the top 256
    about 0.3 ms."""
    vocab = logits.shape[-1]
    total = torch.logsumexp(logits.double(), dim=-1)
    k = min(NUCLEUS_CANDIDATES, vocab)
    while True:
        values, indices = torch.topk(logits, k)  # most likely first
        probs = torch.exp(values.double() - total)
        cumulative = torch.cumsum(probs, dim=-1)
        if k == vocab or cumulative[-1] >= top_p:  # every later token starts past top_p
            break
        k = min(8 * k, vocab)
    keep = cumulative - probs < top_p
    return probs[keep], indices[keep]


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """An index drawn with probability proportional to ``probs`` (``[n]``, non-negative,
    any float dtype, at least one positive, need not sum to 1), from one uniform number of
    ``generator`` (None: torch's global one): inverse transform sampling over the float64
    cumulative sum, so no sort is needed (``torch.multinomial`` over SmolLM2's 49,152
    probabilities took 2.2 ms a token, this about 0.2 ms). A zero-probability index is
    never drawn."""
    cumulative = torch.cumsum(probs.double(), dim=-1)
    target = torch.rand((), generator=generator, dtype=torch.float64) * cumulative[-1]
    index = int(torch.searchsorted(cumulative, target, right=True))
    if index >= len(cumulative):  # u * total rounded up to the total: the last positive one
        index = int(torch.nonzero(probs).flatten()[-1])
    return index
