"""Pipeline placement: which node holds which layer range.

Layer ranges follow each node's capacity (its available memory), not equal splits, using
the largest-remainder method so the counts add up to the model's layers exactly.
"""

from __future__ import annotations

from dataclasses import dataclass


class PlacementError(ValueError):
    """The model cannot be placed on the given nodes; the message says why."""


class MemoryShortError(PlacementError):
    """A node has fewer available bytes than its rank would hold; the message names the
    node and the shortfall ("short by ... bytes")."""


@dataclass(frozen=True)
class NodeCapacity:
    """A node as placement sees it: its id and the bytes it can give a model."""

    node_id: str
    available_bytes: int


def pipeline_layer_ranges(
    num_layers: int,
    nodes: list[NodeCapacity],
    bytes_per_layer: int,
    admit: bool = True,
    fixed_bytes: list[int] | None = None,
) -> list[tuple[int, int]]:
    """Split ``num_layers`` into one contiguous ``[start, end)`` range per node, in order.

    Each node gets at least one layer, at most as many as fit in its available bytes
    less its ``fixed_bytes`` (what its rank holds besides layers: the runtime, the
    embedding on the first rank, the head on the last; default none), and otherwise a
    share proportional to its available bytes (largest remainder first). Without
    ``admit`` (a forced placement) no node is limited to what fits.

    Raises:
        PlacementError: no nodes, more nodes than layers, a node that cannot hold one layer,
            or too little memory in all (the message names the nodes and shortfall in bytes).
    """
    if not nodes:
        raise PlacementError("no nodes to place the model on")
    if len(nodes) > num_layers:
        raise PlacementError(f"{len(nodes)} nodes but only {num_layers} layers: each pipeline rank needs a layer")
    per_layer = max(bytes_per_layer, 1)
    fixed = fixed_bytes or [0] * len(nodes)
    if not admit:
        nodes = [NodeCapacity(n.node_id, max(n.available_bytes, 1)) for n in nodes]
    caps = [max(n.available_bytes - f, 0) // per_layer if admit else num_layers for n, f in zip(nodes, fixed)]
    for node, cap, f in zip(nodes, caps, fixed):
        if cap < 1:
            need = per_layer + f
            raise MemoryShortError(
                f"node {node.node_id} needs at least {need} bytes (one layer and what its "
                f"rank holds besides) but has {node.available_bytes} available (short by "
                f"at least {need - node.available_bytes} bytes)"
            )
    if sum(caps) < num_layers:
        short = (num_layers - sum(caps)) * per_layer
        detail = ", ".join(
            f"node {n.node_id} fits {c} ({n.available_bytes} bytes available, {f} of them "
            f"for what its rank holds besides layers)"
            for n, c, f in zip(nodes, caps, fixed)
        )
        raise MemoryShortError(
            f"{num_layers} layers of {per_layer} bytes need {num_layers * per_layer} bytes; "
            f"{detail}: short by {short} bytes"
        )
    counts = [1] * len(nodes)
    total = sum(n.available_bytes for n in nodes)
    shares = [num_layers * n.available_bytes / total for n in nodes]
    while sum(counts) < num_layers:
        # Give the next layer to the node furthest below its share that still has room.
        room = [j for j in range(len(nodes)) if counts[j] < caps[j]]
        j = max(room, key=lambda j: (shares[j] - counts[j], -j))
        counts[j] += 1
    ranges, start = [], 0
    for count in counts:
        ranges.append((start, start + count))
        start += count
    return ranges
