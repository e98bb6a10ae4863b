"""A lockstep step's plan as a value (vLLM v1's ``SchedulerOutput`` is the model): which
waiting tasks start (:func:`~shardline.runner.prefix_cache.plan_admission`), which
sequences decode a token, which prefill chunks run, and, once the step's tokens are
agreed, which sampled sequences finish and why (:func:`finish_reason`).

Everything here is a pure function of state every rank of an instance holds alike, so each
rank plans the same step and makes the same collective calls in the same order; the
engine (:class:`~shardline.runner.engine.Engine`) only carries the plan out.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

from shardline.models.llama import FUSED_PREFILL_MAX_ROWS
from shardline.models.native_dequant import AMX_PREFILL_MIN_ROWS
from shardline.runner.prefix_cache import (
    Admission,
    CachedPrefix,
    Extension,
    Waiting,
    plan_admission,
    plan_extension,
    row_class,
)


@dataclass(frozen=True, slots=True)
class SequenceState:
    """A sequence as a step's plan sees it: its prompt's length, the prompt tokens
    prefilled, the tokens generated so far, its limits, whether its prompt is scored
    (``prompt_logprobs``: its chunks give every row's hidden state), ``replay``: its
    prompt's last tokens that are output a stream already gave (a continuation's,
    ``SamplingParams.resumed``), prefilled as decode steps compute them
    (:func:`prefill_plan`), and ``draft``: the tokens it guesses follow its next one
    (:mod:`~shardline.runner.speculation`), checked in this step's decode rows."""

    prompt_len: int
    prefilled: int = 0
    generated: int = 0
    max_tokens: int = 1
    stop_token_ids: tuple[int, ...] = ()
    scored: bool = False
    replay: int = 0
    draft: tuple[int, ...] = ()

    @property
    def decoding(self) -> bool:
        """Its prompt is prefilled and it has generated a token: it decodes the next."""
        return self.prefilled >= self.prompt_len and self.generated > 0


@dataclass(frozen=True, slots=True)
class Chunk:
    """A prefill chunk of a step: prompt tokens ``start .. start + length - 1`` of the
    plan's sequence ``seq``; ``last``: it ends the prompt (its last row is sampled)."""

    seq: int
    start: int
    length: int
    last: bool
    scored: bool = False

    @property
    def want_logits(self) -> bool:
        """Its micro-batch gives logits (its last row's, or a scored prompt's every row's
        hidden state)."""
        return self.last or self.scored

    @property
    def every_row(self) -> bool:
        """Every row's final-norm hidden state, not one row's logits (a scored prompt)."""
        return self.scored


@dataclass(frozen=True, slots=True)
class StepLimits:
    """The engine's settings a step's plan reads: the context (tokens per sequence), the
    prefill chunk, the KV block, the prompt tokens prefilled per step while others
    decode (``step_tokens``) and while none does (``burst_tokens``), ``stages``: the
    micro-batches the instance computes at once (a pipeline's stages that can, its world
    size or fewer where ranks share a machine's cores:
    :meth:`~shardline.parallel.pipeline.PipelineStage.stages_at_once`; else 1;
    :func:`fill_stages`), ``rows_apart``: every rank computes a prefill row's bits
    apart from the rows beside it (:func:`prefill_plan`'s ``rows_apart``), and ``batch``:
    the most sequences running at once (None: as many as the free slots take)."""

    context: int
    chunk: int
    block: int
    step_tokens: int
    burst_tokens: int
    stages: int = 1
    rows_apart: bool = False
    batch: int | None = None


@dataclass(frozen=True)
class StepPlan:
    """One step: the tasks admitted (``admission``, indices among the waiting), the
    step's sequences (the running ones, then the admitted ones in admission order: the
    engine's running list after admission), the sequences that decode (``decode``,
    indices into ``seqs``, one micro-batch of a row each) and the prefill chunks (one
    micro-batch each, after the decode one); in a step where none runs, ``extension``: a
    cached prefix's chunk (:func:`~shardline.runner.prefix_cache.plan_extension`)."""

    admission: Admission
    seqs: tuple[SequenceState, ...]
    decode: tuple[int, ...]
    chunks: tuple[Chunk, ...]
    context: int
    extension: Extension | None = None

    @property
    def first_chunk(self) -> int:
        """The micro-batch index of the first prefill chunk (after the decode one)."""
        return 1 if self.decode else 0

    @property
    def micro_batches(self) -> int:
        return self.first_chunk + len(self.chunks)

    @property
    def sampled(self) -> tuple[int, ...]:
        """The sequences sampled after the step, in the order their logits come: those
        that decode, then those whose prompt a chunk ends."""
        return self.decode + tuple(c.seq for c in self.chunks if c.last)

    @property
    def sampled_ids(self) -> int:
        """Token ids the step's exchange carries: per sampled sequence one, and one per
        token of a decoding sequence's draft (the ids it takes, then -1s)."""
        return sum(1 + len(self.seqs[i].draft) for i in self.sampled)

    def outcomes(self, ids: Sequence[int]) -> tuple[tuple[tuple[int, ...], str | None], ...]:
        """Per sampled sequence (:attr:`sampled`), the tokens it takes of the step's agreed
        ``ids`` (:attr:`sampled_ids` of them: its own, -1 past those it takes) and why it
        ends after them (:func:`finish_reason`; None: it goes on): at most to its first
        token that ends it."""
        out = []
        at = 0
        for s in (self.seqs[i] for i in self.sampled):
            mine = [t for t in ids[at : at + 1 + len(s.draft)] if t >= 0]
            at += 1 + len(s.draft)
            taken: list[int] = []
            finish = None
            for token in mine:
                taken.append(token)
                finish = finish_reason(
                    token, s.generated + len(taken), s.prompt_len, s.stop_token_ids, s.max_tokens, self.context
                )
                if finish is not None:
                    break
            out.append((tuple(taken), finish))
        return tuple(out)


