"""Ollama-compatible API: ``POST /api/chat``, ``POST /api/generate``, ``POST /api/show``,
``GET /api/tags``, ``GET /api/ps``, ``GET /api/version``; ``POST /api/embed`` and
``/api/embeddings`` refused (no embedding model can be placed).

Shapes follow Ollama's API documentation (docs/api.md in ollama/ollama): requests with
``options`` (``temperature``, ``top_p``, ``top_k``, ``seed``, ``num_predict``, ``stop``;
Ollama's defaults 0.8, 0.9, 40, none, until the context is full, none) and ``stream``
(default true: newline-delimited JSON objects, the last with ``"done": true``,
``done_reason`` and the token counts and durations in nanoseconds). Errors are
``{"error": message}``. A model answers to its id, with or without Ollama's ``:latest`` tag.

``keep_alive`` (:mod:`shardline.api.keep_alive`): ``0`` unloads the model (deletes its
instances through the coordinator), a duration unloads it after that long idle, absent
changes nothing. A chat without messages or a generate without a prompt loads (answers
``done_reason: "load"`` once the model is ready) or, with ``keep_alive: 0``, unloads
(``"unload"``). As in Ollama, a request for a model the cluster can place but has not
placed loads it first (:meth:`~shardline.api.keep_alive.KeepAlive.load`). Images are
refused: every model shardline runs takes text only.

``think`` turns a reasoning model's thinking on (true) or off (false), or on at a level
(low, medium, high, max: gpt-oss's reasoning effort); absent, the chat template's default
holds. Its thinking comes as the message's ``thinking`` (/api/chat) or the answer's
``thinking`` (/api/generate), never in the content, unless ``think`` is false.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import datetime, timezone
from typing import Any, ClassVar, Literal, get_args

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator

from shardline.api.content import check_parts
from shardline.api.heartbeat import HEARTBEAT_S, Heartbeat
from shardline.api.keep_alive import KeepAlive, parse_keep_alive, unload
from shardline.api.keep_alive import keep as keep_instances
from shardline.api.logprobs import ollama_logprobs
from shardline.api.metrics import RequestMetrics
from shardline.api.model_facts import ModelFacts, held_bytes, model_facts, placed
from shardline.api.params import Endpoint, StopString
from shardline.api.preparation import prepare
from shardline.api.request_body import parse_body
from shardline.api.structured import json_grammar
from shardline.api.text_stream import APIError, Chunk, Generation, GenerationRequest, collect_unless_disconnected
from shardline.api.tools import ToolCall, openai_tool_choice
from shardline.models.store import ModelNotFoundError
from shardline.models.tokenizer import template_reasons
from shardline.node.node import Node
from shardline.node.peer_client import PeerError
from shardline.node.queue_bound import QueueFullError
from shardline.node.status import InstanceStatus
from shardline.node.table import InstanceFailedError
from shardline.node.transfer import TransferError
from shardline.runner.protocol import SamplingParams

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
    # -1 (no limit) and -2 (Ollama's "fill the context") both run until the context is full
    num_predict: int = Field(default=-1, ge=-2)
    num_ctx: int | None = Field(default=None, ge=1)
    stop: list[StopString] | None = None
    repeat_penalty: float = Field(default=1.0, gt=0.0)
    repeat_last_n: int = Field(default=64, ge=-1)  # -1: the whole context, 0: off (Ollama's)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    typical_p: float = 1.0
    tfs_z: float = 1.0
    mirostat: int = 0

    def sampling(self, logprobs: int | None, grammar: str | None) -> SamplingParams:
        repeat = self.repeat_penalty if self.repeat_last_n != 0 else 1.0
        return SamplingParams(
            min(self.temperature, 2.0),
            self.top_p,
            self.top_k,
            self.seed,
            min_p=self.min_p,
            frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty,
            repetition_penalty=repeat,
            repeat_last_n=max(self.repeat_last_n, 0),
            logprobs=logprobs,
            grammar=grammar,
        )


class OllamaMessage(BaseModel):
    """A message: text, an assistant's ``tool_calls`` (``[{function: {name, arguments}}]``,
    arguments an object) and a tool result's ``tool_name``."""

    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    images: list[str] | None = None  # refused unless empty (content.check_parts)
    tool_calls: list[dict[str, Any]] | None = None
    tool_name: str | None = None
    thinking: str | None = None  # a thinking model's reasoning: dropped from the history, as Ollama does

    def chat(self) -> dict[str, Any]:
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [{"type": "function", **call} for call in self.tool_calls]
        if self.tool_name is not None:
            out["name"] = self.tool_name
        return out


