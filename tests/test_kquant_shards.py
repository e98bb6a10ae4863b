"""A model whose GGUF holds K-quant tensors (Q4_K, Q5_K, Q6_K: 256-weight super-blocks)
loads with the file's values, and tensor-parallel ranks hold exactly their slices of
them, also where a rank's columns start inside a super-block."""

import numpy as np
import pytest
import tiny_models as tm
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from shardline.models.int4_planes import Int4Planes
from shardline.models.packed_groups import PackedGroups
from shardline.models.shard_loader import load_shard, load_tensor_shard
from shardline.models.weights import open_weights
from shardline.placement.tensor import tensor_shares

pytestmark = pytest.mark.timeout(60)

# blk.* tensor -> (GGUF type, shardline module, rows of the module's weight it fills)
K_TENSORS = {
    "blk.0.attn_output.weight": ("Q4_K", "layers.0.attn.o"),
    "blk.0.ffn_down.weight": ("Q6_K", "layers.0.mlp.down"),
    "blk.1.ffn_down.weight": ("Q5_K", "layers.1.mlp.down"),
}


@pytest.fixture(scope="module")
def kquant_gguf(tmp_path_factory):
    import transformers

    transformers.logging.set_verbosity_error()
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    path = tmp_path_factory.mktemp("kquant") / "k.gguf"
    return tm.write_gguf(model, path, arch="llama", random_quants={name: t for name, (t, _) in K_TENSORS.items()})


def file_values(path, name) -> torch.Tensor:
    source = open_weights(path)
    t = source._tensors[name]
    return torch.from_numpy(dequantize(np.ascontiguousarray(t.data), t.tensor_type)).double()


def test_k_quant_weights_hold_the_files_values(kquant_gguf):
    shard = load_shard(open_weights(kquant_gguf), 0, 2, dtype=torch.float32)
    modules = dict(shard.named_modules())
    for name, (type_name, module) in K_TENSORS.items():
        assert open_weights(kquant_gguf)._tensors[name].tensor_type == GGMLQuantizationType[type_name]
        got = modules[module].dequantized(torch.float64)
        expected = file_values(kquant_gguf, name)
        assert (got - expected).abs().max() <= 1e-6 * expected.abs().max(), name
    bf16 = load_shard(open_weights(kquant_gguf), 0, 2, dtype=torch.bfloat16)
    forms = {m: type(dict(bf16.named_modules())[m].parts[0]) for _, m in K_TENSORS.values()}
    assert forms == {
        "layers.0.attn.o": Int4Planes,
        "layers.0.mlp.down": PackedGroups,
        "layers.1.mlp.down": PackedGroups,
    }


@pytest.mark.parametrize("world", [2, 3])
def test_tensor_ranks_hold_exactly_their_columns(kquant_gguf, world):
    whole = dict(load_shard(open_weights(kquant_gguf), 0, 2, dtype=torch.float32).named_modules())
    source = open_weights(kquant_gguf)
    for share in tensor_shares(source.config, world):
        part = dict(load_tensor_shard(open_weights(kquant_gguf), share, dtype=torch.float32).named_modules())
        hd = source.config.head_dim
        spans = {"attn.o": (share.heads[0] * hd, share.heads[1] * hd), "mlp.down": tuple(share.columns)}
        for _, module in K_TENSORS.values():
            start, end = spans[module.split(".", 2)[2]]
            expected = whole[module].dequantized()[:, start:end]
            assert torch.equal(part[module].dequantized(), expected), (module, share)
