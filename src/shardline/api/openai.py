"""OpenAI-compatible API: ``POST /v1/chat/completions`` and ``GET /v1/models``.

Request and response shapes follow OpenAI's API reference (Chat Completions, the
``chat.completion`` and ``chat.completion.chunk`` objects, server-sent events ending with
``data: [DONE]``). Errors use OpenAI's body: ``{"error": {"message", "type", "param",
"code"}}``.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

import httpx
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from shardline.models.store import ModelNotFoundError
from shardline.models.tokenizer import ChatTemplateError, IncrementalDetokenizer, Tokenizer
from shardline.node.node import Instance, InstanceFailedError, NoInstanceError, Node
from shardline.node.transfer import TransferError
from shardline.runner.protocol import PrefillProgress, SamplingParams


class OpenAIError(Exception):
    """An error answered in OpenAI's format with an HTTP status."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def response(self) -> JSONResponse:
        return JSONResponse(status_code=self.status, content=error_body(self.message, self.type, self.param, self.code))


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class StreamOptions(BaseModel):
    include_usage: bool = False


class ChatCompletionRequest(BaseModel):
    """The fields of OpenAI's request that shardline honours; others are accepted and ignored."""

    model_config = ConfigDict(extra="allow")
    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=1)
    ignore_eos: bool = False  # as in vLLM: generate max_tokens whatever the model says
    # As in llama.cpp's server: while a long prompt is prefilled, stream chunks with an empty
    # delta and ``prompt_progress: {total, cache, processed, time_ms}``.
    return_progress: bool = False


class StopMatcher:
    """Finds stop strings in streamed text, holding back text that may begin one."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self.pending = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """Return (text safe to send, whether a stop string was reached)."""
        self.pending += text
        for stop in self.stops:
            index = self.pending.find(stop)
            if index >= 0:
                out, self.pending = self.pending[:index], ""
                return out, True
        hold = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(self.pending)), 0, -1):
                if self.pending.endswith(stop[:k]):
                    hold = max(hold, k)
                    break
        out = self.pending[: len(self.pending) - hold]
        self.pending = self.pending[len(out):]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


class Generation:
    """One request's prepared inputs: prompt ids, limits and sampling."""

    def __init__(self, node: Node, req: ChatCompletionRequest, prompt: list[int],
                 inst: Instance, tokenizer: Tokenizer) -> None:
        self.node = node
        self.req = req
        self.prompt = prompt
        limit = req.max_completion_tokens or req.max_tokens
        room = inst.context - len(prompt)
        if room < 1 or (limit is not None and limit > room):
            asked = f" and {limit} for the completion" if limit is not None else ""
            raise OpenAIError(
                400,
                f"this model's context is {inst.context} tokens; the request asks for "
                f"{len(prompt)} in the messages{asked}",
                param="max_tokens" if room >= 1 else "messages", code="context_length_exceeded",
            )
        self.max_tokens = limit or room
        self.sampling = SamplingParams(req.temperature, req.top_p, req.top_k, req.seed)
        self.stop_ids = [] if req.ignore_eos else tokenizer.eos_token_ids
        self.detokenizer = IncrementalDetokenizer(tokenizer)
        self.stops = StopMatcher([req.stop] if isinstance(req.stop, str) else (req.stop or []))
        self.completion_tokens = 0
        self.started = time.monotonic()

    async def texts(self) -> AsyncIterator[tuple[str, str | None] | PrefillProgress]:
        """Yield (text delta, finish_reason or None) until the request ends; before the
        first token, a PrefillProgress after each engine step of a long prompt's prefill."""
        events = self.node.generate(self.req.model, self.prompt, self.max_tokens, self.sampling, self.stop_ids)
        try:
            async for event in events:
                if isinstance(event, PrefillProgress):
                    yield event
                    continue
                if event.token_id >= 0:
                    self.completion_tokens += 1
                finish = event.finish_reason
                text = ""
                if event.token_id >= 0 and event.token_id not in self.stop_ids:
                    text, hit = self.stops.feed(self.detokenizer.push(event.token_id))
                    if hit:
                        yield text, "stop"
                        return
                if finish is not None:
                    yield text + self.stops.flush(), "stop" if finish == "cancelled" else finish
                    return
                if text:
                    yield text, None
        finally:
            await events.aclose()

    def usage(self) -> dict:
        return {
            "prompt_tokens": len(self.prompt),
            "completion_tokens": self.completion_tokens,
            "total_tokens": len(self.prompt) + self.completion_tokens,
        }


