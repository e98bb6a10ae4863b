"""The statuses of an instance and of its ranks: one enum each, used by the table, the
runners' handles and the coordinator's rules."""

from __future__ import annotations

from enum import StrEnum


class RankStatus(StrEnum):
    """A rank's state in the table, and a runner's on its node
    (:class:`~shardline.node.runner_processes.RunnerHandle`)."""

    LOADING = "loading"  # placed; its runner starts or loads
    FETCHING = "fetching"  # its node copies the shard's files from a peer
    READY = "ready"  # its runner serves
    FAILED = "failed"  # its runner (or node) failed
    STOPPED = "stopped"  # stopped because another rank failed, or lost contact with it


class InstanceStatus(StrEnum):
    """An instance's state: loading until every rank is ready; failed for good (a new
    instance is placed instead)."""

    LOADING = "loading"
    READY = "ready"
    FAILED = "failed"
