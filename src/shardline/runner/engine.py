"""The engine loop every rank of an instance runs in lockstep.

Each step:

1. drain the inbox (tasks and cancellations that reached this rank);
2. unless the last step already did (step 5), agree with the other ranks on which tasks
   start and which are cancelled (:mod:`shardline.runner.agreement`); agreed tasks queue
   in task-id order;
3. admit queued tasks, in order, while a KV-cache slot is free and the KV pool has the
   blocks a task reserves (:func:`kv_reservation`; continuous batching); a task whose
   prompt starts with a finished sequence's cached prompt takes that slot and prefills
   only the rest, and cached slots are evicted, least recently used, for tasks that need
   the room (:mod:`shardline.runner.prefix_cache`);
4. run the step's micro-batches: one decode token for every sequence that is generating,
   then prefill chunks of the sequences still prefilling, oldest first, up to a budget of
   prompt tokens (chunks cut at multiples of ``prefill_chunk`` tokens, so a prompt is cut
   at the same positions whatever else runs, and whatever part of it was cached). The
   budget is smaller while other sequences decode (``prefill_step_tokens``), bounding
   how long prompts delay their next token, and larger when none does, so a pipeline's
   stages overlap many chunks (:mod:`shardline.parallel.pipeline`). A step with nothing
   running or waiting computes a chunk of a cached prefix's generated tokens instead, so a
   conversation's next turn finds its last answer cached too
   (:func:`~shardline.runner.prefix_cache.plan_extension`);
5. the sampling rank samples every sequence that has new logits
   (:mod:`shardline.runner.sampling`, each sequence by its own parameters and, where it
   has a grammar, its own mask: :mod:`shardline.runner.constraint`); one exchange gives
   the token ids to every rank and agrees on the next step's tasks and cancellations at
   once, and when a sequence of the step asks for log-probabilities (every rank knows
   which do) a broadcast gives them (:mod:`shardline.runner.logprob_tables`); a chunk of a
   prompt scored whole (``prompt_logprobs``) has its prompt tokens' log-probabilities
   broadcast the same way, before the step's sampling;
6. the ranks whose node streams a task emit its tokens; during its prefill they emit the
   prompt tokens they have processed after each chunk (with a scored prompt's
   log-probabilities).

Every decision in steps 2-5 depends only on state that is identical on all ranks, so all
ranks make the same collective calls in the same order. Steps 3-5 are planned first, as a
value (:class:`~shardline.runner.step_plan.StepPlan`: the admissions, the decode rows, the
prefill chunks, the sequences sampled and, once their tokens are agreed, which finish);
the engine carries the plan out.
"""

from __future__ import annotations

import logging
import queue
import time
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from shardline.models.decode_graphs import GRAPH_MAX_ROWS
from shardline.models.kv_cache import cache_slots, whole_blocks
from shardline.models.llama import ForwardBatch
from shardline.models.weight_products import KERNEL_MAX_ROWS
from shardline.parallel.pipeline import PipelineStage, use_threads
from shardline.runner.agreement import Agreement, decide, encode_proposal, proposal_length, sampled_tokens
from shardline.runner.block_hashes import block_hashes
from shardline.runner.constraint import Constraint
from shardline.runner.draft_model import NO_TOKEN, P_MIN, DraftModel, ModelDrafts
from shardline.runner.logprob_tables import logprob_table, logprob_width, prompt_logprob_table, read_logprobs
from shardline.runner.other_load import OtherLoad, free_count
from shardline.runner.prefix_cache import Admission, CachedPrefix, Extension, Waiting, exact_end, window_rows
from shardline.runner.protocol import Cancel, EngineStats, PrefillProgress, Shutdown, Task, TokenEvent, Tokens
from shardline.runner.sampling import MAX_TOP_LOGPROBS, Sampler
from shardline.runner.speculation import Drafter
from shardline.runner.step_plan import (
    Chunk,
    SequenceState,
    StepLimits,
    StepPlan,
    cap_drafts,
    draft_room,
    plan_step,
    prefill_plan,
)
from shardline.runner.threads import ThreadGovernor

log = logging.getLogger(__name__)

DECODE_MAX_ROWS = min(KERNEL_MAX_ROWS, GRAPH_MAX_ROWS)
"""Most rows of a decode step with drafts: each row computed as a lone decode row is (the
compiled kernel's, a CUDA graph's), so a drafted row has the bits decoding it would give."""

AGREE_K = 32
"""Most tasks (and, apart, cancellations) a rank proposes in one step; more wait for the
next (:func:`shardline.runner.agreement.encode_proposal`)."""


def kv_reservation(prompt_tokens: int, max_tokens: int, context: int, block_tokens: int, pool_tokens: int) -> int:
    """KV-pool tokens a task reserves for its lifetime: its prompt and ``max_tokens``
    completion tokens (at most ``context`` in all), rounded up to whole blocks of
    ``block_tokens`` (the pages its positions take), at most the pool's
    ``pool_tokens``."""
    tokens = min(prompt_tokens + max_tokens, context)
    return min(whole_blocks(tokens, block_tokens), pool_tokens)


def idle_release(
    worked: bool, busy: bool, idle_since: float | None, now: float, delay_s: float
) -> tuple[bool, float | None]:
    """Whether an idle rank hands its scratch back now, and when its idle time began.

    ``worked``: it ran a forward pass since it last did; ``busy``: a sequence runs or
    waits; ``idle_since``/``now``: seconds on one clock (None: not idle). Busy resets the
    idle time; a rank that has not worked has nothing to hand back."""
    if busy or not worked:
        return False, None
    since = now if idle_since is None else idle_since
    if now - since >= delay_s:
        return True, None
    return False, since


def pool_tokens(kv_tokens: int, max_batch: int, context: int, block_tokens: int) -> int:
    """Tokens of a rank's KV pool: ``kv_tokens``, or where that is 0 or at least
    ``max_batch`` x ``context``, ``max_batch`` whole contexts in blocks of ``block_tokens``
    (so every slot can take a whole context)."""
    if kv_tokens and kv_tokens < max_batch * context:
        return kv_tokens
    return max_batch * whole_blocks(context, block_tokens)


