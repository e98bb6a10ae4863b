"""The benchmark's random mixture-of-experts GGUF (``shardline.bench.moe_model``): its
blocks dequantize (by the ``gguf`` library, the oracle) to zero-mean weights of the chosen
spread, its tensors have the real model's shapes and llama.cpp's Q4_K_M types, and a small
one loads with shardline's loader, tokenizes with SmolLM2's tokenizer, gives finite logits
and routes over all its experts."""

from __future__ import annotations

import math

import numpy as np
import pytest

from shardline.bench import moe_model as mm


@pytest.mark.timeout(30)
@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_K", "Q5_K", "Q6_K", "MXFP4"])
def test_blocks_dequantize_to_zero_mean_weights_of_the_spread_asked(type_name):
    import gguf
    from gguf.quants import dequantize

    rng = np.random.default_rng(1)
    for std in (0.02, 1.0):
        blocks = mm.weight_blocks(type_name, 64, 1024, std, rng)
        values = dequantize(blocks, gguf.GGMLQuantizationType[type_name])
        assert values.shape == (64, 1024) and np.isfinite(values).all()
        # MXFP4's scale is a power of two: its spread within a factor sqrt(2) of std
        assert abs(values.std() / std - 1) < (0.45 if type_name == "MXFP4" else 0.05)
        assert abs(values.mean()) < 0.05 * std


def test_qwen3_30b_a3b_plan_has_its_shapes_and_llama_cpp_q4_k_m_types():
    plans = {p.name: p for p in mm.plan_tensors(mm.SHAPES["qwen3-30b-a3b"], 4, 49152, "q4_k_m")}
    assert plans["blk.0.ffn_gate_exps.weight"].shape == (128, 768, 2048)
    assert plans["blk.0.ffn_down_exps.weight"].shape == (128, 2048, 768)
    assert plans["blk.0.ffn_gate_inp.weight"].shape == (128, 2048)
    assert plans["blk.0.attn_q.weight"].shape == (32 * 128, 2048)
    assert plans["blk.0.attn_k.weight"].shape == (4 * 128, 2048)
    assert plans["blk.0.attn_k_norm.weight"].shape == (128,)
    types = {name: p.type_name for name, p in plans.items()}
    # llama.cpp's use_more_bits picks layers 2 and 3 of 4 for Q6_K attn_v and ffn_down.
    assert [types[f"blk.{i}.ffn_down_exps.weight"] for i in range(4)] == ["Q4_K", "Q4_K", "Q6_K", "Q6_K"]
    assert [types[f"blk.{i}.attn_v.weight"] for i in range(4)] == ["Q4_K", "Q4_K", "Q6_K", "Q6_K"]
    assert {types[f"blk.{i}.ffn_{p}_exps.weight"] for i in range(4) for p in ("gate", "up")} == {"Q4_K"}
    assert types["token_embd.weight"] == "Q4_K" and types["output.weight"] == "Q6_K"
    assert types["blk.0.ffn_gate_inp.weight"] == "F32"
    every_q4_k = {p.name: p.type_name for p in mm.plan_tensors(mm.SHAPES["qwen3-30b-a3b"], 4, 49152, "q4_k")}
    assert {every_q4_k[f"blk.{i}.ffn_down_exps.weight"] for i in range(4)} == {"Q4_K"}


def test_the_dense_qwen2_1_5b_plan_has_its_shapes_biases_and_q4_k_m_types():
    plans = {p.name: p for p in mm.plan_tensors(mm.SHAPES["qwen2-1.5b"], 28, 49152, "q4_k_m")}
    assert plans["blk.0.ffn_gate.weight"].shape == (8960, 1536)
    assert plans["blk.0.ffn_down.weight"].shape == (1536, 8960)
    assert plans["blk.0.attn_k.weight"].shape == (256, 1536) and plans["blk.0.attn_k.bias"].shape == (256,)
    assert "blk.0.attn_output.bias" not in plans and not any("exps" in n or "gate_inp" in n for n in plans)
    types = {name: p.type_name for name, p in plans.items()}
    # use_more_bits of 28 layers: the first 3, the last 4, and every third between
    more = [i for i in range(28) if types[f"blk.{i}.ffn_down.weight"] == "Q6_K"]
    assert more == [i for i in range(28) if i < 3 or i >= 24 or (i - 3) % 3 == 2]
    assert [i for i in range(28) if types[f"blk.{i}.attn_v.weight"] == "Q6_K"] == more
    params = sum(math.prod(p.shape) for p in plans.values())
    assert 1.4e9 < params < 1.6e9  # a 1.5B-class model (its vocabulary SmolLM2's)


