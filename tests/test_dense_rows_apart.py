"""A 16- or 32-bit model's decode rows (the compiled dense product,
:func:`shardline.models.native_dequant.dense_gemv`, where it is built; else
:func:`shardline.models.linear.rows_apart_product`): each row's logits are the bits it
gets alone, whatever rows are beside it (other sequences of the batch, a draft's rows),
so a greedy text does not change with either; on every path a bfloat16 model takes (the
fused decode layers, the torch code with the compiled products, the torch code with
torch's). The real model's sizes (SmolLM2 as a bfloat16 safetensors directory): tiny
models' products took one kernel for any row count, SmolLM2's down projection did not (a
row alone got other bits than beside another, and speculation changed a bfloat16
model's greedy text)."""

from __future__ import annotations

import pytest
import tiny_models as tm
import torch
from smollm2_safetensors import write_smollm2_safetensors

from shardline.models import native_dequant
from shardline.models.linear import DenseWeight, rows_apart_product

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def smollm2_dir(tmp_path_factory):
    return write_smollm2_safetensors(tmp_path_factory.mktemp("smollm2-bf16") / "model")


needs_dense_kernel = pytest.mark.skipif(
    not native_dequant.dense_gemv_built(), reason="the compiled dense product needs AVX-512 BF16"
)


@pytest.mark.parametrize(
    "dtype, path",
    [
        pytest.param(torch.bfloat16, "fused", marks=needs_dense_kernel),
        pytest.param(torch.bfloat16, "compiled products", marks=needs_dense_kernel),
        (torch.bfloat16, "torch"),
        (torch.float32, "torch"),
    ],
)
def test_each_decode_row_gets_the_bits_it_gets_alone(smollm2_dir, dtype, path, monkeypatch):
    from shardline.models.shard_loader import load_shard
    from shardline.models.weights import open_weights

    if path == "torch":
        monkeypatch.setattr(DenseWeight, "compiled", lambda self: False)
    source = open_weights(smollm2_dir)
    shard = load_shard(source, 0, source.config.num_layers, dtype=dtype)
    assert (shard.fused is not None) == (path != "torch")
    if path == "compiled products":
        shard.fused = None  # the torch code, its products the compiled ones
    cache = tm.new_cache(shard, slots=2, context=128)
    prompt = list(range(100, 140))
    start = len(prompt)
    shard(torch.tensor(prompt), shard.prefill_batch(0, 0, start, want_logits=True), cache)
    rows = [17, 4_000, 12, 900, 31_000, 5]
    alone = []  # each token decoded alone after those before it, in slot 1
    for j, token in enumerate(rows):
        cache.copy(0, 1, start + j)
        alone.append(shard(torch.tensor([token]), shard.decode_batch([1], [start + j]), cache)[0])
        cache.k[0][1, :, start + j + 1 :].zero_()
        for t in cache.k + cache.v:  # its row kept for the next: decode it where it belongs
            t[0, :, start + j].copy_(t[1, :, start + j])
    for k in (2, 3, len(rows)):
        together = shard(torch.tensor(rows[:k]), shard.decode_batch([0] * k, list(range(start, start + k))), cache)
        for j in range(k):
            assert torch.equal(together[j], alone[j]), (k, j)


@pytest.mark.fast
@needs_dense_kernel
@pytest.mark.parametrize("K", [1536, 592])  # 592: the last 16 columns a half of 32
def test_the_compiled_dense_products_rows_are_computed_apart(K):
    torch.manual_seed(0)
    weight = (torch.randn(581, K) * 0.05).to(torch.bfloat16)
    x = torch.randn(64, K).to(torch.bfloat16)
    every = native_dequant.dense_gemv(weight, x)
    assert every.dtype == torch.float32 and every.shape == (64, 581)
    exact = x.double() @ weight.double().T
    assert float((every.double() - exact).abs().max()) < 1e-5 * float(exact.abs().max())
    for k in (1, 2, 3, 5, 9):
        assert torch.equal(native_dequant.dense_gemv(weight, x[:k]), every[:k]), k
    assert torch.equal(native_dequant.dense_gemv(weight, x[7:8]), every[7:8])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(native_dequant.dense_gemv(weight, x), every)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.fast
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_products_rows_are_computed_apart(dtype):
    torch.manual_seed(0)
    weight = (torch.randn(576, 1536) * 0.05).to(dtype)
    x = torch.randn(64, 1536).to(dtype)
    one = rows_apart_product(x[:1], weight)
    for k in (2, 3, 4, 5, 9):  # a draft's rows, a few sequences (to 64 on the AMD EPYC VM)
        assert torch.equal(rows_apart_product(x[:k], weight)[:1], one), k
    assert rows_apart_product(x[:0], weight).shape == (0, 576)
