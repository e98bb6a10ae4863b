"""The error of a peer that could not be reached or did not answer as a node of this
version does: :mod:`shardline.node.peer_client` raises it, the link meter
(:mod:`shardline.node.link_probe`) catches it. Its own module, without httpx, so neither
imports the other for it."""

from __future__ import annotations


class PeerError(RuntimeError):
    """A peer could not be reached or did not answer as a node of this version does."""
