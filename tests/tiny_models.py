"""Tiny random-weight Llama / Qwen2 / Qwen3 / Qwen3-MoE / Mixtral models for the model tests.

Built with ``transformers`` (used only as a test oracle and as a writer of Hugging Face
checkpoints) and written as safetensors directories or GGUF files. All weights are
re-drawn with a fixed seed so that norms, biases and attention are far from their
trivial initial values (unit norm weights, zero biases, near-uniform attention would
hide mapping mistakes such as swapped norms or a wrong RoPE).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch

from shardline.bench.moe_model import F16_FIELDS, random_quant_blocks  # noqa: F401 (tests import them from here)
from shardline.models.kv_cache import KVCache

VOCAB = 128
HIDDEN = 64
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 16
INTERMEDIATE = 128
EXPERTS = 8
EXPERTS_PER_TOKEN = 2
EXPERT_WIDTH = 64
GPT_OSS_WINDOW = 4

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # Small, so that the tiny head_dim has low, medium and high frequency bands.
    "original_max_position_embeddings": 16,
}


def hf_model(
    arch: str,
    *,
    num_layers: int = 4,
    rope_theta: float = 10000.0,
    rope_scaling: dict | None = None,
    tie: bool = False,
    seed: int = 0,
    vocab: int = VOCAB,
    experts: int = EXPERTS,
    norm_topk_prob: bool = True,
    head_dim: int = HEAD_DIM,
):
    """A float32, eval-mode ``*ForCausalLM`` of ``arch`` ("llama", "qwen2", "qwen3", and
    the mixtures of experts "qwen3moe" and "mixtral", of ``experts`` experts
    :data:`EXPERT_WIDTH` wide, :data:`EXPERTS_PER_TOKEN` a token) with a vocabulary of
    ``vocab`` tokens (49,152 to pair it with SmolLM2's tokenizer: :func:`save_with_tokenizer`);
    ``head_dim``: qwen3's (the others' is :data:`HIDDEN` / :data:`HEADS`)."""
    import transformers

    transformers.logging.set_verbosity_error()
    kwargs = dict(
        vocab_size=vocab,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=num_layers,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        rope_theta=rope_theta,
        tie_word_embeddings=tie,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    if rope_scaling is not None:
        kwargs["rope_scaling"] = dict(rope_scaling)
    if arch == "llama":
        config_cls, model_cls = transformers.LlamaConfig, transformers.LlamaForCausalLM
    elif arch == "qwen2":
        config_cls, model_cls = transformers.Qwen2Config, transformers.Qwen2ForCausalLM
        kwargs["use_sliding_window"] = False
    elif arch == "qwen3":
        config_cls, model_cls = transformers.Qwen3Config, transformers.Qwen3ForCausalLM
        kwargs["head_dim"] = head_dim
        kwargs["use_sliding_window"] = False
    elif arch == "qwen3moe":
        config_cls, model_cls = transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM
        kwargs.update(
            head_dim=HEAD_DIM,
            use_sliding_window=False,
            num_experts=experts,
            num_experts_per_tok=EXPERTS_PER_TOKEN,
            moe_intermediate_size=EXPERT_WIDTH,
            norm_topk_prob=norm_topk_prob,
        )
    elif arch == "mixtral":
        config_cls, model_cls = transformers.MixtralConfig, transformers.MixtralForCausalLM
        kwargs.update(num_local_experts=experts, num_experts_per_tok=EXPERTS_PER_TOKEN, intermediate_size=EXPERT_WIDTH)
    elif arch == "gpt-oss":  # a window of 4 and YaRN from 64 positions, so short prompts see both
        config_cls, model_cls = transformers.GptOssConfig, transformers.GptOssForCausalLM
        del kwargs["rope_theta"]
        kwargs.update(
            head_dim=HEAD_DIM,
            num_local_experts=experts,
            intermediate_size=EXPERT_WIDTH,
            num_experts_per_tok=EXPERTS_PER_TOKEN,
            sliding_window=GPT_OSS_WINDOW,
            rope_parameters={
                "rope_type": "yarn",
                "factor": 8.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "rope_theta": rope_theta,
                "original_max_position_embeddings": 64,
            },
        )
    else:
        raise ValueError(arch)
    config = config_cls(**kwargs)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    randomize(model, seed)
    return model


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int) -> None:
    """Re-draw every parameter: norms near 1, small biases, unit-variance projections."""
    gen = torch.Generator().manual_seed(seed + 1000)
    for name, param in model.named_parameters():
        noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
        if "norm" in name:
            param.copy_(1.0 + 0.3 * noise)
        elif name.endswith(".bias"):
            param.copy_(0.5 * noise)
        elif "embed_tokens" in name:
            param.copy_(noise)
        else:  # nn.Linear weight [out, in], or an MoE's experts' [experts, out, in]
            param.copy_(noise * (1.5 / math.sqrt(param.shape[-1])))


def save_hf(model, directory: Path, *, legacy_rope_keys: bool = False) -> Path:
    """``save_pretrained`` as safetensors.

    With ``legacy_rope_keys`` config.json is rewritten to the transformers 4.x layout found
    in most Hub checkpoints (top-level ``rope_theta`` and ``rope_scaling``) instead of the
    ``rope_parameters`` dict transformers 5 writes.
    """
    directory = Path(directory)
    model.save_pretrained(directory, safe_serialization=True)
    if legacy_rope_keys:
        path = directory / "config.json"
        cfg = json.loads(path.read_text())
        rope = dict(cfg.pop("rope_parameters", None) or {})
        cfg["rope_theta"] = rope.pop("rope_theta", 10000.0)
        cfg["rope_scaling"] = rope if rope.get("rope_type", "default") != "default" else None
        path.write_text(json.dumps(cfg, indent=2))
    return directory


SMOLLM2_VOCAB = 49152


def save_with_tokenizer(directory: Path, *, num_layers: int = 4, seed: int = 0, arch: str = "llama") -> Path:
    """A tiny random ``arch`` model (llama) with SmolLM2's vocabulary, saved as safetensors with the embedded
    SmolLM2 GGUF's tokenizer files beside it, so the directory is a model a runner serves
    and tokenizes (constrained decoding needs a real tokenizer). Takes a few seconds."""
    from shardline.models.store import default_model_path
    from shardline.models.tokenizer import Tokenizer

    save_hf(hf_model(arch, num_layers=num_layers, seed=seed, vocab=SMOLLM2_VOCAB), directory)
    Tokenizer(default_model_path()).save(directory)
    return Path(directory)


def hf_logits(model, tokens: list[int]) -> torch.Tensor:
    """float32 logits ``[len(tokens), vocab]`` of a full forward pass."""
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()


def llama_cpp_permute(weight: np.ndarray, n_head: int) -> np.ndarray:
    """The q/k row permutation of llama.cpp's convert_hf_to_gguf.py for ``llama``."""
    return (
        weight.reshape(n_head, 2, weight.shape[0] // n_head // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def llama3_rope_factors(head_dim: int, theta: float, scaling: dict) -> np.ndarray:
    """``rope_freqs.weight`` as convert_hf_to_gguf.py writes it for Llama 3 scaling."""
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_ctx = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


_GGUF_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


_GPT_OSS_NAMES = {  # llama.cpp's names for gpt-oss's own tensors
    "self_attn.o_proj.bias": "attn_output.bias",
    "self_attn.sinks": "attn_sinks.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
}


def write_gguf(
    model,
    path: Path,
    *,
    arch: str,
    rope_theta: float = 10000.0,
    rope_factors: np.ndarray | None = None,
    q8_0: tuple[str, ...] = (),
    random_quants: dict[str, str] | None = None,
    mxfp4: tuple[str, ...] = (),
) -> Path:
    """Write ``model``'s weights as a GGUF file the way llama.cpp's converter lays them out.

    q/k weights (and biases) of ``llama`` are permuted; ``q8_0`` names GGUF tensors to
    store quantized as Q8_0 (``mxfp4`` as MXFP4), ``random_quants`` tensors to replace by random blocks of a
    GGUF type (``{"blk.0.ffn_down.weight": "Q6_K"}``: the gguf library has no quantizer
    for the K types), and everything else is F32. A tied model gets no output.weight.
    """
    import gguf
    from gguf.quants import quantize

    cfg = model.config
    state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(rope_theta)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    oss = arch == "gpt-oss"
    if oss:
        rope = cfg.rope_parameters
        writer.add_sliding_window(cfg.sliding_window)
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    experts = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None)
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
        if hasattr(cfg, "moe_intermediate_size"):
            writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)

    tensors: dict[str, np.ndarray] = {
        "token_embd.weight": state["model.embed_tokens.weight"],
        "output_norm.weight": state["model.norm.weight"],
    }
    if not cfg.tie_word_embeddings:
        tensors["output.weight"] = state["lm_head.weight"]
    if rope_factors is not None:
        tensors["rope_freqs.weight"] = rope_factors
    for i in range(cfg.num_hidden_layers):
        prefix = f"model.layers.{i}."
        names = dict(_GGUF_NAMES, **(_GPT_OSS_NAMES if oss else {}))
        for hf_name, gguf_name in names.items():
            if prefix + hf_name not in state:
                continue
            tensor = state[prefix + hf_name]
            if arch == "llama" and hf_name.startswith(("self_attn.q_proj", "self_attn.k_proj")):
                heads = cfg.num_attention_heads if "q_proj" in hf_name else cfg.num_key_value_heads
                tensor = llama_cpp_permute(tensor, heads)
            tensors[f"blk.{i}.{gguf_name}"] = tensor
        if oss:  # [experts, in, out], gate and up interleaved: llama.cpp's converter splits them
            gate_up, down = state[prefix + "mlp.experts.gate_up_proj"], state[prefix + "mlp.experts.down_proj"]
            bias = state[prefix + "mlp.experts.gate_up_proj_bias"]
            tensors.update(
                {
                    f"blk.{i}.ffn_gate_inp.weight": state[prefix + "mlp.router.weight"],
                    f"blk.{i}.ffn_gate_inp.bias": state[prefix + "mlp.router.bias"],
                    f"blk.{i}.ffn_gate_exps.weight": gate_up[:, :, ::2].transpose(0, 2, 1),
                    f"blk.{i}.ffn_up_exps.weight": gate_up[:, :, 1::2].transpose(0, 2, 1),
                    f"blk.{i}.ffn_down_exps.weight": down.transpose(0, 2, 1),
                    f"blk.{i}.ffn_gate_exps.bias": bias[:, ::2],
                    f"blk.{i}.ffn_up_exps.bias": bias[:, 1::2],
                    f"blk.{i}.ffn_down_exps.bias": state[prefix + "mlp.experts.down_proj_bias"],
                }
            )
        elif experts:  # the router, and each kind of expert weight as one 3-D tensor
            gate_up = state[prefix + "mlp.experts.gate_up_proj"]  # [experts, 2 * width, hidden]
            width = gate_up.shape[1] // 2
            tensors[f"blk.{i}.ffn_gate_inp.weight"] = state[prefix + "mlp.gate.weight"]
            tensors[f"blk.{i}.ffn_gate_exps.weight"] = gate_up[:, :width]
            tensors[f"blk.{i}.ffn_up_exps.weight"] = gate_up[:, width:]
            tensors[f"blk.{i}.ffn_down_exps.weight"] = state[prefix + "mlp.experts.down_proj"]
    for name, tensor in tensors.items():
        tensor = np.ascontiguousarray(tensor, dtype=np.float32)
        if name in (random_quants or {}):
            qtype = gguf.GGMLQuantizationType[random_quants[name]]
            *outer, cols = tensor.shape
            blocks = cols // gguf.GGML_QUANT_SIZES[qtype][0]
            data = random_quant_blocks(random_quants[name], math.prod(outer), blocks, seed=len(name))
            writer.add_tensor(name, data.reshape(*outer, -1), raw_dtype=qtype)
        elif name in q8_0:
            qtype = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(name, quantize(tensor, qtype), raw_dtype=qtype)
        elif name in mxfp4:
            qtype = gguf.GGMLQuantizationType.MXFP4
            writer.add_tensor(name, quantize(tensor, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, tensor)
    return _written(writer, path)


def _written(writer, path) -> Path:
    """Write a ``gguf.GGUFWriter``'s header, metadata and tensors to ``path``."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)


def q4_k_m_type(name: str, layers: int) -> str:
    """The GGUF type llama.cpp's Q4_K_M gives a 2-D weight of a model with a tied embedding
    (``llama_tensor_get_type`` in its src/llama-quant.cpp): Q6_K for the embedding and for
    ``attn_v`` and ``ffn_down`` of the layers its ``use_more_bits`` picks, Q4_K elsewhere."""
    if name == "token_embd.weight":
        return "Q6_K"
    layer = int(name.split(".")[1])
    more = layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2
    return "Q6_K" if more and name.endswith(("attn_v.weight", "ffn_down.weight")) else "Q4_K"


def write_q4_k_m_gguf(
    path: Path,
    tokenizer_from: Path,
    *,
    layers: int,
    hidden: int,
    intermediate: int,
    heads: int,
    kv_heads: int,
    seed: int = 0,
) -> Path:
    """A Qwen2 GGUF of random weights in llama.cpp's Q4_K_M mix of types
    (:func:`q4_k_m_type`; F32 norms and biases) with a tied embedding and the tokenizer
    metadata (``tokenizer.*``) of the GGUF ``tokenizer_from``: a K-quant model that is
    served like a real one, at any size, without a download. Weights are about 1e-3 in
    magnitude, so activations stay finite."""
    import gguf

    source = gguf.GGUFReader(str(tokenizer_from))
    vocab = len(source.fields["tokenizer.ggml.tokens"].data)
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_block_count(layers)
    writer.add_context_length(4096)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(intermediate)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(1_000_000.0)
    writer.add_vocab_size(vocab)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    for name, field in source.fields.items():
        if name.startswith("tokenizer."):
            sub = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(name, field.contents(), field.types[0], sub)
    head_dim, kv = hidden // heads, hidden // heads * kv_heads
    shapes = {"token_embd.weight": (vocab, hidden)}
    rng = np.random.default_rng(seed)
    vectors = {"output_norm.weight": np.ones(hidden, np.float32)}
    for i in range(layers):
        shapes |= {
            f"blk.{i}.attn_q.weight": (hidden, hidden),
            f"blk.{i}.attn_k.weight": (kv, hidden),
            f"blk.{i}.attn_v.weight": (kv, hidden),
            f"blk.{i}.attn_output.weight": (hidden, hidden),
            f"blk.{i}.ffn_gate.weight": (intermediate, hidden),
            f"blk.{i}.ffn_up.weight": (intermediate, hidden),
            f"blk.{i}.ffn_down.weight": (hidden, intermediate),
        }
        vectors |= {
            f"blk.{i}.attn_norm.weight": np.ones(hidden, np.float32),
            f"blk.{i}.ffn_norm.weight": np.ones(hidden, np.float32),
        }
        for part, size in (("q", hidden), ("k", kv), ("v", kv)):
            vectors[f"blk.{i}.attn_{part}.bias"] = (rng.standard_normal(size) * 0.01).astype(np.float32)
    assert head_dim * heads == hidden
    for n, (name, (rows, cols)) in enumerate(shapes.items()):
        type_name = q4_k_m_type(name, layers)
        qtype = gguf.GGMLQuantizationType[type_name]
        blocks = cols // gguf.GGML_QUANT_SIZES[qtype][0]
        writer.add_tensor(
            name, random_quant_blocks(type_name, rows, blocks, seed=seed + n, scale=1e-4), raw_dtype=qtype
        )
    for name, vector in vectors.items():
        writer.add_tensor(name, vector)
    return _written(writer, path)


# --- driving a shardline shard --------------------------------------------------------


def new_cache(shard, slots: int = 1, context: int = 64) -> KVCache:
    return KVCache(shard.config, shard.layer_end - shard.layer_start, slots, context, shard.dtype)


def run_pipeline(shards, caches, inputs: torch.Tensor, make_batch) -> torch.Tensor:
    """Run ``inputs`` through consecutive shards; ``make_batch(shard)`` describes the step."""
    h = inputs
    for shard, cache in zip(shards, caches):
        h = shard(h, make_batch(shard), cache)
    return h


def prefill(shard, cache, tokens: list[int], *, slot: int = 0, start: int = 0) -> torch.Tensor:
    """Prefill ``tokens`` at positions ``start..``; float32 logits of the last one ``[vocab]``."""
    batch = shard.prefill_batch(slot, start, len(tokens), True)
    return shard(torch.tensor(tokens), batch, cache)[0]


def decode(shard, cache, tokens: list[int], slots: list[int], positions: list[int]) -> torch.Tensor:
    """One decode step; float32 logits ``[len(tokens), vocab]``."""
    batch = shard.decode_batch(slots, positions)
    return shard(torch.tensor(tokens), batch, cache)


def greedy(shard, prompt: list[int], steps: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy continuation with the KV cache; the tokens and each step's logits."""
    cache = new_cache(shard, context=len(prompt) + steps + 1)
    logits = prefill(shard, cache, prompt)
    out, all_logits = [], [logits]
    for step in range(steps):
        token = int(torch.argmax(logits))
        out.append(token)
        if step == steps - 1:
            break
        logits = decode(shard, cache, [token], [0], [len(prompt) + step])[0]
        all_logits.append(logits)
    return out, all_logits
