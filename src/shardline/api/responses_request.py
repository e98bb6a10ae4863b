"""The Responses API's request (``POST /v1/responses``), checked and mapped to a
:class:`~shardline.api.text_stream.GenerationRequest`: pure functions.

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
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from shardline.api.params import PARAMETERS, Endpoint
from shardline.api.request_body import validation_error
from shardline.api.structured import json_grammar, strict_schema_problem
from shardline.api.text_stream import APIError, GenerationRequest
from shardline.api.tools import ToolChoice, ToolChoiceMode, check_history, check_tools
from shardline.runner.protocol import SamplingParams

# Values of fields that work, which this server does not serve.
SERVICE_TIERS = (None, "auto", "default")
LOGPROBS_INCLUDE = "message.output_text.logprobs"
INCLUDABLE = frozenset(
    {
        LOGPROBS_INCLUDE,
        "reasoning.encrypted_content",
        "file_search_call.results",
        "web_search_call.results",
        "web_search_call.action.sources",
        "message.input_image.image_url",
        "computer_call_output.output.image_url",
        "code_interpreter_call.outputs",
    }
)
"""``include`` values of the reference: logprobs are given; the rest ask for parts of items
this server never makes (reasoning, hosted tools' calls, images), so there is nothing to
include (Codex asks for ``reasoning.encrypted_content`` on every request)."""
REASONING = {
    "effort": (None, "none", "minimal", "low", "medium", "high", "xhigh", "max"),
    "summary": (None, "auto", "concise", "detailed"),
    "generate_summary": (None, "auto", "concise", "detailed"),
    "context": (None, "auto", "current_turn", "all_turns"),
}
"""``reasoning``'s fields and values: a reasoning model thinks unless ``effort`` is
"none" (its reasoning a ``reasoning`` item with its text, no summary); a model that does
not reason spends no effort and writes no summary, as OpenAI's non-reasoning models take
it from clients that send it by default (Codex)."""
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
    client_metadata: dict[str, Any] | None = None


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
            json.dumps({k: v for k, v in body.items() if k not in NULL_ONLY}), strict=True
        )
    except ValidationError as exc:
        raise validation_error(exc) from None
    if req.truncation == "auto":
        raise unsupported("truncation", " 'auto'")
    if req.service_tier not in SERVICE_TIERS:
        raise unsupported("service_tier", f" '{req.service_tier}'")
    if req.background:
        raise unsupported("background", " (true)")
    _check_options(req)
    text_format(req.text)  # checked here, built where the request is mapped
    return req


def _check_options(req: ResponsesRequest) -> None:
    """Check a validated request's nested options: ``reasoning``'s keys and values,
    ``include``'s items, ``top_logprobs`` with its include, ``stream_options`` with a
    stream, ``metadata``'s lengths.

    Raises:
        APIError: 400 naming the field (``unknown_parameter``, ``invalid_value``, or none).
    """
    for key, value in (req.reasoning or {}).items():
        if key not in REASONING:
            raise bad(f"Unknown parameter: 'reasoning.{key}'.", f"reasoning.{key}", "unknown_parameter")
        if value not in REASONING[key]:
            raise bad(
                f"Invalid value for 'reasoning.{key}': {value!r}. Supported values are: "
                f"{', '.join(repr(v) for v in REASONING[key] if v)}.",
                f"reasoning.{key}",
                "invalid_value",
            )
    for index, item in enumerate(req.include or []):
        if item not in INCLUDABLE:
            raise bad(
                f"Invalid value for 'include[{index}]': {item!r}. Supported values are: "
                f"{', '.join(sorted(INCLUDABLE))}.",
                f"include[{index}]",
                "invalid_value",
            )
    if req.top_logprobs and LOGPROBS_INCLUDE not in (req.include or []):
        raise bad(
            f"top_logprobs gives alternatives to the logprobs that include['{LOGPROBS_INCLUDE}'] "
            "asks for; include it, or leave top_logprobs out",
            "top_logprobs",
        )
    if req.stream_options is not None:
        if not req.stream:
            raise bad("stream_options is only allowed when stream is true", "stream_options")
        extra = set(req.stream_options) - {"include_obfuscation"}
        if extra:
            raise bad(
                f"Unknown parameter: 'stream_options.{sorted(extra)[0]}'.",
                f"stream_options.{sorted(extra)[0]}",
                "unknown_parameter",
            )
    for key, value in (req.metadata or {}).items():
        if len(key) > 64 or len(value) > 512:
            raise bad("metadata keys are at most 64 characters and values 512", "metadata")


_ROWS = {p.name: p for p in PARAMETERS if p.endpoint is Endpoint.RESPONSES}
FIELDS = {name for name in _ROWS if name in ResponsesRequest.model_fields}
"""Fields validated by :class:`ResponsesRequest` (rows of
:data:`shardline.api.params.PARAMETERS`; a few refused at some values by :func:`check_fields`)."""
NULL_ONLY: dict[str, tuple[Any, ...]] = {name: (None, *p.allowed) for name, p in _ROWS.items() if name not in FIELDS}
"""Fields of the reference accepted only as null (or a value that asks for nothing)."""


# -- input items -------------------------------------------------------------------------

_MESSAGE_KEYS = {"type", "role", "content", "id", "status", "phase"}
_CALL_KEYS = {"type", "call_id", "name", "arguments", "id", "status", "namespace", "caller"}
_CUSTOM_CALL_KEYS = {"type", "call_id", "name", "input", "id", "status", "namespace", "caller", "async"}
_OUTPUT_KEYS = {"type", "call_id", "output", "id", "status", "name", "namespace", "caller"}
_REASONING_KEYS = {"type", "id", "summary", "content", "encrypted_content", "status"}


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
    "function_call", "call_id", "name", "arguments"}`` (a ``custom_tool_call``'s ``input``
    becomes ``{"input": ...}`` arguments) and ``{"type": "function_call_output", "call_id",
    "output"}`` (a string; a ``custom_tool_call_output`` likewise). ``reasoning`` items (a
    reasoning model's, sent back by clients such as Codex) are dropped, as reasoning
    models' chat templates leave out earlier turns' reasoning.

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
        elif kind in ("function_call", "custom_tool_call"):
            custom = kind == "custom_tool_call"
            _no_other_keys(item, _CUSTOM_CALL_KEYS if custom else _CALL_KEYS, at)
            for key in ("call_id", "name", "input" if custom else "arguments"):
                if not isinstance(item.get(key), str) or (key in ("call_id", "name") and not item[key]):
                    raise bad(f"{at}.{key}: a string is required", f"{at}.{key}")
            if item.get("caller") not in (None, {"type": "direct"}):
                raise unsupported(f"{at}.caller")
            arguments = json.dumps({"input": item["input"]}, ensure_ascii=False) if custom else item["arguments"]
            items.append(
                {"type": "function_call", "call_id": item["call_id"], "name": item["name"], "arguments": arguments}
            )
        elif kind in ("function_call_output", "custom_tool_call_output"):
            _no_other_keys(item, _OUTPUT_KEYS, at)
            if not isinstance(item.get("call_id"), str) or not item["call_id"]:
                raise bad(f"{at}.call_id: a string is required", f"{at}.call_id")
            if item.get("caller") not in (None, {"type": "direct"}):
                raise unsupported(f"{at}.caller")
            output = _text_of(item.get("output"), model, f"{at}.output")
            items.append({"type": "function_call_output", "call_id": item["call_id"], "output": output})
        elif kind == "reasoning":
            _no_other_keys(item, _REASONING_KEYS, at)
        else:
            raise bad(
                f"{at}.type: input items of type {kind!r} are not supported by this server (message, "
                "function_call, custom_tool_call, their outputs and reasoning are)",
                f"{at}.type",
                "unsupported_parameter",
            )
    return items


def chat_messages(instructions: str | None, items: list[dict], first_new: int = 0) -> list[dict]:
    """Canonical items (:func:`normalize_input`, and stored output items) as chat messages
    in Hugging Face's chat-template format (interfaces15.md §3): ``instructions`` as a
    system message first; developer as system; function calls as an assistant message's
    ``tool_calls`` (arguments parsed), joined to the assistant message just before them;
    outputs as ``tool`` messages named after their call; ``reasoning`` items (a stored
    response's output holds them) left out.

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
        elif kind == "reasoning":
            continue
        elif kind in ("function_call", "custom_tool_call"):  # a stored response's output holds the latter
            try:
                arguments = (
                    {"input": item["input"]} if kind == "custom_tool_call" else json.loads(item["arguments"] or "{}")
                )
            except json.JSONDecodeError:
                arguments = None
            if not isinstance(arguments, dict):
                raise bad(
                    f"{at}.arguments: the arguments of call {item['call_id']} are not a JSON object", f"{at}.arguments"
                )
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": arguments},
            }
            names[item["call_id"]] = item["name"]
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:  # function_call_output
            if item["call_id"] not in names:
                raise bad(
                    f"{at}.call_id: no function_call with call_id {item['call_id']!r} comes before it", f"{at}.call_id"
                )
            messages.append(
                {
                    "role": "tool",
                    "content": item["output"],
                    "tool_call_id": item["call_id"],
                    "name": names[item["call_id"]],
                }
            )
    return messages


# -- tools and text format ---------------------------------------------------------------

_TOOL_KEYS = {
    "type",
    "name",
    "description",
    "parameters",
    "strict",
    "defer_loading",
    "allowed_callers",
    "output_schema",
    "async",
}
_CUSTOM_KEYS = {"type", "name", "description", "format", "defer_loading", "allowed_callers", "async"}
HOSTED_TOOLS = frozenset(
    {
        "web_search",
        "web_search_2025_08_26",
        "web_search_preview",
        "web_search_preview_2025_03_11",
        "file_search",
        "code_interpreter",
        "image_generation",
        "computer",
        "computer_use_preview",
        "mcp",
        "local_shell",
        "shell",
        "apply_patch",
        "tool_search",
        "programmatic_tool_calling",
    }
)
"""Tool types of the Responses API that the platform runs or that need a built-in call
format (web search, code interpreter, MCP, shell, ...). This server runs none of them, so
the model is not offered them: the request is served with the others, and the response
says which were left out (:attr:`ToolSet.not_offered`), as a hosted tool the server cannot
run is one the model cannot call."""


@dataclass(frozen=True)
class ToolSet:
    """A request's ``tools`` and ``tool_choice`` as the model is offered them.

    Attributes:
        tools: chat-template tools ``[{"type": "function", "function": {"name",
            "description", "parameters"}}]``: function tools, a namespace's tools, and
            custom (freeform) tools as a function of one string argument ``input``.
        mode: ``none | auto | required | named``; ``name`` the named function.
        namespaces: the namespace of each function offered from a ``namespace`` tool, by
            name (its calls are ``function_call`` items with that ``namespace``).
        custom: the names of custom tools (their calls are ``custom_tool_call`` items).
        not_offered: the tools left out, as ``type`` or ``type:name`` (hosted tools, and
            tools deferred to a tool search this server does not run).
    """

    tools: list[dict] = field(default_factory=list)
    mode: str = "auto"
    name: str | None = None
    namespaces: dict[str, str] = field(default_factory=dict)
    custom: frozenset[str] = frozenset()
    not_offered: tuple[str, ...] = ()


def _function_tool(tool: dict, at: str) -> dict:
    """A ``function`` tool as a chat-template tool (checked).

    Raises:
        APIError: 400 naming ``at``'s field.
    """
    _no_other_keys(tool, _TOOL_KEYS, at)
    for key, ok in (("allowed_callers", (None, ["direct"])), ("output_schema", (None,)), ("async", (None, False))):
        if tool.get(key) not in ok:
            raise unsupported(f"{at}.{key}")
    name, params = tool.get("name"), tool.get("parameters")
    if not isinstance(name, str) or not name:
        raise bad(f"{at}.name: a non-empty string is required", f"{at}.name")
    if params is not None and not isinstance(params, dict):
        raise bad(f"{at}.parameters: a JSON schema object is required", f"{at}.parameters")
    if tool.get("strict") not in (None, True, False) or not isinstance(tool.get("description") or "", str):
        raise bad(f"{at}: strict must be a boolean and description a string", at)
    function = {
        "name": name,
        "description": tool.get("description") or "",
        "parameters": params if params is not None else {"type": "object", "properties": {}},
    }
    if tool.get("strict"):  # checked and held to as in Chat Completions (api.tools)
        function["strict"] = True
    return {"type": "function", "function": function}


def _custom_tool(tool: dict, at: str) -> dict:
    """A ``custom`` (freeform) tool as a chat-template function of one string, ``input``;
    its format (a Lark or regex grammar) is told to the model in the description.

    Raises:
        APIError: 400 naming ``at``'s field.
    """
    _no_other_keys(tool, _CUSTOM_KEYS, at)
    for key, ok in (("allowed_callers", (None, ["direct"])), ("async", (None, False))):
        if tool.get(key) not in ok:
            raise unsupported(f"{at}.{key}")
    name, fmt = tool.get("name"), tool.get("format") or {"type": "text"}
    if not isinstance(name, str) or not name:
        raise bad(f"{at}.name: a non-empty string is required", f"{at}.name")
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "grammar"):
        raise bad(f"{at}.format.type: expected text or grammar", f"{at}.format.type")
    described = tool.get("description") or ""
    if fmt["type"] == "grammar":
        if not isinstance(fmt.get("definition"), str) or fmt.get("syntax") not in ("lark", "regex"):
            raise bad(f"{at}.format: a grammar needs a definition and a syntax, lark or regex", f"{at}.format")
        problem = _grammar_problem(fmt["syntax"], fmt["definition"])
        if problem:
            raise bad(
                f"{at}.format.definition: the {fmt['syntax']} grammar does not compile: {problem}",
                f"{at}.format.definition",
            )
        described += f"\n\nThe input follows this {fmt['syntax']} grammar:\n{fmt['definition']}"
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": described.strip(),
            "parameters": {
                "type": "object",
                "properties": {"input": {"type": "string", "description": "the tool's input"}},
                "required": ["input"],
            },
        },
    }


