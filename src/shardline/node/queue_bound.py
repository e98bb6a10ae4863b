"""The bound on requests waiting for an instance: past it a request is refused with 429
and ``Retry-After`` instead of joining the queue.

Where the count is authoritative: requests queue in each rank's engine
(``Engine.waiting``, agreed by every rank, and ``Engine.held``, not yet agreed), which
the node learns from its rank's ``EngineStats`` (``node.engine_stats``) a step late, and
before that in the node's own streams (``node.streams``: requests it took, delivered or
about to be). The node that takes a request and holds a rank of the instance decides;
a node without a rank forwards the request to the node of rank 0, which decides there.
So the count is the instance's agreed queue plus this node's requests it does not show
yet; requests another node is delivering at the same moment are not seen, so a burst
spread over several nodes can overshoot the bound by a few (each node admits at most
the bound's worth more than its own count shows).
"""

from __future__ import annotations

DEFAULT_MAX_WAITING = 64
RETRY_AFTER_S = 2  # seconds a refused client is asked to wait (one request's decode, about)


class QueueFullError(Exception):
    """An instance has as many requests waiting as it takes; retry after ``retry_after_s``
    seconds."""

    def __init__(self, message: str, retry_after_s: int = RETRY_AFTER_S) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


def waiting_count(own: set[int], stats: dict | None) -> int:
    """Requests waiting for an instance as a node with one of its ranks sees them.

    Args:
        own: task ids of the requests this node took for the instance and has not seen
            finish (its streams).
        stats: its rank's last ``EngineStats`` as a dict (``running``, ``waiting``,
            ``held``: task ids; ``free_slots``), or None before the first.

    Returns:
        The tasks the rank shows waiting (agreed, or held before agreement), plus this
        node's tasks it does not show yet: behind those if any wait (first come, first
        served), else those beyond the free slots (each task counted once). Before the
        first stats, all of this node's tasks.
    """
    if stats is None:
        return len(own)
    queued = set(stats.get("waiting", ())) | set(stats.get("held", ()))
    unseen = own - queued - set(stats.get("running", ()))
    if queued:
        return len(queued) + len(unseen)
    return max(0, len(unseen) - int(stats.get("free_slots", 0)))


def admits(waiting: int, max_waiting: int) -> bool:
    """Whether a request may join a queue of ``waiting`` requests (at most ``max_waiting``
    wait; 0 refuses every request that would wait)."""
    return waiting < max_waiting


def retry_after(header: str | None) -> int:
    """The seconds of a ``Retry-After`` header in its delay-seconds form (RFC 9110,
    section 10.2.3); :data:`RETRY_AFTER_S` where it is missing or an HTTP date."""
    if header is not None and header.strip().isdigit():
        return int(header.strip())
    return RETRY_AFTER_S
