"""A lockstep step's plan (:mod:`shardline.runner.step_plan`): which sequences decode,
which prefill chunks run with which outputs, which tasks start, and, once the tokens are
agreed, which sampled sequences finish and why. Tables over pure functions: every rank of
an instance plans the same step from the same state."""

import pytest

from shardline.runner.prefix_cache import Admission, CachedPrefix, Extension, Start, Waiting
from shardline.runner.step_plan import (
    Chunk,
    SequenceState,
    StepLimits,
    StepPlan,
    cap_drafts,
    fill_stages,
    finish_reason,
    plan_step,
    prefill_plan,
    schedule,
)

pytestmark = [pytest.mark.fast, pytest.mark.timeout(10)]

LIMITS = StepLimits(context=64, chunk=8, block=4, step_tokens=8, burst_tokens=24)


def seq(prompt_len: int, prefilled: int = 0, generated: int = 0, scored: bool = False) -> SequenceState:
    return SequenceState(prompt_len, prefilled, generated, max_tokens=16, scored=scored)


@pytest.mark.parametrize(
    "token, generated, prompt_len, max_tokens, context, reason",
    [
        (5, 1, 10, 16, 64, None),
        (2, 1, 10, 16, 64, "stop"),  # a stop token
        (3, 4, 10, 16, 64, "stop"),  # any of them
        (5, 16, 10, 16, 64, "length"),  # max_tokens generated
        (5, 15, 10, 16, 64, None),
        (2, 16, 10, 16, 64, "stop"),  # a stop token at max_tokens is a stop
        (5, 4, 60, 16, 64, "length"),  # the context full
        (5, 3, 60, 16, 64, None),
        (2, 4, 60, 16, 64, "stop"),  # a stop token at the context's end is a stop
        (5, 1, 10, 1, 64, "length"),  # max_tokens 1: one token
        (5, 1, 63, 16, 64, "length"),  # a prompt one short of the context: one token
    ],
    ids=[
        "goes on",
        "stop token",
        "another stop token",
        "max tokens",
        "one short of max tokens",
        "stop before max tokens",
        "context full",
        "one short of the context",
        "stop before the context",
        "max tokens 1",
        "prompt fills the context",
    ],
)
def test_the_finish_rule(token, generated, prompt_len, max_tokens, context, reason):
    assert finish_reason(token, generated, prompt_len, (2, 3), max_tokens, context) == reason


@pytest.mark.parametrize(
    "state, decoding",
    [
        (seq(10), False),  # not prefilled
        (seq(10, 8), False),  # partly prefilled
        (seq(10, 10), False),  # prefilled but not yet sampled (never so after a step)
        (seq(10, 10, 1), True),
        (seq(10, 10, 5), True),
    ],
)
def test_a_sequence_decodes_once_prefilled_and_sampled(state, decoding):
    assert state.decoding is decoding


@pytest.mark.parametrize(
    "seqs, decode, chunks",
    [
        ([], (), ()),
        ([seq(10, 10, 1), seq(12, 12, 3)], (0, 1), ()),  # decode only
        ([seq(20)], (), (Chunk(0, 0, 8, False), Chunk(0, 8, 8, False), Chunk(0, 16, 4, True))),  # burst budget
        ([seq(30)], (), (Chunk(0, 0, 8, False), Chunk(0, 8, 8, False), Chunk(0, 16, 8, False))),  # 24 a step
        ([seq(10, 10, 1), seq(20)], (0,), (Chunk(1, 0, 8, False),)),  # a decode step's budget
        ([seq(10, 10, 1), seq(20, 16)], (0,), (Chunk(1, 16, 4, True),)),
        ([seq(6), seq(5)], (), (Chunk(0, 0, 6, True), Chunk(1, 0, 5, True))),  # oldest first
        ([seq(20, 5)], (), (Chunk(0, 5, 3, False), Chunk(0, 8, 8, False), Chunk(0, 16, 4, True))),  # resumed
        ([seq(10, scored=True)], (), (Chunk(0, 0, 8, False, True), Chunk(0, 8, 2, True, True))),
    ],
    ids=[
        "nothing",
        "decode only",
        "a whole prompt",
        "the burst budget",
        "the step budget while decoding",
        "the last chunk",
        "oldest first",
        "resumed at chunk multiples",
        "a scored prompt",
    ],
)
def test_a_steps_schedule(seqs, decode, chunks):
    assert schedule(seqs, LIMITS) == (decode, chunks)