ThinkLevel = Literal["low", "medium", "high", "max"]
"""Ollama's ``think`` levels (besides true and false): a reasoning effort, which gpt-oss's
template writes as its level (:func:`~shardline.models.tokenizer.reasoning_level`)."""
THINK_LEVELS = get_args(ThinkLevel)


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
    think: bool | ThinkLevel | None = None  # a level: thinks, at that effort (gpt-oss)

    @model_validator(mode="after")
    def _logprobs_asked(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: logprobs must be true when top_logprobs is set")
        return self

    def grammar(self) -> str | None:
        """``format``: "json" (any JSON object, as llama.cpp's JSON grammar) or a JSON schema."""
        if self.format is None:
            return None
        try:
            return json_grammar(None if self.format == "json" else self.format)
        except ValueError as exc:
            raise APIError(400, f"format: {exc}", param="format") from exc

    keep_alive: Any = None  # a duration or seconds: parse_keep_alive

    @staticmethod
    def check_raw(data: Any) -> None:
        """Refuse, in the raw body (before its strict JSON validation), images, by name
        (:func:`~shardline.api.content.check_parts`), and a ``think`` that is neither a
        boolean nor one of Ollama's levels, in Ollama's words (clients read "invalid think
        value" to try again with ``think: true``).

        Raises:
            APIError: 400 naming the field.
        """
        check_parts(data, "ollama")
        think = data.get("think") if isinstance(data, dict) else None
        if think is not None and not isinstance(think, bool) and think not in THINK_LEVELS:
            raise APIError(
                400,
                f'invalid think value: {json.dumps(think)} (must be "high", "medium", "low", "max", true, or false)',
                param="think",
            )

    def keep_alive_s(self) -> float | None:
        """``keep_alive`` in seconds (:func:`parse_keep_alive`).

        Raises:
            APIError: 400 naming keep_alive for a value that is not a duration.
        """
        try:
            return parse_keep_alive(self.keep_alive)
        except ValueError as exc:
            raise APIError(400, str(exc), param="keep_alive") from None

    def has_input(self) -> bool:
        """Whether there is something to generate from (else: load or unload)."""
        raise NotImplementedError

    def generation(self, prompt, prompt_param: str) -> GenerationRequest:
        o = self.options
        return GenerationRequest(
            model=self.model.removesuffix(":latest"),
            prompt=prompt,
            max_tokens=o.num_predict if o.num_predict > 0 else None,
            sampling=o.sampling(self.top_logprobs if self.logprobs else None, self.grammar()),
            stop=list(o.stop or []),
            api="ollama",
            max_tokens_param="options.num_predict",
            max_tokens_capped=True,
            prompt_param=prompt_param,
            context=o.num_ctx,
            thinking=True if isinstance(self.think, str) else self.think,
            effort=self.think if isinstance(self.think, str) else None,
        )

    def to_generation(self) -> GenerationRequest:
        """The request as every API's generation takes it (each Ollama route its own)."""
        raise NotImplementedError


class ChatRequest(_Request):
    ENDPOINT = Endpoint.OLLAMA_CHAT
    messages: list[OllamaMessage] = Field(default_factory=list)  # none: load or unload the model

    def has_input(self) -> bool:
        return bool(self.messages)

    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] = "auto"  # an extension: OpenAI's values (Ollama has none)

    def to_generation(self) -> GenerationRequest:
        try:
            choice = openai_tool_choice(self.tool_choice)
        except ValueError as exc:
            raise APIError(400, str(exc), param="tool_choice") from None
        return dataclasses.replace(
            self.generation([m.chat() for m in self.messages], "messages"),
            tools=list(self.tools or []),
            tool_choice=choice,
            name_param="tool_name",
            truncate_history=True,
        )


