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

import dataclasses
import json
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any, ClassVar, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from shardline.api.content import check_parts
from shardline.api.generation import (
    APIError,
    Generation,
    GenerationRequest,
    collect_unless_disconnected,
)
from shardline.api.metrics import RequestMetrics
from shardline.api.params import Endpoint, StopString
from shardline.api.preparation import prepare, tokenize
from shardline.api.request_body import parse_body
from shardline.api.structured import json_grammar
from shardline.api.tools import ToolCall, ToolChoice, ToolChoiceMode
from shardline.node.node import Node
from shardline.node.queue_bound import QueueFullError
from shardline.node.table import InstanceFailedError
from shardline.runner.protocol import PrefillProgress, SamplingParams

# APIError kinds as Anthropic names them.
_ERROR_TYPES = {"invalid_request_error": "invalid_request_error", "not_found_error": "not_found_error",
                "server_error": "api_error"}


def error_body(kind: str, message: str) -> dict:
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(kind, kind), "message": message}}


def error_response(exc: APIError) -> JSONResponse:
    """An :class:`APIError` in Anthropic's format (a model that is loading: 529 overloaded)."""
    if exc.code == "model_not_ready":
        return JSONResponse(status_code=529, content=error_body("overloaded_error", exc.message))
    return JSONResponse(status_code=exc.status, content=error_body(exc.kind, exc.message))


class TextBlock(BaseModel):
    model_config = ConfigDict(extra="allow")  # e.g. cache_control
    type: Literal["text"]
    text: str


class ToolUseBlock(BaseModel):
    """An assistant's tool call: ``{type: "tool_use", id, name, input}``."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: dict | None = None
    caller: None = None  # set only for server-side (code execution) callers, which are not run here
    toolset_name: None = None


class ToolResultBlock(BaseModel):
    """A tool's result in a user turn: ``{type: "tool_result", tool_use_id, content,
    is_error}`` (content a string or text blocks)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool = False
    cache_control: dict | None = None

    def text(self) -> str:
        text = self.content if isinstance(self.content, str) else "".join(b.text for b in self.content)
        return f"Error: {text}" if self.is_error else text


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")]


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["user", "assistant"]
    content: str | list[Block]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(b.text for b in self.content if isinstance(b, TextBlock))

    def chat(self) -> list[dict[str, Any]]:
        """The turn in the chat template's form: tool results first, as ``tool`` messages,
        then the text; an assistant's tool_use blocks as its ``tool_calls``."""
        blocks = [] if isinstance(self.content, str) else self.content
        out: list[dict[str, Any]] = [{"role": "tool", "content": b.text(), "tool_call_id": b.tool_use_id}
                                     for b in blocks if isinstance(b, ToolResultBlock)]
        calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": b.input}}
                 for b in blocks if isinstance(b, ToolUseBlock)]
        text = self.text()
        if calls:
            out.append({"role": "assistant", "content": text or None, "tool_calls": calls})
        elif text or not out:
            out.append({"role": self.role, "content": text})
        return out


class Tool(BaseModel):
    """A client tool: ``{name, description, input_schema}`` (server tools are refused)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["custom"] | None = None
    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    cache_control: dict | None = None

    def function(self) -> dict[str, Any]:
        function: dict[str, Any] = {"name": self.name, "parameters": self.input_schema}
        if self.description is not None:
            function["description"] = self.description
        return {"type": "function", "function": function}


class ToolChoiceParam(BaseModel):
    """``tool_choice``: ``{type: auto | any | tool | none, name, disable_parallel_tool_use}``."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False

    def choice(self) -> ToolChoice:
        if self.type == "tool":
            if self.name is None:
                raise APIError(400, "tool_choice.name: required with type tool", param="tool_choice.name")
            return ToolChoice(ToolChoiceMode.NAMED, self.name)
        return ToolChoice({"auto": ToolChoiceMode.AUTO, "any": ToolChoiceMode.REQUIRED,
                           "none": ToolChoiceMode.NONE}[self.type])


class Metadata(BaseModel):
    model_config = ConfigDict(extra="forbid")
    user_id: str | None = Field(default=None, max_length=256)


