"""Prefix caching's decisions (:mod:`shardline.runner.prefix_cache`): where a prompt resumes
from a cached prefix so that it gives a cold prefill's bits, which rows a finished
sequence may cache, and which tasks start in which slots with which cached slots evicted.
Tables over pure functions: every rank of an instance makes the same decisions from the
same state."""

import pytest
import torch

from shardline.models.kv_cache import SLOTS_PER_SEQUENCE, cache_slots
from shardline.runner.block_hashes import block_hashes
from shardline.runner.prefix_cache import (
    CachedPrefix,
    Extension,
    Start,
    Waiting,
    exact_end,
    matched_tokens,
    plan_admission,
    plan_extension,
    reuse,
    row_class,
    window_rows,
)

pytestmark = [pytest.mark.fast, pytest.mark.timeout(10)]

B = 4  # block tokens in the admission tables
C = 8  # prefill chunk tokens in the admission tables


@pytest.mark.parametrize("rows, cls", [(1, 0), (64, 0), (65, 1), (95, 1), (96, 2), (512, 2)])
def test_a_chunks_rows_decide_its_computation(rows, cls):
    assert row_class(rows) == cls


@pytest.mark.parametrize(
    "matched, total, start",
    [
        (0, 1100, 0),
        (32, 1100, 32),  # first piece 32..511, computed as the cold 0..511
        (512, 1100, 512),
        (640, 1100, 640),  # 640..1023 as the cold 512..1023
        (992, 1100, 992),  # 992..1023 is 32 rows, computed as the cold chunk's 512
        (1000, 1100, 1000),
        (1056, 1100, 1024),  # the cold last chunk 1024..1099 is 76 rows (int8): none of it cached
        (1088, 1100, 1024),
        (1100, 1100, 1024),  # the same prompt again: its last chunk is prefilled again
        (1088, 1130, 1088),  # last chunk 1024..1129 (106 rows): 1088..1129 computed as it
        (1024, 1130, 1024),
        (2048, 1100, 1024),  # a longer cached prefix: at most the prompt, less its last chunk
        (1024, 1030, 1024),  # a 6-row last chunk, prefilled as the cold one
        (2073, 2308, 2073),  # a block part full
        (6000, 6050, 6000),  # an agent's short turn: its 50 rows alone
    ],
    ids=lambda v: str(v),
)
def test_a_hit_resumes_where_its_match_ends_unless_a_short_last_chunk_holds_it(matched, total, start):
    assert reuse(matched, total, chunk=512) == start


@pytest.mark.parametrize(
    "matched, total, start",
    [(128, 200, 128), (192, 200, 192), (200, 200, 199), (64, 65, 64), (64, 64, 63), (150, 200, 150)],
)
def test_small_chunks_resume_at_any_token(matched, total, start):
    """Chunks of 8 rows (the tests' runners): every chunk is in one class; the same
    prompt again resumes at its last token (its logits are computed)."""
    assert reuse(matched, total, chunk=8) == start


@pytest.mark.parametrize(
    "start, total, rows",
    [(0, 1100, 512), (32, 1100, 512), (1000, 1100, 512), (1024, 1100, 76), (1090, 1100, 76), (0, 40, 40)],
)
def test_a_piece_is_computed_as_the_cold_chunk_it_lies_in(start, total, rows):
    assert window_rows(start, total, 512) == rows


@pytest.mark.parametrize(
    "end, start, length, computed_as, after",
    [
        (0, 0, 512, 512, 512),  # a whole chunk
        (512, 512, 100, 100, 612),  # a last chunk of a whole chunk's class
        (512, 512, 76, 76, 512),  # a shorter one is not cached
        (0, 640, 384, 512, 0),  # does not follow on
        (640, 640, 384, 512, 1024),  # a resumed first piece
        (992, 992, 32, 512, 1024),  # a short one, computed as its chunk
        (512, 512, 40, 76, 512),  # a piece of a short last chunk
    ],
    ids=lambda v: str(v),
)
def test_rows_computed_in_a_whole_chunks_class_are_cached(end, start, length, computed_as, after):
    assert exact_end(end, start, length, 512, computed_as) == after


def test_block_hashes_are_chained_so_a_block_names_every_token_before_it():
    a = block_hashes((1, 2, 3, 4, 5, 6, 7, 8, 9), 4)
    b = block_hashes((0, 2, 3, 4, 5, 6, 7, 8), 4)
    assert len(a) == 2 and len(b) == 2
    assert a[0] != b[0] and a[1] != b[1]  # the second blocks are equal, their prefixes not
    assert block_hashes((1, 2, 3), 4) == []