class GenerateRequest(_Request):
    ENDPOINT = Endpoint.OLLAMA_GENERATE
    prompt: str = ""
    system: str | None = None
    raw: bool = False  # true: the prompt as it is, without the chat template

    def has_input(self) -> bool:
        return bool(self.prompt)

    def to_generation(self) -> GenerationRequest:
        if self.raw:
            return self.generation(self.prompt, "prompt")
        chat = [{"role": "system", "content": self.system}] if self.system else []
        return self.generation(chat + [{"role": "user", "content": self.prompt}], "prompt")


class ShowRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # verbose: the tokenizer's arrays are never listed
    model: str


FOREVER = datetime(9999, 12, 31, 23, 59, 59, tzinfo=timezone.utc).isoformat()
"""``expires_at`` of a model without a keep_alive deadline (shardline keeps placed models)."""


def _now() -> str:
    return datetime.now(timezone.utc).isoformat()


def _at(seconds: float | None) -> str:
    """An ISO 8601 time from ``time.time()`` seconds (None or infinite: :data:`FOREVER`)."""
    if seconds is None or seconds == float("inf"):
        return FOREVER
    return datetime.fromtimestamp(seconds, timezone.utc).isoformat()


def default_parameters(context: int | None) -> dict[str, Any]:
    """The options shardline applies when a request gives none (:class:`Options`' defaults)
    and the context of the model's instance (``num_ctx``)."""
    out: dict[str, Any] = {name: Options.model_fields[name].default for name in ("temperature", "top_k", "top_p")}
    if context:
        out["num_ctx"] = context
    return out


def parameters_text(parameters: dict[str, Any]) -> str:
    """Ollama's ``parameters`` text: a line per parameter, its name padded to 30 columns."""
    return "\n".join(f"{name:<30} {value}" for name, value in parameters.items())


def modelfile_text(model: str, template: str | None, parameters: dict[str, Any]) -> str:
    """A Modelfile that names the model, its chat template and the default parameters."""
    lines = [f"# Modelfile generated by shardline for {model}", f"FROM {model}"]
    if template:
        lines.append(f'TEMPLATE """{template}"""')
    lines += [f"PARAMETER {name} {value}" for name, value in parameters.items()]
    return "\n".join(lines) + "\n"


def capabilities(template: str | None) -> list[str]:
    """Ollama's ``capabilities``: completion, tools where the chat template renders a
    ``tools`` variable (the template's text mentions it), and thinking where it writes
    ``<think>`` (a reasoning model's)."""
    return (
        ["completion"]
        + (["tools"] if template and "tools" in template else [])
        + (["thinking"] if template_reasons(template) else [])
    )


def _template_of(tokenizer: Any) -> str | None:
    """The tokenizer's chat template text (a named set: the default one)."""
    template = getattr(tokenizer, "chat_template", None) or getattr(
        getattr(tokenizer, "_tok", None), "chat_template", None
    )
    if isinstance(template, dict):
        template = template.get("default") or next(iter(template.values()), None)
    return template if isinstance(template, str) else None


def _not_found(model: str) -> JSONResponse:
    return error_response(APIError(404, f"model '{model}' not found", "not_found_error", param="model"))


