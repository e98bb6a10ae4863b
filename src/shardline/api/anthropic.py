"""Anthropic-compatible API: ``POST /v1/messages`` (Claude Messages), streamed or not.

Shapes follow Anthropic's Messages API reference: the request's ``system``, ``messages``
(text content, as a string or text blocks), ``max_tokens`` (required), ``temperature``,
``top_p``, ``top_k``, ``stop_sequences``, ``stream``; the ``message`` object with one text
content block, ``stop_reason`` (``end_turn``, ``max_tokens``, ``stop_sequence``) and
``usage``; server-sent events ``message_start``, ``content_block_start``, ``ping``,
``content_block_delta``, ``content_block_stop``, ``message_delta``, ``message_stop``.
Errors use Anthropic's body: ``{"type": "error", "error": {"type", "message"}}``.
"""

from __future__ import annotations

import functools
import json
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from shardline.api.anthropic_request import CountTokensRequest, MessagesRequest, apply_edits
from shardline.api.heartbeat import HEARTBEAT_S, Heartbeat
from shardline.api.metrics import RequestMetrics
from shardline.api.preparation import prepare, tokenize
from shardline.api.request_body import parse_body
from shardline.api.text_stream import APIError, Chunk, Generation, GenerationRequest, collect_unless_disconnected
from shardline.api.tools import NOT_OFFERED_HEADER, ToolCall
from shardline.models.tokenizer import Tokenizer
from shardline.node.node import Node
from shardline.node.queue_bound import QueueFullError
from shardline.node.table import InstanceFailedError

# APIError kinds as Anthropic names them.
_ERROR_TYPES = {
    "invalid_request_error": "invalid_request_error",
    "not_found_error": "not_found_error",
    "server_error": "api_error",
}


def error_body(kind: str, message: str) -> dict:
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(kind, kind), "message": message}}


def error_response(exc: APIError) -> JSONResponse:
    """An :class:`APIError` in Anthropic's format (a model that is loading: 529 overloaded)."""
    if exc.code == "model_not_ready":
        return JSONResponse(status_code=529, content=error_body("overloaded_error", exc.message))
    return JSONResponse(status_code=exc.status, content=error_body(exc.kind, exc.message))


def _stop_reason(gen: Generation, finish: str) -> tuple[str, str | None]:
    """Anthropic's ``stop_reason`` and ``stop_sequence`` for a finish reason."""
    if finish == "length":
        return "max_tokens", None
    if finish == "tool_calls":
        return "tool_use", None
    if gen.stops.matched is not None:
        return "stop_sequence", gen.stops.matched
    return "end_turn", None


async def edited(
    node: Node, req: CountTokensRequest, wait: bool = True, tokenized: tuple[Tokenizer, list[int]] | None = None
) -> tuple[GenerationRequest, list[dict[str, Any]]]:
    """``req`` in the engine's terms after its ``context_management`` edits, and the
    edits applied (Anthropic's ``applied_edits``). Where an edit's trigger counts input
    tokens, the unedited prompt is tokenized first, unless ``tokenized`` gives it (the
    tokenizer and the prompt's ids); ``wait``: for a loading model, as
    :func:`~shardline.api.preparation.tokenize`.

    Raises:
        APIError: as :func:`~shardline.api.preparation.tokenize`.
    """
    if req.context_management is None or not req.context_management.edits:
        return req.to_generation(), []
    input_tokens = None
    count: Callable[[str], int] = len  # where no edit counts tokens, no count is read
    if req.context_management.counts_tokens:
        if tokenized is None:
            _, tokenizer, prompt = await tokenize(node, req.to_generation(), wait=wait)
        else:
            tokenizer, prompt = tokenized
        input_tokens = len(prompt)
        count = functools.partial(_count, tokenizer)
    messages, applied = apply_edits(req.messages, req.context_management, input_tokens, count)
    return req.model_copy(update={"messages": messages}).to_generation(), applied


