"""Ollama-compatible API: ``POST /api/chat``, ``POST /api/generate``, ``GET /api/tags``,
``GET /api/version``.

Shapes follow Ollama's API documentation (docs/api.md in ollama/ollama): requests with
``options`` (``temperature``, ``top_p``, ``top_k``, ``seed``, ``num_predict``, ``stop``;
Ollama's defaults 0.8, 0.9, 40, none, until the context is full, none) and ``stream``
(default true: newline-delimited JSON objects, the last with ``"done": true``,
``done_reason`` and the token counts and durations in nanoseconds). Errors are
``{"error": message}``. A model answers to its id, with or without Ollama's ``:latest`` tag.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from datetime import datetime, timezone
from typing import Any, ClassVar, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from shardline.api.generation import (
    APIError,
    Generation,
    GenerationRequest,
    collect_unless_disconnected,
    parse_body,
    prepare,
)
from shardline.api.logprobs import ollama_logprobs
from shardline.api.metrics import RequestMetrics
from shardline.api.params import Endpoint
from shardline.api.structured import json_grammar
from shardline.node.node import Node
from shardline.node.queue_bound import QueueFullError
from shardline.node.table import InstanceFailedError
from shardline.runner.protocol import PrefillProgress, SamplingParams

OLLAMA_API_VERSION = "0.12.0"  # the Ollama release whose API this follows


def error_response(exc: APIError) -> JSONResponse:
    return JSONResponse(status_code=exc.status, content={"error": exc.message})


class Options(BaseModel):
    """The model options shardline honours (:data:`shardline.api.params.PARAMETERS`; the
    others are refused there). Defaults are Ollama's, except ``repeat_penalty`` (off)."""

    model_config = ConfigDict(extra="forbid")
    temperature: float = Field(default=0.8, ge=0.0)
    top_p: float = Field(default=0.9, ge=0.0, le=1.0)
    top_k: int = Field(default=40, ge=0)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    seed: int | None = None
    num_predict: int = -1  # -1: until the context is full
    num_ctx: int | None = Field(default=None, ge=1)
    stop: list[str] | None = None
    repeat_penalty: float = Field(default=1.0, gt=0.0)
    repeat_last_n: int = Field(default=64, ge=-1)  # -1: the whole context, 0: off (Ollama's)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    typical_p: float = 1.0
    tfs_z: float = 1.0
    mirostat: int = 0

    def sampling(self, logprobs: int | None, grammar: str | None) -> SamplingParams:
        greedy = self.top_p == 0.0
        repeat = self.repeat_penalty if self.repeat_last_n != 0 else 1.0
        return SamplingParams(
            0.0 if greedy else min(self.temperature, 2.0), 1.0 if greedy else self.top_p, self.top_k, self.seed,
            min_p=self.min_p, frequency_penalty=self.frequency_penalty, presence_penalty=self.presence_penalty,
            repetition_penalty=repeat, repeat_last_n=max(self.repeat_last_n, 0), logprobs=logprobs,
            grammar=grammar)


class OllamaMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""


class _Request(BaseModel):
    ENDPOINT: ClassVar[Endpoint]
    model_config = ConfigDict(extra="forbid")
    model: str
    stream: bool = True
    options: Options = Field(default_factory=Options)
    format: Literal["json"] | dict[str, Any] | None = None
    logprobs: bool = False
    top_logprobs: int = Field(default=0, ge=0, le=20)
    images: list[str] | None = None
    think: bool | None = None

    def grammar(self) -> str | None:
        """``format``: "json" (any JSON object, as llama.cpp's JSON grammar) or a JSON schema."""
        if self.format is None:
            return None
        try:
            return json_grammar(None if self.format == "json" else self.format)
        except ValueError as exc:
            raise APIError(400, f"format: {exc}", param="format") from exc

    def generation(self, prompt, prompt_param: str) -> GenerationRequest:
        o = self.options
        return GenerationRequest(
            model=self.model.removesuffix(":latest"), prompt=prompt,
            max_tokens=o.num_predict if o.num_predict > 0 else None,
            sampling=o.sampling(self.top_logprobs if self.logprobs else None, self.grammar()),
            stop=list(o.stop or []), api="ollama", max_tokens_param="options.num_predict",
            prompt_param=prompt_param, context=o.num_ctx)

    def to_generation(self) -> GenerationRequest:
        """The request as every API's generation takes it (each Ollama route its own)."""
        raise NotImplementedError


class ChatRequest(_Request):
    ENDPOINT = Endpoint.OLLAMA_CHAT
    messages: list[OllamaMessage] = Field(min_length=1)

    def to_generation(self) -> GenerationRequest:
        return self.generation([{"role": m.role, "content": m.content} for m in self.messages], "messages")