class CountTokensRequest(BaseModel):
    """``POST /v1/messages/count_tokens``: the prompt part of a Messages request
    (:data:`shardline.api.params.PARAMETERS` lists its fields)."""

    ENDPOINT: ClassVar[Endpoint] = Endpoint.COUNT_TOKENS
    model_config = ConfigDict(extra="forbid")
    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    thinking: dict | None = None  # {"type": "disabled"} only (params.screen refuses the rest)
    tools: list[Tool] | None = None
    tool_choice: ToolChoiceParam | None = None

    @staticmethod
    def check_raw(data: Any) -> None:
        """Refuse, in the raw body (before its strict JSON validation), an empty or media block, by name
        (:func:`~shardline.api.content.check_parts`)."""
        check_parts(data, "anthropic")

    def chat(self) -> list[dict]:
        """The conversation as chat-template messages (the system prompt first)."""
        chat: list[dict] = []
        if self.system:
            system = self.system if isinstance(self.system, str) else "".join(b.text for b in self.system)
            chat.append({"role": "system", "content": system})
        for m in self.messages:
            chat += m.chat()
        return chat

    def to_generation(self) -> GenerationRequest:
        """A last assistant message is the start of the reply (a prefill): continued, not
        answered with a new turn."""
        choice = self.tool_choice or ToolChoiceParam(type="auto")
        return GenerationRequest(model=self.model, prompt=self.chat(), api="anthropic", prompt_param="messages",
                                 continue_final_message=self.messages[-1].role == "assistant",
                                 tools=[t.function() for t in self.tools or []], tool_choice=choice.choice(),
                                 max_tool_calls=1 if choice.disable_parallel_tool_use else None)


class OutputFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(BaseModel):
    """``output_config``: ``format`` (structured output by constrained decoding);
    ``effort`` refused (not a reasoning model)."""

    model_config = ConfigDict(extra="forbid")
    format: OutputFormat | None = None
    effort: None = None

    def grammar(self) -> str | None:
        if self.format is None:
            return None
        try:
            return json_grammar(self.format.schema_)
        except ValueError as exc:
            raise APIError(400, f"output_config.format.schema: {exc}", param="output_config") from exc


class MessagesRequest(CountTokensRequest):
    """A Messages request (:data:`shardline.api.params.PARAMETERS` lists each field and
    what it does; the rest are refused)."""

    ENDPOINT = Endpoint.MESSAGES
    max_tokens: int = Field(ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=1.0)
    top_p: float = Field(default=1.0, ge=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    stop_sequences: list[StopString] | None = None
    stream: bool = False
    metadata: Metadata | None = None
    service_tier: str | None = None
    speed: str | None = None
    cache_control: dict[str, Any] | None = None
    output_config: OutputConfig | None = None

    def to_generation(self) -> GenerationRequest:
        return dataclasses.replace(
            super().to_generation(), max_tokens=self.max_tokens,
            sampling=SamplingParams(self.temperature, self.top_p, self.top_k, None,
                                    grammar=None if self.output_config is None else self.output_config.grammar()),
            stop=list(self.stop_sequences or []))


def _stop_reason(gen: Generation, finish: str) -> tuple[str, str | None]:
    """Anthropic's ``stop_reason`` and ``stop_sequence`` for a finish reason."""
    if finish == "length":
        return "max_tokens", None
    if finish == "tool_calls":
        return "tool_use", None
    if gen.stops.matched is not None:
        return "stop_sequence", gen.stops.matched
    return "end_turn", None


def router(node: Node, metrics: RequestMetrics | None = None) -> APIRouter:
    api = APIRouter()

    @api.post("/v1/messages")
    async def messages(request: Request):
        try:
            req = await parse_body(request, MessagesRequest)
            gen = await prepare(node, req.to_generation(), metrics)
        except APIError as exc:
            return error_response(exc)
        message_id = f"msg_{uuid.uuid4().hex}"
        if req.stream:
            return StreamingResponse(_stream(gen, req, message_id), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            chunks, finish = await collect_unless_disconnected(gen, request)
        except InstanceFailedError as exc:
            return error_response(APIError(500, str(exc), "server_error"))
        if finish is None:  # the client left; nobody reads this
            return JSONResponse(status_code=499, content=error_body("api_error", "client closed the request"))
        reason, sequence = _stop_reason(gen, finish)
        text = "".join(c.text for c in chunks)
        calls = [_tool_use(call) for c in chunks for call in c.tool_calls]
        content = ([{"type": "text", "text": text}] if text or not calls else []) + calls
        return dict(_message(gen, req, message_id, content),
                    stop_reason=reason, stop_sequence=sequence,
                    usage={"input_tokens": len(gen.prompt), "output_tokens": gen.completion_tokens})

    @api.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request):
        """The prompt's tokens as /v1/messages would count them: ``{"input_tokens": N}``."""
        try:
            req = await parse_body(request, CountTokensRequest)
            _, _, prompt = await tokenize(node, req.to_generation(), wait=False)  # not while it loads
        except APIError as exc:
            return error_response(exc)
        return {"input_tokens": len(prompt)}

    return api


def _message(gen: Generation, req: MessagesRequest, message_id: str, content: list[dict]) -> dict:
    return {"id": message_id, "type": "message", "role": "assistant", "model": req.model,
            "content": content, "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": len(gen.prompt), "output_tokens": 0}}


