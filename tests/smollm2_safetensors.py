"""SmolLM2-135M-Instruct as a Hugging Face safetensors directory, made from the embedded
GGUF: every tensor dequantized by the ``gguf`` library (the file's own values), written in
bfloat16 under the Hugging Face names, q/k rows put back in Hugging Face's order, with the
GGUF's tokenizer and chat template. A real 16-bit model for the tests, with no download.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import save_file

from shardline.models.shard_loader import _unpermute_index
from shardline.models.store import default_model_path
from shardline.models.tokenizer import Tokenizer
from shardline.models.weights import open_weights

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


def write_smollm2_safetensors(directory: Path) -> Path:
    """Write the model into ``directory`` (created); returns it. Takes a few seconds."""
    gguf_path = default_model_path()
    config = open_weights(gguf_path).config
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for t in gguf.GGUFReader(gguf_path).tensors:
        values = np.array(gguf.dequantize(t.data, t.tensor_type), dtype=np.float32)
        values = values.reshape([int(d) for d in reversed(t.shape)])
        if t.name == "token_embd.weight":
            name = "model.embed_tokens.weight"
        elif t.name == "output_norm.weight":
            name = "model.norm.weight"
        else:
            _, layer, kind, _ = t.name.split(".")
            name = f"model.layers.{layer}.{_LAYER_NAMES[kind]}.weight"
            if kind in ("attn_q", "attn_k"):
                heads = config.num_heads if kind == "attn_q" else config.num_kv_heads
                values = values[_unpermute_index(values.shape[0], heads)]
        tensors[name] = torch.from_numpy(np.ascontiguousarray(values)).to(torch.bfloat16)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "hidden_size": config.hidden_size,
                "intermediate_size": config.intermediate_size,
                "num_attention_heads": config.num_heads,
                "num_key_value_heads": config.num_kv_heads,
                "num_hidden_layers": config.num_layers,
                "vocab_size": config.vocab_size,
                "rms_norm_eps": config.rms_norm_eps,
                "rope_theta": config.rope_theta,
                "max_position_embeddings": config.max_position_embeddings,
                "tie_word_embeddings": config.tie_word_embeddings,
                "torch_dtype": "bfloat16",
                "head_dim": config.head_dim,
                "hidden_act": "silu",
            }
        )
    )
    Tokenizer(gguf_path).save(directory)
    return directory