SCORE_BLOCK_ROWS = 16
"""Rows of a scored prompt's chunk whose logits are taken at once (:meth:`Engine._share_prompt_logprobs`)."""


@dataclass
class Sequence:
    """A task admitted to the batch: its slot, KV reservation (tokens), prefill progress
    and generated tokens.

    ``reused``: prompt tokens whose keys and values its slot held from a cached prefix
    (its prefill started there); ``exact_end``: its first rows whose keys and values have
    the bits a cold prefill gives (:func:`~shardline.runner.prefix_cache.exact_end`),
    which its slot keeps as a cached prefix when it ends; ``hashes``: its prompt's
    :func:`~shardline.runner.prefix_cache.block_hashes` (empty without prefix caching);
    ``drafter``: its drafts where it speculates
    (:meth:`SamplingParams.drafts <shardline.runner.protocol.SamplingParams.drafts>`);
    ``touched``: its slot's positions below which pages may be written (the cached
    prefix it was admitted to, then every row it computed, a draft's too): where its end
    gives them back (:meth:`KVCache.release <shardline.models.kv_cache.KVCache.release>`)."""

    task: Task
    slot: int
    kv_reserved: int = 0
    prefilled: int = 0
    generated: list[int] = field(default_factory=list)
    sampler: Sampler | None = None
    reused: int = 0
    exact_end: int = 0
    hashes: list[int] = field(default_factory=list)
    drafter: Drafter | ModelDrafts | None = None
    touched: int = 0

    @property
    def prompt_len(self) -> int:
        return len(self.task.prompt)

    @property
    def scored(self) -> bool:
        """Its prompt's log-probabilities are asked for (``sampling.prompt_logprobs``):
        its prefill chunks give every row's final-norm hidden state, not one row's logits."""
        return self.task.sampling.prompt_logprobs is not None

    @property
    def next_position(self) -> int:
        """Position of the next token fed to the model (the last generated one)."""
        return self.prompt_len + len(self.generated) - 1

    def state(self, context: int) -> SequenceState:
        """It as a step's plan sees it (``context``: the instance's, which bounds a draft)."""
        return SequenceState(
            self.prompt_len,
            self.prefilled,
            len(self.generated),
            self.task.max_tokens,
            self.task.stop_token_ids,
            self.scored,
            self.task.sampling.resumed,
            self.draft(context),
        )

    def draft(self, context: int) -> tuple[int, ...]:
        """The tokens it guesses follow its next one, where it decodes and speculates: up
        to ``draft_tokens``, short of its ``max_tokens`` and of ``context`` (a step then
        gives at most one token past the draft)."""
        if self.drafter is None or self.prefilled < self.prompt_len or not self.generated:
            return ()
        room = min(self.task.max_tokens - len(self.generated), context - self.prompt_len - len(self.generated)) - 1
        return self.drafter.draft(room)


def queued_state(task: Task) -> SequenceState:
    """A waiting task as a step's plan sees it (:meth:`Sequence.state` once admitted, its
    prefill yet to start)."""
    return SequenceState(
        len(task.prompt),
        0,
        0,
        task.max_tokens,
        task.stop_token_ids,
        task.sampling.prompt_logprobs is not None,
        task.sampling.resumed,
    )


