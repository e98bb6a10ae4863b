"""The compiled prefill attention (``models/prefill_attention.py``,
``kernels/prefill_attention.c``): close to float32 attention (as close as torch's
bfloat16 one), each row the same bits whatever chunk it is computed in, no key read past
the chunk, and where it runs."""

import pytest
import torch
import torch.nn.functional as F

from shardline.models import prefill_attention

pytestmark = [
    pytest.mark.fast,
    pytest.mark.timeout(60),
    pytest.mark.skipif(
        not prefill_attention.built(), reason="the compiled prefill attention needs AVX-512 BF16 and a C compiler"
    ),
]

POSITIONS = 400


def _caches(kv_heads: int, hd: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random bfloat16 caches ``[2 slots, kv_heads, POSITIONS, hd]``."""
    gen = torch.Generator().manual_seed(seed)
    shape = (2, kv_heads, POSITIONS, hd)
    return (torch.randn(shape, generator=gen) * 0.7).to(torch.bfloat16), torch.randn(shape, generator=gen).to(
        torch.bfloat16
    )


def _queries(n: int, heads: int, hd: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, heads, hd, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def _reference(q, k, v, slot, start, dtype):
    """torch's attention of chunk ``q`` at ``start`` over slot ``slot``, in ``dtype``."""
    n = q.shape[0]
    mask = torch.arange(start + n).unsqueeze(0) <= torch.arange(start, start + n).unsqueeze(1)
    out = F.scaled_dot_product_attention(
        q.to(dtype).transpose(0, 1).unsqueeze(0),
        k[slot : slot + 1, :, : start + n].to(dtype),
        v[slot : slot + 1, :, : start + n].to(dtype),
        attn_mask=mask,
        enable_gqa=True,
    )
    return out.squeeze(0).transpose(0, 1).float()


@pytest.mark.parametrize(
    "heads,kv_heads,hd,start,n",
    [
        (9, 3, 64, 0, 200),  # SmolLM2's heads, a cold first chunk
        (9, 3, 64, 250, 97),  # a resumed chunk
        (12, 2, 128, 30, 150),  # a 1.5B Qwen2's
        (4, 4, 64, 5, 3),  # no grouping, fewer rows than a tile
        (16, 1, 96, 64, 64),  # a head size of neither specialization, 16 heads a KV head
        (30, 1, 64, 70, 3),  # 30 heads a KV head: a task of one row, its last group of vectors short
    ],
)
def test_it_is_as_close_to_float32_attention_as_torchs_bfloat16(heads, kv_heads, hd, start, n):
    k, v = _caches(kv_heads, hd)
    q = _queries(n, heads, hd)
    out = prefill_attention.attend(q, k, v, 1, start)
    assert out.shape == (n, heads, hd) and out.dtype == torch.bfloat16
    exact = _reference(q, k, v, 1, start, torch.float32)
    ours = (out.float() - exact).abs().max().item()
    torchs = (_reference(q, k, v, 1, start, torch.bfloat16) - exact).abs().max().item()
    assert ours <= max(torchs, 2**-8), (ours, torchs)


def test_a_row_has_the_same_bits_in_any_chunk():
    """A prompt's rows cut into chunks anywhere (a cold prefill's, a resumed one's, a
    pipeline's pieces) have the bits of the same rows in one chunk."""
    k, v = _caches(3, 64)
    q = _queries(300, 9, 64)
    whole = prefill_attention.attend(q, k, v, 0, 0)
    for cuts in ([0, 96, 300], [0, 7, 64, 65, 200, 300], [0, 131, 299, 300]):
        parts = [prefill_attention.attend(q[a:b], k, v, 0, a) for a, b in zip(cuts, cuts[1:])]
        assert torch.equal(torch.cat(parts), whole), cuts


def test_no_key_past_the_chunk_is_read():
    """Positions past the chunk's last row (another slot's, or never written) may hold
    anything, NaN included: the rows do not change."""
    k, v = _caches(2, 128)
    q = _queries(70, 4, 128)
    before = prefill_attention.attend(q, k, v, 1, 100)
    k[1, :, 170:] = float("nan")
    v[1, :, 170:] = float("nan")
    k[0], v[0] = float("nan"), float("nan")
    assert torch.equal(prefill_attention.attend(q, k, v, 1, 100), before)


def test_a_strided_query_view_is_read_as_it_is():
    """The layer passes q as a view of its fused q/k rows (row stride beyond the heads)."""
    k, v = _caches(3, 64)
    qk = _queries(50, 12, 64)
    assert torch.equal(
        prefill_attention.attend(qk[:, :9], k, v, 0, 10), prefill_attention.attend(qk[:, :9].contiguous(), k, v, 0, 10)
    )


def test_what_it_takes():
    k, _ = _caches(3, 64)
    assert prefill_attention.takes(_queries(4, 9, 64), k)
    assert not prefill_attention.takes(_queries(4, 9, 64).float(), k.float())  # float32 keeps torch's
    assert not prefill_attention.takes(_queries(4, 9, 48), _caches(3, 48)[0])  # not a multiple of 32
    assert not prefill_attention.takes(_queries(4, 8, 64), k)  # 8 heads over 3 KV heads
    assert not prefill_attention.takes(_queries(4, 9, 64), k.to("meta"))
