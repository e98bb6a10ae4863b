"""The int8 decode copy of the linear weights: accuracy and batch independence."""

import pytest
import torch

import tiny_models as tm
from shardline.models.linear import Linear, weight_bytes
from shardline.models.weights import load_shard, open_weights

pytestmark = pytest.mark.timeout(60)


def make_linear(rows: int, cols: int, max_rows: int, bias: bool = False) -> Linear:
    layer = Linear(cols, rows, bias=bias)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(rows, cols))
        if bias:
            layer.bias.copy_(torch.randn(rows))
    layer.to(torch.bfloat16)
    layer.add_int8_copy(max_rows)
    return layer


def test_int8_path_is_close_to_the_bf16_path():
    torch.manual_seed(0)
    layer = make_linear(96, 64, max_rows=4, bias=True)
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    exact = torch.nn.functional.linear(x.float(), layer.weight.float(), layer.bias.float())
    got = layer(x).float()
    assert (got - exact).norm() / exact.norm() < 0.02


def test_rows_over_the_limit_use_the_bf16_weight():
    torch.manual_seed(1)
    layer = make_linear(32, 16, max_rows=2)
    x = torch.randn(5, 16, dtype=torch.bfloat16)
    assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight))


def test_each_row_is_computed_independently_of_the_batch():
    torch.manual_seed(2)
    layer = make_linear(200, 64, max_rows=8)
    x = torch.randn(8, 64, dtype=torch.bfloat16)
    together = layer(x)
    for i in range(8):
        assert torch.equal(layer(x[i : i + 1]), together[i : i + 1])


def test_weight_bytes_counts_the_int8_copy():
    layer = make_linear(32, 16, max_rows=1)
    assert weight_bytes(layer) == 32 * 16 * 2 + 32 * 16 + 32 * 2


def test_batched_int8_decode_gives_the_same_greedy_tokens_as_alone(tmp_path):
    model = tm.hf_model("llama", num_layers=3, seed=3)
    tm.save_hf(model, tmp_path)
    shard = load_shard(open_weights(tmp_path), 0, 3, dtype=torch.bfloat16, int8_decode_rows=4)
    prompts = [[5, 9, 2, 7, 1], [3, 3, 8, 1, 4, 6, 2, 9, 11]]

    def run(which: list[int], steps: int = 6) -> dict[int, list[int]]:
        cache = tm.new_cache(shard, slots=2, context=32)
        last = {i: int(torch.argmax(tm.prefill(shard, cache, prompts[i], slot=i))) for i in which}
        out = {i: [last[i]] for i in which}
        for step in range(steps):
            logits = tm.decode(shard, cache, [out[i][-1] for i in which], list(which),
                               [len(prompts[i]) + step for i in which])
            for row, i in enumerate(which):
                out[i].append(int(torch.argmax(logits[row])))
        return out

    together = run([0, 1])
    assert together[0] == run([0])[0]
    assert together[1] == run([1])[1]
