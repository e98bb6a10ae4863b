"""The quantized decode copy of the linear weights: accuracy and batch independence."""

import pytest
import torch

import tiny_models as tm
from shardline.models.linear import Linear, weight_bytes
from shardline.models.weights import load_shard, open_weights

pytestmark = pytest.mark.timeout(60)


def make_linear(rows: int, cols: int, bits: int, max_rows: int, bias: bool = False,
                weight: torch.Tensor | None = None) -> Linear:
    layer = Linear(cols, rows, bias=bias)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(rows, cols) if weight is None else weight)
        if bias:
            layer.bias.copy_(torch.randn(rows))
    layer.to(torch.bfloat16)
    layer.add_decode_copy(bits, max_rows)
    return layer


@pytest.mark.parametrize("bits, tolerance", [(8, 0.02), (4, 0.15)])
def test_quantized_path_is_close_to_the_bf16_path(bits, tolerance):
    torch.manual_seed(0)
    layer = make_linear(96, 64, bits, max_rows=4, bias=True)
    assert layer.decode_bits == bits
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    exact = torch.nn.functional.linear(x.float(), layer.weight.float(), layer.bias.float())
    got = layer(x).float()
    assert (got - exact).norm() / exact.norm() < tolerance


def test_int4_is_exact_for_weights_on_a_4_bit_grid():
    """A Q4_1-style weight (16 levels per group of 32) survives the int4 copy unchanged."""
    torch.manual_seed(1)
    q = torch.randint(0, 16, (48, 64)).float()
    q[:, ::32] = 0  # every group uses its lowest and highest level, as Q4_1's do
    q[:, 1::32] = 15
    scale = torch.rand(48, 2).repeat_interleave(32, dim=1) / 8 + 0.01
    low = torch.randn(48, 2).repeat_interleave(32, dim=1)
    weight = (q * scale + low).bfloat16().float()
    layer = make_linear(48, 64, 4, max_rows=1, weight=weight)
    x = torch.randn(1, 64, dtype=torch.bfloat16)
    reference = torch.nn.functional.linear(x.float(), layer.weight.float())
    assert (layer(x).float() - reference).abs().max() < 0.05 * reference.abs().max()


def test_int4_falls_back_to_int8_when_groups_do_not_fit():
    assert make_linear(16, 48, 4, max_rows=1).decode_bits == 8


def test_rows_over_the_limit_use_the_bf16_weight():
    torch.manual_seed(1)
    layer = make_linear(32, 32, 4, max_rows=2)
    x = torch.randn(5, 32, dtype=torch.bfloat16)
    assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight))


@pytest.mark.parametrize("bits", [4, 8])
def test_each_row_is_computed_independently_of_the_batch(bits):
    torch.manual_seed(2)
    layer = make_linear(208, 64, bits, max_rows=8)
    x = torch.randn(8, 64, dtype=torch.bfloat16)
    together = layer(x)
    for i in range(8):
        assert torch.equal(layer(x[i : i + 1]), together[i : i + 1])


def test_weight_bytes_counts_the_quantized_copy():
    layer = make_linear(32, 16, 8, max_rows=1)
    assert weight_bytes(layer) == 32 * 16 * 2 + 32 * 16 + 32 * 2


def test_batched_quantized_decode_gives_the_same_greedy_tokens_as_alone(tmp_path):
    model = tm.hf_model("llama", num_layers=3, seed=3)
    tm.save_hf(model, tmp_path)
    shard = load_shard(open_weights(tmp_path), 0, 3, dtype=torch.bfloat16, decode_rows=4)
    assert all(m.decode_bits == 8 for m in shard.modules() if isinstance(m, Linear))
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


def test_gguf_4_bit_weights_get_an_int4_copy():
    from shardline.models.store import default_model_path

    source = open_weights(default_model_path())
    shard = load_shard(source, 29, 30, decode_rows=8)
    bits = {name: m.decode_bits for name, m in shard.named_modules() if isinstance(m, Linear)}
    assert bits["layers.0.mlp.down"] == 4  # Q4_1 in the file
    assert bits["lm_head"] == 8  # the tied embedding is Q8_0 in the file
