"""OpenAI-compatible API: ``POST /v1/chat/completions`` and ``GET /v1/models`` (the
legacy ``POST /v1/completions`` is :mod:`shardline.api.completions`, on what this module
shares: :class:`SamplingFields`, :class:`ChatShape`, :func:`serve`).

Request and response shapes follow OpenAI's API reference (Chat Completions with the
``chat.completion`` and ``chat.completion.chunk`` objects; server-sent events ending with
``data: [DONE]``). Errors use OpenAI's body: ``{"error": {"message", "type", "param",
"code"}}``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any, ClassVar, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from shardline.api.content import check_parts
from shardline.api.heartbeat import HEARTBEAT_S, Heartbeat
from shardline.api.logprobs import chat_logprobs
from shardline.api.metrics import RequestMetrics
from shardline.api.params import Endpoint, StopString
from shardline.api.preparation import prepare
from shardline.api.request_body import parse_body
from shardline.api.structured import ANY_OBJECT, json_grammar, strict_schema_problem
from shardline.api.text_stream import (
    APIError,
    Chunk,
    Generation,
    GenerationRequest,
    collect_unless_disconnected,
    merge_streams,
)
from shardline.api.tools import ToolCall, ToolChoice, openai_tool_choice
from shardline.node.node import Node
from shardline.node.queue_bound import QueueFullError
from shardline.node.table import InstanceFailedError
from shardline.runner.protocol import PrefillProgress, SamplingParams
from shardline.runner.speculation import MAX_DRAFT_TOKENS

MAX_CHOICES = 8
"""Most choices (``n``) one request may ask for: each is its own sequence in the batch."""


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


_ERROR_TYPES = {"not_found_error": "invalid_request_error"}
"""APIError kinds OpenAI names otherwise: it has no type of its own for a 404 (an unknown
model is an ``invalid_request_error`` of code ``model_not_found``)."""


def error_response(exc: APIError) -> JSONResponse:
    """An :class:`APIError` in OpenAI's format."""
    kind = _ERROR_TYPES.get(exc.kind, exc.kind)
    return JSONResponse(status_code=exc.status, content=error_body(exc.message, kind, exc.param, exc.code))


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """A message: its text (a string or text parts), an assistant's ``tool_calls``
    (``[{id, type: "function", function: {name, arguments: JSON text}}]``) and a tool
    result's ``tool_call_id``. An assistant's earlier reasoning, as this server and vLLM
    send it (``reasoning_content``, or ``reasoning`` as OpenRouter names it), is accepted
    back and given to the chat template as ``reasoning_content`` and ``thinking`` (the
    names Qwen3's and gpt-oss's templates read; most templates leave it out)."""

    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = Field(default=None, validate_default=True)
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None

    @field_validator("content")
    @classmethod
    def _content_unless_assistant(cls, content: Any, info: ValidationInfo) -> Any:
        """Only an assistant's message may go without content (it called tools, or
        refused), as OpenAI's reference has it: a null or missing one is refused."""
        role = info.data.get("role")
        if content is None and role is not None and role != "assistant":
            raise ValueError(f"a {role} message needs content (a string or text parts), not null")
        return content

    def chat(self) -> dict[str, Any]:
        """The message in the chat template's form (developer is system)."""
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = self.tool_calls
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        reasoning = self.reasoning_content or self.reasoning
        if reasoning and self.role == "assistant":
            out["reasoning_content"] = out["thinking"] = reasoning
        return out

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    include_obfuscation: bool = True  # OpenAI's default: chunks with text carry padding


def obfuscation(delta: str) -> str:
    """OpenAI's stream obfuscation: random URL-safe characters that bring a streamed
    delta's size to a multiple of 16 characters (1-16 of them), so that an observer of
    the encrypted stream cannot read the tokens' lengths off the records' sizes (the
    ``obfuscation`` field of a chunk or event, on by default; ``include_obfuscation``
    false leaves it out)."""
    return secrets.token_urlsafe(12)[: 16 - len(delta) % 16]