@pytest.mark.parametrize(
    "chunk, want_logits, every_row",
    [
        (Chunk(0, 0, 8, False), False, False),
        (Chunk(0, 8, 2, True), True, False),  # its last row's logits
        (Chunk(0, 0, 8, False, True), True, True),  # scored: every row's hidden state
        (Chunk(0, 8, 2, True, True), True, True),
    ],
)
def test_a_chunks_outputs(chunk, want_logits, every_row):
    assert (chunk.want_logits, chunk.every_row) == (want_logits, every_row)


def test_a_plan_samples_the_decoding_then_the_prompts_its_chunks_end():
    seqs = (seq(10, 10, 1), seq(6), seq(20), seq(12, 12, 4))
    decode, chunks = schedule(seqs, LIMITS)
    plan = StepPlan(Admission((), ()), seqs, decode, chunks, LIMITS.context)
    assert plan.decode == (0, 3)
    assert [(c.seq, c.start, c.length, c.last) for c in plan.chunks] == [
        (1, 0, 6, True)
    ]  # 2 tokens left: no 8-token chunk
    assert plan.sampled == (0, 3, 1)
    assert (plan.first_chunk, plan.micro_batches) == (1, 2)


def test_a_plan_without_decoding_starts_its_chunks_at_the_first_micro_batch():
    plan = plan_step([seq(6)], [], [], [1], [], 64, LIMITS)
    assert (plan.decode, plan.first_chunk, plan.micro_batches, plan.sampled) == ((), 0, 1, (0,))


def test_a_plans_finishes_follow_its_sampled_sequences():
    seqs = (
        SequenceState(10, 10, 3, max_tokens=4, stop_token_ids=(2,)),
        SequenceState(60, 60, 3, max_tokens=16, stop_token_ids=(2,)),
        SequenceState(6, 0, 0, max_tokens=16, stop_token_ids=(2,)),
        SequenceState(8, 8, 1, max_tokens=16, stop_token_ids=(2,)),
    )
    decode, chunks = schedule(seqs, LIMITS)
    plan = StepPlan(Admission((), ()), seqs, decode, chunks, LIMITS.context)
    assert plan.sampled == (0, 1, 3, 2) and plan.sampled_ids == 4
    # the 4th token of 4; the context's 64th; one more; a stop token as the first
    assert plan.outcomes([7, 7, 7, 2]) == (((7,), "length"), ((7,), "length"), ((7,), None), ((2,), "stop"))


@pytest.mark.parametrize(
    "draft, ids, outcome",
    [
        ((5, 6, 7), [5, 6, 7, 8], ((5, 6, 7, 8), None)),  # every drafted token matched: one more
        ((5, 6, 7), [5, 9, -1, -1], ((5, 9), None)),  # the second differed: the token in its place
        ((5, 6, 7), [4, -1, -1, -1], ((4,), None)),
        ((5, 2, 7), [5, 2, 7, 8], ((5, 2), "stop")),  # a stop token ends it, the rest dropped
        ((5, 6, 7, 8, 9), [5, 6, 7, 8, 9, 1], ((5, 6, 7, 8, 9, 1), None)),
    ],
)
def test_a_decoding_sequence_takes_its_drafts_tokens_up_to_the_first_that_differed(draft, ids, outcome):
    seqs = (
        SequenceState(10, 10, 3, max_tokens=16, stop_token_ids=(2,), draft=draft),
        SequenceState(6, 6, 1, max_tokens=16),
    )
    plan = StepPlan(Admission((), ()), seqs, (0, 1), (), LIMITS.context)
    assert plan.sampled_ids == 1 + len(draft) + 1
    assert plan.outcomes([*ids, 3]) == (outcome, ((3,), None))


def test_max_tokens_ends_a_draft_early():
    seqs = (SequenceState(10, 10, 3, max_tokens=5, draft=(5, 6, 7)),)
    plan = StepPlan(Admission((), ()), seqs, (0,), (), LIMITS.context)
    assert plan.outcomes([5, 6, 7, 8]) == (((5, 6), "length"),)


