"""Hashes of a prompt's whole blocks of tokens, each chained over the one before (vLLM's
automatic prefix caching keys its blocks so): the prefix cache's keys
(:mod:`shardline.runner.prefix_cache`) and routing's (:mod:`shardline.node.prefix_routing`).
No torch here: the node process imports it too."""

from __future__ import annotations


def block_hashes(tokens: tuple[int, ...], block: int) -> list[int]:
    """One hash per whole block of ``block`` tokens, each chained over the one before, so
    hash ``i`` names the tokens ``0 .. (i + 1) * block - 1`` (Python's hash of int tuples:
    the same in every process)."""
    hashes: list[int] = []
    previous = 0
    for start in range(0, len(tokens) - block + 1, block):
        previous = hash((previous, *tokens[start : start + block]))
        hashes.append(previous)
    return hashes
