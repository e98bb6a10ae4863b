"""Each rank's share of a model for a sharding: the one entry point the coordinator calls."""

from __future__ import annotations

from dataclasses import dataclass

from shardline.models.config import ModelConfig, TensorShare
from shardline.placement.memory import RUNTIME_BASELINE_BYTES, prefill_scratch_bytes
from shardline.placement.pipeline import NodeCapacity, PlacementError, pipeline_layer_ranges
from shardline.placement.ring import ring_admission, ring_working_bytes
from shardline.placement.tensor import tensor_placement, tensor_rank_bytes

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


def model_param_count(config: ModelConfig) -> int:
    """Weight elements of the whole model: layers, embedding, and an untied head."""
    embed = config.vocab_size * config.hidden_size
    return (config.num_layers * config.layer_param_count()
            + embed * (1 if config.tie_word_embeddings else 2))


def resident_bytes_per_weight(config: ModelConfig, weight_file_bytes: int, dtype: str) -> float:
    """Bytes a weight element takes in a runner's memory, on average.

    Quantized GGUF weights stay in the file's bits (:mod:`shardline.models.linear`): about
    the file's bytes per weight, up to 15% more (two int4 planes hold an 8-bit type in 10
    bits, Q6_K takes 9 of its 6.6). 16-bit and float32 files are held in ``dtype``.
    ``weight_file_bytes`` 0 (unknown) counts every weight in ``dtype``.
    """
    if weight_file_bytes <= 0:
        return float(DTYPE_BYTES[dtype])
    per_weight = weight_file_bytes / model_param_count(config)
    if per_weight >= 1.9:  # a 16- or 32-bit file: held in the compute dtype
        return float(DTYPE_BYTES[dtype])
    return min(1.15 * per_weight, float(DTYPE_BYTES[dtype]))


def _runtime_and_scratch(config: ModelConfig, baseline_bytes: int) -> int:
    """What every rank holds besides weights and KV cache: its runtime and the scratch of
    a prefill chunk."""
    largest = 2 * config.intermediate_size * config.hidden_size  # the fused gate/up
    return baseline_bytes + prefill_scratch_bytes(config.hidden_size, config.intermediate_size,
                                                  largest)


def _pipeline_fixed(config: ModelConfig, rank: int, world_size: int, weight_bytes: float) -> int:
    """Bytes a pipeline rank holds outside its layers: the embedding on the first, the
    final norm and head on the last (a tied head on a one-rank shard shares the embedding)."""
    embed = config.vocab_size * config.hidden_size * weight_bytes
    held = embed if rank == 0 else 0
    if rank == world_size - 1 and not (config.tie_word_embeddings and world_size == 1):
        held += embed
    return int(held)


def _ring_working(config: ModelConfig, world_size: int, kv_bytes: int) -> int:
    """Bytes of a ring prefill's working set on each of ``world_size`` ranks."""
    return ring_working_bytes(ring_prefill_chunk(world_size), world_size, config.num_heads,
                              config.num_kv_heads, config.head_dim, config.hidden_size,
                              config.intermediate_size, kv_bytes)


def _kv_hint(kv_cache: int, context: int, max_batch: int) -> str:
    return (f"a KV cache of {max_batch} sequences of {context} tokens is {kv_cache} bytes for "
            f"the whole model: a smaller context or max_batch needs less")