def _count(tokenizer: Tokenizer, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


def router(node: Node, metrics: RequestMetrics | None = None, heartbeat_s: float = HEARTBEAT_S) -> APIRouter:
    """The Messages API's routes on ``node``; a stream sends a ``ping`` event after
    ``heartbeat_s`` seconds with nothing else to send (a long prefill)."""
    api = APIRouter()

    @api.post("/v1/messages")
    async def messages(request: Request):
        try:
            req = await parse_body(request, MessagesRequest)
            generation, applied = await edited(node, req)
            gen = await prepare(node, generation, metrics)
        except APIError as exc:
            return error_response(exc)
        message_id = f"msg_{uuid.uuid4().hex}"
        headers = {NOT_OFFERED_HEADER: ", ".join(req.not_offered())} if req.not_offered() else {}
        if req.stream:
            return StreamingResponse(
                _stream(gen, req, message_id, applied, heartbeat_s),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers},
            )
        try:
            chunks, finish = await collect_unless_disconnected(gen, request)
        except InstanceFailedError as exc:
            return error_response(APIError(500, str(exc), "server_error"))
        if finish is None:  # the client left; nobody reads this
            return JSONResponse(status_code=499, content=error_body("api_error", "client closed the request"))
        reason, sequence = _stop_reason(gen, finish)
        return JSONResponse(
            dict(
                _message(gen, req, message_id, answer_blocks(req, chunks), applied),
                stop_reason=reason,
                stop_sequence=sequence,
                usage=dict(_input_usage(gen), output_tokens=gen.completion_tokens),
            ),
            headers=headers,
        )

    @api.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request):
        """The prompt's tokens as /v1/messages would count them: ``{"input_tokens": N}``
        (after ``context_management``'s edits)."""
        try:
            req = await parse_body(request, CountTokensRequest)
            _, tokenizer, original = await tokenize(node, req.to_generation(), wait=False)  # not while it loads
            generation, applied = await edited(node, req, wait=False, tokenized=(tokenizer, original))
            prompt = (await tokenize(node, generation, wait=False))[2] if applied else original
        except APIError as exc:
            return error_response(exc)
        answer: dict[str, Any] = {"input_tokens": len(prompt)}
        if req.context_management is not None:
            answer["context_management"] = {"original_input_tokens": len(original)}
        return answer

    return api


def answer_blocks(req: MessagesRequest, chunks: list[Chunk]) -> list[dict]:
    """The ``content`` blocks of a whole answer: a reasoning model's thinking as a
    ``thinking`` block first where ``req`` enabled thinking (with no text where its
    display is omitted), the text (one empty text block where there is neither text nor a
    call), then a ``tool_use`` block per call."""
    text = "".join(c.text for c in chunks)
    calls = [_tool_use(call) for c in chunks for call in c.tool_calls]
    blocks = ([{"type": "text", "text": text}] if text or not calls else []) + calls
    reasoning = "".join(c.reasoning for c in chunks)
    if reasoning and req.thinks:
        blocks.insert(0, _thinking_block(reasoning if req.shows_thinking else ""))
    return blocks


def _message(
    gen: Generation, req: MessagesRequest, message_id: str, content: list[dict], applied: list[dict[str, Any]]
) -> dict:
    message: dict[str, Any] = {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": req.model,
        "content": content,
        "stop_reason": None,
        "stop_sequence": None,
        "usage": dict(_input_usage(gen), output_tokens=0),
    }
    if req.context_management is not None:  # the beta's answer: which edits changed the prompt
        message["context_management"] = {"applied_edits": applied}
    return message


def _input_usage(gen: Generation) -> dict[str, int]:
    """The prompt's part of Anthropic's ``usage``: ``cache_read_input_tokens`` those the
    instance's prefix cache held (:mod:`shardline.runner.prefix_cache`),
    ``cache_creation_input_tokens`` those the request left in it, ``input_tokens`` the
    rest; the three sum to the prompt, as Anthropic's do. Every prompt is cached on its
    own (``cache_control`` marks nothing more); before the request starts (a stream's
    ``message_start``) all count as input."""
    written = min(gen.cache_written, gen.computed_tokens)
    return {
        "input_tokens": gen.computed_tokens - written,
        "cache_creation_input_tokens": written,
        "cache_read_input_tokens": gen.cached_tokens,
    }


