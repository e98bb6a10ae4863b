"""Rank agreement on tasks and cancellations (pure decision logic)."""

import pytest

from shardline.runner.agreement import decide, encode_proposal, sampled_tokens

pytestmark = [pytest.mark.fast, pytest.mark.timeout(30)]


def test_task_starts_only_when_every_rank_holds_it():
    k = 8
    proposals = [encode_proposal([5, 3, 9], [], k), encode_proposal([9, 3], [], k), encode_proposal([3, 9, 7], [], k)]
    assert decide(proposals, k).tasks == (3, 9)


def test_agreed_order_is_task_id_order_not_arrival_order():
    k = 8
    a = decide([encode_proposal([30, 10, 20], [], k), encode_proposal([20, 30, 10], [], k)], k)
    b = decide([encode_proposal([20, 30, 10], [], k), encode_proposal([10, 20, 30], [], k)], k)
    assert a.tasks == b.tasks == (10, 20, 30)


def test_a_cancellation_held_by_any_rank_is_agreed():
    k = 4
    result = decide([encode_proposal([1], [7], k), encode_proposal([1], [], k)], k)
    assert result.cancels == (7,)


def test_more_than_k_pending_wait_for_a_later_step():
    k = 2
    result = decide([encode_proposal([4, 1, 3, 2], [], k), encode_proposal([1, 2, 3, 4], [], k)], k)
    assert result.tasks == (1, 2)


def test_tokens_ride_after_the_proposal_and_come_from_the_sampling_rank():
    k = 2
    proposals = [encode_proposal([3], [], k, [0, 0]), encode_proposal([3, 4], [9], k, [11, 12])]
    assert sampled_tokens(proposals, sampler=1, k=k) == [11, 12]
    assert decide(proposals, k) == decide([p[: 2 + 2 * k] for p in proposals], k)
    assert decide(proposals, k).tasks == (3,) and decide(proposals, k).cancels == (9,)
