"""A 16- or 32-bit model's decode rows (:func:`shardline.models.linear.rows_apart_product`):
each row's logits are the bits it gets alone, whatever rows are beside it (other
sequences of the batch, a draft's rows), so a greedy text does not change with either.
The real model's sizes (SmolLM2 as a bfloat16 safetensors directory): tiny models' products
took one kernel for any row count, SmolLM2's down projection did not (a row alone got
other bits than beside another, and speculation changed a bfloat16 model's greedy text)."""

from __future__ import annotations

import pytest
import tiny_models as tm
import torch
from smollm2_safetensors import write_smollm2_safetensors

from shardline.models.linear import rows_apart_product

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def smollm2_dir(tmp_path_factory):
    return write_smollm2_safetensors(tmp_path_factory.mktemp("smollm2-bf16") / "model")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_each_decode_row_gets_the_bits_it_gets_alone(smollm2_dir, dtype):
    from shardline.models.shard_loader import load_shard
    from shardline.models.weights import open_weights

    source = open_weights(smollm2_dir)
    shard = load_shard(source, 0, source.config.num_layers, dtype=dtype)
    assert shard.fused is None  # torch's layers: the products are torch's
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
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_products_rows_are_computed_apart(dtype):
    torch.manual_seed(0)
    weight = (torch.randn(576, 1536) * 0.05).to(dtype)
    x = torch.randn(64, 1536).to(dtype)
    one = rows_apart_product(x[:1], weight)
    for k in (2, 3, 4, 5, 9):  # a draft's rows, a few sequences (to 64 on the AMD EPYC VM)
        assert torch.equal(rows_apart_product(x[:k], weight)[:1], one), k
    assert rows_apart_product(x[:0], weight).shape == (0, 576)
