"""shardline's decoder against transformers' reference implementations (the test oracle).

Tiny random Llama, Qwen2 (q/k/v bias) and Qwen3 (q/k RMSNorm, tied embeddings) models are
saved with ``save_pretrained`` and loaded back with shardline; last-position prefill
logits, every decode step's logits and greedy continuations must agree.

config.json comes in two layouts: the transformers 4.x one of most Hub checkpoints
(top-level ``rope_theta`` / ``rope_scaling``) and the transformers 5 one written by the
pinned transformers (``rope_parameters``).
"""

from __future__ import annotations

import dataclasses

import pytest
import tiny_models as tm
import torch

from shardline.models.shard_loader import load_shard
from shardline.models.weights import open_weights

LOGIT_ATOL = 1e-4
NEW_TOKENS = 8

CASES = [
    pytest.param("llama", 10000.0, None, False, id="llama"),
    pytest.param("qwen2", 1_000_000.0, None, False, id="qwen2"),
    pytest.param("qwen3", 1_000_000.0, None, True, id="qwen3-tied"),
    pytest.param("llama", 500_000.0, tm.LLAMA3_SCALING, False, id="llama3-rope-scaling"),
]


def _prompt(seed: int, length: int = 11) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, tm.VOCAB, (length,), generator=g).tolist()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("layout", ["hub-legacy", "transformers5"])
@pytest.mark.parametrize("arch,rope_theta,rope_scaling,tie", CASES)
def test_matches_transformers(tmp_path, arch, rope_theta, rope_scaling, tie, layout):
    model = tm.hf_model(arch, rope_theta=rope_theta, rope_scaling=rope_scaling, tie=tie)
    tm.save_hf(model, tmp_path, legacy_rope_keys=layout == "hub-legacy")

    source = open_weights(tmp_path)
    config = source.config
    assert config.architecture == arch
    assert config.attention_bias == (arch == "qwen2")
    assert config.qk_norm == (arch == "qwen3")
    assert config.tie_word_embeddings == tie
    shard = load_shard(source, 0, config.num_layers, dtype=torch.float32)

    prompt = _prompt(seed=1)
    # Prefill: last-position logits.
    reference = tm.hf_logits(model, prompt)
    cache = tm.new_cache(shard)
    logits = tm.prefill(shard, cache, prompt)
    prefill_diff = (logits - reference[-1]).abs().max().item()
    assert prefill_diff < LOGIT_ATOL, f"prefill logits differ by {prefill_diff}"

    # Greedy decoding with the KV cache against generate(do_sample=False).
    ours, step_logits = tm.greedy(shard, prompt, NEW_TOKENS)
    with torch.no_grad():
        generated = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            pad_token_id=0,
        )
    theirs = generated[0, len(prompt) :].tolist()
    assert ours == theirs

    # Every decode step's logits against a full forward pass over the whole sequence.
    full = tm.hf_logits(model, prompt + ours)
    expected = full[len(prompt) - 1 : len(prompt) - 1 + len(step_logits)]
    decode_diff = (torch.stack(step_logits) - expected).abs().max().item()
    assert decode_diff < LOGIT_ATOL, f"decode logits differ by {decode_diff}"


@pytest.mark.timeout(30)
def test_llama3_scaling_changes_the_logits(tmp_path):
    """The llama3 case above is sensitive: dropping the scaling changes the logits."""
    model = tm.hf_model("llama", rope_theta=500_000.0, rope_scaling=tm.LLAMA3_SCALING)
    tm.save_hf(model, tmp_path, legacy_rope_keys=True)
    prompt = _prompt(seed=2, length=24)
    scaled = load_shard(open_weights(tmp_path), 0, 4, dtype=torch.float32)
    source = open_weights(tmp_path)
    source.config = dataclasses.replace(source.config, rope_scaling=None)
    unscaled = load_shard(source, 0, 4, dtype=torch.float32)
    a = tm.prefill(scaled, tm.new_cache(scaled), prompt)
    b = tm.prefill(unscaled, tm.new_cache(unscaled), prompt)
    assert (a - b).abs().max().item() > 1e-2


@pytest.mark.timeout(30)
def test_from_hf_config_reads_rope_parameters():
    from shardline.models.config import ModelConfig

    cfg = tm.hf_model("llama", num_layers=1, rope_theta=500_000.0, rope_scaling=tm.LLAMA3_SCALING).config.to_dict()
    assert "rope_theta" not in cfg and "rope_parameters" in cfg  # the transformers 5 layout
    config = ModelConfig.from_hf_config(cfg)
    assert config.rope_theta == 500_000.0
    assert (config.rope_scaling or {}).get("rope_type") == "llama3"