class Engine:
    """Lockstep scheduler and executor for one rank.

    Constructing it is a collective of the group (every rank constructs its engine): the
    ranks exchange what each step's plan reads of them all (:meth:`Stage.stages_at_once
    <shardline.parallel.stage.Stage.stages_at_once>`, the prefix cache's rows apart).

    Args:
        stage: this rank's pipeline stage (model shard + KV cache).
        inbox: messages from the node: Task, Cancel, Shutdown.
        send: called with each step's Tokens (events of tasks this rank streams) and with
            EngineStats whenever the batch changed.
        node_id: tasks whose ``origin`` equals it are emitted by this rank.
        group: the instance's process group, or None for a single rank.
        max_batch: the most sequences running at once; the KV cache's slots where they
            are as many (on the CPU, where every rank has :func:`~shardline.models.kv_cache.cache_slots`'
            more, the finished sequences' cached prompts keep the others: :meth:`_slots`).
        context: most tokens per sequence.
        kv_tokens: tokens of the KV pool, all sequences together (see
            :func:`pool_tokens`; 0: ``max_batch`` whole contexts).
        prefill_chunk: prompt tokens per prefill micro-batch (a sequence's last chunk may
            be shorter).
        prefill_step_tokens: most prompt tokens prefilled per step while other sequences
            decode (at least one chunk): bounds how long a long prompt holds up their
            next token.
        prefill_burst_tokens: most prompt tokens prefilled per step while no sequence
            decodes: more chunks per step keep a pipeline's stages busy; bounds how late
            a cancellation or a new task's admission takes effect.
        idle_wait_s: how long an idle rank waits on its inbox between agreement rounds.
        on_idle: called once each time the rank has been idle (no sequence running or
            waiting) for ``idle_release_s`` after work: the runner hands its prefill
            scratch and freed heap back to the system there, so an idle rank holds its
            weights and runtime only. Not at once: the next prefill faults that memory in
            again (SmolLM2's 512-token TTFT 1.4 s -> 1.6-1.9 s when released after every
            request), and requests back to back should not pay it.
        idle_release_s: seconds idle before ``on_idle``.
        grammar_tokenizer: returns the llguidance tokenizer for constrained tasks (called
            on the sampling rank at the first task with a grammar;
            :class:`shardline.runner.constraint.GrammarTokenizer`); None: a task with a
            grammar is ended at once (logged).
        prefix_cache: a finished sequence's slot keeps its prompt's keys and values for a
            later prompt that starts the same (:mod:`shardline.runner.prefix_cache`);
            False: every prompt is prefilled whole and a slot is emptied when its sequence
            ends. With it, the ranks agree whether each computes a prefill row apart from
            the rows beside it (:meth:`Stage.all_agree
            <shardline.parallel.stage.Stage.all_agree>`).
        draft_tokens: tokens a request that names none may draft a step (speculative
            decoding by prompt lookup, :mod:`shardline.runner.speculation`; 0: it does
            not speculate): :func:`~shardline.runner.speculation.default_drafts`.
        threads: sets the compute threads of every step from the measured times of the
            decode-only ones (:mod:`shardline.runner.threads`). None: torch's count
            throughout.
        other_load: the other processes' CPU use (:mod:`shardline.runner.other_load`).
            With ``threads``, it lets a step with prefill rows take more threads than
            decode's and gives a fresh runner's decode steps their first count; without
            (a CPU pipeline stage of several ranks), a step with prefill rows asks for the
            threads the free CPUs give (its stage computes on as many as the machine's
            compute slots give it: :mod:`shardline.parallel.compute_slots`) and the
            others run at torch's count at construction (the configured one). None:
            every step at the governed count, or torch's.
        model_drafts: the instance has a draft model (every rank is told): its
            sequences' drafts come from it, not from prompt lookup, ``draft_tokens``
            places each in the exchange after the sampled ids
            (:mod:`shardline.runner.draft_model`).
        draft_model: the draft model, on the sampling rank (required there with
            ``model_drafts``; ignored elsewhere).

    Raises:
        ValueError: ``model_drafts`` on the sampling rank without ``draft_model``.
    """

    def __init__(
        self,
        stage: PipelineStage,
        inbox: "queue.Queue[object]",
        send: Callable[[object], None],
        node_id: str,
        group,
        max_batch: int,
        context: int,
        prefill_chunk: int,
        prefill_step_tokens: int,
        prefill_burst_tokens: int,
        comm_device: torch.device | str = "cpu",
        idle_wait_s: float = 0.05,
        kv_tokens: int = 0,
        on_idle: Callable[[], None] | None = None,
        idle_release_s: float = 0.5,
        grammar_tokenizer: Callable[[], object] | None = None,
        prefix_cache: bool = True,
        draft_tokens: int = 0,
        threads: ThreadGovernor | None = None,
        other_load: OtherLoad | None = None,
        model_drafts: bool = False,
        draft_model: DraftModel | None = None,
    ) -> None:
        if model_drafts and stage.samples and draft_model is None:
            raise ValueError("the sampling rank of an instance with a draft model needs the draft model")
        self.stage = stage
        self.threads = threads
        self.other_load = other_load
        self.serving_threads = torch.get_num_threads()
        self.inbox = inbox
        self.send = send
        self.node_id = node_id
        self.group = group
        self.max_batch = max_batch
        self.context = context
        self.prefill_chunk = prefill_chunk
        self.prefill_step_tokens = prefill_step_tokens
        self.prefill_burst_tokens = prefill_burst_tokens
        self.progress = stage.progress
        self.comm_device = torch.device(comm_device)
        self.idle_wait_s = idle_wait_s
        self.held: dict[int, Task] = {}
        self.pending_cancels: set[int] = set()
        self.cancelled: OrderedDict[int, None] = OrderedDict()  # agreed, kept bounded
        self.waiting: list[Task] = []
        self.running: list[Sequence] = []
        self.draft_model = draft_model if stage.samples else None
        self.free_slots = list(range(self._slots(max_batch, prefix_cache)))
        self.kv_tokens = pool_tokens(kv_tokens, max_batch, context, stage.cache.block_tokens)
        self.free_kv_tokens = self.kv_tokens
        self.stopping = False
        self.steps = 0
        self._last_stats: EngineStats | None = None
        self.on_idle = on_idle
        self.idle_release_s = idle_release_s
        self._worked = False  # ran a forward pass since on_idle was last called
        self._idle_since: float | None = None
        self._agreed = False  # the last step's token exchange agreed on this step's tasks
        self.grammar_tokenizer = grammar_tokenizer
        self.prefix_cache = prefix_cache
        # A resumed prompt's pieces may run as one where every rank's rows are apart
        # (step_plan.prefill_plan): agreed once, every rank plans alike.
        self.rows_apart = prefix_cache and stage.all_agree(stage.prefill_rows_apart(), self.comm_device)
        self.stages_at_once = stage.stages_at_once(self.comm_device)  # a step's micro-batches to fill
        self.draft_tokens = draft_tokens
        self.model_drafts = model_drafts
        self.cached: dict[int, CachedPrefix] = {}  # free slots holding a cached prefix
        self._clock = 0  # advanced whenever a slot is cached: the cached prefixes' recency
        self._hashes: dict[int, list[int]] = {}  # waiting tasks' prompt block hashes
        self.prompt_tokens = 0  # prompt tokens of the tasks admitted so far
        self.reused_tokens = 0  # of those, the ones taken from cached prefixes
        self.drafted_tokens = 0  # drafted tokens checked in a step (speculative decoding)
        self.accepted_tokens = 0  # of those, the ones taken

    def _slots(self, max_batch: int, prefix_cache: bool) -> int:
        """The KV-cache slots the engine uses: :func:`~shardline.models.kv_cache.cache_slots`'
        CPU count where every rank's caches (its draft model's too) have them and the
        prefix cache keeps finished prompts there, else ``max_batch``; agreed by the ranks
        (a collective: every rank calls it at its start)."""
        wide = cache_slots(max_batch, "cpu")
        caches = [self.stage.cache] + ([self.draft_model.cache] if self.draft_model is not None else [])
        holds = all(c.slots >= wide for c in caches)
        if prefix_cache and self.stage.all_agree(holds, self.comm_device):
            return wide
        return max_batch

    # -- inbox and agreement -------------------------------------------------------------

    def _take(self, message: object) -> None:
        if isinstance(message, Task):
            if message.task_id not in self.cancelled:
                self.held[message.task_id] = message
        elif isinstance(message, Cancel):
            self.pending_cancels.add(message.task_id)
        elif isinstance(message, Shutdown):
            self.stopping = True

    def drain_inbox(self) -> None:
        idle = not (self.running or self.waiting or self.held or self.pending_cancels)
        try:
            if idle:
                self._take(self.inbox.get(timeout=self.idle_wait_s))
            while True:
                self._take(self.inbox.get_nowait())
        except queue.Empty:
            pass

    def exchange(self, tokens: list[int]) -> tuple[Agreement, list[int]]:
        """Propose the held tasks and pending cancellations, with this step's sampled
        ``tokens`` (the sampling rank's; the others pass as many zeros), and exchange the
        proposals (:meth:`Stage.gather <shardline.parallel.stage.Stage.gather>`): returns
        the agreement and the sampling rank's tokens."""
        proposal = encode_proposal(list(self.held), list(self.pending_cancels), AGREE_K, tokens)
        if self.stage.world_size > 1:  # alone, it stays where it is (no trip to a GPU and back)
            proposal = proposal.to(self.comm_device)
        gathered = self.stage.gather(proposal)
        return decide(gathered, AGREE_K), sampled_tokens(gathered, self.stage.sampler, AGREE_K)

    def apply_agreement(self, agreement: Agreement) -> None:
        """Queue the agreed tasks; end the agreed cancellations (emitting ``cancelled``
        for the tasks this rank streams)."""
        for task_id in agreement.tasks:
            self.waiting.append(self.held.pop(task_id))
        events: list[TokenEvent | PrefillProgress] = []
        for task_id in agreement.cancels:
            self.pending_cancels.discard(task_id)
            self.cancelled[task_id] = None
            if len(self.cancelled) > 10_000:
                self.cancelled.popitem(last=False)
            held = self.held.pop(task_id, None)
            if held is not None and held.origin == self.node_id:
                events.append(TokenEvent(task_id, -1, "cancelled", len(held.prompt)))
            for task in [t for t in self.waiting if t.task_id == task_id]:
                self.waiting.remove(task)
                self._hashes.pop(task_id, None)
                if task.origin == self.node_id:
                    events.append(TokenEvent(task_id, -1, "cancelled", len(task.prompt)))
            for seq in [s for s in self.running if s.task.task_id == task_id]:
                self._finish(seq)
                if seq.task.origin == self.node_id:
                    events.append(TokenEvent(task_id, -1, "cancelled", seq.prompt_len, cached_tokens=seq.reused))
        self.emit(events)

    # -- scheduling ----------------------------------------------------------------------

    def plan(self) -> tuple[StepPlan, list[Waiting]]:
        """This step's plan (:func:`~shardline.runner.step_plan.plan_step`) over the
        running sequences, the waiting tasks (with what admission sees of them, returned
        beside it for :meth:`admit`) and the free and cached slots."""
        block = self.stage.cache.block_tokens
        wants = []
        for t in self.waiting:
            # A continuation's output already given is computed as decode computed it, not
            # taken from the cache (whose rows have a cold prefill's bits): it matches its
            # prompt before that only.
            given = len(t.prompt) - t.sampling.resumed
            prompt, hashes = t.prompt, self._prompt_hashes(t)
            if t.sampling.resumed:  # (not a copy of every waiting prompt at every step)
                prompt, hashes = prompt[:given], hashes[: given // block]
            wants.append(
                Waiting(
                    prompt,
                    hashes,
                    kv_reservation(len(t.prompt), t.max_tokens, self.context, block, self.kv_tokens),
                    self._may_reuse(t),
                )
            )
        limits = StepLimits(
            self.context,
            self.prefill_chunk,
            block,
            self.prefill_step_tokens,
            self.prefill_burst_tokens,
            self.stages_at_once,
            self.rows_apart,
            self.max_batch,
        )
        plan = plan_step(
            cap_drafts([s.state(self.context) for s in self.running], DECODE_MAX_ROWS),
            [queued_state(t) for t in self.waiting],
            wants,
            self.free_slots,
            list(self.cached.values()),
            self.free_kv_tokens,
            limits,
        )
        return plan, wants

    def admit(self, plan: Admission, wants: list[Waiting]) -> None:
        """Start the waiting tasks the plan admits, in order (``wants``: the waiting as
        :func:`~shardline.runner.prefix_cache.plan_admission` saw them): each in a slot,
        resuming from its cached prefix where it takes one, the cached slots it needs
        evicted."""
        if not plan.starts and not plan.evicted:
            return
        cache = self.stage.cache
        done = 0  # of plan.evicted: each start's evictions just before it
        for start, before in zip(plan.starts, plan.evicted_before, strict=True):
            self._evict(plan.evicted[done:before])
            done = before
            task, want = self.waiting.pop(0), wants[start.index]
            self._hashes.pop(task.task_id, None)
            touched = start.reused
            if start.slot in self.cached:  # its cached prefix: the first ``reused`` positions are kept
                cached = self.cached.pop(start.slot).tokens
                self.free_kv_tokens += cached
                self._admitted_to_cached(start.slot, start.reused, want.need, cached)
                touched = max(touched, cached)
            else:
                self.free_slots.remove(start.slot)
            if start.source is not None:  # another conversation's: its shared positions copied
                cache.copy(start.source, start.slot, start.reused)
                if self.draft_model is not None:
                    self.draft_model.copy(start.source, start.slot, start.reused)
                self._clock += 1
                self.cached[start.source] = replace(self.cached[start.source], used=self._clock)
            seq = Sequence(
                task,
                start.slot,
                kv_reserved=want.need,
                prefilled=start.reused,
                reused=start.reused,
                exact_end=start.reused,
                hashes=want.hashes,
                drafter=self._drafter(task),
                touched=touched,
            )
            self.free_kv_tokens -= want.need
            self.prompt_tokens += len(task.prompt)
            self.reused_tokens += start.reused
            if self.stage.samples:
                seq.sampler = self._sampler(task)
            self.running.append(seq)

    def _drafter(self, task: Task) -> Drafter | ModelDrafts | None:
        """Where an admitted ``task``'s drafts come from: the draft model's, or prompt
        lookup's; None where it does not speculate."""
        drafts = task.sampling.drafts(self.draft_tokens)
        if not drafts:
            return None
        return ModelDrafts(drafts) if self.model_drafts else Drafter(task.prompt, drafts)

    def _release(self, slot: int, keep: int, touched: int) -> None:
        """Give back the memory of ``slot``'s keys and values past its first ``keep``
        positions, written below ``touched`` (and the draft model's, where this rank holds
        one)."""
        self.stage.cache.release(slot, keep, touched)
        if self.draft_model is not None:
            self.draft_model.release(slot, keep)

    def _admitted_to_cached(self, slot: int, reused: int, reserved: int, cached: int) -> None:
        """A sequence that reserves ``reserved`` positions takes cached ``slot``, whose
        first ``cached`` positions hold a prefix, resuming after ``reused`` of them: the
        pages past its reservation go back; those within it stay until it ends (it
        rewrites them as it grows, and its reservation counts them), since giving pages
        back costs a system call a layer and head (~2 ms of a 2-vCPU VM, at a
        conversation's every turn). The draft model's slot keeps ``reused`` positions (it
        holds the tokens it has keys for)."""
        self.stage.cache.release(slot, max(reused, reserved), cached)
        if self.draft_model is not None:
            self.draft_model.release(slot, reused)

    def _evict(self, slots: tuple[int, ...]) -> None:
        """Empty these cached slots (their pages back to the system) and free them."""
        for slot in slots:
            prefix = self.cached.pop(slot)
            self.free_kv_tokens += prefix.tokens
            self._release(slot, 0, prefix.tokens)
            self.free_slots.append(slot)
        self.free_slots.sort()

    def _may_reuse(self, task: Task) -> bool:
        """Whether ``task`` may resume from a cached prefix: not where every prompt row's
        log-probabilities are asked for (a cached row gives none), nor where it asks for
        its whole prompt prefilled (``cache_prompt`` false)."""
        return self.prefix_cache and task.cache_prompt and task.sampling.prompt_logprobs is None

    def _prompt_hashes(self, task: Task) -> list[int]:
        """``task``'s prompt block hashes (computed once while it waits; none without
        prefix caching)."""
        if not self.prefix_cache:
            return []
        hashes = self._hashes.get(task.task_id)
        if hashes is None:
            hashes = self._hashes[task.task_id] = block_hashes(task.prompt, self.stage.cache.block_tokens)
        return hashes

    def _sampler(self, task: Task) -> Sampler:
        constraint = None
        if task.sampling.grammar is not None:
            constraint = Constraint.start(
                task.sampling.grammar, self._grammar_tokenizer, task.stop_token_ids, task.task_id
            )
        return Sampler(task.sampling, task.prompt, constraint)

    def _grammar_tokenizer(self) -> object:
        if self.grammar_tokenizer is None:
            raise RuntimeError("this runner has no tokenizer for grammars")
        return self.grammar_tokenizer()

    def _finish(self, seq: Sequence) -> None:
        """End ``seq``: its slot keeps its exact prompt rows as a cached prefix (with prefix
        caching), or is emptied."""
        self.running.remove(seq)
        self.free_kv_tokens += seq.kv_reserved
        block = self.stage.cache.block_tokens
        keep = self._kept(seq)
        if keep <= 0:
            self._release(seq.slot, 0, seq.touched)
            self.free_slots.append(seq.slot)
            self.free_slots.sort()
            return
        self._release(seq.slot, keep, seq.touched)
        self._clock += 1
        sequence = seq.task.prompt + tuple(seq.generated)
        prefix = CachedPrefix(
            seq.slot, sequence[:keep], tuple(seq.hashes[: keep // block]), self._clock, sequence[keep:], block=block
        )
        self.cached[seq.slot] = prefix
        self.free_kv_tokens -= prefix.tokens

    def _kept(self, seq: Sequence) -> int:
        """Prompt tokens ``seq``'s slot keeps as a cached prefix when it ends: its exact
        rows (none without prefix caching)."""
        return min(seq.exact_end, seq.kv_reserved) if self.prefix_cache else 0

    # -- execution -----------------------------------------------------------------------

    def step(self) -> None:
        """One lockstep iteration (see the module docstring)."""
        self.drain_inbox()
        if self.other_load is not None:  # idle too (a step each idle wait): a recent base
            self.other_load.sample()
        self.progress.begin("agreeing on tasks with the other ranks")
        if not self._agreed:
            self.apply_agreement(self.exchange([])[0])
        self._agreed = False
        plan, wants = self.plan()
        self.admit(plan.admission, wants)
        if self.running or plan.extension is not None:
            self._worked = True
        self._run_micro_batches(plan)
        if plan.extension is not None:
            self._extend(plan.extension)
        if self.on_idle is not None:
            release, self._idle_since = idle_release(
                self._worked,
                bool(self.running or self.waiting),
                self._idle_since,
                time.monotonic(),
                self.idle_release_s,
            )
            if release:
                self._worked = False
                self.on_idle()
        self.steps += 1
        self.progress.end()
        self.report()

    def _run_micro_batches(self, plan: StepPlan) -> None:
        """Carry out ``plan``'s micro-batches (its decode rows, then its prefill chunks),
        then sample the sequences it samples (:meth:`_sample_and_advance`)."""
        seqs = list(self.running)  # the plan's sequences: admitted as it planned
        assert len(seqs) == len(plan.seqs)
        decoding = [(seqs[i], plan.seqs[i].draft) for i in plan.decode]
        chunks = [(seqs[c.seq], c) for c in plan.chunks]
        micro = self._micro_batches(decoding, chunks)
        if not micro:
            return

        def computed(index: int) -> None:
            if index >= plan.first_chunk:
                seq, chunk = chunks[index - plan.first_chunk]
                if seq.task.origin == self.node_id and not seq.scored:  # (scored: once shared)
                    self.emit(
                        [
                            PrefillProgress(
                                seq.task.task_id, chunk.start + chunk.length, seq.prompt_len, cached=seq.reused
                            )
                        ]
                    )

        if plan.sampled:  # the exchange after it (_sample_and_advance) carries their ids
            places = self._draft_places([seqs[i] for i in plan.sampled])
            self.stage.expect_gather(proposal_length(AGREE_K, plan.sampled_ids + places))
        plain = not chunks and not any(draft for _, draft in decoding)  # one row a sequence
        outputs = self._compute(micro, computed, len(decoding), timed=plain)
        rows: list[torch.Tensor] = []  # per sampled sequence, its rows of logits [1 + draft, vocab]
        if decoding and self.stage.samples:
            logits = outputs[0]
            assert logits is not None  # the sampling rank has logits for every micro-batch
            at = 0
            for _, draft in decoding:
                rows.append(logits[at : at + 1 + len(draft)])
                at += 1 + len(draft)
        rows += self._advance_prefill(chunks, outputs[plan.first_chunk :])
        if plan.sampled:
            self._sample_and_advance(plan, [seqs[i] for i in plan.sampled], rows)

    def _extend(self, extension: Extension) -> None:
        """Compute a cached prefix's rows ``extension`` names (prefill chunks, no logits,
        each computed as a whole chunk) and cache them
        (:func:`~shardline.runner.prefix_cache.plan_extension`)."""
        prefix = self.cached[extension.slot]
        end = extension.start + extension.length
        tokens = (prefix.token_ids + prefix.rest)[:end]
        chunk = self.prefill_chunk
        micro = []
        for _, start, length in prefill_plan([(end, extension.start)], chunk, end):
            batch = self.stage.prefill_batch(extension.slot, start, length, want_logits=False, key_span=chunk)
            batch.computed_as = chunk
            micro.append((torch.tensor(tokens[start : start + length], dtype=torch.long), batch))
        self._compute(micro, lambda _: None, 0, timed=False)
        extended = prefix.extended(end)
        self.free_kv_tokens -= extended.tokens - prefix.tokens
        self.cached[extension.slot] = extended

    def _micro_batches(
        self, decoding: list[tuple[Sequence, tuple[int, ...]]], chunks: list[tuple[Sequence, Chunk]]
    ) -> list[tuple[torch.Tensor, ForwardBatch]]:
        """The step's micro-batches, their input ids and batch: the decode rows of every
        sequence in ``decoding`` (if any: its next token, then its draft's tokens, each at
        its own position of its slot: every row's key and value is written before any row
        attends, so a drafted row sees those before it), then each prefill chunk."""
        stage = self.stage
        micro = []
        key_span = self.prefill_chunk if self.prefix_cache else 0  # a cold prefill's bits on a hit
        if decoding:
            slots, positions, tokens = [], [], []
            for s, draft in decoding:
                s.touched = max(s.touched, s.next_position + len(draft) + 1)
                for j, token in enumerate((s.generated[-1], *draft)):
                    slots.append(s.slot)
                    positions.append(s.next_position + j)
                    tokens.append(token)
            micro.append((torch.tensor(tokens, dtype=torch.long), stage.decode_batch(slots, positions)))
        for seq, chunk in chunks:
            seq.touched = max(seq.touched, chunk.start + chunk.length)
            batch = stage.prefill_batch(
                seq.slot,
                chunk.start,
                chunk.length,
                want_logits=chunk.want_logits,
                every_row=chunk.every_row,
                key_span=key_span,
            )
            batch.computed_as = self._computed_as(seq, chunk)
            micro.append(
                (torch.tensor(seq.task.prompt[chunk.start : chunk.start + chunk.length], dtype=torch.long), batch)
            )
        return micro

    def _compute(
        self,
        micro: list[tuple[torch.Tensor, ForwardBatch]],
        computed: Callable[[int], None],
        decoding: int,
        timed: bool,
    ) -> list[torch.Tensor | None]:
        """Run the micro-batches at the thread governor's count (a step with prefill rows
        at up to the configured count, as far as the other processes leave CPUs free,
        read again before each of its micro-batches after the first:
        :func:`~shardline.runner.other_load.free_count`, as do a fresh runner's decode
        steps until the governor has a time; a pipeline stage of several ranks, without
        a governor, asks for up to every CPU for a step with prefill rows, as far as
        they are free); with ``timed`` (a decode-only step without
        drafts: ``decoding`` rows), time the step for it. A step whose sequences drafted
        has as many rows more as they drafted, 1 to 16 a sequence,
        and takes up to 3x as long: timed under the sequences' count, such steps set off
        the governor's slow-step probes, and a probe that landed on a short draft won
        against the long ones' median (SmolLM2 under one busy core: two threads adopted
        again, decode at 17-28 tokens/s and a prompt's first token after 7.5 s)."""
        threads, load = self.threads, self.other_load
        prefill = any(batch.prefill for _, batch in micro)
        count = None
        if threads is not None:
            count = threads.threads
            if load is not None:
                if prefill:

                    def free() -> int:  # the threads the free CPUs give now
                        return free_count(threads.threads, threads.most, load.cpus, load.cores())

                    count = free()
                    computed = self._recounted(computed, free)  # and at each chunk
                elif threads.unseeded and (others := load.cores()) is not None:  # no times yet
                    count = threads.seed(free_count(count, threads.most, load.cpus, others))
        elif load is not None:  # a CPU pipeline stage: its compute slots give it the threads
            serving = self.serving_threads
            count = free_count(serving, load.cpus, load.cpus, load.cores()) if prefill else serving
        if count is not None:
            use_threads(count)
        started = time.perf_counter()
        outputs = self.stage.run(micro, computed)
        assert len(outputs) == len(micro)  # one each (None off the sampling rank)
        if threads is not None and timed:
            before = threads.threads
            if threads.timed(decoding, time.perf_counter() - started) != before:
                log.debug("decode steps: %d compute threads next", threads.threads)
        return outputs

    @staticmethod
    def _recounted(computed: Callable[[int], None], free: Callable[[], int]) -> Callable[[int], None]:
        """``computed``, then ``free()`` threads (those the free CPUs give now) for the
        step's next micro-batch: a prompt prefilled in one step (up to
        ``prefill_burst_tokens``, seconds of an agent's) follows the machine's load chunk
        by chunk, not the reading at its start alone (a burst of the client's just before
        it, a process that starts or stops during it)."""

        def then(index: int) -> None:
            computed(index)
            use_threads(free())

        return then

    def _computed_as(self, seq: Sequence, chunk: Chunk) -> int:
        """The rows ``chunk`` of ``seq`` is computed as: the cold prefill's chunk its rows
        lie in (:func:`~shardline.runner.prefix_cache.window_rows`; a continuation's
        prompt ends where its replayed output starts), so a piece of it (a hit's first,
        a pipeline's fill) gives that chunk's bits; or 0 for replayed output (its own
        rows: decode's computation, :func:`~shardline.runner.step_plan.prefill_plan`)."""
        given = seq.prompt_len - seq.task.sampling.resumed
        return window_rows(chunk.start, given, self.prefill_chunk) if chunk.start < given else 0

    def _advance_prefill(
        self, chunks: list[tuple[Sequence, Chunk]], outputs: list[torch.Tensor | None]
    ) -> list[torch.Tensor]:
        """Record the step's prefill chunks (``outputs``: theirs) in their sequences, share
        a scored prompt's log-probabilities; the logits of the prompts' last rows that the
        chunks end (on the sampling rank)."""
        rows: list[torch.Tensor] = []
        for (seq, chunk), out in zip(chunks, outputs):
            seq.prefilled = chunk.start + chunk.length
            computed_as = self._computed_as(seq, chunk)
            seq.exact_end = exact_end(seq.exact_end, chunk.start, chunk.length, self.prefill_chunk, computed_as)
            if seq.scored:
                self._share_prompt_logprobs(seq, chunk.start, chunk.length, out)
            if self.draft_model is not None and isinstance(seq.drafter, ModelDrafts):
                self.draft_model.extend(seq.slot, list(seq.task.prompt[: seq.prefilled]))
            if chunk.last and self.stage.samples:
                assert out is not None
                if seq.scored:  # every row's hidden state
                    out = self.stage.shard.logits(out[-1:])
                rows.append(out[-1:])
        return rows

    def _share_prompt_logprobs(self, seq: Sequence, start: int, length: int, hidden: torch.Tensor | None) -> None:
        """Share the log-probabilities of the prompt tokens a chunk gives (of tokens
        ``start + 1 .. start + length``, those in the prompt) from the sampling rank, and
        send them (:class:`PrefillProgress` ``logprobs``) where the task streams. Called
        on every rank alike: all know the chunk and the task's width. ``hidden``: on the
        sampling rank, the chunk's final-norm hidden states ``[length, hidden]``, whose
        logits are taken :data:`SCORE_BLOCK_ROWS` rows at a time (a block's float32
        logits and log-softmax are what scoring adds to a prefill's memory: 6 MB for a
        49,152-token vocabulary, 19 MB for 151,936)."""
        k = seq.task.sampling.prompt_logprobs
        assert k is not None
        n = min(start + length, seq.prompt_len - 1) - start  # rows whose next token is the prompt's
        width = min(k, MAX_TOP_LOGPROBS)
        rows: list[list[float]] = []
        if n > 0:
            if self.stage.samples:
                assert hidden is not None  # every row's, on the sampling rank
                targets = torch.tensor(seq.task.prompt[start + 1 : start + 1 + n], dtype=torch.long)
                hidden = hidden[:n]
                table = torch.cat(
                    [
                        prompt_logprob_table(
                            self.stage.shard.logits(hidden[b : b + SCORE_BLOCK_ROWS]),
                            targets[b : b + SCORE_BLOCK_ROWS],
                            width,
                        )
                        for b in range(0, n, SCORE_BLOCK_ROWS)
                    ]
                ).to(self.comm_device)
            else:
                table = torch.empty((n, 1 + 2 * width), dtype=torch.float32, device=self.comm_device)
            rows = self.stage.share_logprobs(table).cpu().tolist()
        if seq.task.origin == self.node_id:
            entries = tuple((start + 1 + i, *read_logprobs(row, width, width)) for i, row in enumerate(rows))
            self.emit([PrefillProgress(seq.task.task_id, start + length, seq.prompt_len, entries)])

    def _sample_and_advance(self, plan: StepPlan, seqs: list[Sequence], logits: list[torch.Tensor]) -> None:
        """Sample ``plan``'s sampled sequences ``seqs`` on the sampling rank (``logits``:
        float32 ``[1 + draft, vocab]`` per sequence: its next token's row, then one per
        drafted token), share the ids (and the log-probabilities, when any sequence asks)
        with every rank, append the tokens each takes and end the sequences that finished
        (:meth:`StepPlan.outcomes <shardline.runner.step_plan.StepPlan.outcomes>`); then
        apply the agreement on the next step's tasks exchanged with the ids
        (:meth:`exchange`)."""
        wanted = [s.task.sampling.logprobs for s in seqs]
        width = logprob_width(wanted)  # the same on every rank: all know the params
        drafts = [plan.seqs[i].draft for i in plan.sampled]
        sampled, table = self._sample(seqs, logits, drafts, width)
        agreement, ids = self.exchange(sampled + self._next_drafts(plan, seqs, sampled))
        ids, places = ids[: len(sampled)], ids[len(sampled) :]
        rows: list[list[float]] = []
        if table is not None and width is not None:
            rows = self.stage.share_logprobs(table).cpu().tolist()
        events: list[TokenEvent | PrefillProgress] = []
        for index, (seq, (tokens, finish)) in enumerate(zip(seqs, plan.outcomes(ids))):
            seq.generated.extend(tokens)
            if seq.drafter is not None:
                self.drafted_tokens += len(drafts[index])
                self.accepted_tokens += seq.drafter.took(len(drafts[index]), tokens)
            if isinstance(seq.drafter, ModelDrafts):
                seq.drafter.received(places[: seq.drafter.k])
                places = places[seq.drafter.k :]
            if seq.task.origin == self.node_id:
                k = wanted[index]
                logprob, top = (None, ()) if k is None or width is None else read_logprobs(rows[index], width, k)
                written = max(0, self._kept(seq) - seq.reused) if finish is not None else 0
                for j, token in enumerate(tokens):
                    last = j == len(tokens) - 1
                    events.append(
                        TokenEvent(
                            seq.task.task_id,
                            token,
                            finish if last else None,
                            seq.prompt_len,
                            logprob,
                            top,
                            cached_tokens=seq.reused,
                            cache_written=written if last else 0,
                            drafted=len(drafts[index]),
                        )
                    )
            if finish is not None:
                self._finish(seq)
        self.emit(events)
        self.apply_agreement(agreement)
        self._agreed = True

    @staticmethod
    def _draft_places(sampled: list[Sequence]) -> int:
        """Places the step's exchange carries for the next drafts of its ``sampled``
        sequences, after their ids: ``k`` each where a draft model drafts
        (:class:`~shardline.runner.draft_model.ModelDrafts`)."""
        return sum(s.drafter.k for s in sampled if isinstance(s.drafter, ModelDrafts))

    def _next_drafts(self, plan: StepPlan, seqs: list[Sequence], sampled: list[int]) -> list[int]:
        """The exchange's places for the next drafts of the sampled ``seqs`` (the plan's
        :attr:`~shardline.runner.step_plan.StepPlan.sampled` ones; ``sampled``: the ids
        :meth:`_sample` gave): on the sampling rank, for each whose draft model drafts,
        up to its ``k`` tokens guessed after those it takes now (none where they end it,
        or none fit its ``max_tokens`` or the context, nor past what the next step's
        decode rows may carry: :func:`~shardline.runner.step_plan.draft_room`, the rule
        that cuts them there), padded with :data:`~shardline.runner.draft_model.NO_TOKEN`;
        zeros elsewhere."""
        model = self.draft_model
        if model is None:
            return [0] * self._draft_places(seqs)
        places: list[int] = []
        outcomes = plan.outcomes(sampled)
        going_on = sum(1 for _, finish in outcomes if finish is None)
        sampled_now = {id(s) for s in seqs}
        others = sum(1 for s in self.running if id(s) not in sampled_now and s.generated)
        budget = draft_room(going_on + others, DECODE_MAX_ROWS)
        for index, seq in enumerate(seqs):
            if not isinstance(seq.drafter, ModelDrafts):
                continue
            k = seq.drafter.k
            tokens, finish = outcomes[index]
            drafted: list[int] = []
            if finish is None:
                so_far = [*seq.task.prompt, *seq.generated, *tokens]
                made = len(so_far) - seq.prompt_len
                room = min(seq.task.max_tokens - made, self.context - len(so_far)) - 1
                p_min = seq.task.sampling.draft_p_min
                drafted = model.draft(seq.slot, so_far, min(k, room, budget), P_MIN if p_min is None else p_min)
                budget -= len(drafted)
            places += drafted + [NO_TOKEN] * (k - len(drafted))
        return places

    def _sample(
        self, seqs: list[Sequence], logits: list[torch.Tensor], drafts: list[tuple[int, ...]], width: int | None
    ) -> tuple[list[int], torch.Tensor | None]:
        """The sampled ids (on the sampling rank; as many zeros elsewhere): per sequence its
        next token and, where it drafted, the next after each drafted token it matched
        (-1 for each row past the first mismatch); and, where ``width`` is set, the
        log-probability table to share (elsewhere, one to receive it into).

        Each row is sampled as decoding samples that token (argmax, or one draw of the
        sequence's generator), in order, until one differs from the draft: the tokens, and
        the generator's draws, are decoding's, so a seeded sample is the same text with or
        without speculation. For a draft of one token a guess (n-gram lookup), this takes
        a drafted token with probability p(token), as the rejection rule of speculative
        sampling does (Leviathan et al. 2023, Chen et al. 2023: accept with min(1, p/q), q
        = 1 here), and after a rejection its sample is one from p without that token,
        as theirs is from the residual max(0, p - q)."""
        count = sum(1 + len(d) for d in drafts)
        if not self.stage.samples:
            table = None
            if width is not None:
                table = torch.empty((len(seqs), 1 + 2 * width), dtype=torch.float32, device=self.comm_device)
            return [0] * count, table
        ids: list[int] = []
        choices = []
        for s, rows, draft in zip(seqs, logits, drafts):
            assert s.sampler is not None  # admitted on the sampling rank with one
            first = s.sampler.choose(rows[0])
            choices.append(first)
            mine = [first.token]
            while len(mine) <= len(draft) and mine[-1] == draft[len(mine) - 1]:
                mine.append(s.sampler.choose(rows[len(mine)]).token)
            ids += mine + [-1] * (1 + len(draft) - len(mine))
        table = logprob_table(choices, width).to(self.comm_device) if width is not None else None
        return ids, table

    def emit(self, events: list[TokenEvent | PrefillProgress]) -> None:
        if events:
            self.send(Tokens(tuple(events)))

    def report(self) -> None:
        """Send EngineStats if the batch differs from the last report."""
        stats = EngineStats(
            running=tuple(s.task.task_id for s in self.running),
            waiting=tuple(t.task_id for t in self.waiting),
            held=tuple(sorted(self.held)),
            free_slots=self.max_batch - len(self.running),
            steps=self.steps,
            free_kv_tokens=self.free_kv_tokens + sum(c.tokens for c in self.cached.values()),
            cached_slots=len(self.cached),
            cached_tokens=sum(len(c.token_ids) for c in self.cached.values()),
            cached_bytes=sum(c.tokens for c in self.cached.values()) * self.stage.cache.bytes_per_token,
            prompt_tokens=self.prompt_tokens,
            reused_tokens=self.reused_tokens,
            drafted_tokens=self.drafted_tokens,
            accepted_tokens=self.accepted_tokens,
        )
        last = self._last_stats
        if last is None or (stats.running, stats.waiting, stats.held, stats.cached_tokens) != (
            last.running,
            last.waiting,
            last.held,
            last.cached_tokens,
        ):
            self._last_stats = stats
            self.send(stats)

    def run(self) -> None:
        """Step until a Shutdown message arrives. Errors propagate (the runner fails)."""
        while not self.stopping:
            self.step()
