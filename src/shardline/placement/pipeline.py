"""Pipeline placement: which node holds which layer range.

Layer ranges follow each node's capacity (its available memory), not equal splits, using
the largest-remainder method so the counts add up to the model's layers exactly.
"""

from __future__ import annotations

from dataclasses import dataclass


class PlacementError(ValueError):
    """The model cannot be placed on the given nodes; the message says why."""


@dataclass(frozen=True)
class NodeCapacity:
    """A node as placement sees it: its id and the bytes it can give a model."""

    node_id: str
    available_bytes: int


def pipeline_layer_ranges(
    num_layers: int, nodes: list[NodeCapacity], bytes_per_layer: int
) -> list[tuple[int, int]]:
    """Split ``num_layers`` into one contiguous ``[start, end)`` range per node, in order.

    Each node gets at least one layer and a share proportional to its available bytes.

    Raises:
        PlacementError: no nodes, more nodes than layers, or a node's share does not fit
            (the message names the node and the shortfall in bytes).
    """
    if not nodes:
        raise PlacementError("no nodes to place the model on")
    if len(nodes) > num_layers:
        raise PlacementError(
            f"{len(nodes)} nodes but only {num_layers} layers: each pipeline rank needs a layer"
        )
    total = sum(max(n.available_bytes, 0) for n in nodes)
    if total <= 0:
        shares = [num_layers / len(nodes)] * len(nodes)
    else:
        shares = [num_layers * max(n.available_bytes, 0) / total for n in nodes]
    counts = [max(1, int(s)) for s in shares]
    while sum(counts) > num_layers:  # the max(1, .) floors can overshoot
        i = max(range(len(counts)), key=lambda j: (counts[j] - shares[j], counts[j]))
        counts[i] -= 1
    by_remainder = sorted(range(len(nodes)), key=lambda j: shares[j] - counts[j], reverse=True)
    for j in by_remainder[: num_layers - sum(counts)]:
        counts[j] += 1
    ranges, start = [], 0
    for node, count in zip(nodes, counts):
        need = count * bytes_per_layer
        if need > node.available_bytes:
            raise PlacementError(
                f"node {node.node_id} needs {need} bytes for {count} layers but has "
                f"{node.available_bytes} available (short by {need - node.available_bytes} bytes)"
            )
        ranges.append((start, start + count))
        start += count
    return ranges