@pytest.mark.timeout(60)
def test_a_small_model_loads_tokenizes_and_routes_over_its_experts(tmp_path):
    from shardline.models.gguf_header import open_gguf
    from shardline.models.store import default_model_path
    from shardline.models.weights import open_weights

    path = mm.write_moe_gguf(tmp_path / "moe.gguf", "qwen3moe-small", 2, seed=3)
    shape = mm.SHAPES["qwen3moe-small"]
    source = open_weights(path)
    config = source.config
    assert (config.architecture, config.num_layers, config.hidden_size) == ("qwen3moe", 2, shape.hidden)
    assert (config.num_experts, config.num_experts_per_tok, config.intermediate_size) == (
        shape.experts,
        shape.experts_used,
        shape.expert_width,
    )
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (shape.heads, shape.kv_heads, shape.head_dim)
    assert config.qk_norm and not config.tie_word_embeddings and config.vocab_size == 49152
    types = {t.name: t.tensor_type.name for t in source.reader.tensors}
    # ffn_down_exps rows are an expert's 128 columns: not whole K-quant blocks.
    assert types["blk.0.ffn_down_exps.weight"] == "Q8_0"
    assert types["blk.0.ffn_gate_exps.weight"] == types["blk.0.attn_q.weight"] == "Q4_K"
    # SmolLM2's tokenizer and chat template: every tokenizer.* key, as the gguf library
    # reads the scalars (the token arrays are left out of shardline's metadata) and as
    # this module parses them all. (transformers' GGUF tokenizer, which a node builds
    # once when a model is added, takes tens of seconds here.)
    smollm2 = default_model_path()
    _, theirs = open_gguf(smollm2)
    scalars = {k: v for k, v in theirs.items() if k.startswith("tokenizer.")}
    assert "tokenizer.chat_template" in scalars
    assert {k: v for k, v in source.metadata.items() if k.startswith("tokenizer.")} == scalars
    assert mm._tokenizer_fields(path) == mm._tokenizer_fields(smollm2)

    report = mm.check_model(path, prompt_tokens=48)
    assert math.isfinite(report["logit_std"]) and report["logit_std"] > 0.5
    for layer in report["routing"]:
        assert layer["distinct_experts"] >= shape.experts - 2, report
        assert layer["entropy"] > 0.9, report


def test_gpt_oss_20b_plan_has_its_shapes_mxfp4_experts_and_biases():
    plans = {p.name: p for p in mm.plan_tensors(mm.SHAPES["gpt-oss-20b"], 4, 49152, "q4_k_m")}
    assert plans["blk.0.ffn_gate_exps.weight"].shape == (32, 2880, 2880)
    assert plans["blk.0.ffn_down_exps.bias"].shape == (32, 2880)
    assert plans["blk.0.attn_q.weight"].shape == (64 * 64, 2880)
    assert plans["blk.0.attn_sinks.weight"].shape == (64,)
    assert plans["blk.0.ffn_gate_inp.bias"].shape == (32,)
    assert "blk.0.post_attention_norm.weight" in plans and "blk.0.ffn_norm.weight" not in plans
    types = {name: p.type_name for name, p in plans.items()}
    assert {types[f"blk.{i}.ffn_{p}_exps.weight"] for i in range(4) for p in ("gate", "up", "down")} == {"MXFP4"}
    # rows of 2880 are not whole K-quant blocks
    assert types["blk.0.attn_q.weight"] == types["output.weight"] == "Q8_0"


@pytest.mark.timeout(60)
def test_a_small_gpt_oss_model_loads_with_its_window_yarn_and_sinks(tmp_path):
    from shardline.models.weights import open_weights

    path = mm.write_moe_gguf(tmp_path / "oss.gguf", "gpt-oss-small", 2, seed=4)
    shape = mm.SHAPES["gpt-oss-small"]
    config = open_weights(path).config
    assert (config.architecture, config.num_experts, config.num_experts_per_tok) == ("gpt-oss", 8, 2)
    assert config.sliding_window == shape.sliding_window
    report = mm.check_model(path)  # raises on a logit that is not finite
    assert all(r["distinct_experts"] == shape.experts for r in report["routing"])


@pytest.mark.timeout(120)
def test_a_gpt_oss_ggufs_tokenizer_converts_despite_its_yarn_keys(tmp_path):
    """A gpt-oss GGUF carries rope.scaling keys (llama.cpp's converter writes YaRN's
    factor), which transformers 5.24 misreads and NumPy 2.4 refuses: a node could not add
    one ("cannot read the tokenizer ... only 0-dimensional arrays can be converted")."""
    from shardline.models.tokenizer import Tokenizer, save_tokenizer_files

    path = mm.write_moe_gguf(tmp_path / "oss.gguf", "gpt-oss-small", 1, seed=5)
    save_tokenizer_files(path, tmp_path / "tokenizer")
    tokenizer = Tokenizer(tmp_path / "tokenizer")
    assert tokenizer.decode(tokenizer.encode("Paris is big")) == "Paris is big"
