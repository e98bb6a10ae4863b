"""A cluster-API request that only the coordinator answers (placing an instance, deleting
one), sent on to it by a node that does not coordinate."""

from __future__ import annotations

from typing import TYPE_CHECKING

from shardline.api.errors import API, error_body
from shardline.node.peer_client import PeerError

if TYPE_CHECKING:
    from shardline.node.node import Node


async def ask_coordinator(node: Node, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
    """Send a cluster-API request to ``node``'s coordinator; its status and JSON body (503
    while ``node``, the next coordinator, still hears the cluster, or when the
    coordinator cannot be reached)."""
    if node.coordinator_id() == node.node_id:
        return 503, error_body(API.CLUSTER, 503, "this node is taking over as coordinator; try again in a few seconds")
    try:
        return await node.peer_client.forward(method, node.address_of(node.coordinator_id()), path, body)
    except PeerError as exc:
        return 503, error_body(API.CLUSTER, 503, f"the coordinator could not be reached: {exc}")
