"""Mixture-of-experts models (Qwen3-MoE, Mixtral, gpt-oss): tiny random-weight models built with
transformers (the oracle), written as safetensors and as GGUF (each layer's experts as one
3-D tensor, as llama.cpp's converter writes them), run as one shard, as a pipeline of 3, as
2 tensor ranks, and batched."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import tiny_models as tm
import torch
from ranks import spawn_ranks
from test_tensor_parallel import greedy_schedule

from shardline.models.config import ModelConfig, UnsupportedModelError
from shardline.models.kv_cache import KVCache
from shardline.models.shard_loader import load_shard
from shardline.models.weights import WeightFormatError, open_weights
from shardline.parallel.tensor import TensorStage, load_tensor_stage
from shardline.placement.layer_ranges import PlacementError
from shardline.placement.tensor import tensor_shares

LAYERS = 3
FAMILIES = {"qwen3moe": "qwen3moe", "mixtral": "llama", "gpt-oss": "gpt-oss"}  # -> GGUF arch
Q8_0_EXPERTS = ("blk.1.ffn_up_exps.weight", "blk.2.ffn_down_exps.weight")


def _prompts(count: int, vocab: int = tm.VOCAB) -> list[list[int]]:
    g = torch.Generator().manual_seed(17)
    return [
        torch.randint(0, vocab, (int(n),), generator=g).tolist() for n in torch.randint(3, 12, (count,), generator=g)
    ]


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> dict[str, tuple[object, dict[str, object]]]:
    """family -> (the transformers model, {format: path}): safetensors (not gpt-oss's),
    F32 GGUF, and a GGUF with :data:`Q8_0_EXPERTS` in Q8_0 (gpt-oss: MXFP4, as its files
    hold its experts)."""
    out = {}
    for seed, (family, gguf_arch) in enumerate(FAMILIES.items()):
        root = tmp_path_factory.mktemp(family)
        model = tm.hf_model(family, num_layers=LAYERS, seed=seed + 3)
        paths = {"gguf": tm.write_gguf(model, root / "f32.gguf", arch=gguf_arch)}
        if family != "gpt-oss":
            paths["safetensors"] = tm.save_hf(model, root / "hf")
        quantized = {"mxfp4" if family == "gpt-oss" else "q8_0": Q8_0_EXPERTS}
        paths["q8_0"] = tm.write_gguf(model, root / "q8.gguf", arch=gguf_arch, **quantized)
        out[family] = (model, paths)
    return out


def _quantized_oracle(model, path):
    """``model`` with the Q8_0 experts of the GGUF at ``path`` replaced by their values as
    the gguf library dequantizes them."""
    import copy

    from gguf import GGUFReader
    from gguf.quants import dequantize

    model = copy.deepcopy(model)
    tensors = {t.name: t for t in GGUFReader(str(path)).tensors}
    state = model.state_dict()
    for name in Q8_0_EXPERTS:
        layer, kind = int(name.split(".")[1]), name.split(".")[2]
        values = torch.from_numpy(dequantize(tensors[name].data, tensors[name].tensor_type))
        prefix = f"model.layers.{layer}.mlp.experts."
        if model.config.model_type == "gpt_oss":  # [experts, in, out], up at odd columns
            if kind == "ffn_down_exps":
                state[prefix + "down_proj"].copy_(values.transpose(1, 2))
            else:
                state[prefix + "gate_up_proj"][:, :, 1::2].copy_(values.transpose(1, 2))
        elif kind == "ffn_down_exps":
            state[prefix + "down_proj"].copy_(values)
        else:
            width = values.shape[1]
            state[prefix + "gate_up_proj"][:, width:].copy_(values)
    return model


# --- the model as transformers computes it ------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fmt", ["safetensors", "gguf", "q8_0"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_text_and_logits_match_transformers(moe, family, fmt):
    """32 greedy tokens of 5 prompts equal transformers' float32, every step's logits
    within 1e-3 of the largest."""
    model, paths = moe[family]
    if fmt not in paths:
        pytest.skip(f"{family} is read from GGUF only")
    if fmt == "q8_0":
        model = _quantized_oracle(model, paths["q8_0"])
    source = open_weights(paths[fmt])
    assert source.config.is_moe and source.config.num_experts == tm.EXPERTS
    shard = load_shard(source, 0, LAYERS, dtype=torch.float32)
    worst = 0.0
    for prompt in _prompts(5):
        tokens, logits = tm.greedy(shard, prompt, 32)
        expected = tm.hf_logits(model, prompt + tokens[:-1])[len(prompt) - 1 :]
        assert tokens == expected.argmax(dim=-1).tolist()
        got = torch.stack(logits)
        worst = max(worst, ((got - expected).abs().max() / expected.abs().max()).item())
    print(f"\n{family} {fmt}: max relative logit diff {worst:.1e}")
    assert worst <= 1e-3


@pytest.mark.timeout(60)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_shard_reads_only_the_expert_bytes_of_its_layers(moe, family):
    _, paths = moe[family]
    source = open_weights(paths["gguf"])
    load_shard(source, 1, 2, dtype=torch.float32)
    assert {n.split(".")[1] for n in source.tensors_read if n.startswith("blk.")} == {"1"}
    experts = [n for n in source.tensors_read if "_exps.weight" in n]
    assert sorted(set(experts)) == [f"blk.1.ffn_{p}_exps.weight" for p in ("down", "gate", "up")]


# --- pipeline, tensor, batch ----------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_pipeline_of_three_matches_one_shard(moe, family):
    _, paths = moe[family]
    one = load_shard(open_weights(paths["gguf"]), 0, LAYERS, dtype=torch.float32)
    shards = [load_shard(open_weights(paths["gguf"]), i, i + 1, dtype=torch.float32) for i in range(LAYERS)]
    prompt = _prompts(1)[0]
    one_cache, caches = tm.new_cache(one), [tm.new_cache(s) for s in shards]

    def prefill(shard):
        return shard.prefill_batch(0, 0, len(prompt), True)

    expected = one(torch.tensor(prompt), prefill(one), one_cache)
    got = tm.run_pipeline(shards, caches, torch.tensor(prompt), prefill)
    diffs = [(got - expected).abs().max().item()]
    for step in range(6):
        token, pos = int(expected[0].argmax()), len(prompt) + step
        expected = one(torch.tensor([token]), one.decode_batch([0], [pos]), one_cache)
        got = tm.run_pipeline(
            shards, caches, torch.tensor([token]), lambda shard, pos=pos: shard.decode_batch([0], [pos])
        )
        diffs.append((got - expected).abs().max().item())
    assert max(diffs) <= 1e-6, diffs


def _tensor_job(rank, world, path, steps, whole_experts):
    source = open_weights(path)
    share = tensor_shares(source.config, world, whole_experts)[rank]
    stage = load_tensor_stage(source, rank, world, slots=2, context=64, dtype=torch.float32, share=share)
    tokens, logits = greedy_schedule(stage, _prompts(2), steps)
    return {
        "tokens": tokens,
        "logits": logits,
        "columns": stage.shard.share.columns,
        "experts": stage.shard.share.experts,
        "bytes_read": source.bytes_read,
    }


@pytest.mark.timeout(120)
@pytest.mark.parametrize("whole_experts", [False, True], ids=["tensor", "expert"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_two_tensor_ranks_each_hold_half_of_the_experts(moe, family, whole_experts, tmp_path):
    """tensor: each rank holds half the columns of every expert; expert: half the experts,
    whole (and each the whole router), of F32 and Q8_0 (gpt-oss: MXFP4) experts: the two
    ranks' greedy tokens and logits are one rank's."""
    _, paths = moe[family]
    steps = 6
    results = spawn_ranks(2, _tensor_job, (paths["q8_0"], steps, whole_experts), tmp_path, timeout=100)
    source = open_weights(paths["q8_0"])
    shard = load_shard(source, 0, LAYERS, dtype=torch.float32)
    stage = TensorStage(shard, KVCache(source.config, LAYERS, 2, 64, torch.float32), 0, 1)
    tokens, logits = greedy_schedule(stage, _prompts(2), steps)
    assert results[0]["tokens"] == tokens == results[1]["tokens"]
    diff = max((a - b).abs().max().item() for a, b in zip(results[0]["logits"], logits))
    assert diff <= 1e-4, diff
    if whole_experts:
        assert [r["experts"] for r in results] == [(0, tm.EXPERTS // 2), (tm.EXPERTS // 2, tm.EXPERTS)]
        assert [r["columns"] for r in results] == [(0, tm.EXPERT_WIDTH)] * 2
    else:
        assert [r["columns"] for r in results] == [(0, tm.EXPERT_WIDTH // 2), (tm.EXPERT_WIDTH // 2, tm.EXPERT_WIDTH)]
    # Each rank reads about half of the experts' bytes, not all of them.
    expert_bytes = sum(t.n_bytes for t in source.reader.tensors if "_exps" in t.name)
    for r in results:
        assert r["bytes_read"] < source.bytes_read - expert_bytes // 3


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fmt", ["gguf", "q8_0"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_rows_text_at_batch_8_is_its_text_alone(moe, family, fmt):
    """bfloat16, as served: 8 sequences decoded together give each one's tokens alone, and
    the same logits bit for bit (the experts each row runs do not depend on its batch), with
    16-bit experts and with Q8_0 ones (int4 planes)."""
    _, paths = moe[family]
    shard = load_shard(open_weights(paths[fmt]), 0, LAYERS, dtype=torch.bfloat16)
    prompts, steps = _prompts(8), 12
    alone = [tm.greedy(shard, p, steps) for p in prompts]
    cache = tm.new_cache(shard, slots=8, context=64)
    logits = torch.stack([tm.prefill(shard, cache, p, slot=i) for i, p in enumerate(prompts)])
    tokens: list[list[int]] = [[] for _ in prompts]
    for step in range(steps):
        for i, row in enumerate(logits):
            assert torch.equal(row, alone[i][1][step]), (i, step)
            tokens[i].append(int(row.argmax()))
        positions = [len(p) + step for p in prompts]
        logits = tm.decode(shard, cache, [t[-1] for t in tokens], list(range(8)), positions)
    assert tokens == [a[0] for a in alone]


# --- configuration and bad input -------------------------------------------------------------


def test_configs_read_from_hf_and_gguf(moe):
    for family, (model, paths) in moe.items():
        if family == "gpt-oss":
            continue
        hf, gguf = (open_weights(paths[f]).config for f in ("safetensors", "gguf"))
        assert hf == replace(gguf, rms_norm_eps=hf.rms_norm_eps), family  # GGUF's is float32
        assert (hf.num_experts, hf.num_experts_per_tok, hf.intermediate_size) == (
            tm.EXPERTS,
            tm.EXPERTS_PER_TOKEN,
            tm.EXPERT_WIDTH,
        )
        assert hf.architecture == FAMILIES[family]
        d = tm.HIDDEN
        assert hf.layer_param_count() - hf.active_layer_param_count() == (
            (tm.EXPERTS - tm.EXPERTS_PER_TOKEN) * 3 * d * tm.EXPERT_WIDTH
        )


@pytest.mark.parametrize(
    "changes, words",
    [
        ({"num_experts_per_tok": 9}, "chooses 9 experts per token of 8"),
        ({"num_experts_per_tok": 0}, "chooses 0 experts"),
        ({"mlp_only_layers": [1]}, "mix dense MLPs and experts"),
        ({"decoder_sparse_step": 2}, "mix dense MLPs and experts"),
    ],
)
def test_bad_router_configs_are_refused(changes, words):
    cfg = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": 64,
        "intermediate_size": 256,
        "moe_intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": 128,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        **changes,
    }
    with pytest.raises(UnsupportedModelError, match=words):
        ModelConfig.from_hf_config(cfg)


@pytest.mark.timeout(30)
def test_an_expert_tensor_of_the_wrong_shape_is_named(moe, tmp_path):
    model, _ = moe["qwen3moe"]
    import copy

    broken = copy.deepcopy(model)
    with torch.no_grad():
        down = broken.model.layers[1].mlp.experts.down_proj
        broken.model.layers[1].mlp.experts.down_proj = torch.nn.Parameter(down[:, :, :32].clone())
    path = tm.write_gguf(broken, tmp_path / "bad.gguf", arch="qwen3moe")
    with pytest.raises(WeightFormatError, match=r"layer 1 expert 0 down \('blk.1.ffn_down_exps"):
        load_shard(open_weights(path), 0, LAYERS, dtype=torch.float32)
    assert np.prod(down.shape) > 0


def test_expert_sharding_needs_experts_enough_for_its_ranks(moe):
    config = open_weights(moe["qwen3moe"][1]["gguf"]).config
    with pytest.raises(PlacementError, match="9 expert ranks but only 8 experts"):
        tensor_shares(replace(config, num_heads=16, num_kv_heads=16), 9, whole_experts=True)
    dense = replace(config, architecture="qwen3", num_experts=0, num_experts_per_tok=0)
    with pytest.raises(PlacementError, match="expert sharding needs a mixture-of-experts model"):
        tensor_shares(dense, 2, whole_experts=True)
    assert [s.experts for s in tensor_shares(config, 3, whole_experts=True)] == [(0, 3), (3, 6), (6, 8)]