def router(node: Node) -> APIRouter:
    api = APIRouter()

    def model_object(m: dict) -> dict:
        return {"id": m["id"], "object": "model", "created": m["created"], "owned_by": "shardline"}

    @api.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str):
        for m in node.models():
            if m["id"] == model_id:
                return model_object(m)
        return OpenAIError(404, f"The model '{model_id}' does not exist or is not loaded",
                           param="model", code="model_not_found").response()

    @api.get("/v1/models")
    async def list_models() -> dict:
        return {
            "object": "list",
            "data": [model_object(m) for m in node.models()],
        }

    @api.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        try:
            req = await parse_body(request, ChatCompletionRequest)
            gen = await prepare(node, req)
        except OpenAIError as exc:
            return exc.response()
        completion_id = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        if req.stream:
            return StreamingResponse(
                stream_chat(gen, completion_id, created),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        try:
            parts, finish = await collect_unless_disconnected(gen, request)
        except InstanceFailedError as exc:
            return OpenAIError(503, str(exc), "server_error", code="instance_failed").response()
        if finish is None:  # the client left; nobody reads this
            return JSONResponse(status_code=499, content=error_body("client closed the request", "client_closed"))
        return {
            "id": completion_id,
            "object": "chat.completion",
            "created": created,
            "model": req.model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "".join(parts)},
                    "logprobs": None,
                    "finish_reason": finish,
                }
            ],
            "usage": gen.usage(),
        }

    return api


async def collect_unless_disconnected(
    gen: Generation, request: Request, poll_s: float = 0.25
) -> tuple[list[str], str | None]:
    """Run a non-streamed generation to the end, or cancel it once the client disconnects.

    Returns the text pieces and the finish reason (None when the client left).
    Raises:
        InstanceFailedError: the instance failed mid-request.
    """
    parts: list[str] = []
    finish: str | None = None

    async def consume() -> None:
        nonlocal finish
        async for item in gen.texts():
            if not isinstance(item, PrefillProgress):
                text, finish = item
                parts.append(text)

    task = asyncio.create_task(consume())
    while not task.done():
        await asyncio.wait({task}, timeout=poll_s)
        if not task.done() and await request.is_disconnected():
            task.cancel()  # closes the generation, which cancels the task on every rank
            try:
                await task
            except asyncio.CancelledError:
                pass
            return parts, None
    task.result()
    return parts, finish


async def parse_body(request: Request, model: type[BaseModel]) -> Any:
    """Parse a JSON body (whatever its Content-Type) into ``model``.

    Raises:
        OpenAIError: 400 for a body that is not JSON or does not fit the model; the message
            names the first offending field.
    """
    raw = await request.body()
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise OpenAIError(400, "the request body is not valid JSON") from None
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first.get("loc", ())) or None
        raise OpenAIError(400, f"{param or 'body'}: {first.get('msg')}", param=param) from None


async def prepare(node: Node, req: ChatCompletionRequest) -> Generation:
    """Tokenize and check a request.

    Raises:
        OpenAIError: 404 for a model no instance serves, 400 for a bad prompt.
    """
    try:
        inst = node.ready_instance(req.model)
    except NoInstanceError:
        placed = [i for i in node.instances.values() if i.model_id == req.model]
        if placed:
            detail = "; ".join(f"instance {i.instance_id} {i.status}" + (f": {i.error}" if i.error else "")
                               for i in placed)
            raise OpenAIError(503, f"The model '{req.model}' is not ready ({detail}); retry later",
                              "server_error", param="model", code="model_not_ready") from None
        known = ", ".join(m["id"] for m in node.models()) or "none"
        raise OpenAIError(404, f"The model '{req.model}' does not exist or is not loaded (available: {known})",
                          param="model", code="model_not_found") from None
    try:
        tokenizer = await node.tokenizer(req.model)
    except (ModelNotFoundError, TransferError, httpx.HTTPError) as exc:
        raise OpenAIError(503, f"The model '{req.model}' cannot be tokenized on this node: {exc}",
                          "server_error", param="model", code="model_not_ready") from exc
    messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in req.messages]
    try:
        prompt = await asyncio.to_thread(tokenizer.encode_chat, messages)
    except ChatTemplateError as exc:
        raise OpenAIError(400, str(exc), param="messages") from exc
    return Generation(node, req, prompt, inst, tokenizer)


def _sse(data: Any) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


async def stream_chat(gen: Generation, completion_id: str, created: int) -> AsyncIterator[str]:
    def chunk(choices: list[dict], **extra) -> dict:
        return {"id": completion_id, "object": "chat.completion.chunk", "created": created,
                "model": gen.req.model, "choices": choices, **extra}

    def choice(delta: dict, finish: str | None) -> list[dict]:
        return [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]

    yield _sse(chunk(choice({"role": "assistant", "content": ""}, None)))
    try:
        async for item in gen.texts():
            if isinstance(item, PrefillProgress):
                if gen.req.return_progress:
                    progress = {"total": item.total, "cache": 0, "processed": item.done,
                                "time_ms": round((time.monotonic() - gen.started) * 1000, 1)}
                    yield _sse(chunk(choice({}, None), prompt_progress=progress))
                continue
            text, finish = item
            if text:
                yield _sse(chunk(choice({"content": text}, None)))
            if finish is not None:
                yield _sse(chunk(choice({}, finish)))
    except InstanceFailedError as exc:
        yield _sse(error_body(str(exc), "server_error", code="instance_failed"))
        return
    if gen.req.stream_options and gen.req.stream_options.include_usage:
        yield _sse(chunk([], usage=gen.usage()))
    yield "data: [DONE]\n\n"