def rank_bytes(config: ModelConfig, sharding: str, shares: list[RankShare], rank: int,
               context: int, max_batch: int, dtype: str = "bfloat16",
               weight_file_bytes: int = 0, baseline_bytes: int = RUNTIME_BASELINE_BYTES) -> int:
    """Bytes rank ``rank`` of a placement (``shares``, one per rank) holds in memory: its
    runtime (``baseline_bytes``), prefill scratch, weights at
    :func:`resident_bytes_per_weight` each, and its KV cache of ``max_batch`` sequences of
    ``context`` tokens in ``dtype`` (a tensor rank only its KV heads); ring adds the
    ring prefill's working set. The same figure :func:`place_ranks` admits by.
    """
    world = len(shares)
    kv_bytes = DTYPE_BYTES[dtype]
    weight_bytes = resident_bytes_per_weight(config, weight_file_bytes, dtype)
    fixed = _runtime_and_scratch(config, baseline_bytes)
    share = shares[rank]
    if sharding == "tensor":
        assert share.tensor_share is not None
        return fixed + tensor_rank_bytes(config, TensorShare.from_dict(share.tensor_share),
                                         context=context, max_batch=max_batch,
                                         weight_bytes=weight_bytes, kv_element_bytes=kv_bytes)
    kv_per_layer = max_batch * context * config.kv_bytes_per_token(kv_bytes) // config.num_layers
    if sharding == "ring":
        return (fixed + int(weight_bytes * model_param_count(config))
                + kv_per_layer * config.num_layers + _ring_working(config, world, kv_bytes))
    layers = share.layer_end - share.layer_start
    per_layer = int(weight_bytes * config.layer_param_count()) + kv_per_layer
    return fixed + _pipeline_fixed(config, rank, world, weight_bytes) + layers * per_layer


def place_ranks(config: ModelConfig, sharding: str, nodes: list[NodeCapacity], context: int,
                max_batch: int, dtype: str = "bfloat16", admit: bool = True,
                weight_file_bytes: int = 0,
                baseline_bytes: int = RUNTIME_BASELINE_BYTES) -> list[RankShare]:
    """Each node's share (node i is rank i) of a model under ``sharding``.

    Each rank must fit :func:`rank_bytes` (runtime, prefill scratch, weights in the file's
    quantization from ``weight_file_bytes``, KV cache, ring's working set) in its node's
    available bytes; a memory refusal also says what the KV cache takes. Without
    ``admit`` (a forced placement) memory refuses nothing: pipeline layer ranges still
    follow the nodes' available bytes, and shapes that cannot split are refused.

    Raises:
        PlacementError: an unknown sharding, or a model that does not fit or split; the
            message names the node and the shortfall in bytes, or the shape that cannot split.
    """
    try:
        return _place(config, sharding, nodes, context, max_batch, dtype, admit,
                      weight_file_bytes, baseline_bytes)
    except PlacementError as exc:
        if "short by" not in str(exc):
            raise
        kv = max_batch * context * config.kv_bytes_per_token(DTYPE_BYTES[dtype])
        raise PlacementError(f"{exc}; {_kv_hint(kv, context, max_batch)}") from None


def _place(config: ModelConfig, sharding: str, nodes: list[NodeCapacity], context: int,
           max_batch: int, dtype: str, admit: bool, weight_file_bytes: int,
           baseline_bytes: int) -> list[RankShare]:
    """:func:`place_ranks` without the KV hint."""
    layers = config.num_layers
    kv_bytes = DTYPE_BYTES[dtype]
    weight_bytes = resident_bytes_per_weight(config, weight_file_bytes, dtype)
    kv_cache = max_batch * context * config.kv_bytes_per_token(kv_bytes)
    fixed = _runtime_and_scratch(config, baseline_bytes)
    if sharding == "pipeline":
        per_layer = int(weight_bytes * config.layer_param_count()) + kv_cache // layers
        rank_fixed = [fixed + _pipeline_fixed(config, r, len(nodes), weight_bytes)
                      for r in range(len(nodes))]
        return [RankShare(s, e) for s, e in
                pipeline_layer_ranges(layers, nodes, per_layer, admit, rank_fixed)]
    if sharding == "tensor":
        shares = tensor_placement(config, nodes, context=context, max_batch=max_batch,
                                  weight_bytes=weight_bytes, kv_element_bytes=kv_bytes,
                                  admit=admit, fixed_bytes=fixed)
        return [RankShare(0, layers, share.to_dict()) for share in shares]
    if sharding == "ring":
        weights = int(weight_bytes * model_param_count(config)) + fixed
        ring_admission(nodes, weights, kv_cache, _ring_working(config, len(nodes), kv_bytes), admit)
        return [RankShare(0, layers) for _ in nodes]
    raise PlacementError(f"sharding {sharding!r} is not supported (supported: {', '.join(SHARDINGS)})")
