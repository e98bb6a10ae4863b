"""Tensor placement: which heads, KV heads and MLP columns each tensor rank holds.

The split is Megatron-LM's (Shoeybi et al., 2019, "Megatron-LM: Training Multi-Billion
Parameter Language Models Using Model Parallelism"): every rank holds every layer, but of
each only a contiguous range of query heads (with the KV heads those heads read) and a
contiguous range of MLP intermediate columns; two all-reduces per layer complete the
outputs. The embedding is held whole by every rank; the final norm and LM head by the
sampling rank (rank 0) only.

Shapes that do not divide evenly are split unevenly rather than refused:

- query heads: as evenly as possible, the larger shares first (SmolLM2-135M's 9 heads on 2
  ranks: 5 and 4), in contiguous ranges;
- KV heads (grouped-query attention): each rank holds the KV heads its query heads read, so
  a KV head whose group of query heads spans two ranks is held and computed by both
  (SmolLM2 on 2 ranks: KV heads 0-1 and 1-2);
- MLP columns: in blocks of 32 (the int4 decode copy quantizes groups of 32 inputs of the
  down projection and packs 16 outputs of gate/up), the larger shares first.

A shape is refused (:class:`PlacementError`) when a rank would get no query head, when the
intermediate size is not a multiple of 32, or when there are fewer blocks of 32 columns
than ranks; a node whose available bytes cannot hold its rank's share is refused with the
shortfall.

Everything here is pure: no torch, no I/O.
"""

from __future__ import annotations

from shardline.models.config import ModelConfig, TensorShare
from shardline.placement.layer_ranges import MemoryShortError, NodeCapacity, PlacementError

COLUMN_BLOCK = 32


def _even(total: int, parts: int) -> list[tuple[int, int]]:
    """``[0, total)`` as ``parts`` contiguous ranges, sizes differing by at most one,
    larger ones first."""
    base, extra = divmod(total, parts)
    ranges, start = [], 0
    for i in range(parts):
        size = base + (1 if i < extra else 0)
        ranges.append((start, start + size))
        start += size
    return ranges


def tensor_shares(config: ModelConfig, world_size: int, whole_experts: bool = False) -> list[TensorShare]:
    """Each of ``world_size`` ranks' heads, KV heads and MLP columns (see the module doc);
    with ``whole_experts`` (expert sharding) each rank's heads and a run of whole experts
    (as even as the count allows, the first ranks one more), all of their columns.

    Raises:
        PlacementError: no ranks, more ranks than query heads, or an intermediate size that
            does not split into at least ``world_size`` blocks of 32 columns; with
            ``whole_experts``, a model with no experts or fewer experts than ranks.
    """
    if world_size < 1:
        raise PlacementError("no nodes to place the model on")
    if world_size > config.num_heads:
        raise PlacementError(
            f"{world_size} tensor ranks but only {config.num_heads} attention heads: "
            f"each tensor rank needs at least one head"
        )
    inter = config.intermediate_size
    if whole_experts:
        if not config.is_moe:
            raise PlacementError(
                f"expert sharding needs a mixture-of-experts model; {config.architecture} has no experts"
            )
        if config.num_experts < world_size:
            raise PlacementError(
                f"{world_size} expert ranks but only {config.num_experts} experts: each rank needs at least one"
            )
        return [
            TensorShare(rank, world_size, heads, _kv_heads(config, heads), (0, inter), experts)
            for rank, (heads, experts) in enumerate(
                zip(_even(config.num_heads, world_size), _even(config.num_experts, world_size))
            )
        ]
    if world_size > 1 and inter % COLUMN_BLOCK:
        raise PlacementError(
            f"intermediate size {inter} is not a multiple of {COLUMN_BLOCK}: the MLP columns "
            f"cannot split in blocks of {COLUMN_BLOCK} across tensor ranks"
        )
    blocks = inter // COLUMN_BLOCK if world_size > 1 else 1
    if blocks < world_size:
        raise PlacementError(
            f"intermediate size {inter} has only {blocks} blocks of {COLUMN_BLOCK} columns "
            f"for {world_size} tensor ranks"
        )
    scale = COLUMN_BLOCK if world_size > 1 else inter
    shares = []
    for rank, (heads, cols) in enumerate(zip(_even(config.num_heads, world_size), _even(blocks, world_size))):
        shares.append(
            TensorShare(
                rank=rank,
                world_size=world_size,
                heads=heads,
                kv_heads=_kv_heads(config, heads),
                columns=(cols[0] * scale, cols[1] * scale),
            )
        )
    return shares


