"""OpenAI's Responses API: ``POST /v1/responses`` (whole or streamed as server-sent events),
``GET`` and ``DELETE /v1/responses/{id}``.

The request is checked and mapped in :mod:`shardline.api.responses_request`, the answer
built in :mod:`shardline.api.responses_output`; responses with ``store`` (the default) are
kept in this node's memory (:mod:`shardline.api.response_store`) for
``previous_response_id``, and in every live peer's (:func:`share`: before the client has
the response whole), so any node serves them. Errors use OpenAI's body
(:func:`shardline.api.openai.error_response`).
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.datastructures import QueryParams

from shardline.api.heartbeat import HEARTBEAT_S, Heartbeat
from shardline.api.metrics import RequestMetrics
from shardline.api.openai import KEEPALIVE_COMMENT, error_body, error_response
from shardline.api.preparation import prepare
from shardline.api.request_body import PARSE_IN_THREAD_BYTES, decode_json_body
from shardline.api.response_store import ResponseStore, StoredResponse
from shardline.api.responses_output import OutputBuilder, Piece, new_id, usage_object
from shardline.api.responses_request import (
    LOGPROBS_INCLUDE,
    ResponsesRequest,
    bad,
    check_fields,
    normalize_input,
    to_generation,
)
from shardline.api.text_stream import APIError, Chunk, Generation, collect_unless_disconnected
from shardline.api.tools import NOT_OFFERED_HEADER
from shardline.node.node import Node
from shardline.node.queue_bound import QueueFullError
from shardline.node.table import InstanceFailedError
from shardline.node.wire import ForgottenResponse, SharedResponse

log = logging.getLogger(__name__)

SHARE_TIMEOUT_S = 2.0
"""How long a node waits for its peers to take a stored response (or its deletion) before
it answers the client (seconds); a peer that did not take it by then may not have it."""

RETRIEVE_QUERY = {"include", "include[]", "stream", "starting_after", "include_obfuscation"}


async def parse_request(request: Request) -> ResponsesRequest:
    """The body of a ``POST /v1/responses``, checked (:func:`check_fields`).

    Raises:
        APIError: 400 for a body that is not UTF-8 JSON, or a field refused or out of range.
    """
    raw = await request.body()
    if len(raw) >= PARSE_IN_THREAD_BYTES:
        return await asyncio.to_thread(lambda: check_fields(decode_json_body(raw)))
    return check_fields(decode_json_body(raw))


def _piece(chunk: Chunk) -> Piece:
    return Piece(chunk.text, chunk.finish, chunk.tool_calls, chunk.logprobs, chunk.reasoning)


def _sse(event: dict) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"


def not_found(response_id: str) -> APIError:
    return APIError(
        404,
        f"Response with id '{response_id}' not found.",
        "invalid_request_error",
        param="response_id",
        code="response_not_found",
    )


def router(
    node: Node,
    metrics: RequestMetrics | None = None,
    store: ResponseStore | None = None,
    heartbeat_s: float = HEARTBEAT_S,
) -> APIRouter:
    """The Responses API's routes on ``node``; stored responses go to ``store`` (a new
    :class:`ResponseStore` with its default bounds when None); a stream sends an SSE
    comment after ``heartbeat_s`` seconds with nothing else to send."""
    api = APIRouter()
    responses = store if store is not None else ResponseStore()

    @api.post("/v1/responses")
    async def create(request: Request):
        return await _create(node, metrics, responses, heartbeat_s, request)

    @api.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str, request: Request):
        try:
            _check_retrieve_query(request.query_params)
            entry = responses.get(response_id)
            if entry is None:
                raise not_found(response_id)
        except APIError as exc:
            return error_response(exc)
        return entry.response

    @api.delete("/v1/responses/{response_id}")
    async def delete(response_id: str):
        if not responses.delete(response_id):
            return error_response(not_found(response_id))
        await share(node, ForgottenResponse(response_id=response_id))
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    return api


async def _create(
    node: Node, metrics: RequestMetrics | None, responses: ResponseStore, heartbeat_s: float, request: Request
) -> Response:
    """``POST /v1/responses``: the response, streamed or whole, continuing a stored one
    where the request names it (404 where none is stored), stored unless the request says
    not (and shared with the peers); 503 where the instance fails, 499 where the client
    left before the whole answer."""
    try:
        req = await parse_request(request)
        history: list[dict] = []
        new_items = normalize_input(req.input, req.model)
        if req.previous_response_id is not None:
            previous = responses.get(req.previous_response_id)
            if previous is None:
                raise APIError(
                    404,
                    f"Previous response with id '{req.previous_response_id}' not found.",
                    param="previous_response_id",
                    code="previous_response_not_found",
                )
            history = previous.conversation()
        gen = await prepare(node, to_generation(req, history, new_items), metrics)
    except APIError as exc:
        return error_response(exc)
    builder = OutputBuilder(req, new_id("resp"), int(time.time()))
    items = history + new_items
    headers = {NOT_OFFERED_HEADER: ", ".join(builder.tools.not_offered)} if builder.tools.not_offered else {}

    async def keep(response: dict) -> None:
        if req.store is not False:
            entry = StoredResponse.of(copy.deepcopy(response), items)
            if responses.put(response["id"], entry):
                await share(
                    node, SharedResponse(response_id=response["id"], response=entry.response, items=list(entry.items))
                )

    if req.stream:
        return StreamingResponse(
            _stream(gen, builder, keep, heartbeat_s),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers},
        )
    try:
        chunks, finish = await collect_unless_disconnected(gen, request)
    except InstanceFailedError as exc:
        return error_response(APIError(503, str(exc), "server_error", code=exc.code))
    if finish is None:  # the client left; nobody reads this
        return JSONResponse(status_code=499, content=error_body("client closed the request", "client_closed"))
    for chunk in chunks:
        builder.feed(_piece(chunk))
    builder.finish(
        finish,
        usage_object(
            len(gen.prompt), gen.completion_tokens, gen.reasoning_tokens, gen.cached_tokens, gen.cache_written
        ),
    )
    await keep(builder.response)
    return JSONResponse(builder.response, headers=headers)


def _check_retrieve_query(query: QueryParams) -> None:
    """Refuse a retrieve's query parameters this server does not take.

    Raises:
        APIError: 400 for an unknown parameter, a stream (background responses are not
            run here), or an include other than the logprobs'.
    """
    for key in query:
        if key not in RETRIEVE_QUERY:
            raise bad(f"Unknown parameter: '{key}'.", key, "unknown_parameter")
    if query.get("stream", "false").lower() not in ("false", "0"):
        raise bad(
            "stream is for background responses, which this server does not run", "stream", "unsupported_parameter"
        )
    for value in query.getlist("include") + query.getlist("include[]"):
        if value != LOGPROBS_INCLUDE:
            raise bad(f"include '{value}' is not supported by this server", "include", "unsupported_parameter")


async def share(node: Node, message: SharedResponse | ForgottenResponse) -> None:
    """Give a stored response, or its deletion, to every live peer at once, and wait for
    them at most :data:`SHARE_TIMEOUT_S` (best effort: a peer that is down, or slow, may
    not have it; it is logged)."""
    peers = node.live_peers()
    if not peers:
        return
    tasks = [asyncio.ensure_future(node.peer_client.share_response(p.address, message)) for p in peers]
    done, pending = await asyncio.wait(tasks, timeout=SHARE_TIMEOUT_S)
    for task in pending:
        task.cancel()
    for peer, task in zip(peers, tasks):
        error = "no answer" if task in pending else task.exception()
        if error is not None:
            log.info("stored response %s not shared with node %s: %s", message.response_id, peer.node_id, error)


async def _stream(gen: Generation, builder: OutputBuilder, keep, heartbeat_s: float) -> AsyncIterator[str]:
    """The server-sent events of a streamed response; ``keep`` stores the finished one."""
    for event in builder.start():
        yield _sse(event)
    finish: str | None = None
    try:
        async for item in gen.texts(heartbeat_s):
            if isinstance(item, Heartbeat):
                yield KEEPALIVE_COMMENT
                continue
            if not isinstance(item, Chunk):  # prefill progress
                continue
            piece = _piece(item)
            for event in builder.feed(piece):
                yield _sse(event)
            finish = piece.finish or finish
    except QueueFullError as exc:  # a forwarded request the rank's node refused
        for event in builder.fail(str(exc), "rate_limit_exceeded"):
            yield _sse(event)
        return
    except InstanceFailedError as exc:
        for event in builder.fail(str(exc), "server_error"):
            yield _sse(event)
        return
    events = builder.finish(
        finish or "stop",
        usage_object(
            len(gen.prompt), gen.completion_tokens, gen.reasoning_tokens, gen.cached_tokens, gen.cache_written
        ),
    )
    await keep(builder.response)  # before the last event: a client may continue from it at once
    for event in events:
        yield _sse(event)