def finish_reason(
    token: int, generated: int, prompt_len: int, stop_token_ids: Sequence[int], max_tokens: int, context: int
) -> str | None:
    """Why a sequence ends after it generated ``token`` (its ``generated``-th token):
    ``"stop"`` for one of its stop tokens (which it emits), ``"length"`` at ``max_tokens``
    generated or a full context (prompt and generated tokens), else None."""
    if token in stop_token_ids:
        return "stop"
    if generated >= max_tokens:
        return "length"
    if prompt_len + generated >= context:
        return "length"
    return None


def prefill_plan(
    prompts: list[tuple[int, int]], chunk: int, budget: int, replays: Sequence[int] = (), rows_apart: bool = False
) -> list[tuple[int, int, int]]:
    """A step's prefill chunks ``(index of the prompt, start, length)``, oldest prompt
    first, whole chunks up to ``budget`` prompt tokens (at least one chunk), cut at
    multiples of ``chunk`` (a prompt resumed from a cached prefix is cut where its cold
    prefill is). ``prompts``: per sequence, (prompt tokens, tokens prefilled).

    With ``rows_apart`` (every rank computes each prefill row's bits apart from the rows
    beside it, given the :func:`~shardline.runner.prefix_cache.row_class` it is computed
    in: the compiled prefill attention, no mixture of experts), a prompt resumed inside a
    chunk is not cut at that chunk's end where the rest of the chunk and the next one, the
    prompt's short last, make at most ``chunk`` rows of one class: one piece, computed as
    the chunk it starts in, gives each row the bits of the two (a 1.5B Q4_K_M model on 2
    vCPUs, 296 new rows after 2,039 cached: 1,043-1,062 -> 978-1,010 ms, the 9-row piece
    to the chunk's end having cost as much as a forward's dequantized weights).

    ``replays[i]`` (0 where absent): prompt i's last tokens are output already given (a
    continuation's): its chunks end where they begin, and they are cut in pieces of at
    most :data:`~shardline.models.llama.FUSED_PREFILL_MAX_ROWS` (and ``chunk``), which
    the compiled decode layers compute row by row as decode steps do, so their keys,
    values and the next token's logits have the bits the interrupted stream's decode
    gave them (where those layers run the shard: the CPU)."""
    plan: list[tuple[int, int, int]] = []
    for index, (total, start) in enumerate(prompts):
        given = total - (replays[index] if index < len(replays) else 0)  # where the replay starts
        while start < total:
            if start < given:
                length = min(chunk - start % chunk, given - start)
                after = min(chunk, given - start - length)  # the next cold chunk's rows
                if (
                    rows_apart
                    and start % chunk
                    and 0 < after <= chunk - length
                    and row_class(after) == row_class(chunk)
                ):
                    length += after
            else:
                length = min(FUSED_PREFILL_MAX_ROWS, chunk, total - start)
            if plan and length > budget:
                return plan
            plan.append((index, start, length))
            budget -= length
            start += length
    return plan


def fill_stages(planned: list[tuple[int, int, int]], busy: int, stages: int) -> list[tuple[int, int, int]]:
    """``planned`` (:func:`prefill_plan`'s chunks) with chunks cut in pieces of at least
    :data:`AMX_PREFILL_MIN_ROWS` rows until the step has ``stages`` micro-batches (``busy``
    of them not prefill: the decode rows'), where its chunks allow: a pipeline of P
    stages computes a step of W micro-batches in about W + P - 1 stage times
    (:mod:`shardline.parallel.pipeline`), so a prompt's one chunk cut in P pieces keeps
    every stage busy instead of one at a time. Each cut goes to the chunk whose pieces
    are longest; a chunk's pieces differ by at most a row.

    The pieces' rows have the bits of the whole chunk's: each piece is computed as its
    chunk (:func:`~shardline.runner.prefix_cache.window_rows`), and its attention reads
    the same keys (:func:`~shardline.parallel.stage.span_keys`, where the prefix cache is
    on). Pieces of fewer rows (65 or more, for three micro-batches) were no faster.

    SmolLM2-135M Q4_1 on a 3-node pipeline of a 2-vCPU VM, a conversation's last turn
    (227 new tokens after 2,079 cached): 761 ms to its first token in one micro-batch,
    see ``docs/performance.md`` for it cut in pieces."""
    pieces = [1] * len(planned)
    while busy + sum(pieces) < stages and planned:
        longest = max(range(len(planned)), key=lambda i: planned[i][2] / pieces[i])
        if planned[longest][2] // (pieces[longest] + 1) < AMX_PREFILL_MIN_ROWS:
            break
        pieces[longest] += 1
    out = []
    for (index, start, length), n in zip(planned, pieces):
        for k in range(n):
            size = length // n + (k < length % n)
            out.append((index, start, size))
            start += size
    return out