def _kv_heads(config: ModelConfig, heads: tuple[int, int]) -> tuple[int, ...]:
    """The KV heads query heads ``[start, end)`` read, ascending."""
    return tuple(range(config.kv_head_of(heads[0]), config.kv_head_of(heads[1] - 1) + 1))


def tensor_rank_bytes(
    config: ModelConfig,
    share: TensorShare,
    *,
    kv_tokens: int = 0,
    weight_bytes: float = 2.0,
    kv_element_bytes: int = 2,
    vocab_bytes: float | None = None,
) -> int:
    """Bytes one rank needs: its slices of every layer (of every expert of an MoE layer),
    the replicated parts (an MoE layer's router), its KV cache.

    Args:
        weight_bytes: bytes a layer's weight element takes in memory (see
            :func:`shardline.placement.ranks.resident_bytes_per_weight`).
        vocab_bytes: the same for the embedding and LM head (None: ``weight_bytes``).
            Every rank holds the embedding; rank 0 also the LM head (a tied head shares
            the embedding's memory).
        kv_tokens, kv_element_bytes: the KV pool's tokens (all sequences together) and
            bytes per element; a rank caches only its own KV heads.
    """
    d, hd = config.hidden_size, config.head_dim
    q, kv, cols = share.num_heads * hd, share.num_kv_heads * hd, share.num_columns
    e0, e1 = share.expert_range(config)
    linear = d * (q + 2 * kv) + q * d + ((e1 - e0) or 1) * 3 * d * cols
    norms = 2 * d + (2 * hd if config.qk_norm else 0)
    bias = (q + 2 * kv) if config.attention_bias else 0
    router = config.num_experts * d * 8  # float64 on every rank (feed_forward.MixtureOfExperts)
    per_layer = linear * weight_bytes + (norms + bias) * kv_element_bytes + router
    vocab = weight_bytes if vocab_bytes is None else vocab_bytes
    total = config.num_layers * per_layer + config.vocab_size * d * vocab
    if share.rank == 0:
        head = 0 if config.tie_word_embeddings else vocab
        total += config.vocab_size * d * head + d * kv_element_bytes
    kv_cache = 2 * config.num_layers * share.num_kv_heads * hd * kv_element_bytes
    total += kv_cache * kv_tokens
    return int(total)


def tensor_placement(
    config: ModelConfig,
    nodes: list[NodeCapacity],
    *,
    kv_tokens: int = 0,
    weight_bytes: float = 2.0,
    kv_element_bytes: int = 2,
    vocab_bytes: float | None = None,
    admit: bool = True,
    fixed_bytes: int = 0,
    whole_experts: bool = False,
) -> list[TensorShare]:
    """One :class:`TensorShare` per node, in rank order (node i is rank i); with
    ``whole_experts`` expert sharding's (:func:`tensor_shares`).

    Byte arguments as for :func:`tensor_rank_bytes`, plus ``fixed_bytes`` each rank holds
    besides (its runtime and scratch); without ``admit`` (a forced placement) memory is
    not checked.

    Raises:
        PlacementError: the shape cannot split over ``len(nodes)`` ranks (see
            :func:`tensor_shares`), or a node's available bytes cannot hold its rank's
            share; the message names each such node, what it needs, has, and lacks.
    """
    shares = tensor_shares(config, len(nodes), whole_experts)
    if not admit:
        return shares
    short = []
    for node, share in zip(nodes, shares):
        need = (
            tensor_rank_bytes(
                config,
                share,
                kv_tokens=kv_tokens,
                weight_bytes=weight_bytes,
                vocab_bytes=vocab_bytes,
                kv_element_bytes=kv_element_bytes,
            )
            + fixed_bytes
        )
        if need > node.available_bytes:
            short.append(
                f"node {node.node_id} (rank {share.rank}: heads {share.heads[0]}-"
                f"{share.heads[1] - 1}, KV heads {list(share.kv_heads)}, MLP columns "
                f"{share.columns[0]}-{share.columns[1] - 1}"
                + (f", experts {share.experts[0]}-{share.experts[1] - 1}" if share.experts else "")
                + f") needs {need} bytes but has "
                f"{node.available_bytes} available (short by {need - node.available_bytes} bytes)"
            )
    if short:
        raise MemoryShortError("tensor placement does not fit: " + "; ".join(short))
    return shares