def cached(slot: int, tokens: tuple[int, ...], used: int) -> CachedPrefix:
    return CachedPrefix(slot, tokens, tuple(block_hashes(tokens, B)), used, block=B)


def task(tokens: tuple[int, ...], need: int = 16, may_reuse: bool = True) -> Waiting:
    return Waiting(tokens, block_hashes(tokens, B), need, may_reuse)


SYSTEM = tuple(range(100, 112))  # 12 tokens: 3 blocks
A = SYSTEM + (1, 2, 3, 4, 5, 6)
B_ = SYSTEM + (7, 8, 9)
LONG = SYSTEM + tuple(range(16))  # another conversation: 7 blocks, a chunk (8) past the system prompt
SHORT = SYSTEM[:4] + tuple(range(60, 67))  # another, sharing a block (a template's header), 7 tokens past it


def test_a_hash_collision_matches_nothing():
    fake = CachedPrefix(0, (9,) * 12, tuple(block_hashes(SYSTEM, B)), 1, block=B)
    assert matched_tokens(A, block_hashes(A, B), fake, B) == 0
    assert matched_tokens(A, block_hashes(A, B), cached(0, SYSTEM, 1), B) == 12


@pytest.mark.parametrize(
    "prompt, kept, matched",
    [
        (A, A[:16], 16),
        (A, A[:14], 14),  # its last block part full
        (SYSTEM + (1, 2, 9), A[:16], 14),  # shared to the middle of a block
        (A[:13], A[:16], 13),  # the prompt ends inside it
        ((0,) + A[1:], A[:16], 0),  # the first block differs
    ],
)
def test_a_prompt_matches_whole_blocks_by_hash_then_token_by_token(prompt, kept, matched):
    assert matched_tokens(prompt, block_hashes(prompt, B), cached(0, kept, 1), B) == matched


