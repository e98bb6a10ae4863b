"""Which tensors a rank reads (:mod:`shardline.models.rank_reads`): a table over a file's
tensor names, and the rule checked against what the loader reads of tiny GGUF files and a
safetensors directory, rank by rank, for each sharding."""

from __future__ import annotations

import pytest

from shardline.models.config import RankShare, Sharding
from shardline.models.rank_reads import GGUF_NAMING, HF_NAMING, RankReads, rank_tensors, tensors_read

pytestmark = pytest.mark.timeout(120)

P, T, R = Sharding.PIPELINE, Sharding.TENSOR, Sharding.RING

# 4 layers; blk.12 and blk.1x would be taken for blk.1 by a careless match
GGUF_NAMES = [
    "token_embd.weight",
    "output_norm.weight",
    "output.weight",
    "rope_freqs.weight",
    "blk.0.attn_q.weight",
    "blk.1.ffn_down_exps.weight",
    "blk.2.attn_norm.weight",
    "blk.3.ffn_gate_inp.weight",
    "blk.12.attn_q.weight",
    "blk.1x.attn_q.weight",
    "unknown.weight",
]
EVERY = {"rope_freqs.weight"}
LAYER = {
    0: {"blk.0.attn_q.weight"},
    1: {"blk.1.ffn_down_exps.weight"},
    2: {"blk.2.attn_norm.weight"},
    3: {"blk.3.ffn_gate_inp.weight"},
}
EMBED, HEAD = {"token_embd.weight"}, {"output_norm.weight", "output.weight"}


def layers(*indices: int) -> set[str]:
    return set().union(*(LAYER[i] for i in indices))


@pytest.mark.parametrize(
    "sharding, rank, share, tied, expected",
    [
        # a pipeline: the first rank the embedding, the last the final norm and head
        (P, 0, (0, 1), False, EVERY | EMBED | layers(0)),
        (P, 1, (1, 3), False, EVERY | layers(1, 2)),
        (P, 2, (3, 4), False, EVERY | HEAD | layers(3)),
        # tied: the last rank's head is the embedding (the file has no output.weight)
        (P, 2, (3, 4), True, EVERY | HEAD | EMBED | layers(3)),
        (P, 1, (1, 3), True, EVERY | layers(1, 2)),
        (P, 0, (0, 4), False, EVERY | EMBED | HEAD | layers(0, 1, 2, 3)),  # one rank: all it can read
        # ring: every rank the whole model
        (R, 1, (0, 4), False, EVERY | EMBED | HEAD | layers(0, 1, 2, 3)),
        # tensor: every layer and the embedding on each rank, the head on rank 0
        (T, 0, (0, 4), False, EVERY | EMBED | HEAD | layers(0, 1, 2, 3)),
        (T, 1, (0, 4), False, EVERY | EMBED | layers(0, 1, 2, 3)),
        (T, 1, (0, 4), True, EVERY | EMBED | layers(0, 1, 2, 3)),
    ],
)
def test_what_a_rank_reads_of_a_gguf_file(sharding, rank, share, tied, expected):
    config = {"num_layers": 4, "tie_word_embeddings": tied}
    names = [n for n in GGUF_NAMES if not (tied and n == "output.weight")]
    expected = expected - ({"output.weight"} if tied else set())
    assert rank_tensors(names, "gguf", config, sharding, rank, RankShare(*share)) == expected


@pytest.mark.parametrize(
    "reads, tied, expected",
    [
        (RankReads(0, 1, embed=True, head=False), False, {"model.embed_tokens.weight", "model.layers.0.mlp.w"}),
        (
            RankReads(1, 2, embed=False, head=True),
            False,
            {"model.layers.1.mlp.w", "model.norm.weight", "lm_head.weight"},
        ),
        (
            RankReads(1, 2, embed=False, head=True),
            True,
            {"model.layers.1.mlp.w", "model.norm.weight", "lm_head.weight", "model.embed_tokens.weight"},
        ),
    ],
)
def test_what_a_rank_reads_of_a_safetensors_model(reads, tied, expected):
    names = [
        "model.embed_tokens.weight",
        "model.norm.weight",
        "lm_head.weight",
        "model.layers.0.mlp.w",
        "model.layers.1.mlp.w",
        "model.rotary_emb.inv_freq",
    ]
    assert tensors_read(names, HF_NAMING, tied, reads) == expected