@pytest.mark.parametrize(
    "drafts, decoding, rows, kept",
    [
        ([(1, 2), (3,)], 2, 8, [(1, 2), (3,)]),  # 2 + 3 rows: room
        ([(1, 2, 3), (4, 5)], 2, 5, [(1, 2, 3), ()]),  # the oldest first
        ([(1, 2, 3), (4, 5)], 2, 4, [(1, 2), ()]),
        ([(1,), (2,)], 2, 2, [(), ()]),  # no room past one row each
        ([(1, 2), (3,), (4,)], 3, 32, [(), (), ()]),  # more than SPECULATE_MAX_BATCH decode
    ],
)
def test_drafts_are_cut_to_the_decode_rows_a_step_may_have(drafts, decoding, rows, kept):
    seqs = [SequenceState(4, 4, 1, max_tokens=16, draft=d) for d in drafts]
    assert [s.draft for s in cap_drafts(seqs, rows)] == kept


def test_admitted_tasks_join_the_step_prefilled_to_what_they_reuse():
    prompt = tuple(range(20))
    cached = CachedPrefix(1, prompt[:12], (0, 1, 2), used=1, block=LIMITS.block)  # hashes as the waiting prompt's
    hashes = [0, 1, 2, 3, 4]
    wants = [Waiting(prompt, hashes, need=24), Waiting(tuple(range(100, 106)), [9, 8], need=8)]
    waiting = [SequenceState(20, max_tokens=4), SequenceState(6, max_tokens=2, scored=True)]
    running = [seq(10, 10, 1)]
    plan = plan_step(running, waiting, wants, [0, 2], [cached], 64, LIMITS)
    assert plan.admission.starts == (Start(0, 1, 12, 12), Start(1, 0, 0))  # the cached slot, and the lowest free
    assert plan.seqs == (
        running[0],
        SequenceState(20, 12, max_tokens=4),
        SequenceState(6, 0, max_tokens=2, scored=True),
    )
    assert plan.decode == (0,)
    # resumed at 12, cut at 16; the step budget (8 tokens while one decodes) leaves the other for later
    assert plan.chunks == (Chunk(1, 12, 4, False), Chunk(1, 16, 4, True))
    assert plan.sampled == (0, 1)


def test_no_waiting_task_no_admission():
    plan = plan_step([seq(10, 10, 1)], [], [], [1, 2], [], 64, LIMITS)
    assert plan.admission == Admission((), ())
    assert plan.seqs == (seq(10, 10, 1),)


def test_a_task_that_does_not_fit_waits_outside_the_plan():
    wants = [Waiting(tuple(range(6)), [1], need=8)]
    plan = plan_step([], [SequenceState(6)], wants, [], [], 64, LIMITS)  # no free slot
    assert plan.admission.starts == () and plan.seqs == () and plan.chunks == ()


def test_a_cached_prefix_grows_only_in_a_step_where_nothing_runs_or_waits():
    tokens = tuple(range(24))
    answered = CachedPrefix(1, tokens[:12], (0, 1, 2), used=1, rest=tokens[12:], block=LIMITS.block)
    idle = plan_step([], [], [], [0], [answered], 64, LIMITS)
    assert idle.extension == Extension(1, 12, 4) and idle.chunks == () and idle.decode == ()
    assert plan_step([seq(10, 10, 1)], [], [], [0], [answered], 64, LIMITS).extension is None
    wants = [Waiting(tuple(range(50, 56)), [1], need=8)]
    assert plan_step([], [SequenceState(6)], wants, [0], [answered], 64, LIMITS).extension is None


@pytest.mark.parametrize(
    "total, start, replay, chunk, pieces",
    [
        (600, 0, 0, 512, [(0, 512), (512, 88)]),
        # a continuation: the prompt cut as before, the output already given in pieces of 64
        (1100, 0, 150, 512, [(0, 512), (512, 438), (950, 64), (1014, 64), (1078, 22)]),
        (700, 650, 100, 512, [(650, 50)]),  # resumed inside the output given
        (700, 500, 100, 512, [(500, 12), (512, 88), (600, 64), (664, 36)]),
        (40, 0, 20, 8, [(0, 8), (8, 8), (16, 4), (20, 8), (28, 8), (36, 4)]),  # pieces of a short chunk
    ],
    ids=lambda v: str(v),
)
def test_a_continuations_output_given_is_prefilled_in_decodes_pieces(total, start, replay, chunk, pieces):
    planned = prefill_plan([(total, start)], chunk, 10**6, [replay])
    assert [(s, n) for _, s, n in planned] == pieces