class GenerateRequest(_Request):
    ENDPOINT = Endpoint.OLLAMA_GENERATE
    prompt: str = ""
    system: str | None = None
    raw: bool = False  # true: the prompt as it is, without the chat template

    def to_generation(self) -> GenerationRequest:
        if self.raw:
            return self.generation(self.prompt, "prompt")
        chat = [{"role": "system", "content": self.system}] if self.system else []
        return self.generation(chat + [{"role": "user", "content": self.prompt}], "prompt")


def _now() -> str:
    return datetime.now(timezone.utc).isoformat()


def router(node: Node, metrics: RequestMetrics | None = None) -> APIRouter:
    api = APIRouter()

    @api.get("/api/version")
    async def version() -> dict:
        return {"version": OLLAMA_API_VERSION}

    @api.get("/api/tags")
    async def tags() -> dict:
        out = []
        for m in node.router.models():
            inst = node.router.ready_instance(m["id"])
            out.append({"name": m["id"], "model": m["id"],
                        "modified_at": datetime.fromtimestamp(m["created"], timezone.utc).isoformat(),
                        "size": sum((r.loaded or {}).get("param_bytes", 0) for r in inst.ranks),
                        "digest": "", "details": {"format": "", "family": "", "parameter_size": "",
                                                  "quantization_level": "", "sharding": inst.sharding}})
        return {"models": out}

    @api.post("/api/chat")
    async def chat(request: Request):
        return await _serve(node, metrics, request, ChatRequest,
                            lambda text: {"message": {"role": "assistant", "content": text}})

    @api.post("/api/generate")
    async def generate(request: Request):
        try:
            req = await parse_body(request, GenerateRequest)
        except APIError as exc:
            return error_response(exc)
        if not req.prompt:  # Ollama's way to load a model: answer that it is ready, or why not
            try:
                node.router.ready_instance(req.model.removesuffix(":latest"))
            except LookupError:
                return error_response(APIError(404, f"model '{req.model}' not found"))
            return {"model": req.model, "created_at": _now(), "response": "", "done": True,
                    "done_reason": "load"}
        return await _serve(node, metrics, request, GenerateRequest, lambda text: {"response": text}, req)

    return api


async def _serve(node: Node, metrics: RequestMetrics | None, request: Request, request_type: type[_Request],
                 content: Callable[[str], dict], req: _Request | None = None):
    try:
        req = req or await parse_body(request, request_type)
        gen = await prepare(node, req.to_generation(), metrics)
    except APIError as exc:
        return error_response(exc)
    if req.stream:
        return StreamingResponse(_stream(gen, req, content), media_type="application/x-ndjson")
    try:
        chunks, finish = await collect_unless_disconnected(gen, request)
    except InstanceFailedError as exc:
        return error_response(APIError(500, str(exc)))
    if finish is None:  # the client left; nobody reads this
        return JSONResponse(status_code=499, content={"error": "client closed the request"})
    body = content("".join(c.text for c in chunks))
    if req.logprobs:
        body["logprobs"] = ollama_logprobs([t for c in chunks for t in c.logprobs])
    return _final(gen, req, body, finish)


def _final(gen: Generation, req: _Request, body: dict, finish: str) -> dict:
    """The last object: done, why, and Ollama's counts and durations (nanoseconds; the
    prompt's is the time to the first token)."""
    now = time.monotonic()
    first = gen.first_token_at or now
    return {"model": req.model, "created_at": _now(), **body, "done": True, "done_reason": finish,
            "total_duration": int((now - gen.started) * 1e9), "load_duration": 0,
            "prompt_eval_count": len(gen.prompt), "prompt_eval_duration": int((first - gen.started) * 1e9),
            "eval_count": gen.completion_tokens, "eval_duration": int((now - first) * 1e9)}


async def _stream(gen: Generation, req: _Request, content: Callable[[str], dict]) -> AsyncIterator[str]:
    def line(data: dict) -> str:
        return json.dumps(data, ensure_ascii=False) + "\n"

    try:
        async for item in gen.texts():
            if isinstance(item, PrefillProgress):
                continue
            if item.text or item.logprobs:
                body = content(item.text)
                if req.logprobs:
                    body["logprobs"] = ollama_logprobs(list(item.logprobs))
                yield line({"model": req.model, "created_at": _now(), **body, "done": False})
            if item.finish is not None:
                yield line(_final(gen, req, content(""), item.finish))
    except (InstanceFailedError, QueueFullError) as exc:  # QueueFullError: a forwarded request refused
        yield line({"error": str(exc)})