def test_the_names_are_the_loaders():
    from shardline.models.weights import GGUFSource, SafetensorsSource

    for naming, source in ((GGUF_NAMING, GGUFSource), (HF_NAMING, SafetensorsSource)):
        assert (naming.embed, naming.norm, naming.head) == tuple(source.TOP_NAMES[k] for k in ("embed", "norm", "head"))
        assert naming.layer.search(source.LAYER_FORMAT.format(layer=7, name="x")).group(1) == "7"


def read_by_loader(path, sharding: Sharding, rank: int, share: RankShare) -> set[str]:
    """The tensors a runner of this rank reads of ``path``: :func:`shard_tensors` as
    ``load_stage`` calls it, each embedding and head read (a block of rows)."""
    from shardline.models.linear import RowBlocks
    from shardline.models.shard_loader import shard_tensors
    from shardline.models.weights import open_weights

    source = open_weights(path)
    if sharding == Sharding.TENSOR:
        from shardline.placement.tensor import tensor_shares

        tensor_share = tensor_shares(source.config, 2)[rank]
        parts = shard_tensors(source, 0, source.config.num_layers, share=tensor_share, head=rank == 0)
    else:
        parts = shard_tensors(source, share.layer_start, share.layer_end)
    for _, value in parts:
        for part in value if isinstance(value, list) else [value]:
            if isinstance(part, RowBlocks):
                part.read(0, 1)
    return set(source.tensors_read)


CASES = [(P, 0, (0, 1)), (P, 1, (1, 3)), (P, 2, (3, 4)), (R, 0, (0, 4)), (T, 0, (0, 4)), (T, 1, (0, 4))]


@pytest.fixture(scope="module")
def model_files(tmp_path_factory):
    """Tiny 4-layer models: a tied llama GGUF with RoPE factors, an untied qwen2 GGUF, a
    qwen3moe GGUF, and an untied llama as safetensors."""
    import numpy as np
    import tiny_models as tm

    tmp = tmp_path_factory.mktemp("reads")
    llama = tm.hf_model("llama", tie=True)
    factors = np.linspace(1.0, 4.0, tm.HEAD_DIM // 2, dtype=np.float32)
    out = {
        "llama-tied": tm.write_gguf(llama, tmp / "llama.gguf", arch="llama", rope_factors=factors),
        "qwen2": tm.write_gguf(tm.hf_model("qwen2"), tmp / "qwen2.gguf", arch="qwen2"),
        "qwen3moe": tm.write_gguf(tm.hf_model("qwen3moe"), tmp / "moe.gguf", arch="qwen3moe"),
    }
    out["safetensors"] = tm.save_hf(tm.hf_model("llama"), tmp / "hf")
    return out


@pytest.mark.parametrize("model", ["llama-tied", "qwen2", "qwen3moe", "safetensors"])
def test_the_rule_is_what_the_loader_reads(model_files, model):
    from shardline.models.weights import open_weights

    path = model_files[model]
    source = open_weights(path)
    fmt = "gguf" if path.suffix == ".gguf" else "safetensors"
    naming = GGUF_NAMING if fmt == "gguf" else HF_NAMING
    for sharding, rank, layers_ in CASES:
        share = RankShare(*layers_)
        expected = read_by_loader(path, sharding, rank, share)
        rule = rank_tensors(source.names(), fmt, source.config.to_dict(), sharding, rank, share)
        if sharding == T:  # every layer's tensors, whole: a few a rank skips (a bias added once) too
            assert expected <= rule and all(naming.layer.search(n) for n in rule - expected), (rank, rule - expected)
        else:
            assert rule == expected, (sharding, rank, share)
    if model == "llama-tied":
        assert "rope_freqs.weight" in expected and "output.weight" not in source.names()
