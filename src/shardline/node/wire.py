"""What nodes send each other over ``/internal``: one pydantic model per message, so a
malformed message is refused (a 400 naming the field, or a :class:`PeerError` on the
sending side), never half read. :class:`~shardline.node.peer_client.PeerClient` sends
them; ``shardline.api.internal.peer_server`` receives them.

Format: JSON bodies. Domain values that already are frozen dataclasses (the instance
table's :class:`~shardline.node.table.Instance`, a runner's
:class:`~shardline.runner.protocol.Task`) are validated field by field by pydantic, which
also refuses fields they do not have.

Routes: ``GET /internal/info`` -> :class:`NodeInfo`; ``GET /internal/state`` ->
:class:`StateMessage`; ``POST /internal/state`` :class:`StateMessage` -> :class:`StateReply`
(409 when not newer); ``GET /internal/free-port`` -> :class:`FreePort`; ``POST
/internal/runner-status`` :class:`RankReport`; ``POST /internal/tasks``
:class:`TaskMessage` and ``POST /internal/cancel`` :class:`CancelMessage` -> :class:`Delivered`;
``POST /internal/generate`` :class:`~shardline.runner.protocol.TokenRequest` -> lines
of :class:`StreamLine` (NDJSON); ``POST /internal/responses`` :class:`SharedResponse` and
``POST /internal/responses/forget`` :class:`ForgottenResponse` -> :class:`Delivered`; ``POST
/internal/keep-alive`` :class:`KeepAliveMessage` (503 where the node does not coordinate). Model files (``shardline.node.transfer``) and the link
probe (``shardline.node.link_probe``) carry raw bytes.
"""

from __future__ import annotations

import time

from pydantic import BaseModel, ConfigDict

from shardline.node.epochs import Epoch
from shardline.node.state import ClusterState, RankReported
from shardline.node.status import RankStatus
from shardline.node.table import Instance
from shardline.runner.protocol import PrefillProgress, Task, TokenEvent


class Message(BaseModel):
    """A node-to-node message: unknown fields are refused."""

    model_config = ConfigDict(extra="forbid")


class NodeInfo(Message):
    """``GET /internal/info``: a node as its peers see it (the poll that also carries the
    caller's address, so membership goes both ways).

    Bytes are bytes of memory: ``offered_bytes`` what the node offers to models,
    ``committed_bytes`` what ranks placed on it hold, ``free_bytes`` and
    ``available_bytes`` (the same) what is left; ``started_at`` is its start (seconds
    since the epoch: a restart changes it); ``profile`` its measured
    :class:`~shardline.node.profile.HostProfile`; ``links`` the links it measured, by node id;
    ``served`` what the placements it streamed requests of did
    (:meth:`~shardline.placement.served.ServedSpeed.to_dict` each).
    """

    node_id: str
    address: str
    started_at: float
    available_bytes: int
    offered_bytes: int
    committed_bytes: int
    free_bytes: int
    total_bytes: int
    memory_limit_bytes: int | None
    models: dict[str, dict]
    epoch: Epoch
    coordinator: str
    settled: bool
    profile: dict | None
    links: dict[str, dict]
    members: list[str]
    busy: list[str]
    served: list[dict] = []


class StateMessage(Message):
    """The instance table and its epoch: ``GET``/``POST /internal/state`` and the
    ``cluster-state.json`` a node keeps on disk."""

    epoch: Epoch
    instances: list[Instance]

    @classmethod
    def of(cls, state: ClusterState) -> "StateMessage":
        return cls(epoch=state.epoch, instances=list(state.instances.values()))

    def state(self) -> ClusterState:
        return ClusterState(self.epoch, {i.instance_id: i for i in self.instances})


class StateReply(Message):
    """The answer to ``POST /internal/state``: the receiver's epoch after it (200: adopted;
    409: not newer than the one it holds, with ``detail``)."""

    epoch: Epoch
    detail: str | None = None


class FreePort(Message):
    """``GET /internal/free-port``: a TCP port free on the answering node now."""

    port: int


class RankReport(Message):
    """``POST /internal/runner-status``: a node reports its rank of an instance to the
    coordinator (:class:`~shardline.node.state.RankReported`)."""

    instance_id: str
    node_id: str
    status: RankStatus
    error: str | None = None
    loaded: dict | None = None
    fetched: dict | None = None
    peer_lost: bool = False

    def event(self, at: float | None = None) -> RankReported:
        """The event the coordinator applies, taken at ``at`` (default: now, seconds)."""
        return RankReported(
            self.instance_id,
            self.node_id,
            self.status,
            self.error,
            self.loaded,
            self.fetched,
            self.peer_lost,
            time.time() if at is None else at,
        )


class TaskMessage(Message):
    """``POST /internal/tasks``: a task for the rank of ``instance_id`` on the receiver."""

    instance_id: str
    task: Task


class CancelMessage(Message):
    """``POST /internal/cancel``: drop task ``task_id`` from that rank's batch."""

    instance_id: str
    task_id: int


class Delivered(Message):
    """Whether the receiver's runner of the instance took the task or cancellation."""

    delivered: bool


class StreamLine(Message):
    """One line of ``POST /internal/generate``'s stream: exactly one of a token, a
    prefill's progress, the error that ended the request, or the id of the instance that
    runs it (before its first event, and again before the events of another where the
    first failed before any output: the node that forwarded it names it in the
    ``system_fingerprint``)."""

    token: TokenEvent | None = None
    progress: PrefillProgress | None = None
    error: str | None = None
    code: str | None = None  # with error: its EndCode
    instance_id: str | None = None


class SharedResponse(Message):
    """``POST /internal/responses``: a Responses API response another node stored, kept
    here too (:mod:`shardline.api.response_store`), so that any node serves
    ``previous_response_id`` and ``GET /v1/responses/{id}``, after its node died too."""

    response_id: str
    response: dict
    items: list[dict]


class ForgottenResponse(Message):
    """``POST /internal/responses/forget``: a stored response deleted on another node."""

    response_id: str


class KeepAliveMessage(Message):
    """``POST /internal/keep-alive``: a node asks the coordinator to keep instances
    ``seconds`` idle from now before they are unloaded (Ollama's ``keep_alive``; None: for
    ever), as :meth:`~shardline.node.coordinator.Coordinator.keep_alive` records it."""

    instance_ids: list[str]
    seconds: float | None
