"""Which waiting tasks start, by KV-cache slots and KV-pool blocks: tables over the
engine's pure admission functions; and when an idle rank hands its scratch back."""

import pytest

from shardline.runner.engine import idle_release, kv_reservation, pool_tokens
from shardline.runner.prefix_cache import Waiting, plan_admission
from shardline.runner.step_plan import prefill_plan

pytestmark = [pytest.mark.fast, pytest.mark.timeout(10)]


@pytest.mark.parametrize(
    "prompt, max_tokens, context, block, pool, expected",
    [
        (10, 20, 4096, 32, 32768, 32),  # 30 tokens: one block
        (30, 3, 4096, 32, 32768, 64),  # 33 tokens: two blocks
        (100, 10_000, 4096, 32, 32768, 4096),  # never beyond the context
        (100, 10_000, 1000, 32, 32768, 1024),  # ... in whole blocks
        (100, 10_000, 1000, 32, 1000, 1000),  # ... and never beyond the pool
        (5, 5, 96, 1, 96, 10),
    ],
)
def test_a_task_reserves_its_prompt_and_completion_in_whole_blocks(prompt, max_tokens, context, block, pool, expected):
    assert kv_reservation(prompt, max_tokens, context, block, pool) == expected


@pytest.mark.parametrize(
    "needs, slots, free, started",
    [
        ([], 4, 100, 0),
        ([32, 32, 32], 4, 100, 3),
        ([32, 32, 32], 2, 100, 2),  # slots run out first
        ([64, 64], 4, 100, 1),  # blocks run out
        ([128, 32], 4, 100, 0),  # first come, first served: a small task waits behind a big one
        ([32, 96, 32], 4, 100, 1),
        ([100], 1, 100, 1),
    ],
)
def test_tasks_start_in_order_while_slots_and_blocks_last(needs, slots, free, started):
    waiting = [Waiting((1,) * 10, [], need) for need in needs]
    plan = plan_admission(waiting, list(range(slots)), [], free, chunk=8, block=32)
    assert [s.index for s in plan.starts] == list(range(started))
    assert [s.slot for s in plan.starts] == list(range(started))  # the lowest slots, in order
    assert all(s.reused == 0 for s in plan.starts) and plan.evicted == ()


@pytest.mark.parametrize(
    "asked, max_batch, context, block, expected",
    [
        (0, 8, 4096, 32, 8 * 4096),  # the default: max_batch contexts
        (0, 8, 1000, 32, 8 * 1024),  # ... each in whole blocks
        (5000, 8, 1000, 32, 5000),  # a smaller pool, as placed
        (9000, 8, 1000, 32, 8 * 1024),  # the batch cannot use more than its contexts
    ],
)
def test_a_ranks_pool_holds_what_was_placed_or_every_slot_a_whole_context(asked, max_batch, context, block, expected):
    assert pool_tokens(asked, max_batch, context, block) == expected


@pytest.mark.parametrize(
    "worked, busy, idle_since, now, expected",
    [
        (True, True, None, 10.0, (False, None)),  # busy: not idle
        (True, True, 9.0, 10.0, (False, None)),  # busy again: the idle time resets
        (False, False, None, 10.0, (False, None)),  # idle, but nothing to hand back
        (True, False, None, 10.0, (False, 10.0)),  # just fell idle: the clock starts
        (True, False, 9.8, 10.0, (False, 9.8)),  # idle 0.2 s of 0.5
        (True, False, 9.5, 10.0, (True, None)),  # idle 0.5 s: hand it back
        (True, False, 1.0, 10.0, (True, None)),
    ],
)
def test_an_idle_rank_hands_its_scratch_back_after_the_delay(worked, busy, idle_since, now, expected):
    assert idle_release(worked, busy, idle_since, now, 0.5) == expected


@pytest.mark.parametrize(
    "prompts, budget, plan",
    [
        ([(20, 0)], 100, [(0, 0, 8), (0, 8, 8), (0, 16, 4)]),
        ([(20, 0)], 10, [(0, 0, 8)]),
        ([(20, 0)], 0, [(0, 0, 8)]),  # at least one chunk
        ([(20, 8), (5, 0)], 100, [(0, 8, 8), (0, 16, 4), (1, 0, 5)]),
        ([(20, 20), (5, 0)], 100, [(1, 0, 5)]),  # the first is decoding
        ([(20, 5)], 100, [(0, 5, 3), (0, 8, 8), (0, 16, 4)]),  # resumed at 5: cut where a cold prefill is
        ([(20, 5)], 3, [(0, 5, 3)]),
    ],
    ids=[
        "whole chunks",
        "up to the budget",
        "one chunk at least",
        "oldest first",
        "prefilled ones skipped",
        "a resumed prompt cut at chunk multiples",
        "its first chunk counts as 3",
    ],
)
def test_a_steps_prefill_plan(prompts, budget, plan):
    assert prefill_plan(prompts, 8, budget) == plan