@pytest.mark.parametrize(
    "planned, busy, stages, expected",
    [
        # a hit's one chunk of 227 rows on 3 stages: two pieces (three would be under 96 rows)
        ([(0, 2079, 227)], 0, 3, [(0, 2079, 114), (0, 2193, 113)]),
        ([(0, 0, 512)], 0, 3, [(0, 0, 171), (0, 171, 171), (0, 342, 170)]),
        ([(0, 0, 512)], 1, 3, [(0, 0, 256), (0, 256, 256)]),  # the decode rows fill a stage
        ([(0, 0, 512)], 0, 1, [(0, 0, 512)]),  # tensor and ring: one micro-batch at a time
        ([(0, 0, 191)], 0, 3, [(0, 0, 191)]),  # too short to cut
        ([(0, 0, 192)], 0, 3, [(0, 0, 96), (0, 96, 96)]),
        ([(0, 0, 512), (1, 0, 512), (2, 0, 100)], 0, 3, [(0, 0, 512), (1, 0, 512), (2, 0, 100)]),  # full already
        ([(0, 0, 100), (1, 0, 400)], 0, 3, [(0, 0, 100), (1, 0, 200), (1, 200, 200)]),  # the longest is cut
        ([(0, 0, 512), (1, 512, 300)], 0, 4, [(0, 0, 256), (0, 256, 256), (1, 512, 150), (1, 662, 150)]),
        ([], 0, 3, []),
    ],
    ids=lambda v: str(v),
)
def test_a_pipelines_chunks_are_cut_to_fill_its_stages(planned, busy, stages, expected):
    assert fill_stages(planned, busy, stages) == expected


def test_a_pipeline_cuts_a_steps_chunks_but_not_a_scored_prompts():
    pipeline = StepLimits(context=4096, chunk=512, block=16, step_tokens=2048, burst_tokens=4096, stages=3)
    _, chunks = schedule((seq(400),), pipeline)
    assert [(c.start, c.length, c.last) for c in chunks] == [(0, 134, False), (134, 133, False), (267, 133, True)]
    _, chunks = schedule((seq(400, scored=True),), pipeline)
    assert [(c.start, c.length) for c in chunks] == [(0, 400)]


@pytest.mark.parametrize(
    "total, start, budget, replay, plan",
    [
        (2335, 2039, 4096, 0, [(0, 2039, 296)]),  # 9 rows to the chunk's end and the 287-row last chunk
        (700, 300, 4096, 0, [(0, 300, 400)]),
        (1130, 1000, 4096, 0, [(0, 1000, 130)]),
        (1100, 1000, 4096, 0, [(0, 1000, 24), (0, 1024, 76)]),  # a last chunk of another class (76 rows)
        (1300, 700, 4096, 0, [(0, 700, 324), (0, 1024, 276)]),  # together more than a chunk
        (2000, 1000, 4096, 0, [(0, 1000, 24), (0, 1024, 512), (0, 1536, 464)]),  # the next chunk is whole
        (1130, 1024, 4096, 0, [(0, 1024, 106)]),  # resumed at a chunk's start: nothing to join
        (1130, 1000, 100, 0, [(0, 1000, 130)]),  # one piece, the step's first
        (1130, 1000, 4096, 106, [(0, 1000, 24), (0, 1024, 64), (0, 1088, 42)]),  # replayed as decode computed it
        (1300, 1000, 4096, 100, [(0, 1000, 200), (0, 1200, 64), (0, 1264, 36)]),  # joined up to the replay
    ],
    ids=[
        "an agent's turn",
        "rest of the first chunk and the next",
        "short rest",
        "another class",
        "more than a chunk",
        "a whole chunk next",
        "at a chunk's start",
        "over the budget alone",
        "the output given is not joined",
        "joined up to the output given",
    ],
)
def test_where_rows_are_apart_a_resumed_piece_runs_on_into_the_short_last_chunk(total, start, budget, replay, plan):
    assert prefill_plan([(total, start)], 512, budget, [replay], rows_apart=True) == plan
    if plan[0][2] > 512 - start % 512:  # joined: without rows apart it is cut at the chunk's end
        assert prefill_plan([(total, start)], 512, budget, [replay])[0] == (0, start, 512 - start % 512)