def _event(name: str, data: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


def _tool_use(call: ToolCall) -> dict:
    """A tool call as a ``tool_use`` content block (``toolu_`` ids, as Anthropic's)."""
    return {"type": "tool_use", "id": "toolu_" + call.id.removeprefix("call_"), "name": call.name,
            "input": json.loads(call.arguments)}


async def _stream(gen: Generation, req: MessagesRequest, message_id: str) -> AsyncIterator[str]:
    """Anthropic's events, the blocks of the non-streamed answer's ``content``: text opens
    a text block; each tool call is a ``tool_use`` block whose input comes as one
    ``input_json_delta``; text after a call opens a new text block; an answer with
    neither is one empty text block."""
    yield _event("message_start", {"type": "message_start", "message": _message(gen, req, message_id, [])})
    yield _event("ping", {"type": "ping"})
    index, open_text = -1, False
    reason, sequence = "end_turn", None
    try:
        async for item in gen.texts():
            if isinstance(item, PrefillProgress):
                continue
            if item.text:
                if not open_text:
                    index, open_text = index + 1, True
                    yield _event("content_block_start", {"type": "content_block_start", "index": index,
                                                         "content_block": {"type": "text", "text": ""}})
                yield _event("content_block_delta", {"type": "content_block_delta", "index": index,
                                                     "delta": {"type": "text_delta", "text": item.text}})
            for call in item.tool_calls:
                if open_text:
                    yield _event("content_block_stop", {"type": "content_block_stop", "index": index})
                    open_text = False
                index += 1
                block = _tool_use(call)
                yield _event("content_block_start", {"type": "content_block_start", "index": index,
                                                     "content_block": dict(block, input={})})
                yield _event("content_block_delta", {"type": "content_block_delta", "index": index, "delta": {
                    "type": "input_json_delta", "partial_json": json.dumps(block["input"], ensure_ascii=False)}})
                yield _event("content_block_stop", {"type": "content_block_stop", "index": index})
            if item.finish is not None:
                reason, sequence = _stop_reason(gen, item.finish)
    except QueueFullError as exc:  # a forwarded request the rank's node refused
        yield _event("error", error_body("rate_limit_error", str(exc)))
        return
    except InstanceFailedError as exc:
        yield _event("error", error_body("api_error", str(exc)))
        return
    if index < 0:  # no text and no call: the non-streamed answer's one empty text block
        index, open_text = 0, True
        yield _event("content_block_start", {"type": "content_block_start", "index": 0,
                                             "content_block": {"type": "text", "text": ""}})
    if open_text:
        yield _event("content_block_stop", {"type": "content_block_stop", "index": index})
    yield _event("message_delta", {"type": "message_delta",
                                   "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                   "usage": {"output_tokens": gen.completion_tokens}})
    yield _event("message_stop", {"type": "message_stop"})
