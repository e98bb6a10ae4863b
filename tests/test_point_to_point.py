"""A rank's collectives (:class:`~shardline.parallel.collectives.Collectives`) on real
gloo ranks: every rank gets the same table, the same sum and the root's tensor, bit for
bit, by point-to-point sends, and calls in a row do not take each other's messages (a
gather's receives posted ahead too); a sum above ``POINT_TO_POINT_BYTES`` (gloo's ring)
is right too."""

from __future__ import annotations

import pytest
import torch
from ranks import spawn_ranks

from shardline.parallel.collectives import Collectives
from shardline.placement.speed import POINT_TO_POINT_BYTES


def _values(rank: int, call: int) -> torch.Tensor:
    """Rank ``rank``'s float32 ``[3, 5]`` input to call ``call``: magnitudes apart, so the
    order of the additions shows in the sum's last bits."""
    gen = torch.Generator().manual_seed(1000 * call + rank)
    return torch.randn(3, 5, generator=gen) * 10.0 ** (rank * 3 - 3)


def _job(rank: int, world: int, calls: int) -> dict:
    """Alternate gather_at (rooted at the last rank, then the first), all_reduce and
    broadcast (from the first rank, then the last); then one large all_reduce."""
    collectives = Collectives(None, rank, world)
    assert collectives.sends
    tables, sums, shared = [], [], []
    for call in range(calls):
        root = world - 1 if call % 2 == 0 else 0
        proposal = torch.arange(4, dtype=torch.int64) + 100 * rank + 10_000 * call
        if call % 3 == 2:  # the root posts its receives ahead, as a pipeline's sampler does
            collectives.expect_gather_at(root, torch.empty(4, dtype=torch.int64))
            assert (collectives._posted is not None) == (rank == root)
        tables.append(collectives.gather_at(root, proposal))
        x = _values(rank, call)
        out = collectives.all_reduce(x)
        assert out.data_ptr() == x.data_ptr()  # written in place
        sums.append(out.clone())
        source = 0 if call % 2 == 0 else world - 1
        table = _values(rank, call) if rank == source else torch.empty(3, 5)
        shared.append(collectives.broadcast(table, source).clone())
    large = torch.full((POINT_TO_POINT_BYTES // 4 + 16,), float(rank + 1))
    result = {"tables": tables, "sums": sums, "shared": shared, "large": collectives.all_reduce(large)}
    root = world - 1
    refused = []
    for other_root, length in [(root, 6), (0, 5)]:  # another shape, another root: refused before a wait
        collectives.expect_gather_at(root, torch.empty(5, dtype=torch.int64))
        try:
            collectives.gather_at(other_root, torch.zeros(length, dtype=torch.int64)) if rank == root else None
        except RuntimeError as exc:
            refused.append(str(exc))
    result["refused"] = refused
    return result


@pytest.mark.timeout(90)
@pytest.mark.parametrize("world", [2, 3])
def test_gather_and_all_reduce_agree_on_every_rank(tmp_path, world):
    calls = 6
    results = spawn_ranks(world, _job, (calls,), tmp_path, timeout=75)
    for call in range(calls):
        expected_table = torch.stack(
            [torch.arange(4, dtype=torch.int64) + 100 * r + 10_000 * call for r in range(world)]
        )
        expected_sum = _values(0, call).clone()
        for r in range(1, world):
            expected_sum += _values(r, call)  # group rank order, as the ranks add
        for rank, result in enumerate(results):
            assert torch.equal(result["tables"][call], expected_table), (rank, call)
            assert torch.equal(result["sums"][call], expected_sum), (rank, call)
            source = 0 if call % 2 == 0 else world - 1
            assert torch.equal(result["shared"][call], _values(source, call)), (rank, call)
    for result in results:
        assert torch.equal(result["large"], torch.full_like(result["large"], world * (world + 1) / 2))
    assert [
        "met receives posted for" in results[-1]["refused"][0],
        "met receives posted at rank" in results[-1]["refused"][1],
    ] == [True, True]
    assert all(result["refused"] == [] for result in results[:-1])