class SamplingFields(BaseModel):
    """The fields both OpenAI requests share (:data:`shardline.api.params.PARAMETERS`
    lists each and what it does; :func:`~shardline.api.params.screen` refuses the rest
    before these are validated). Ranges are the reference's."""

    ENDPOINT: ClassVar[Endpoint]
    model_config = ConfigDict(extra="forbid")
    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, ge=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)  # int64, as OpenAI's
    stop: StopString | Annotated[list[StopString], Field(max_length=4)] | None = None  # up to 4
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=10.0)
    logit_bias: dict[int, float] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None
    store: bool = False
    metadata: dict[str, str] | None = None
    ignore_eos: bool = False  # as in vLLM: generate max_tokens whatever the model says
    # As in llama.cpp's server: while a long prompt is prefilled, stream chunks with an empty
    # delta (text) and ``prompt_progress: {total, cache, processed, time_ms}``.
    return_progress: bool = False
    # As in llama.cpp's server: false prefills the whole prompt, its cached prefix unused.
    cache_prompt: bool = True
    # llama.cpp's per-request speculation bound: most tokens drafted a step (prompt lookup;
    # 0: none; absent: the instance's default, runner.speculation.default_drafts).
    speculative_n_max: int | None = Field(default=None, ge=0, le=MAX_DRAFT_TOKENS, alias="speculative.n_max")
    # llama.cpp's: a draft model's draft ends before a guess it gives less probability
    # (absent: runner.draft_model.P_MIN, 0; prompt lookup ignores it).
    speculative_p_min: float | None = Field(default=None, ge=0.0, le=1.0, alias="speculative.p_min")

    @model_validator(mode="after")
    def _check_bias(self):
        for token, bias in (self.logit_bias or {}).items():
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias: the bias of token {token} must be between -100 and 100")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        return self

    def logprobs_wanted(self) -> int | None:
        """Alternatives per token the request wants (None: no logprobs)."""
        return None

    def grammar(self) -> str | None:
        """The llguidance grammar the output must match, if any."""
        return None

    def sampling(self, choice: int = 0) -> SamplingParams:
        """The sampling of choice ``choice`` (a seeded request's choices take seed,
        seed + 1, ...: n choices of one seed would all be the same)."""
        return SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=None if self.seed is None else self.seed + choice,
            min_p=self.min_p,
            frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias=tuple(sorted((self.logit_bias or {}).items())),
            logprobs=self.logprobs_wanted(),
            grammar=self.grammar(),
            draft_tokens=self.speculative_n_max,
            draft_p_min=self.speculative_p_min,
        )

    def generation(self, prompt, max_tokens: int | None, max_tokens_param: str, prompt_param: str) -> GenerationRequest:
        return GenerationRequest(
            model=self.model,
            prompt=prompt,
            max_tokens=max_tokens,
            sampling=self.sampling(),
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            ignore_eos=self.ignore_eos,
            max_tokens_param=max_tokens_param,
            prompt_param=prompt_param,
            cache_prompt=self.cache_prompt,
        )


class JSONSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """``response_format``: ``text``, ``json_object`` (any JSON object) or ``json_schema``."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with (and only with) type json_schema")
        return self

    def grammar(self) -> str | None:
        if self.type == "text":
            return None
        schema = self.json_schema.schema_ if self.json_schema is not None else None
        problem = (
            strict_schema_problem(schema or ANY_OBJECT)
            if self.json_schema is not None and self.json_schema.strict
            else None
        )
        if problem:
            raise APIError(
                400,
                f"response_format.json_schema.schema: a strict schema's {problem}",
                param="response_format.json_schema.schema",
            )
        try:
            return json_grammar(schema or None)  # None: any object (json_object, or an empty json_schema)
        except ValueError as exc:
            raise APIError(400, f"response_format: {exc}", param="response_format") from exc


class ChatTemplateKwargs(BaseModel):
    """vLLM's ``chat_template_kwargs``: of the chat template's variables, ``enable_thinking``
    (whether a reasoning model thinks) is taken; others are refused."""

    model_config = ConfigDict(extra="forbid")
    enable_thinking: bool | None = None


class ChatCompletionRequest(SamplingFields):
    ENDPOINT = Endpoint.CHAT
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    modalities: list[str] | None = None
    tools: Annotated[list[dict[str, Any]], Field(min_length=1)] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    # a reasoning model's settings: "none" turns its thinking off; a model that does not
    # reason spends no effort (as vLLM takes them)
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None
    chat_template_kwargs: ChatTemplateKwargs | None = None  # vLLM's: enable_thinking only

    @staticmethod
    def check_raw(data: Any) -> None:
        """Refuse, in the raw body (before its strict JSON validation), an empty or media part, by name
        (:func:`~shardline.api.content.check_parts`)."""
        check_parts(data, "openai")

    @model_validator(mode="after")
    def _logprobs_asked(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: logprobs must be true when top_logprobs is set")
        return self

    def logprobs_wanted(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def grammar(self) -> str | None:
        return None if self.response_format is None else self.response_format.grammar()

    def to_generation(self) -> GenerationRequest:
        limit = self.max_completion_tokens or self.max_tokens
        param = "max_completion_tokens" if self.max_completion_tokens else "max_tokens"
        return dataclasses.replace(
            self.generation([m.chat() for m in self.messages], limit, param, "messages"),
            tools=list(self.tools or []),
            tool_choice=self.choice(),
            max_tool_calls=None if self.parallel_tool_calls else 1,
            name_param="name",
            thinking=self.thinking(),
            effort=self.reasoning_effort,
        )

    def thinking(self) -> bool:
        """Whether a reasoning model thinks: ``chat_template_kwargs.enable_thinking`` where
        given, else unless ``reasoning_effort`` is "none"."""
        if self.chat_template_kwargs is not None and self.chat_template_kwargs.enable_thinking is not None:
            return self.chat_template_kwargs.enable_thinking
        return self.reasoning_effort != "none"

    def choice(self) -> ToolChoice:
        try:
            return openai_tool_choice(self.tool_choice)
        except ValueError as exc:
            raise APIError(400, str(exc), param="tool_choice") from None


class EmbeddingsRequest(BaseModel):
    """OpenAI's embeddings request, as far as refusing it needs."""

    model_config = ConfigDict(extra="allow")
    model: str


def router(node: Node, metrics: RequestMetrics | None = None, heartbeat_s: float = HEARTBEAT_S) -> APIRouter:
    """Chat Completions and the model list on ``node``; a stream sends an SSE comment
    (``: keep-alive``) after ``heartbeat_s`` seconds with nothing else to send."""
    api = APIRouter()

    def model_object(m: dict) -> dict:
        return {"id": m["id"], "object": "model", "created": m["created"], "owned_by": "shardline"}

    @api.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str):
        for m in node.router.models():
            if m["id"] == model_id:
                return model_object(m)
        return error_response(
            APIError(
                404,
                f"The model '{model_id}' does not exist or is not loaded",
                "not_found_error",
                param="model",
                code="model_not_found",
            )
        )

    @api.get("/v1/models")
    async def list_models() -> dict:
        return {"object": "list", "data": [model_object(m) for m in node.router.models()]}

    @api.post("/v1/embeddings")
    async def embeddings(request: Request):
        """Refused: no model shardline places computes embeddings (400 for a placed model,
        404 for another)."""
        try:
            req = await parse_body(request, EmbeddingsRequest)
        except APIError as exc:
            return error_response(exc)
        if not any(i.model_id == req.model for i in node.instances.values()):
            return error_response(
                APIError(
                    404,
                    f"The model '{req.model}' does not exist or is not loaded",
                    "not_found_error",
                    param="model",
                    code="model_not_found",
                )
            )
        return error_response(
            APIError(400, f"model '{req.model}' does not support embeddings", param="model", code="model_not_supported")
        )

    @api.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await serve(node, metrics, request, ChatCompletionRequest, "chatcmpl", ChatShape, heartbeat_s)

    return api


