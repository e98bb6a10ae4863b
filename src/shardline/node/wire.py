"""What nodes send each other over ``/internal``: one pydantic model per message, so a
malformed message is a 400 naming the field, never a half-read dict.

Format: JSON bodies; the instance table itself is :class:`~shardline.node.state.ClusterState`'s
``to_dict`` form.
"""

from __future__ import annotations

import time

from pydantic import BaseModel, ConfigDict

from shardline.node.state import RankReported
from shardline.node.status import RankStatus


class RankReport(BaseModel):
    """``POST /internal/runner-status``: a node reports its rank of an instance to the
    coordinator (:class:`~shardline.node.state.RankReported`)."""

    model_config = ConfigDict(extra="forbid")

    instance_id: str
    node_id: str
    status: RankStatus
    error: str | None = None
    loaded: dict | None = None
    fetched: dict | None = None
    peer_lost: bool = False

    def event(self, at: float | None = None) -> RankReported:
        """The event the coordinator applies, taken at ``at`` (default: now, seconds)."""
        return RankReported(self.instance_id, self.node_id, self.status, self.error,
                            self.loaded, self.fetched, self.peer_lost,
                            time.time() if at is None else at)
