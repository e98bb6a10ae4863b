"""Routing by cached prefix: where a model has several ready instances, a request goes to
the one most likely to hold its prompt's longest prefix in its prefix cache
(:mod:`shardline.runner.prefix_cache`), then to one with a rank on this node, then to the
least loaded, then to the oldest.

Which instance holds what is not asked of the ranks: the node remembers the prompts it
sent to each instance (:class:`PrefixRecord`: a hash chained over every
:data:`ROUTE_BLOCK` tokens, :func:`~shardline.runner.block_hashes.block_hashes`, least
recently used forgotten past what the instance's KV pool holds), as SGLang's cache-aware
router keeps an approximate tree per worker. A conversation that comes back to the same
node (a client talks to one) finds the instance that served its last turn; requests
other nodes sent are not seen, and an instance may have evicted what the record still
names: then the request prefills more, never anything wrong.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from shardline.runner.block_hashes import block_hashes

ROUTE_BLOCK = 64
"""Tokens a routing hash covers (a prefix matches in whole blocks of it)."""


def route_hashes(prompt: Sequence[int]) -> list[int]:
    """The routing hashes of a prompt's whole :data:`ROUTE_BLOCK`-token blocks, each naming
    every token before it."""
    return block_hashes(tuple(prompt), ROUTE_BLOCK)


@dataclass(frozen=True)
class Candidate:
    """A ready instance as routing sees it: the prompt blocks its record matches
    (:meth:`PrefixRecord.matched`), whether it has a rank on this node, the requests this
    node has in flight on it, and when it was placed (seconds since the epoch)."""

    instance_id: str
    matched: int
    local: bool
    load: int
    created_at: float


def choose(candidates: Sequence[Candidate]) -> str | None:
    """The instance a request goes to: the longest matched prefix, then one with a rank
    on this node, then the fewest requests in flight, then the oldest (None: no
    candidate)."""
    if not candidates:
        return None
    best = min(candidates, key=lambda c: (-c.matched, not c.local, c.load, c.created_at))
    return best.instance_id


class PrefixRecord:
    """The routing hashes of the prompts this node sent to each instance, at most
    ``capacity`` blocks an instance, least recently used forgotten first."""

    def __init__(self) -> None:
        self._held: dict[str, OrderedDict[int, None]] = {}

    def matched(self, instance_id: str, hashes: Sequence[int]) -> int:
        """Leading blocks of ``hashes`` the record of ``instance_id`` holds."""
        held = self._held.get(instance_id)
        if not held:
            return 0
        n = 0
        for h in hashes:
            if h not in held:
                break
            n += 1
        return n

    def record(self, instance_id: str, hashes: Sequence[int], capacity: int) -> None:
        """``hashes`` were sent to ``instance_id`` (the most recently used now); the least
        recently used past ``capacity`` blocks are forgotten."""
        held = self._held.setdefault(instance_id, OrderedDict())
        for h in hashes:
            held[h] = None
            held.move_to_end(h)
        while len(held) > max(capacity, 0):
            held.popitem(last=False)

    def keep_only(self, instance_ids: set[str]) -> None:
        """Forget the instances not in ``instance_ids`` (deleted, or placed again)."""
        for gone in self._held.keys() - instance_ids:
            del self._held[gone]