def _grammar_problem(syntax: str, definition: str) -> str | None:
    """Why a custom tool's grammar does not compile (llguidance's words: its Lark dialect
    and its regexes are what OpenAI's custom tools take), or None."""
    import llguidance

    if not definition.strip():
        return "it is empty"
    try:
        grammar = (
            llguidance.LLMatcher.grammar_from_lark(definition)
            if syntax == "lark"
            else llguidance.LLMatcher.grammar_from_regex(definition)
        )
        return llguidance.LLMatcher.validate_grammar(grammar) or None
    except Exception as exc:  # llguidance raises ValueError or its own kinds
        return str(exc)


def parse_tools(tools: list[dict] | None, choice: str | dict | None) -> ToolSet:
    """``tools`` and ``tool_choice`` as the model is offered them (:class:`ToolSet`):
    function and custom tools, the tools of a ``namespace``; hosted tools and tools with
    ``defer_loading`` are left out and named. ``allowed_tools`` narrows the tools to those
    it lists.

    Raises:
        APIError: 400 naming ``tools[i]...`` or ``tool_choice`` for malformed tools, a tool
            type the API does not have, and choices other than these (or naming a tool
            the model is not offered).
    """
    out: list[dict] = []
    namespaces: dict[str, str] = {}
    custom: set[str] = set()
    not_offered: list[str] = []

    def offer(tool: Any, at: str, namespace: str | None = None) -> None:
        kind = tool.get("type") if isinstance(tool, dict) else tool
        if kind not in ("function", "custom") or not isinstance(tool, dict):
            raise bad(f"{at}.type: expected function or custom inside a namespace, got {kind!r}", f"{at}.type")
        if tool.get("defer_loading") not in (None, False):
            not_offered.append(f"{kind}:{tool.get('name')}")
            return
        out.append(_function_tool(tool, at) if kind == "function" else _custom_tool(tool, at))
        if kind == "custom":
            custom.add(tool["name"])
        if namespace is not None:
            namespaces[tool["name"]] = namespace

    for index, tool in enumerate(tools or []):
        at = f"tools[{index}]"
        kind = tool.get("type") if isinstance(tool, dict) else tool
        if kind in HOSTED_TOOLS:
            not_offered.append(str(kind))
        elif kind == "namespace":
            _no_other_keys(tool, {"type", "name", "description", "tools"}, at)
            if not isinstance(tool.get("name"), str) or not isinstance(tool.get("tools"), list):
                raise bad(f"{at}: a namespace needs a name and a list of tools", at)
            for inner, member in enumerate(tool["tools"]):
                offer(member, f"{at}.tools[{inner}]", tool["name"])
        elif kind in ("function", "custom"):
            offer(tool, at)
        else:
            raise bad(
                f"{at}.type: tools of type {kind!r} are not known to this server (function, custom, "
                "namespace and the hosted tools are)",
                f"{at}.type",
                "unsupported_parameter",
            )
    found = ToolSet(out, namespaces=namespaces, custom=frozenset(custom), not_offered=tuple(not_offered))
    if choice is None or choice in ("none", "auto", "required"):
        return dataclasses.replace(found, mode=str(choice or "auto"))
    if isinstance(choice, dict) and choice.get("type") in ("function", "custom") and set(choice) == {"type", "name"}:
        return dataclasses.replace(found, mode="named", name=str(choice["name"]))
    if (
        isinstance(choice, dict)
        and choice.get("type") == "allowed_tools"
        and choice.get("mode") in ("auto", "required")
    ):
        listed = choice.get("tools")
        if not isinstance(listed, list) or any(
            not isinstance(t, dict) or t.get("type") not in ("function", "custom") for t in listed
        ):
            raise bad("tool_choice.tools: a list of {type: function, name} is required", "tool_choice.tools")
        allowed = {t.get("name") for t in listed}
        return dataclasses.replace(
            found, tools=[t for t in out if t["function"]["name"] in allowed], mode=choice["mode"]
        )
    raise bad(
        "tool_choice: none, auto, required, {type: function, name}, {type: custom, name} or "
        "{type: allowed_tools} (hosted and MCP tools are not run by this server)",
        "tool_choice",
        "unsupported_parameter",
    )


