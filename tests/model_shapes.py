"""Configs with real models' shapes (no weights), for the placement tests."""

from __future__ import annotations

from shardline.models.config import ModelConfig


def smollm2(**changes) -> ModelConfig:
    """SmolLM2-135M's shape (30 layers, 9 heads, 3 KV heads), unless changed."""
    base = dict(
        architecture="llama",
        num_layers=30,
        hidden_size=576,
        intermediate_size=1536,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        vocab_size=49152,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
    )
    base.update(changes)
    return ModelConfig(**base)


def llama8b() -> ModelConfig:
    """Llama-3-8B's shape."""
    return smollm2(
        num_layers=32,
        hidden_size=4096,
        intermediate_size=14336,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        vocab_size=128256,
        tie_word_embeddings=False,
    )
