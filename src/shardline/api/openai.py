"""OpenAI-compatible API: ``POST /v1/chat/completions``, ``POST /v1/completions`` and
``GET /v1/models``.

Request and response shapes follow OpenAI's API reference (Chat Completions with the
``chat.completion`` and ``chat.completion.chunk`` objects; the legacy Completions with
``text_completion``; server-sent events ending with ``data: [DONE]``). Errors use OpenAI's
body: ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator

from shardline.api.content import check_parts
from shardline.api.generation import (
    APIError,
    Generation,
    GenerationRequest,
    collect_unless_disconnected,
    parse_body,
    prepare,
)
from shardline.api.metrics import RequestMetrics
from shardline.node.node import Node
from shardline.node.queue_bound import QueueFullError
from shardline.node.table import InstanceFailedError
from shardline.runner.protocol import PrefillProgress, SamplingParams


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(exc: APIError) -> JSONResponse:
    """An :class:`APIError` in OpenAI's format."""
    return JSONResponse(status_code=exc.status, content=error_body(exc.message, exc.kind, exc.param, exc.code))


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


class SamplingFields(BaseModel):
    """The fields both OpenAI requests share; others are accepted and ignored."""

    model_config = ConfigDict(extra="allow")
    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=1)
    ignore_eos: bool = False  # as in vLLM: generate max_tokens whatever the model says
    # As in llama.cpp's server: while a long prompt is prefilled, stream chunks with an empty
    # delta (text) and ``prompt_progress: {total, cache, processed, time_ms}``.
    return_progress: bool = False

    def generation(self, prompt, max_tokens: int | None, max_tokens_param: str,
                   prompt_param: str) -> GenerationRequest:
        return GenerationRequest(
            model=self.model, prompt=prompt, max_tokens=max_tokens,
            sampling=SamplingParams(self.temperature, self.top_p, self.top_k, self.seed),
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            ignore_eos=self.ignore_eos, max_tokens_param=max_tokens_param, prompt_param=prompt_param)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)

    @model_validator(mode="before")
    @classmethod
    def _text_parts(cls, data: Any) -> Any:
        check_parts(data, "openai")  # APIError: an empty or media part, by name
        return data

    def to_generation(self) -> GenerationRequest:
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                    for m in self.messages]
        limit = self.max_completion_tokens or self.max_tokens
        param = "max_completion_tokens" if self.max_completion_tokens else "max_tokens"
        return self.generation(messages, limit, param, "messages")


class CompletionRequest(SamplingFields):
    """The legacy Completions request: a text prompt (or one list of token ids)."""

    prompt: str | list[str] | list[int] = Field(min_length=1)
    max_tokens: int = Field(default=16, ge=1)  # OpenAI's default for this endpoint
    echo: bool = False  # the answer begins with the prompt's text
    suffix: None = None  # insertion is not supported

    def to_generation(self) -> GenerationRequest:
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise APIError(400, "one prompt per request (a list of several is not supported)", param="prompt")
            prompt = prompt[0]
        return self.generation(prompt, self.max_tokens, "max_tokens", "prompt")


class EmbeddingsRequest(BaseModel):
    """OpenAI's embeddings request, as far as refusing it needs."""

    model_config = ConfigDict(extra="allow")
    model: str


def router(node: Node, metrics: RequestMetrics | None = None) -> APIRouter:
    api = APIRouter()

    def model_object(m: dict) -> dict:
        return {"id": m["id"], "object": "model", "created": m["created"], "owned_by": "shardline"}

    @api.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str):
        for m in node.router.models():
            if m["id"] == model_id:
                return model_object(m)
        return error_response(APIError(404, f"The model '{model_id}' does not exist or is not loaded",
                                       "not_found_error", param="model", code="model_not_found"))

    @api.get("/v1/models")
    async def list_models() -> dict:
        return {
            "object": "list",
            "data": [model_object(m) for m in node.router.models()],
        }

    @api.post("/v1/embeddings")
    async def embeddings(request: Request):
        """Refused: no model shardline places computes embeddings (400 for a placed model,
        404 for another)."""
        try:
            req = await parse_body(request, EmbeddingsRequest)
        except APIError as exc:
            return error_response(exc)
        if not any(i.model_id == req.model for i in node.instances.values()):
            return error_response(APIError(404, f"The model '{req.model}' does not exist or is not loaded",
                                           "not_found_error", param="model", code="model_not_found"))
        return error_response(APIError(400, f"model '{req.model}' does not support embeddings",
                                       param="model", code="model_not_supported"))

    @api.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _serve(node, metrics, request, ChatCompletionRequest, "chatcmpl", _ChatShape)

    @api.post("/v1/completions")
    async def completions(request: Request):
        return await _serve(node, metrics, request, CompletionRequest, "cmpl", _CompletionShape)

    return api


