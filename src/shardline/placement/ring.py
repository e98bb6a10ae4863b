"""Ring placement: every rank holds the whole model; admission checks each node's memory.

A ring instance (sequence-parallel prefill, :mod:`shardline.parallel.ring`) replicates the
weights, so a node joins only if it fits the whole model, the KV cache of the instance's
full context for every slot, and the prefill working set of one ring chunk.
"""

from __future__ import annotations

from shardline.placement.layer_ranges import MemoryShortError, NodeCapacity, PlacementError


def ring_working_bytes(
    chunk_tokens: int,
    world: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    hidden_size: int,
    intermediate_size: int,
    element_bytes: int,
) -> int:
    """Bytes one rank needs beyond weights and KV cache while it prefills a ring chunk.

    Per rank ``n = chunk_tokens / world`` queries attend to a block of n keys at a time:
    float32 scores and weights ``[heads, n, n]`` (twice), the block held and the one in
    flight (k and v, ``[n, kv_heads, head_dim]`` each), and the layer's activations
    (``[n, hidden + 2 * intermediate]`` plus q/k/v) in the compute dtype.
    """
    n = -(-chunk_tokens // world)
    scores = 2 * 4 * num_heads * n * n
    blocks = 2 * 2 * n * num_kv_heads * head_dim * element_bytes
    activations = (
        n * (2 * hidden_size + 2 * intermediate_size + (num_heads + 2 * num_kv_heads) * head_dim) * element_bytes
    )
    return scores + blocks + activations


def ring_admission(
    nodes: list[NodeCapacity], weight_bytes: int, kv_cache_bytes: int, working_bytes: int, admit: bool = True
) -> None:
    """Check that every node fits a full replica: weights + KV cache + working set (bytes);
    without ``admit`` (a forced placement) only that there are 2 nodes or more.

    Raises:
        PlacementError: fewer than 2 nodes, or a node that lacks memory; the message names
            every such node and its shortfall in bytes.
    """
    if len(nodes) < 2:
        raise PlacementError("ring sharding needs at least 2 nodes (it splits the prompt across them)")
    need = weight_bytes + kv_cache_bytes + working_bytes
    short = [n for n in nodes if n.available_bytes < need] if admit else []
    if short:
        detail = ", ".join(
            f"node {n.node_id} has {n.available_bytes} bytes available (short by {need - n.available_bytes} bytes)"
            for n in short
        )
        raise MemoryShortError(
            f"every ring rank holds the whole model: {weight_bytes} bytes of weights + "
            f"{kv_cache_bytes} bytes of KV cache + {working_bytes} bytes of prefill working "
            f"set = {need} bytes; {detail}"
        )