def router(
    node: Node, metrics: RequestMetrics | None = None, keep: KeepAlive | None = None, heartbeat_s: float = HEARTBEAT_S
) -> APIRouter:
    """The Ollama routes; ``keep``: the node's keep_alive deadlines (a new set if None); a
    stream sends a chunk with no text after ``heartbeat_s`` seconds with nothing else to
    send."""
    api = APIRouter()
    keep = keep if keep is not None else KeepAlive()
    facts = _facts_of(node)

    @api.get("/api/version")
    async def version() -> dict:
        return {"version": OLLAMA_API_VERSION}

    @api.get("/api/tags")
    async def tags():
        """The models a request can name, as Ollama lists its local ones: those served,
        and those a live node holds whole (and the embedded default), which a request
        loads first. ``size`` is their weight files' bytes, ``digest`` as
        :mod:`shardline.api.model_facts` says, ``modified_at`` when it was placed (served)
        or added; a served one's ``details`` name its sharding."""
        return await _tags(node, facts)

    @api.get("/api/ps", response_model=None)
    async def ps() -> dict | JSONResponse:
        """The models with a ready instance: bytes their ranks hold (``size``; on GPUs
        ``size_vram``), and when keep_alive unloads them (``expires_at``)."""
        return await _ps(node, facts)

    @api.post("/api/show")
    async def show(request: Request):
        return await _show(node, facts, request)

    @api.post("/api/embed")
    async def embed(request: Request):
        return await _refuse_embeddings(node, request)

    @api.post("/api/embeddings")
    async def embeddings(request: Request):
        return await _refuse_embeddings(node, request)

    @api.post("/api/chat")
    async def chat(request: Request):
        return await _serve(node, metrics, keep, request, ChatRequest, _chat_message, heartbeat_s)

    @api.post("/api/generate")
    async def generate(request: Request):
        return await _serve(node, metrics, keep, request, GenerateRequest, _generated, heartbeat_s)

    return api


_Facts = Callable[[str], Awaitable[ModelFacts]]


def _facts_of(node: Node) -> _Facts:
    """A model's :class:`ModelFacts` on ``node``, cached per model by the returned function."""
    facts_cache: dict[str, ModelFacts] = {}

    async def facts(model_id: str) -> ModelFacts:
        """Raises APIError: 404 for a model no node holds, 503 when it cannot be read."""
        try:
            return await model_facts(node, model_id, facts_cache)
        except ModelNotFoundError:
            raise APIError(404, f"model '{model_id}' not found", "not_found_error", param="model") from None
        except (TransferError, PeerError, OSError) as exc:
            raise APIError(503, f"model '{model_id}' cannot be described on this node: {exc}") from exc

    return facts


async def _tags(node: Node, facts: _Facts) -> dict | JSONResponse:
    """``/api/tags``' body (see :func:`router`); an error response where a served model's
    facts cannot be read."""
    served = {m["id"]: m["created"] for m in node.router.models()}
    out = []
    for view in await node.logistics.cluster_models():
        model_id = view["model_id"]
        if model_id not in served and not view["complete_on"]:
            continue
        try:
            f = await facts(model_id)
        except APIError as exc:
            if model_id in served:
                return error_response(exc)
            continue  # held but not readable here now: not listed
        details = f.details()
        if model_id in served:
            details["sharding"] = node.router.ready_instance(model_id).sharding
        when = served.get(model_id) or view["added_at"] or time.time()
        out.append(
            {
                "name": model_id,
                "model": model_id,
                "modified_at": datetime.fromtimestamp(when, timezone.utc).isoformat(),
                "size": f.file_bytes,
                "digest": f.digest,
                "details": details,
            }
        )
    return {"models": out}


async def _ps(node: Node, facts: _Facts) -> dict | JSONResponse:
    """``/api/ps``' body (see :func:`router`); an error response where a model's facts
    cannot be read."""
    out: dict[str, dict] = {}
    for inst in node.instances.values():
        if inst.status != InstanceStatus.READY:
            continue
        try:
            f = await facts(inst.model_id)
        except APIError as exc:
            return error_response(exc)
        size, vram = held_bytes(inst)
        deadline = inst.keep_until
        entry = out.setdefault(
            inst.model_id,
            {
                "name": inst.model_id,
                "model": inst.model_id,
                "size": 0,
                "digest": f.digest,
                "details": f.details(),
                "expires_at": deadline,
                "size_vram": 0,
                "context_length": 0,
            },
        )
        entry["size"] += size
        entry["size_vram"] += vram
        entry["context_length"] = max(entry["context_length"], inst.context)
        if entry["expires_at"] is not None:  # the latest of its instances' (none: for ever)
            entry["expires_at"] = None if deadline is None else max(entry["expires_at"], deadline)
    return {"models": [dict(e, expires_at=_at(e["expires_at"])) for e in out.values()]}


