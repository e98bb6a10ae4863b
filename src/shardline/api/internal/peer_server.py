"""The ``/internal`` routes :class:`shardline.node.peer_client.PeerClient` calls, one for
each of its methods, taking and answering :mod:`shardline.node.wire` messages: membership
(``info``, the table, a free port, runners' reports), tasks and cancellations for this
node's runners, the Responses API's stored responses, and requests run here for another
node (``generate``, streamed as lines). Model files and the link probe have their own
modules beside this one."""

from __future__ import annotations

import math
from collections.abc import AsyncGenerator, AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from shardline.api.response_store import ResponseStore, StoredResponse
from shardline.node.coordinator import free_port
from shardline.node.node import Node
from shardline.node.routing import request_tokens
from shardline.node.signing import MEMBER_HEADER
from shardline.node.table import Instance, InstanceFailedError, NoInstanceError
from shardline.node.wire import (
    CancelMessage,
    Delivered,
    ForgottenResponse,
    FreePort,
    KeepAliveMessage,
    NodeInfo,
    RankReport,
    SharedResponse,
    StateMessage,
    StateReply,
    StreamLine,
    TaskMessage,
)
from shardline.runner.protocol import Cancel, PrefillProgress, TokenEvent, TokenRequest


def router(node: Node, stored: ResponseStore) -> APIRouter:
    """Every ``/internal`` route of :class:`~shardline.node.peer_client.PeerClient` but
    the model files' and the link probe's; ``stored``: the Responses API's store, which
    peers share."""
    routes = APIRouter()
    _membership_routes(routes, node)
    _task_routes(routes, node)
    _response_routes(routes, stored)
    return routes


def _membership_routes(routes: APIRouter, node: Node) -> None:
    """``PeerClient.info``, ``state``, ``push_state``, ``free_port``, ``report`` and
    ``keep_alive``."""

    @routes.get("/internal/info")
    async def info(request: Request) -> NodeInfo:
        caller = request.headers.get(MEMBER_HEADER)
        if caller:
            node.add_peer(caller)
        return node.info()

    @routes.get("/internal/state")
    async def get_state() -> StateMessage:
        return StateMessage.of(node.cluster_state)

    @routes.post("/internal/state")
    async def put_state(message: StateMessage):
        """A coordinator's table: adopted when its epoch is newer than this node's, else
        refused with 409 (an older term's, or a replay)."""
        if not await node.apply_state(message.state()):
            return JSONResponse(
                status_code=409,
                content=StateReply(epoch=node.epoch, detail="the state is not newer than this node's").model_dump(
                    mode="json"
                ),
            )
        return StateReply(epoch=node.epoch)

    @routes.get("/internal/free-port")
    async def get_free_port() -> FreePort:
        return FreePort(port=free_port())

    @routes.post("/internal/keep-alive")
    async def keep_alive(message: KeepAliveMessage):
        seconds = math.inf if message.seconds is None else message.seconds
        if not await node.coordinator.keep_alive(message.instance_ids, seconds):
            return JSONResponse(status_code=503, content={"detail": "this node does not coordinate"})
        return {"ok": True}

    @routes.post("/internal/runner-status")
    async def runner_status(report: RankReport):
        if not await node.coordinator.runner_status(report.event()):
            return JSONResponse(status_code=503, content={"detail": "this node does not coordinate"})
        return {"ok": True}


def _task_routes(routes: APIRouter, node: Node) -> None:
    """``PeerClient.deliver`` (a task or a cancellation) and ``generate``."""

    @routes.post("/internal/tasks")
    async def tasks(message: TaskMessage) -> Delivered:
        return Delivered(delivered=node.router.deliver_local(message.instance_id, message.task))

    @routes.post("/internal/cancel")
    async def cancel(message: CancelMessage) -> Delivered:
        return Delivered(delivered=node.router.deliver_local(message.instance_id, Cancel(message.task_id)))

    @routes.post("/internal/generate")
    async def generate(request: TokenRequest):
        routed: Instance | None = None
        try:  # a full queue is a 429 here (QueueFullError), before the stream begins
            routed = node.router.route(
                request.prompt, node.router.ready_instance(request.model_id, request_tokens(request)), local_only=True
            )
            task_id = node.router.reserve(routed, request, bounded=request.sampling.resumed == 0)
        except NoInstanceError:
            task_id = None  # told in the stream
        ran_on: list[str] = []  # the instances it runs on, in order
        events = node.router.generate(request, task_id, lambda inst: ran_on.append(inst.instance_id), routed)
        return StreamingResponse(stream_lines(events, ran_on), media_type="application/x-ndjson")


async def stream_lines(
    events: AsyncGenerator[TokenEvent | PrefillProgress, None], ran_on: list[str]
) -> AsyncIterator[str]:
    """``/internal/generate``'s answer: a :class:`StreamLine` (JSON) a line for each of
    ``events``, each instance it ran on (``ran_on``, as it grows) named before that
    instance's events, and a failure as the last line."""
    named = 0  # of ran_on
    try:
        async for event in events:
            if named < len(ran_on):
                named = len(ran_on)
                yield StreamLine(instance_id=ran_on[-1]).model_dump_json() + "\n"
            line = StreamLine(progress=event) if isinstance(event, PrefillProgress) else StreamLine(token=event)
            yield line.model_dump_json() + "\n"
    except (InstanceFailedError, NoInstanceError) as exc:
        code = exc.code if isinstance(exc, InstanceFailedError) else None
        yield StreamLine(error=str(exc), code=code).model_dump_json() + "\n"
    finally:
        await events.aclose()


def _response_routes(routes: APIRouter, stored: ResponseStore) -> None:
    """``PeerClient.share_response``: a stored response given, or one deleted."""

    @routes.post("/internal/responses")
    async def share_response(message: SharedResponse) -> Delivered:
        entry = StoredResponse.of(message.response, message.items)
        return Delivered(delivered=stored.put(message.response_id, entry))

    @routes.post("/internal/responses/forget")
    async def forget_response(message: ForgottenResponse) -> Delivered:
        return Delivered(delivered=stored.delete(message.response_id))