class ChatShape:
    """The objects of Chat Completions: ``chat.completion`` and its chunks."""

    def __init__(self, req: SamplingFields, gens: list[Generation], completion_id: str, created: int) -> None:
        self.req, self.gens, self.id, self.created = req, gens, completion_id, created
        self.calls_sent: dict[int, int] = {}  # tool calls streamed so far, per choice

    @property
    def fingerprint(self) -> str:
        """The first choice's instance's (:attr:`Generation.fingerprint`), read at each
        object: a stream's later chunks name the instance placed again where the first
        failed before any output."""
        return self.gens[0].fingerprint

    def _chunk(self, index: int, delta: Any, finish: str | None, logprobs: dict | None = None, **extra) -> dict:
        """A chunk whose choice ``index`` carries ``delta`` (a message delta; None: no choice)."""
        choices = (
            [] if delta is None else [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]
        )
        return {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.req.model,
            "system_fingerprint": self.fingerprint,
            "choices": choices,
            **extra,
        }

    def _logprobs(self, index: int, chunk: Chunk) -> dict | None:
        return chat_logprobs(list(chunk.logprobs)) if self.req.logprobs_wanted() is not None else None

    def first(self, index: int) -> dict | None:
        return self._chunk(index, {"role": "assistant", "content": ""}, None)

    def piece(self, index: int, chunk: Chunk) -> dict | None:
        """The chunk for one piece of output (None: nothing to send); a reasoning model's
        thinking as ``reasoning_content`` (vLLM's and llama.cpp's field); each tool call
        whole in one delta, numbered per choice."""
        if not chunk.text and not chunk.reasoning and not chunk.logprobs and not chunk.tool_calls:
            return None
        delta: dict[str, Any] = {"reasoning_content": chunk.reasoning} if chunk.reasoning else {}
        if chunk.text or (chunk.logprobs and not chunk.reasoning):
            delta["content"] = chunk.text
        if chunk.tool_calls:
            first = self.calls_sent.get(index, 0)
            delta["tool_calls"] = [dict(_call_object(call), index=first + i) for i, call in enumerate(chunk.tool_calls)]
            self.calls_sent[index] = first + len(chunk.tool_calls)
        return self._chunk(index, delta, None, self._logprobs(index, chunk))

    def finish(self, index: int, reason: str) -> dict:
        return self._chunk(index, {}, reason)

    def progress(self, index: int, progress: dict) -> dict:
        return self._chunk(index, {}, None, prompt_progress=progress)

    def prefilled(self, index: int) -> dict | None:
        """The chunk to send once choice ``index``'s prompt is prefilled (None: none)."""
        return None

    def usage(self) -> dict:
        return self._chunk(0, None, None, usage=self.usage_of())

    def usage_of(self) -> dict:
        """Usage over every choice: the prompt once (n choices share it), all completions;
        for a reasoning model, ``completion_tokens_details.reasoning_tokens``."""
        usage = self.gens[0].usage()
        completion = sum(g.completion_tokens for g in self.gens)
        usage = dict(usage, completion_tokens=completion, total_tokens=usage["prompt_tokens"] + completion)
        if self.gens[0].reasons:
            usage["completion_tokens_details"] = {"reasoning_tokens": sum(g.reasoning_tokens for g in self.gens)}
        return usage

    def choice(self, index: int, chunks: list[Chunk], finish: str) -> dict:
        logprobs = None
        if self.req.logprobs_wanted() is not None:
            logprobs = chat_logprobs([t for c in chunks for t in c.logprobs])
        message: dict[str, Any] = {"role": "assistant", "content": "".join(c.text for c in chunks)}
        if self.gens[index].reasons:
            message["reasoning_content"] = "".join(c.reasoning for c in chunks) or None
        calls = [call for c in chunks for call in c.tool_calls]
        if calls:
            message["content"] = message["content"] or None
            message["tool_calls"] = [_call_object(call) for call in calls]
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish}

    def whole(self, choices: list[dict]) -> dict:
        return {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.req.model,
            "system_fingerprint": self.fingerprint,
            "choices": choices,
            "usage": self.usage_of(),
        }