def text_format(text: dict | None) -> tuple[str, dict | None]:
    """``text`` as (format type ``text | json_object | json_schema``, the schema).

    Raises:
        APIError: 400 naming ``text.format...`` or ``text.verbosity`` for other formats,
            a json_schema format without a valid name or a schema object, unknown keys.
    """
    text = text or {}
    _no_other_keys(text, {"format", "verbosity"}, "text")
    if text.get("verbosity") not in (None, "low", "medium", "high"):
        raise bad(f"text.verbosity: expected low, medium or high, got {text['verbosity']!r}", "text.verbosity")
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
    offered = parse_tools(req.tools, req.tool_choice)
    tools, mode, name = offered.tools, offered.mode, offered.name
    params = sampling(req)
    extra: dict[str, Any] = {}
    if tools or any("tool_calls" in m or m["role"] == "tool" for m in messages):
        choice = ToolChoice(ToolChoiceMode[mode.upper()], name)
        try:
            check_tools(tools, choice)
            check_history(messages)
        except ValueError as exc:
            raise bad(str(exc), "tools" if tools else "input") from exc
        extra.update(
            tools=tools, tool_choice=choice, max_tool_calls=None if req.parallel_tool_calls is not False else 1
        )
    elif mode in ("required", "named"):
        raise bad(f"tool_choice {mode} needs tools", "tool_choice")
    kind, schema = text_format(req.text)
    if kind != "text":
        try:
            params = dataclasses.replace(params, grammar=json_grammar(schema))
        except ValueError as exc:
            raise bad(f"text.format.schema: {exc}", "text.format.schema") from exc
    effort = (req.reasoning or {}).get("effort")
    return GenerationRequest(
        model=req.model,
        prompt=messages,
        max_tokens=req.max_output_tokens,
        sampling=params,
        api="openai",
        max_tokens_param="max_output_tokens",
        prompt_param="input",
        thinking=effort != "none",
        effort=effort,
        **extra,
    )