def _event(name: str, data: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


def _thinking_block(thinking: str) -> dict:
    """A reasoning model's thinking as a ``thinking`` content block; its ``signature`` is
    empty (nothing here checks the thinking a client sends back)."""
    return {"type": "thinking", "thinking": thinking, "signature": ""}


def _tool_use(call: ToolCall) -> dict:
    """A tool call as a ``tool_use`` content block (``toolu_`` ids, as Anthropic's)."""
    return {
        "type": "tool_use",
        "id": "toolu_" + call.id.removeprefix("call_"),
        "name": call.name,
        "input": json.loads(call.arguments),
    }


async def _stream(
    gen: Generation, req: MessagesRequest, message_id: str, applied: list[dict[str, Any]], heartbeat_s: float
) -> AsyncIterator[str]:
    """Anthropic's events, the blocks of the non-streamed answer's ``content``: where the
    request enabled thinking, a reasoning model's thinking opens a ``thinking`` block
    first (its text as ``thinking_delta`` s unless display is omitted; a
    ``signature_delta`` before its stop); text opens a text block; each tool call is a
    ``tool_use`` block whose input comes as one ``input_json_delta``; text after a call
    opens a new text block; an answer with neither is one empty text block. A ``ping``
    follows ``message_start``, and another each ``heartbeat_s`` seconds with nothing else
    to send."""
    yield _event("message_start", {"type": "message_start", "message": _message(gen, req, message_id, [], applied)})
    yield _event("ping", {"type": "ping"})
    blocks = _Blocks()
    reason, sequence = "end_turn", None
    try:
        async for item in gen.texts(heartbeat_s):
            if isinstance(item, Heartbeat):
                yield _event("ping", {"type": "ping"})
                continue
            if not isinstance(item, Chunk):  # prefill progress
                continue
            for event in blocks.chunk(item, req):
                yield event
            if item.finish is not None:
                reason, sequence = _stop_reason(gen, item.finish)
    except QueueFullError as exc:  # a forwarded request the rank's node refused
        yield _event("error", error_body("rate_limit_error", str(exc)))
        return
    except InstanceFailedError as exc:
        yield _event("error", error_body("api_error", str(exc)))
        return
    for event in blocks.end():
        yield event
    yield _event(
        "message_delta",
        {
            "type": "message_delta",
            "delta": {"stop_reason": reason, "stop_sequence": sequence},
            "usage": dict(_input_usage(gen), output_tokens=gen.completion_tokens),
        },
    )
    yield _event("message_stop", {"type": "message_stop"})


class _Blocks:
    """The content blocks :func:`_stream` has opened: ``index`` the last one's (-1: none
    yet), whether a text or thinking block is open, and whether any text or tool call came
    (``answered``)."""

    def __init__(self) -> None:
        self.index, self.open_text, self.open_thinking, self.answered = -1, False, False, False

    def chunk(self, item: Chunk, req: MessagesRequest) -> list[str]:
        """The events of one chunk of the answer: its thinking, its text, its tool calls."""
        events: list[str] = []
        if item.reasoning and req.thinks:
            events += self._thinking(item.reasoning, req.shows_thinking)
        if item.text or item.tool_calls:
            self.answered = True
            events += self.close_thinking()
        if item.text:
            events += self._text(item.text)
        for call in item.tool_calls:
            events += self._tool_call(call)
        return events

    def _thinking(self, reasoning: str, shows: bool) -> list[str]:
        events = []
        if self.index < 0:  # the output's first block
            self.index, self.open_thinking = 0, True
            events.append(
                _event(
                    "content_block_start",
                    {"type": "content_block_start", "index": 0, "content_block": _thinking_block("")},
                )
            )
        if self.open_thinking and shows:
            events.append(
                _event(
                    "content_block_delta",
                    {
                        "type": "content_block_delta",
                        "index": self.index,
                        "delta": {"type": "thinking_delta", "thinking": reasoning},
                    },
                )
            )
        return events

    def _text(self, text: str) -> list[str]:
        events = []
        if not self.open_text:
            self.index, self.open_text = self.index + 1, True
            events.append(
                _event(
                    "content_block_start",
                    {"type": "content_block_start", "index": self.index, "content_block": {"type": "text", "text": ""}},
                )
            )
        events.append(
            _event(
                "content_block_delta",
                {"type": "content_block_delta", "index": self.index, "delta": {"type": "text_delta", "text": text}},
            )
        )
        return events

    def _tool_call(self, call: ToolCall) -> list[str]:
        events = []
        if self.open_text:
            events.append(_event("content_block_stop", {"type": "content_block_stop", "index": self.index}))
            self.open_text = False
        self.index += 1
        block = _tool_use(call)
        index = self.index
        events += [
            _event(
                "content_block_start",
                {"type": "content_block_start", "index": index, "content_block": dict(block, input={})},
            ),
            _event(
                "content_block_delta",
                {
                    "type": "content_block_delta",
                    "index": index,
                    "delta": {
                        "type": "input_json_delta",
                        "partial_json": json.dumps(block["input"], ensure_ascii=False),
                    },
                },
            ),
            _event("content_block_stop", {"type": "content_block_stop", "index": index}),
        ]
        return events

    def close_thinking(self) -> list[str]:
        """The open thinking block's signature and stop (none where none is open)."""
        if not self.open_thinking:
            return []
        self.open_thinking = False
        return [
            _event(
                "content_block_delta",
                {
                    "type": "content_block_delta",
                    "index": self.index,
                    "delta": {"type": "signature_delta", "signature": ""},
                },
            ),
            _event("content_block_stop", {"type": "content_block_stop", "index": self.index}),
        ]

    def end(self) -> list[str]:
        """The events that close the answer's blocks: the thinking block's, an empty text
        block where nothing was answered (as the non-streamed answer's), the text block's
        stop."""
        events = self.close_thinking()
        if not self.answered:  # no text and no call: the non-streamed answer's one empty text block
            self.index, self.open_text = self.index + 1, True
            events.append(
                _event(
                    "content_block_start",
                    {"type": "content_block_start", "index": self.index, "content_block": {"type": "text", "text": ""}},
                )
            )
        if self.open_text:
            events.append(_event("content_block_stop", {"type": "content_block_stop", "index": self.index}))
        return events