async def _show(node: Node, facts: _Facts, request: Request) -> dict | JSONResponse:
    """``/api/show``: a placed model's modelfile, parameters, template, details and
    capabilities; 404 for a model not placed, 503 where it cannot be described."""
    try:
        req = await parse_body(request, ShowRequest)
        model = req.model.removesuffix(":latest")
        instances = placed(node, model)
        if not instances:
            return _not_found(req.model)
        f = await facts(model)
        try:
            template = _template_of(await node.logistics.tokenizer(model))
        except (ModelNotFoundError, TransferError, PeerError) as exc:
            raise APIError(503, f"model '{model}' cannot be described on this node: {exc}") from exc
    except APIError as exc:
        return error_response(exc)
    parameters = default_parameters(max(i.context for i in instances))
    return {
        "modelfile": modelfile_text(model, template, parameters),
        "parameters": parameters_text(parameters),
        "template": template or "",
        "details": f.details(),
        "model_info": f.model_info(),
        "capabilities": capabilities(template),
        "modified_at": datetime.fromtimestamp(min(i.created_at for i in instances), timezone.utc).isoformat(),
    }


async def _refuse_embeddings(node: Node, request: Request) -> JSONResponse:
    """400 for a placed model (none computes embeddings), 404 for another."""
    try:
        req = await parse_body(request, ShowRequest)
    except APIError as exc:
        return error_response(exc)
    if not placed(node, req.model.removesuffix(":latest")):
        return _not_found(req.model)
    return error_response(APIError(400, f"model '{req.model}' does not support embeddings", param="model"))


async def _load(
    node: Node, keep: KeepAlive, req: _Request, seconds: float | None, content: Callable[..., dict]
) -> JSONResponse | dict:
    """A request with nothing to generate: unload the model (``keep_alive`` 0; nothing to
    do when it is not placed), else load it (:func:`_loaded`) and answer that it is loaded
    (and keep it ``seconds``), or why not."""
    model = req.model.removesuffix(":latest")
    instances = placed(node, model)
    if seconds == 0:
        for inst in instances:
            status, body = await unload(node, inst.instance_id)
            if status >= 400 and status != 404:  # 404: gone meanwhile
                return error_response(APIError(status, f"model '{req.model}' could not be unloaded: {body}"))
        return {"model": req.model, "created_at": _now(), **content(""), "done": True, "done_reason": "unload"}
    refused = await _loaded(node, keep, req.model)
    if refused is not None:
        return refused
    instances = placed(node, model)
    if seconds is not None:
        await keep_instances(node, [i.instance_id for i in instances], seconds)
    return {"model": req.model, "created_at": _now(), **content(""), "done": True, "done_reason": "load"}


async def _loaded(node: Node, keep: KeepAlive, name: str) -> JSONResponse | None:
    """Load model ``name`` (its id, or with ``:latest``) as Ollama does on a request
    (:meth:`~shardline.api.keep_alive.KeepAlive.load`); None once it is ready, else the
    Ollama error answer (404 for a model the cluster does not know)."""
    refused = await keep.load(node, name.removesuffix(":latest"))
    if refused is None:
        return None
    status, body = refused
    error = body.get("error", {}) if isinstance(body, dict) else {}
    if status == 404 or (status == 400 and error.get("param") == "model"):  # unknown, or no id
        return _not_found(name)
    message = error.get("message", str(body))
    return error_response(APIError(status, f"model '{name}' could not be loaded: {message}"))