@pytest.mark.parametrize(
    "waiting, free_slots, pool, free_tokens, starts, evicted",
    [
        # a hit takes the cached slot and resumes after the shared blocks; its tokens count
        ([task(A)], [1, 2], [cached(0, A[:16], 1)], 0, [Start(0, 0, 16, 16)], []),
        ([task(B_)], [1, 2], [cached(0, A[:16], 1)], 100, [Start(0, 0, 12, 16)], []),
        # the furthest resume wins, then the most recently used
        ([task(A)], [], [cached(0, SYSTEM, 5), cached(1, A[:16], 2)], 100, [Start(0, 1, 16, 16)], []),
        ([task(A)], [], [cached(0, SYSTEM, 1), cached(1, SYSTEM, 2)], 100, [Start(0, 1, 12, 12)], []),
        # a miss takes an empty slot before it evicts one; else the least recently used
        ([task((5,) * 10)], [3], [cached(0, A[:16], 1)], 100, [Start(0, 3, 0)], []),
        ([task((5,) * 10)], [], [cached(0, A[:16], 2), cached(1, B_[:12], 1)], 100, [Start(0, 1, 0)], [1]),
        # the pool's tokens: the least recently used others go, never the hit's own
        (
            [task(A, need=24)],
            [1],
            [cached(0, A[:16], 9), cached(2, B_[:12], 1), cached(3, SYSTEM, 2)],
            4,
            [Start(0, 0, 16, 16)],
            [2],
        ),
        # a task that would not fit without the cache waits, and nothing is evicted for it
        ([task(A, need=40)], [1], [cached(0, A[:16], 9), cached(2, B_[:12], 1)], 8, [], []),
        # ... and one that would fits: every cached token is evictable
        ([task((5,) * 10, need=36)], [1], [cached(0, A[:16], 9), cached(2, B_[:12], 1)], 8, [Start(0, 1, 0)], [2, 0]),
        # two tasks sharing a prefix in one step: one slot, so the second misses
        ([task(A), task(B_)], [1], [cached(0, SYSTEM, 1)], 100, [Start(0, 0, 12, 12), Start(1, 1, 0)], []),
        # first come, first served: the second waits behind the first
        ([task((5,) * 10, need=200), task(A)], [1], [cached(0, A[:16], 1)], 100, [], []),
        # a task scoring its prompt resumes nowhere
        ([task(A, may_reuse=False)], [1], [cached(0, A[:16], 1)], 100, [Start(0, 1, 0)], []),
        # no slot at all: running sequences hold them all
        ([task(A)], [], [], 100, [], []),
        # another conversation holds a chunk more past the shared system prompt: copied from
        ([task(B_)], [1], [cached(0, LONG, 1)], 100, [Start(0, 1, 12, source=0)], []),
        ([task(B_)], [], [cached(0, LONG, 2), cached(3, A[:16], 1)], 100, [Start(0, 3, 12, source=0)], [3]),
        # ... and then counts as used: the next task evicts another
        (
            [task(B_), task((5,) * 10)],
            [1],
            [cached(0, LONG, 1), cached(2, (9,) * 8, 2)],
            100,
            [Start(0, 1, 12, source=0), Start(1, 2, 0)],
            [2],
        ),
        # ... unless that takes evicting it: then taken
        ([task(B_)], [], [cached(0, LONG, 1)], 100, [Start(0, 0, 12, 28)], []),
        ([task(B_, need=40)], [1], [cached(0, LONG, 1)], 20, [Start(0, 0, 12, 28)], []),
        # 5 tokens past the shared 12, in 8 tokens of pages: less than a chunk more, taken
        ([task(B_)], [1], [cached(0, LONG[:17], 1)], 100, [Start(0, 0, 12, 20)], []),
        # less than a chunk past the shared part but more than it: copied, as above
        ([task(B_)], [1], [cached(0, SHORT, 1)], 100, [Start(0, 1, 4, source=0)], []),
        ([task(B_)], [], [cached(0, SHORT, 2), cached(2, (9,) * 8, 1)], 100, [Start(0, 2, 4, source=0)], [2]),
        ([task(B_)], [], [cached(0, SHORT, 1)], 100, [Start(0, 0, 4, 12)], []),
    ],
    ids=[
        "hit",
        "hit on a shared system prompt",
        "furthest",
        "most recent of equals",
        "empty slot first",
        "least recently used slot",
        "evicted for tokens",
        "would not fit without the cache",
        "fits once evicted",
        "one slot for two",
        "in order",
        "scored prompt",
        "no slot",
        "copied",
        "copied into an evicted slot",
        "the copied prefix is used",
        "no other slot",
        "no other tokens",
        "a block part full is not a chunk more",
        "sharing less than it holds past it",
        "sharing less, copied into an evicted slot",
        "sharing less, no other slot",
    ],
)
def test_admission_with_cached_prefixes(waiting, free_slots, pool, free_tokens, starts, evicted):
    plan = plan_admission(waiting, free_slots, pool, free_tokens, C, B)
    assert list(plan.starts) == starts
    assert list(plan.evicted) == evicted


@pytest.mark.parametrize(
    "room, starts",
    [
        (None, [Start(0, 0, 12, 12), Start(1, 1, 0), Start(2, 2, 0)]),  # as many as the slots take
        (2, [Start(0, 0, 12, 12), Start(1, 1, 0)]),  # the batch's places, more slots than them
        (0, []),  # the batch full: cached prefixes are not evicted for a task that cannot run
    ],
)
def test_no_more_tasks_start_than_the_batch_has_room_for(room, starts):
    """Where the KV cache has more slots than the batch (:func:`cache_slots`), the free
    and cached slots do not bound how many tasks start: the batch's places do."""
    waiting = [task(A), task((5,) * 10), task((6,) * 10)]
    plan = plan_admission(waiting, [1, 2, 3], [cached(0, SYSTEM, 1)], 100, C, B, room)
    assert list(plan.starts) == starts and plan.evicted == ()


def test_a_cpu_rank_maps_more_slots_than_its_batch_and_a_gpu_rank_does_not():
    assert cache_slots(8, "cpu") == 8 * SLOTS_PER_SEQUENCE > 8
    assert cache_slots(8, torch.device("cuda", 0)) == 8 and cache_slots(3, "mps") == 3


def test_a_prefix_copied_from_is_evicted_after_the_copy():
    """One cached prefix and one free slot: a task copies from the prefix into the free
    slot, the next evicts the prefix for its slot: the eviction comes after the first
    start (the copy reads the prefix first), before the second."""
    plan = plan_admission([task(B_), task((5,) * 10)], [1], [cached(0, LONG, 1)], 100, C, B)
    assert list(plan.starts) == [Start(0, 1, 12, source=0), Start(1, 0, 0)]
    assert plan.evicted == (0,) and plan.evicted_before == (0, 1)


