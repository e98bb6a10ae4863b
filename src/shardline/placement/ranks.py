"""Each rank's share of a model for a sharding: the one entry point the coordinator calls."""

from __future__ import annotations

from dataclasses import dataclass

from shardline.models.config import ModelConfig
from shardline.placement.pipeline import NodeCapacity, PlacementError, pipeline_layer_ranges
from shardline.placement.ring import ring_admission, ring_working_bytes
from shardline.placement.tensor import tensor_placement

SHARDINGS = ("pipeline", "tensor", "ring")

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclass(frozen=True)
class RankShare:
    """One rank's part: its layer range, and under tensor sharding its heads and columns
    (``TensorShare.to_dict()``)."""

    layer_start: int
    layer_end: int
    tensor_share: dict | None = None


def ring_prefill_chunk(world_size: int, per_rank: int = 512) -> int:
    """Prompt tokens per ring prefill chunk: ``per_rank`` for each rank."""
    return per_rank * world_size


def place_ranks(config: ModelConfig, sharding: str, nodes: list[NodeCapacity], context: int,
                max_batch: int, dtype: str = "bfloat16", admit: bool = True) -> list[RankShare]:
    """Each node's share (node i is rank i) of a model under ``sharding``.

    Memory per rank: linear weights in ``dtype`` for prefill plus their int8 (or int4)
    decode copy (one byte an element at most), embeddings in ``dtype``, the KV cache of
    ``max_batch`` sequences of ``context`` tokens, and for ring the prefill working set.
    Without ``admit`` (a forced placement) memory refuses nothing: pipeline layer ranges
    still follow the nodes' available bytes, and shapes that cannot split are refused.

    Raises:
        PlacementError: an unknown sharding, or a model that does not fit or split; the
            message names the node and the shortfall in bytes, or the shape that cannot split.
    """
    layers = config.num_layers
    embed_bytes = DTYPE_BYTES[dtype]
    weight_bytes = embed_bytes + 1
    kv_cache = max_batch * context * config.kv_bytes_per_token(embed_bytes)
    if sharding == "pipeline":
        per_layer = weight_bytes * config.layer_param_count() + kv_cache // layers
        return [RankShare(s, e) for s, e in pipeline_layer_ranges(layers, nodes, per_layer, admit)]
    if sharding == "tensor":
        shares = tensor_placement(config, nodes, context=context, max_batch=max_batch,
                                  weight_bytes=weight_bytes, embed_bytes=embed_bytes, admit=admit)
        return [RankShare(0, layers, share.to_dict()) for share in shares]
    if sharding == "ring":
        embed = config.vocab_size * config.hidden_size
        head = weight_bytes - embed_bytes if config.tie_word_embeddings else weight_bytes
        weights = weight_bytes * layers * config.layer_param_count() + embed * (embed_bytes + head)
        working = ring_working_bytes(ring_prefill_chunk(len(nodes)), len(nodes), config.num_heads,
                                     config.num_kv_heads, config.head_dim, config.hidden_size,
                                     config.intermediate_size, embed_bytes)
        ring_admission(nodes, weights, kv_cache, working, admit)
        return [RankShare(0, layers) for _ in nodes]
    raise PlacementError(f"sharding {sharding!r} is not supported (supported: {', '.join(SHARDINGS)})")