def schedule(seqs: Sequence[SequenceState], limits: StepLimits) -> tuple[tuple[int, ...], tuple[Chunk, ...]]:
    """The step's decode rows (every sequence that decodes) and prefill chunks
    (:func:`prefill_plan`, its budget ``step_tokens`` where a sequence decodes, else
    ``burst_tokens``; cut further for a pipeline's stages by :func:`fill_stages`, a
    scored prompt's chunks excepted)."""
    decode = tuple(i for i, s in enumerate(seqs) if s.decoding)
    budget = limits.step_tokens if decode else limits.burst_tokens
    planned = prefill_plan(
        [(s.prompt_len, s.prefilled) for s in seqs], limits.chunk, budget, [s.replay for s in seqs], limits.rows_apart
    )
    if limits.stages > 1 and not any(seqs[i].scored for i, _, _ in planned):
        planned = fill_stages(planned, 1 if decode else 0, limits.stages)
    chunks = tuple(
        Chunk(i, start, length, start + length == seqs[i].prompt_len, seqs[i].scored) for i, start, length in planned
    )
    return decode, chunks


SPECULATE_MAX_BATCH = 2
"""Most sequences decoding in a step for it to carry drafts (vLLM's
``speculative_disable_by_batch_size``): a wider batch already fills the step's products,
and a draft not taken is work the others wait for. SmolLM2 on a 3-node pipeline of a
2-vCPU VM, four requests at once, drafts on: aggregate decode 302 -> 272 tokens/s (128-token
prompts) and 177 -> 148 (512); alone 143 -> 145 and 131 -> 308 (docs/performance.md)."""


def draft_room(decoding: int, max_rows: int) -> int:
    """Drafted tokens a step where ``decoding`` sequences decode may carry, all of them
    together: its decode rows are at most ``max_rows``, and none where more than
    :data:`SPECULATE_MAX_BATCH` decode."""
    return max_rows - decoding if decoding <= SPECULATE_MAX_BATCH else 0


def cap_drafts(seqs: Sequence[SequenceState], max_rows: int) -> tuple[SequenceState, ...]:
    """``seqs`` with their drafts cut, oldest sequence's first served, so that the step's
    decode rows (one per decoding sequence and one per drafted token) are at most
    ``max_rows``: past that the decode step takes other kernels, whose bits differ. Where
    more than :data:`SPECULATE_MAX_BATCH` sequences decode, none drafts."""
    room = draft_room(sum(1 for s in seqs if s.decoding), max_rows)
    out = []
    for s in seqs:
        take = max(0, min(len(s.draft), room))
        room -= take
        out.append(s if take == len(s.draft) else replace(s, draft=s.draft[:take]))
    return tuple(out)


def plan_step(
    running: Sequence[SequenceState],
    waiting: Sequence[SequenceState],
    wants: Sequence[Waiting],
    free_slots: list[int],
    cached: list[CachedPrefix],
    free_tokens: int,
    limits: StepLimits,
) -> StepPlan:
    """Plan a step: admit waiting tasks (``waiting``, as admission sees them: ``wants``)
    into the free and cached slots and the free pool tokens
    (:func:`~shardline.runner.prefix_cache.plan_admission`; each starts prefilled to the
    tokens it reuses), then :func:`schedule` the running and the admitted sequences; where
    none runs or waits, extend a cached prefix
    (:func:`~shardline.runner.prefix_cache.plan_extension`)."""
    admission = Admission((), ())
    if wants:
        room = None if limits.batch is None else max(0, limits.batch - len(running))
        admission = plan_admission(list(wants), free_slots, cached, free_tokens, limits.chunk, limits.block, room)
    seqs = tuple(running) + tuple(replace(waiting[s.index], prefilled=s.reused) for s in admission.starts)
    decode, chunks = schedule(seqs, limits)
    extension = None
    if not running and not waiting:
        extension = plan_extension(cached, free_tokens, limits.chunk, limits.block)
    return StepPlan(admission, seqs, decode, chunks, limits.context, extension)
