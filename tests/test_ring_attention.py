"""Ring attention: the online-softmax merge, the zig-zag split and the ring itself (gloo)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from conftest import free_port_block

from shardline.parallel.ring import RingContext, attend_block, block_bounds, merge, zigzag_offsets


def plain_attention(q, k, v, q_pos, k_pos):
    """Reference: float32 SDPA with an explicit position mask, ``[n, H, d]``."""
    heads, kv_heads = q.shape[1], k.shape[1]
    mask = k_pos.unsqueeze(0) <= q_pos.unsqueeze(1)
    out = F.scaled_dot_product_attention(
        q.float().transpose(0, 1),
        k.float().transpose(0, 1).repeat_interleave(heads // kv_heads, 0),
        v.float().transpose(0, 1).repeat_interleave(heads // kv_heads, 0),
        attn_mask=mask,
    )
    return out.transpose(0, 1)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_merging_blocks_equals_plain_causal_attention_including_a_fully_masked_part(dtype, tol):
    torch.manual_seed(0)
    heads, kv_heads, d = 6, 2, 16
    q_all = torch.randn(40, heads, d, dtype=dtype)
    k_all, v_all = torch.randn(40, kv_heads, d, dtype=dtype), torch.randn(40, kv_heads, d, dtype=dtype)
    positions = torch.arange(40)
    lo, hi = 25, 33  # the query block
    expected = plain_attention(q_all[lo:hi], k_all[:hi], v_all[:hi], positions[lo:hi], positions[:hi])
    q = q_all[lo:hi]
    # keys before the block in three uneven parts, then the block itself (causal)
    out, lse = None, None
    for a, b, causal in [(0, 7, False), (7, 19, False), (19, 25, False), (lo, hi, True)]:
        part = attend_block(q, k_all[a:b], v_all[a:b], causal)
        out, lse = part if out is None else merge(out, lse, *part)
    assert torch.allclose(out, expected, atol=tol)
    # a part no query saw (lse -inf, as for keys after every query) weighs nothing
    unseen = (torch.full_like(out, 7.0), torch.full_like(lse, float("-inf")))
    merged = merge(out, lse, *unseen)
    assert torch.equal(merged[0], out) and torch.equal(merged[1], lse)
    both = merge(*unseen, *unseen)
    assert (both[0] == 0).all() and torch.isinf(both[1]).all()


@pytest.mark.parametrize("length,world", [(100, 2), (101, 3), (7, 3), (3000, 3)])
def test_zigzag_split_partitions_the_chunk_and_balances_causal_work(length, world):
    offsets = [zigzag_offsets(length, world, r) for r in range(world)]
    assert sorted(torch.cat(offsets).tolist()) == list(range(length))
    sizes = [hi - lo for lo, hi in block_bounds(length, world)]
    assert max(sizes) - min(sizes) <= 1
    if length >= 100:
        work = [int((o + 1).sum()) for o in offsets]  # keys each rank's queries see
        assert max(work) / min(work) < 1.05


def _ring_rank(rank, world, port, length, start, result_dir, dtype=torch.float32, d=8):
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(1)  # the same full tensors on every rank
    heads, kv_heads, ctx = 4, 2, 64
    q_all = torch.randn(start + length, heads, d).to(dtype)
    k_all = torch.randn(start + length, kv_heads, d).to(dtype)
    v_all = torch.randn(start + length, kv_heads, d).to(dtype)
    k_cache, v_cache = torch.zeros(2, kv_heads, ctx, d, dtype=dtype), torch.zeros(2, kv_heads, ctx, d, dtype=dtype)
    k_cache[1, :, :start], v_cache[1, :, :start] = k_all[:start].transpose(0, 1), v_all[:start].transpose(0, 1)
    ring = RingContext(
        torch.distributed.group.WORLD, rank, world, slot=1, start=start, length=length, device=torch.device("cpu")
    )
    mine = start + zigzag_offsets(length, world, rank)
    out = ring.attend(q_all[mine], k_all[mine], v_all[mine], k_cache, v_cache)
    torch.save(
        {
            "positions": mine,
            "out": out,
            "k": k_cache[1, :, : start + length].clone(),
            "v": v_cache[1, :, : start + length].clone(),
        },
        f"{result_dir}/{rank}.pt",
    )
    torch.distributed.destroy_process_group()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world,length,start", [(2, 37, 0), (3, 50, 11)])
def test_ring_attention_across_processes_equals_plain_causal_attention(tmp_path, world, length, start):
    mp.spawn(_ring_rank, args=(world, free_port_block(1), length, start, str(tmp_path)), nprocs=world)
    torch.manual_seed(1)
    heads, kv_heads, d = 4, 2, 8
    q_all = torch.randn(start + length, heads, d)
    k_all, v_all = torch.randn(start + length, kv_heads, d), torch.randn(start + length, kv_heads, d)
    positions = torch.arange(start + length)
    expected = plain_attention(q_all[start:], k_all, v_all, positions[start:], positions)
    for rank in range(world):
        got = torch.load(tmp_path / f"{rank}.pt")
        rows = got["positions"] - start
        assert torch.allclose(got["out"].view(-1, heads, d), expected[rows], atol=1e-5)
        # every rank's cache holds the whole chunk's k/v after the ring
        assert torch.equal(got["k"], k_all.transpose(0, 1))
        assert torch.equal(got["v"], v_all.transpose(0, 1))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world,length,start", [(2, 37, 0), (2, 45, 19), (3, 50, 11)])
def test_a_ring_row_has_one_nodes_bits_where_the_compiled_attention_runs(tmp_path, world, length, start):
    """bfloat16 on a CPU with AVX-512 BF16: each rank attends its rows over the cache once
    every block has passed, so a row's bits are those the whole chunk's attention on one
    rank gives (and a prompt resumed from a cached prefix, whose rows run whole, gets the
    cold ring prefill's)."""
    from shardline.models import prefill_attention

    if not prefill_attention.built():
        pytest.skip("the compiled prefill attention is not built on this CPU")
    d = 32
    mp.spawn(
        _ring_rank, args=(world, free_port_block(1), length, start, str(tmp_path), torch.bfloat16, d), nprocs=world
    )
    torch.manual_seed(1)
    heads, kv_heads = 4, 2
    q_all = torch.randn(start + length, heads, d).to(torch.bfloat16)
    k_all = torch.randn(start + length, kv_heads, d).to(torch.bfloat16)
    v_all = torch.randn(start + length, kv_heads, d).to(torch.bfloat16)
    k_cache = torch.zeros(2, kv_heads, 64, d, dtype=torch.bfloat16)
    v_cache = torch.zeros(2, kv_heads, 64, d, dtype=torch.bfloat16)
    k_cache[1, :, : start + length], v_cache[1, :, : start + length] = k_all.transpose(0, 1), v_all.transpose(0, 1)
    whole = prefill_attention.attend(q_all[start:], k_cache, v_cache, 1, start)  # one rank, every row
    for rank in range(world):
        got = torch.load(tmp_path / f"{rank}.pt")
        assert torch.equal(got["out"].view(-1, heads, d), whole[got["positions"] - start])
