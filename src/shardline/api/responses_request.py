"""The Responses API's request (``POST /v1/responses``), checked and mapped to a
:class:`~shardline.api.generation.GenerationRequest`: pure functions.

Shapes from OpenAI's API reference (Responses, create) as the ``openai`` package 3.57.0
types them (``openai/types/responses/response_create_params.py``,
``response_input_item_param.py``, ``function_tool_param.py``,
``response_format_text_config_param.py``). Every field of that request either works or is
refused with a 400 naming it (:data:`NULL_ONLY`, :data:`FIELDS`); a field the reference
does not have is refused as OpenAI refuses it (``Unknown parameter: 'x'.``).
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from shardline.api.generation import APIError, GenerationRequest
from shardline.api.params import PARAMETERS, Endpoint
from shardline.api.request_body import validation_error
from shardline.api.structured import json_grammar, strict_schema_problem
from shardline.api.tools import ToolChoice, ToolChoiceMode, check_history, check_tools
from shardline.runner.protocol import SamplingParams

# Values of fields that work, which this server does not serve.
SERVICE_TIERS = (None, "auto", "default")
LOGPROBS_INCLUDE = "message.output_text.logprobs"
TEXT_ONLY_PARTS = {"input_image", "input_file", "input_audio"}
_FORMAT_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")


class ResponsesRequest(BaseModel):
    """The fields of a ``POST /v1/responses`` body that work (after :func:`check_fields`)."""

    model_config = ConfigDict(extra="forbid")
    model: str
    input: str | list[dict[str, Any]] = Field(min_length=1)
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    stream: bool | None = None
    stream_options: dict[str, Any] | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    metadata: dict[str, str] | None = Field(default=None, max_length=16)
    user: str | None = None
    safety_identifier: str | None = Field(default=None, max_length=128)
    prompt_cache_key: str | None = None
    truncation: Literal["disabled", "auto"] | None = None
    include: list[str] | None = None
    max_tool_calls: int | None = Field(default=None, ge=1)
    service_tier: str | None = None
    background: bool | None = None
    reasoning: dict[str, Any] | None = None


def bad(message: str, param: str | None, code: str | None = None, status: int = 400) -> APIError:
    """An invalid-request :class:`APIError` (OpenAI's ``invalid_request_error``)."""
    return APIError(status, message, param=param, code=code)


def unsupported(param: str, what: str = "") -> APIError:
    return bad(f"{param}{what} is not supported by this server", param, "unsupported_parameter")


def check_fields(body: Any) -> ResponsesRequest:
    """Check a parsed JSON body's fields and validate it into a :class:`ResponsesRequest`.

    Raises:
        APIError: 400 for a body that is not an object, a field the reference does not
            have (``Unknown parameter: 'x'.``, code ``unknown_parameter``), a field this
            server does not serve given a value (code ``unsupported_parameter``), or a
            value out of its range (the message and ``param`` name the field).
    """
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object", None)
    for name, value in body.items():
        if name in NULL_ONLY:
            if not any(value == ok for ok in NULL_ONLY[name]):
                raise unsupported(name)
        elif name not in FIELDS:
            raise bad(f"Unknown parameter: '{name}'.", name, "unknown_parameter")
    try:
        req = ResponsesRequest.model_validate_json(  # strict JSON types, as in _parse
            json.dumps({k: v for k, v in body.items() if k not in NULL_ONLY}), strict=True)
    except ValidationError as exc:
        raise validation_error(exc) from None
    if req.truncation == "auto":
        raise unsupported("truncation", " 'auto'")
    if req.service_tier not in SERVICE_TIERS:
        raise unsupported("service_tier", f" '{req.service_tier}'")
    if req.background:
        raise unsupported("background", " (true)")
    if req.reasoning is not None and any(v is not None for v in req.reasoning.values()):
        raise bad(f"reasoning is not supported by model {req.model}", "reasoning", "unsupported_parameter")
    for index, item in enumerate(req.include or []):
        if item != LOGPROBS_INCLUDE:
            raise unsupported(f"include[{index}]", f" '{item}'")
    if req.top_logprobs and LOGPROBS_INCLUDE not in (req.include or []):
        raise bad(f"top_logprobs gives alternatives to the logprobs that include['{LOGPROBS_INCLUDE}'] "
                  "asks for; include it, or leave top_logprobs out", "top_logprobs")
    if req.stream_options is not None:
        if not req.stream:
            raise bad("stream_options is only allowed when stream is true", "stream_options")
        extra = set(req.stream_options) - {"include_obfuscation"}
        if extra:
            raise bad(f"Unknown parameter: 'stream_options.{sorted(extra)[0]}'.",
                      f"stream_options.{sorted(extra)[0]}", "unknown_parameter")
    for key, value in (req.metadata or {}).items():
        if len(key) > 64 or len(value) > 512:
            raise bad("metadata keys are at most 64 characters and values 512", "metadata")
    text_format(req.text)  # checked here, built where the request is mapped
    return req


_ROWS = {p.name: p for p in PARAMETERS if p.endpoint is Endpoint.RESPONSES}
FIELDS = {name for name in _ROWS if name in ResponsesRequest.model_fields}
"""Fields validated by :class:`ResponsesRequest` (rows of
:data:`shardline.api.params.PARAMETERS`; a few refused at some values by :func:`check_fields`)."""
NULL_ONLY: dict[str, tuple[Any, ...]] = {name: (None, *p.allowed) for name, p in _ROWS.items() if name not in FIELDS}
"""Fields of the reference accepted only as null (or a value that asks for nothing)."""


# -- input items -------------------------------------------------------------------------

_MESSAGE_KEYS = {"type", "role", "content", "id", "status", "phase"}
_CALL_KEYS = {"type", "call_id", "name", "arguments", "id", "status", "namespace", "caller"}
_OUTPUT_KEYS = {"type", "call_id", "output", "id", "status", "name", "namespace", "caller"}


def _text_of(content: Any, model: str, where: str) -> str:
    """The text of a message's content (a string, or text parts joined)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not content:
        raise bad(f"{where}: a string or a non-empty list of content parts", where)
    texts = []
    for index, part in enumerate(content):
        at = f"{where}[{index}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in TEXT_ONLY_PARTS:
            raise bad(f"model {model} takes text only ({at} is {kind})", f"{at}.type", "unsupported_content")
        field_name = {"input_text": "text", "output_text": "text", "refusal": "refusal"}.get(str(kind))
        if field_name is None:
            raise bad(f"{at}.type: expected input_text, output_text or refusal, got {kind!r}", f"{at}.type")
        allowed = {"type", field_name} | ({"annotations", "logprobs"} if kind == "output_text" else set())
        _no_other_keys(part, allowed, at)
        if not isinstance(part.get(field_name), str):
            raise bad(f"{at}.{field_name}: a string is required", f"{at}.{field_name}")
        texts.append(part[field_name])
    return "".join(texts)


def _no_other_keys(item: dict, allowed: set[str], where: str) -> None:
    for key in item:
        if key not in allowed:
            raise bad(f"Unknown parameter: '{where}.{key}'.", f"{where}.{key}", "unknown_parameter")


def normalize_input(input_: str | list[dict[str, Any]], model: str) -> list[dict]:
    """The request's ``input`` as canonical items: ``{"type": "message", "role",
    "content": [{"type": "input_text" | "output_text", "text"}]}``, ``{"type":
    "function_call", "call_id", "name", "arguments"}`` and ``{"type":
    "function_call_output", "call_id", "output"}`` (a string).

    Raises:
        APIError: 400 naming the first offending item's field (``input[i]...``): an item
            type other than these (or ``item_reference``), image/file/audio parts
            ("model X takes text only"), an empty content list, unknown keys.
    """
    if isinstance(input_, str):
        return [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": input_}]}]
    items = []
    for index, item in enumerate(input_):
        at = f"input[{index}]"
        kind = item.get("type", "message")
        if kind == "message":
            _no_other_keys(item, _MESSAGE_KEYS, at)
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise bad(f"{at}.role: expected user, assistant, system or developer, got {role!r}", f"{at}.role")
            text = _text_of(item.get("content"), model, f"{at}.content")
            part = "output_text" if role == "assistant" else "input_text"
            items.append({"type": "message", "role": role, "content": [{"type": part, "text": text}]})
        elif kind == "function_call":
            _no_other_keys(item, _CALL_KEYS, at)
            for key in ("call_id", "name", "arguments"):
                if not isinstance(item.get(key), str) or (key != "arguments" and not item[key]):
                    raise bad(f"{at}.{key}: a string is required", f"{at}.{key}")
            if item.get("namespace") is not None:
                raise unsupported(f"{at}.namespace")
            if item.get("caller") not in (None, {"type": "direct"}):
                raise unsupported(f"{at}.caller")
            items.append({"type": "function_call", "call_id": item["call_id"], "name": item["name"],
                          "arguments": item["arguments"]})
        elif kind == "function_call_output":
            _no_other_keys(item, _OUTPUT_KEYS, at)
            if not isinstance(item.get("call_id"), str) or not item["call_id"]:
                raise bad(f"{at}.call_id: a string is required", f"{at}.call_id")
            if item.get("namespace") is not None or item.get("caller") not in (None, {"type": "direct"}):
                raise unsupported(f"{at}.{'namespace' if item.get('namespace') is not None else 'caller'}")
            output = _text_of(item.get("output"), model, f"{at}.output")
            items.append({"type": "function_call_output", "call_id": item["call_id"], "output": output})
        else:
            raise bad(f"{at}.type: input items of type {kind!r} are not supported by this server "
                      "(message, function_call and function_call_output are)", f"{at}.type", "unsupported_parameter")
    return items


def chat_messages(instructions: str | None, items: list[dict], first_new: int = 0) -> list[dict]:
    """Canonical items (:func:`normalize_input`, and stored output items) as chat messages
    in Hugging Face's chat-template format (interfaces15.md §3): ``instructions`` as a
    system message first; developer as system; function calls as an assistant message's
    ``tool_calls`` (arguments parsed), joined to the assistant message just before them;
    outputs as ``tool`` messages named after their call.

    ``first_new``: the index of the request's first own item in ``items`` (those before
    came from ``previous_response_id``), for naming ``input[i]`` in errors.

    Raises:
        APIError: 400 for a call whose arguments are not a JSON object, or an output whose
            ``call_id`` matches no earlier call.
    """
    messages: list[dict] = [{"role": "system", "content": instructions}] if instructions else []
    names: dict[str, str] = {}
    for index, item in enumerate(items):
        at = f"input[{index - first_new}]" if index >= first_new else "previous_response_id"
        kind = item.get("type", "message")
        if kind == "message":
            role = "system" if item["role"] == "developer" else item["role"]
            text = "".join(p.get("text", p.get("refusal", "")) for p in item["content"])
            messages.append({"role": role, "content": text})
        elif kind == "function_call":
            try:
                arguments = json.loads(item["arguments"] or "{}")
            except json.JSONDecodeError:
                arguments = None
            if not isinstance(arguments, dict):
                raise bad(f"{at}.arguments: the arguments of call {item['call_id']} are not a JSON object",
                          f"{at}.arguments")
            call = {"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": arguments}}
            names[item["call_id"]] = item["name"]
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:  # function_call_output
            if item["call_id"] not in names:
                raise bad(f"{at}.call_id: no function_call with call_id {item['call_id']!r} comes before it",
                          f"{at}.call_id")
            messages.append({"role": "tool", "content": item["output"], "tool_call_id": item["call_id"],
                             "name": names[item["call_id"]]})
    return messages


# -- tools and text format ---------------------------------------------------------------

_TOOL_KEYS = {"type", "name", "description", "parameters", "strict", "defer_loading", "allowed_callers",
              "output_schema", "async"}


def parse_tools(tools: list[dict] | None, choice: str | dict | None) -> tuple[list[dict], str, str | None]:
    """Function tools and ``tool_choice`` as (chat-template tools ``[{"type": "function",
    "function": {"name", "description", "parameters"}}]``, mode ``none | auto | required |
    named``, the named function). ``allowed_tools`` narrows the tools to those it lists.

    Raises:
        APIError: 400 naming ``tools[i]...`` or ``tool_choice`` for tools other than
            function tools, malformed ones, and choices other than these.
    """
    out: list[dict] = []
    for index, tool in enumerate(tools or []):
        at = f"tools[{index}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else tool
            raise bad(f"{at}.type: tools of type {kind!r} are not supported by this server (function tools are)",
                      f"{at}.type", "unsupported_parameter")
        _no_other_keys(tool, _TOOL_KEYS, at)
        for key, ok in (("defer_loading", (None, False)), ("allowed_callers", (None, ["direct"])),
                        ("output_schema", (None,)), ("async", (None, False))):
            if tool.get(key) not in ok:
                raise unsupported(f"{at}.{key}")
        name, params = tool.get("name"), tool.get("parameters")
        if not isinstance(name, str) or not name:
            raise bad(f"{at}.name: a non-empty string is required", f"{at}.name")
        if params is not None and not isinstance(params, dict):
            raise bad(f"{at}.parameters: a JSON schema object is required", f"{at}.parameters")
        if tool.get("strict") not in (None, True, False) or not isinstance(tool.get("description") or "", str):
            raise bad(f"{at}: strict must be a boolean and description a string", at)
        function = {"name": name, "description": tool.get("description") or "",
                    "parameters": params if params is not None else {"type": "object", "properties": {}}}
        if tool.get("strict"):  # checked and held to as in Chat Completions (api.tools)
            function["strict"] = True
        out.append({"type": "function", "function": function})
    if choice is None or choice in ("none", "auto", "required"):
        return out, str(choice or "auto"), None
    if isinstance(choice, dict) and choice.get("type") == "function" and set(choice) == {"type", "name"}:
        return out, "named", str(choice["name"])
    if isinstance(choice, dict) and choice.get("type") == "allowed_tools" and choice.get("mode") in ("auto", "required"):
        listed = choice.get("tools")
        if not isinstance(listed, list) or any(not isinstance(t, dict) or t.get("type") != "function" for t in listed):
            raise bad("tool_choice.tools: a list of {type: function, name} is required", "tool_choice.tools")
        allowed = {t.get("name") for t in listed}
        return [t for t in out if t["function"]["name"] in allowed], choice["mode"], None
    raise bad("tool_choice: none, auto, required, {type: function, name} or {type: allowed_tools} "
              "(hosted, custom and MCP tools are not supported by this server)", "tool_choice",
              "unsupported_parameter")


def text_format(text: dict | None) -> tuple[str, dict | None]:
    """``text`` as (format type ``text | json_object | json_schema``, the schema).

    Raises:
        APIError: 400 naming ``text.format...`` or ``text.verbosity`` for other formats,
            a json_schema format without a valid name or a schema object, unknown keys.
    """
    text = text or {}
    _no_other_keys(text, {"format", "verbosity"}, "text")
    if text.get("verbosity") not in (None, "medium"):
        raise unsupported("text.verbosity", f" '{text['verbosity']}'")
    fmt = text.get("format") or {"type": "text"}
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind in ("text", "json_object"):
        _no_other_keys(fmt, {"type"}, "text.format")
        return kind, None
    if kind != "json_schema":
        raise bad(f"text.format.type: expected text, json_object or json_schema, got {kind!r}", "text.format.type")
    _no_other_keys(fmt, {"type", "name", "schema", "strict", "description"}, "text.format")
    if not isinstance(fmt.get("name"), str) or not _FORMAT_NAME.match(fmt["name"]):
        raise bad("text.format.name: 1-64 letters, digits, underscores or dashes", "text.format.name")
    if not isinstance(fmt.get("schema"), dict):
        raise bad("text.format.schema: a JSON schema object is required", "text.format.schema")
    if fmt.get("strict") not in (None, True, False):
        raise bad("text.format.strict: a boolean", "text.format.strict")
    problem = strict_schema_problem(fmt["schema"]) if fmt.get("strict") else None
    if problem:
        raise bad(f"text.format.schema: a strict schema's {problem}", "text.format.schema")
    return kind, fmt["schema"]


# -- the generation request --------------------------------------------------------------

def sampling(req: ResponsesRequest) -> SamplingParams:
    """Temperature and top_p (null: their defaults, 1; ``top_p`` 0 is greedy in the
    sampler), and logprobs when ``include`` asks for them (``top_logprobs`` of them)."""
    temperature = 1.0 if req.temperature is None else req.temperature
    top_p = 1.0 if req.top_p is None else req.top_p
    logprobs = (req.top_logprobs or 0) if LOGPROBS_INCLUDE in (req.include or []) else None
    return SamplingParams(temperature, top_p, 0, None, logprobs=logprobs)


def to_generation(req: ResponsesRequest, history: list[dict], new_items: list[dict]) -> GenerationRequest:
    """The engine's request for ``req``, whose conversation is ``history`` (the items of
    the response it continues, :meth:`StoredResponse.conversation`) then ``new_items``
    (:func:`normalize_input` of its input).

    Raises:
        APIError: 400 for malformed calls (:func:`chat_messages`), and, while this build
            lacks them, for tools, function-call items and JSON formats (named).
    """
    messages = chat_messages(req.instructions, history + new_items, len(history))
    tools, mode, name = parse_tools(req.tools, req.tool_choice)
    params = sampling(req)
    extra: dict[str, Any] = {}
    if tools or any("tool_calls" in m or m["role"] == "tool" for m in messages):
        choice = ToolChoice(ToolChoiceMode[mode.upper()], name)
        try:
            check_tools(tools, choice)
            check_history(messages)
        except ValueError as exc:
            raise bad(str(exc), "tools" if tools else "input") from exc
        extra.update(tools=tools, tool_choice=choice, max_tool_calls=None if req.parallel_tool_calls is not False else 1)
    elif mode in ("required", "named"):
        raise bad(f"tool_choice {mode} needs tools", "tool_choice")
    kind, schema = text_format(req.text)
    if kind != "text":
        try:
            params = dataclasses.replace(params, grammar=json_grammar(schema))
        except ValueError as exc:
            raise bad(f"text.format.schema: {exc}", "text.format.schema") from exc
    return GenerationRequest(model=req.model, prompt=messages, max_tokens=req.max_output_tokens,
                             sampling=params, api="openai", max_tokens_param="max_output_tokens",
                             prompt_param="input", **extra)