async def serve(
    node: Node,
    metrics: RequestMetrics | None,
    request: Request,
    request_type: type[SamplingFields],
    id_prefix: str,
    shape_type: type[ChatShape],
    heartbeat_s: float,
):
    """Parse, prepare and run one request (``n`` sequences); stream it as server-sent
    events (an SSE comment after ``heartbeat_s`` seconds with nothing to send) or answer
    whole."""
    try:
        req = await parse_body(request, request_type)
        first = req.to_generation()
        gens = [await prepare(node, first, metrics)]
        for choice in range(1, req.n):
            gens.append(await prepare(node, dataclasses.replace(first, sampling=req.sampling(choice)), metrics))
    except APIError as exc:
        return error_response(exc)
    shape = shape_type(req, gens, f"{id_prefix}-{uuid.uuid4().hex}", int(time.time()))
    if req.stream:
        options = req.stream_options or StreamOptions()
        return StreamingResponse(
            _stream(gens, shape, req.return_progress, options, heartbeat_s),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    try:  # the choices run together, each its own sequence in the batch
        results = await asyncio.gather(*(collect_unless_disconnected(g, request) for g in gens))
    except InstanceFailedError as exc:
        return error_response(APIError(503, str(exc), "server_error", code=exc.code))
    if any(finish is None for _, finish in results):  # the client left; nobody reads this
        return JSONResponse(status_code=499, content=error_body("client closed the request", "client_closed"))
    return shape.whole(
        [shape.choice(index, chunks, finish or "stop") for index, (chunks, finish) in enumerate(results)]
    )


def _call_object(call: ToolCall) -> dict:
    """A tool call as Chat Completions writes it (arguments as JSON text)."""
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


KEEPALIVE_COMMENT = ": keep-alive\n\n"
"""An SSE comment line: clients skip it (the SSE specification), while it keeps a stream
that has nothing to send yet from their idle timeouts (as vLLM and llama.cpp's server
do not, and proxies such as LiteLLM do)."""


def _sse(data: Any) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


async def _stream(
    gens: list[Generation], shape: ChatShape, return_progress: bool, options: StreamOptions, heartbeat_s: float
) -> AsyncIterator[str]:
    def chunk(data: dict) -> str:
        # with include_usage, every chunk before the last carries "usage": null (OpenAI's
        # stream_options reference)
        return _sse({**data, "usage": None} if options.include_usage else data)

    for index in range(len(gens)):
        first = shape.first(index)
        if first is not None:
            yield chunk(first)
    try:
        async for index, item in merge_streams([g.texts(heartbeat_s) for g in gens]):
            if isinstance(item, Heartbeat):
                yield KEEPALIVE_COMMENT
                continue
            if isinstance(item, PrefillProgress):
                if return_progress:
                    yield chunk(shape.progress(index, gens[index].prefill_progress(item)))
                opening = shape.prefilled(index) if item.done == item.total else None
                if opening is not None:
                    yield chunk(opening)
                continue
            piece = shape.piece(index, item)
            if piece is not None:
                if options.include_obfuscation:
                    piece["obfuscation"] = obfuscation(item.reasoning + item.text)
                yield chunk(piece)
            if item.finish is not None:
                yield chunk(shape.finish(index, item.finish))
    except QueueFullError as exc:  # a forwarded request the rank's node refused
        yield _sse(error_body(str(exc), "rate_limit_exceeded", code="queue_full"))
        return
    except InstanceFailedError as exc:
        yield _sse(error_body(str(exc), "server_error", code=exc.code))
        return
    if options.include_usage:
        yield _sse(shape.usage())
    yield "data: [DONE]\n\n"