@pytest.mark.parametrize(
    "needs, slots, cached_slots, free",
    [
        ([32, 32, 32], 4, 2, 100),
        ([64, 64], 4, 3, 100),
        ([128, 32], 4, 1, 100),
        ([32, 96, 32], 2, 2, 100),
        ([100], 1, 1, 100),
        ([40, 40, 40], 0, 3, 40),
    ],
)
def test_cached_prefixes_refuse_no_task_that_would_start_without_them(needs, slots, cached_slots, free):
    """The same tasks start whether the free slots and tokens are empty or held by cached
    prefixes that none of the tasks matches."""
    waiting = [task((5,) * 10, need) for need in needs]
    cold = plan_admission(waiting, list(range(slots + cached_slots)), [], free, C, B)
    held = [cached(slots + i, (7,) * B, i) for i in range(cached_slots)]
    warm = plan_admission(waiting, list(range(slots)), held, free - B * cached_slots, C, B)
    assert [s.index for s in warm.starts] == [s.index for s in cold.starts]


def answered(slot: int, kept: int, rest: int, used: int = 1) -> CachedPrefix:
    """A cached prefix of ``kept`` tokens whose sequence went on ``rest`` tokens more."""
    tokens = tuple(range(kept + rest))
    return CachedPrefix(slot, tokens[:kept], tuple(block_hashes(tokens[:kept], 16)), used, rest=tokens[kept:], block=16)


@pytest.mark.parametrize(
    "prefixes, free_tokens, extension",
    [
        # a 243-token prompt kept 240 and answered 64: its 67 rows, computed as a whole chunk
        ([answered(0, 240, 67)], 1000, Extension(0, 240, 67)),
        ([answered(0, 512, 70)], 1000, Extension(0, 512, 70)),
        # at the window's end: to it (the next window is the next step's)
        ([answered(0, 992, 40)], 1000, Extension(0, 992, 32)),
        ([answered(0, 480, 200)], 1000, Extension(0, 480, 32)),
        ([answered(0, 512, 100)], 1000, Extension(0, 512, 100)),
        ([answered(0, 512, 168)], 1000, Extension(0, 512, 128)),  # at most 128 rows a step
        # less than a block to add: its last block part full
        ([answered(0, 240, 15)], 1000, Extension(0, 240, 15)),
        # no free pool tokens (nothing is evicted for it): 320 - 240 for its pages
        ([answered(0, 240, 67)], 79, None),
        ([answered(0, 240, 67)], 80, Extension(0, 240, 67)),
        # the most recently used first; one that cannot grow leaves it to the next
        ([answered(0, 240, 67, used=1), answered(1, 480, 200, used=2)], 1000, Extension(1, 480, 32)),
        ([answered(0, 240, 67, used=1), answered(1, 240, 0, used=2)], 1000, Extension(0, 240, 67)),
        ([], 1000, None),
    ],
    ids=[
        "answer",
        "next window",
        "window end",
        "to the window",
        "whole window",
        "at most 128",
        "part block",
        "no pool",
        "pool",
        "recent first",
        "skips",
        "none",
    ],
)
def test_a_cached_prefix_grows_over_its_answer(prefixes, free_tokens, extension):
    assert plan_extension(prefixes, free_tokens, chunk=512, block=16) == extension


def test_an_extended_prefix_holds_its_answer_blocks_with_their_hashes():
    prefix = answered(3, 240, 67, used=5).extended(304)
    tokens = tuple(range(307))
    assert prefix.token_ids == tokens[:304] and prefix.rest == tokens[304:]
    assert prefix.hashes == tuple(block_hashes(tokens[:304], 16)) and (prefix.slot, prefix.used) == (3, 5)
    assert matched_tokens(tokens + (9,), block_hashes(tokens + (9,), 16), prefix, 16) == 304


def test_chunks_shorter_than_a_block_grow_a_prefix_a_block_of_whole_chunks_at_a_time():
    prefix = CachedPrefix(
        0, tuple(range(128)), tuple(block_hashes(tuple(range(128)), 64)), 1, rest=tuple(range(128, 230)), block=64
    )
    assert plan_extension([prefix], 1000, chunk=8, block=64) == Extension(0, 128, 64)
    # the 38 left: to the sequence's end, its last block part full
    assert plan_extension([prefix.extended(192)], 1000, chunk=8, block=64) == Extension(0, 192, 38)