class _ChatShape:
    """The objects of Chat Completions: ``chat.completion`` and its chunks."""

    def __init__(self, req: SamplingFields, gen: Generation, completion_id: str, created: int) -> None:
        self.req, self.gen, self.id, self.created = req, gen, completion_id, created

    def _chunk(self, delta: Any, finish: str | None, **extra) -> dict:
        """A chunk whose choice carries ``delta`` (a message delta; None: no choice)."""
        choices = [] if delta is None else [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                "model": self.req.model, "choices": choices, **extra}

    def first(self) -> dict | None:
        return self._chunk({"role": "assistant", "content": ""}, None)

    def text(self, text: str) -> dict:
        return self._chunk({"content": text}, None)

    def finish(self, reason: str) -> dict:
        return self._chunk({}, reason)

    def progress(self, progress: dict) -> dict:
        return self._chunk({}, None, prompt_progress=progress)

    def usage(self) -> dict:
        return self._chunk(None, None, usage=self.gen.usage())

    def whole(self, text: str, finish: str) -> dict:
        return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.req.model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                             "logprobs": None, "finish_reason": finish}],
                "usage": self.gen.usage()}


class _CompletionShape(_ChatShape):
    """The objects of the legacy Completions: ``text_completion`` (streamed the same)."""

    def _chunk(self, delta: Any, finish: str | None, **extra) -> dict:
        """A chunk whose choice carries ``delta``, here the text (None: no choice)."""
        choices = [] if delta is None else [{"index": 0, "text": delta, "logprobs": None, "finish_reason": finish}]
        return {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.req.model, "choices": choices, **extra}

    def echo(self) -> str:
        """The prompt, when the request asks for it back (``echo``)."""
        assert isinstance(self.req, CompletionRequest)
        if not self.req.echo:
            return ""
        prompt = self.gen.req.prompt
        return prompt if isinstance(prompt, str) else self.gen.tokenizer.decode(self.gen.prompt)

    def first(self) -> dict | None:
        assert isinstance(self.req, CompletionRequest)
        return self._chunk(self.echo(), None) if self.req.echo else None

    def text(self, text: str) -> dict:
        return self._chunk(text, None)

    def finish(self, reason: str) -> dict:
        return self._chunk("", reason)

    def progress(self, progress: dict) -> dict:
        return self._chunk("", None, prompt_progress=progress)

    def whole(self, text: str, finish: str) -> dict:
        return dict(self._chunk(self.echo() + text, finish), usage=self.gen.usage())


async def _serve(node: Node, metrics: RequestMetrics | None, request: Request,
                 request_type: type[SamplingFields], id_prefix: str,
                 shape_type: type[_ChatShape]):
    """Parse, prepare and run one request; stream it as server-sent events or answer whole."""
    try:
        req = await parse_body(request, request_type)
        gen = await prepare(node, req.to_generation(), metrics)
    except APIError as exc:
        return error_response(exc)
    shape = shape_type(req, gen, f"{id_prefix}-{uuid.uuid4().hex}", int(time.time()))
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(
            _stream(gen, shape, req.return_progress, include_usage),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    try:
        parts, finish = await collect_unless_disconnected(gen, request)
    except InstanceFailedError as exc:
        return error_response(APIError(503, str(exc), "server_error", code="instance_failed"))
    if finish is None:  # the client left; nobody reads this
        return JSONResponse(status_code=499, content=error_body("client closed the request", "client_closed"))
    return shape.whole("".join(parts), finish)


def _sse(data: Any) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


async def _stream(gen: Generation, shape: _ChatShape, return_progress: bool,
                  include_usage: bool) -> AsyncIterator[str]:
    first = shape.first()
    if first is not None:
        yield _sse(first)
    try:
        async for item in gen.texts():
            if isinstance(item, PrefillProgress):
                if return_progress:
                    yield _sse(shape.progress(gen.prefill_progress(item)))
                continue
            text, finish = item
            if text:
                yield _sse(shape.text(text))
            if finish is not None:
                yield _sse(shape.finish(finish))
    except QueueFullError as exc:  # a forwarded request the rank's node refused
        yield _sse(error_body(str(exc), "rate_limit_exceeded", code="queue_full"))
        return
    except InstanceFailedError as exc:
        yield _sse(error_body(str(exc), "server_error", code="instance_failed"))
        return
    if include_usage:
        yield _sse(shape.usage())
    yield "data: [DONE]\n\n"