async def _serve(
    node: Node,
    metrics: RequestMetrics | None,
    keep: KeepAlive,
    request: Request,
    request_type: type[_Request],
    content: Callable[..., dict],
    heartbeat_s: float,
):
    try:
        req = await parse_body(request, request_type)
        seconds = req.keep_alive_s()
        if not req.has_input():
            return await _load(node, keep, req, seconds, content)
        load_s = 0.0  # seconds spent placing the model for this request
        if not placed(node, req.model.removesuffix(":latest")):
            loading = time.monotonic()
            refused = await _loaded(node, keep, req.model)
            if refused is not None:
                return refused
            load_s = time.monotonic() - loading
        gen = await prepare(node, req.to_generation(), metrics)
    except APIError as exc:
        return error_response(exc)
    ids = [i.instance_id for i in placed(node, gen.req.model)]
    if req.stream:
        return StreamingResponse(
            _stream(node, gen, req, content, keep, ids, seconds, load_s, heartbeat_s), media_type="application/x-ndjson"
        )
    keep.begin(ids)
    try:
        chunks, finish = await collect_unless_disconnected(gen, request)
    except InstanceFailedError as exc:
        return error_response(APIError(500, str(exc)))
    finally:
        keep.end(node, ids, seconds)
    if finish is None:  # the client left; nobody reads this
        return JSONResponse(status_code=499, content={"error": "client closed the request"})
    thinking = "".join(c.reasoning for c in chunks) if req.think is not False else ""
    body = content("".join(c.text for c in chunks), tuple(call for c in chunks for call in c.tool_calls), thinking)
    if req.logprobs:
        body["logprobs"] = ollama_logprobs([t for c in chunks for t in c.logprobs])
    return _final(gen, req, body, finish, load_s)


def _final(gen: Generation, req: _Request, body: dict, finish: str, load_s: float) -> dict:
    """The last object: done, why, and Ollama's counts and durations (nanoseconds; the
    prompt's is the time to the first token; the load's, ``load_s``, what placing the model
    for this request took, is part of the total). ``prompt_eval_count`` counts the prompt
    tokens computed, as Ollama's does: not those its instance's prefix cache held."""
    now = time.monotonic()
    first = gen.first_token_at or now
    return {
        "model": req.model,
        "created_at": _now(),
        **body,
        "done": True,
        "done_reason": "stop" if finish == "tool_calls" else finish,
        "total_duration": int((now - gen.started + load_s) * 1e9),
        "load_duration": int(load_s * 1e9),
        "prompt_eval_count": gen.computed_tokens,
        "prompt_eval_duration": int((first - gen.started) * 1e9),
        "eval_count": gen.completion_tokens,
        "eval_duration": int((now - first) * 1e9),
    }


def _chat_message(text: str, calls: tuple[ToolCall, ...] = (), thinking: str = "") -> dict:
    """The ``message`` of a chat answer: its ``thinking`` where there is some; tool calls
    with their arguments as objects."""
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if thinking:
        message["thinking"] = thinking
    if calls:
        message["tool_calls"] = [{"function": {"name": c.name, "arguments": json.loads(c.arguments)}} for c in calls]
    return {"message": message}


def _generated(text: str, calls: tuple[ToolCall, ...] = (), thinking: str = "") -> dict:
    """The text fields of a generate answer: ``response``, and ``thinking`` where there is some."""
    return {"response": text, "thinking": thinking} if thinking else {"response": text}


async def _stream(
    node: Node,
    gen: Generation,
    req: _Request,
    content: Callable[..., dict],
    keep: KeepAlive,
    ids: list[str],
    seconds: float | None,
    load_s: float,
    heartbeat_s: float,
) -> AsyncIterator[str]:
    def line(data: dict) -> str:
        return json.dumps(data, ensure_ascii=False) + "\n"

    keep.begin(ids)
    try:
        async for item in gen.texts(heartbeat_s):
            if isinstance(item, Heartbeat):  # an empty chunk: a client reads it as no text yet
                yield line({"model": req.model, "created_at": _now(), **content(""), "done": False})
                continue
            if not isinstance(item, Chunk):  # prefill progress
                continue
            thinking = item.reasoning if req.think is not False else ""
            if item.text or thinking or item.logprobs or item.tool_calls:
                body = content(item.text, item.tool_calls, thinking)
                if req.logprobs:
                    body["logprobs"] = ollama_logprobs(list(item.logprobs))
                yield line({"model": req.model, "created_at": _now(), **body, "done": False})
            if item.finish is not None:
                yield line(_final(gen, req, content(""), item.finish, load_s))
    except (InstanceFailedError, QueueFullError) as exc:  # QueueFullError: a forwarded request refused
        yield line({"error": str(exc)})
    finally:
        keep.end(node, ids, seconds)
