"""Tool calling: which format a model calls tools in, checks of the tools and of a chat's
tool history, a streaming parser of the model's calls, and the grammar that forces a call.

Formats (the families' own chat templates and model cards are the sources):

- :attr:`ToolFormat.HERMES`: each call is ``<tool_call>\\n{"name": ..., "arguments":
  {...}}\\n</tool_call>``, several calls being several blocks, with text around them
  (Qwen2, Qwen2.5, Qwen3, NousResearch Hermes 2/3, and shardline's own system-prompt
  fallback for templates that take no tools).
- :attr:`ToolFormat.LLAMA3_JSON`: the whole reply is one JSON object ``{"name": ...,
  "parameters": {...}}`` (Llama 3.1 / 3.2 with user-defined tools), possibly after
  ``<|python_tag|>``.
- :attr:`ToolFormat.MISTRAL`: ``[TOOL_CALLS]`` then a JSON list of ``{"name": ...,
  "arguments": {...}}`` (Mistral 7B Instruct v0.3, Mixtral 8x22B Instruct, Mistral Nemo).

The call markers (``<tool_call>``, ``</tool_call>``, ``[TOOL_CALLS]``) are single added
tokens in those families' vocabularies (Qwen2.5's ``<tool_call>`` is id 151657, Mistral's
``[TOOL_CALLS]`` a special token) and plain text in others (SmolLM2 with the fallback
prompt): the grammar names them as tokens where the model has them
(:func:`tool_call_grammar`), and the output's text keeps them for the parser
(:func:`call_markers`). Llama 3.1 writes calls of user-defined tools as bare JSON; its
``<|python_tag|>`` (a special token, left out of the text) opens code for its built-in
tools, and the parser skips it where it is text.

Under ``tool_choice: auto`` a model also falls back to writing a call as JSON alone: the
whole reply (whitespace around it allowed) one object ``{"name": ..., "arguments" |
"parameters": {...}}`` or a list of them, bare or in a Markdown code fence (three
backticks with the info string ``json`` or none); Qwen2.5 does so. :class:`ToolCallParser`
reads that as calls too when every name is a declared tool (as Ollama's parser does).

Tools are OpenAI function tools (``{"type": "function", "function": {"name",
"description", "parameters"}}``); chat messages are Hugging Face's chat-template format
(assistant ``tool_calls`` with ``arguments`` a dict, ``tool`` role results).
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

from shardline.api.structured import ANY_OBJECT, matches_schema, strict_schema_problem
from shardline.models.tool_prompt import call_arguments

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
TOOL_CALLS = "[TOOL_CALLS]"
FENCE = "```"

NOT_OFFERED_HEADER = "X-Shardline-Tools-Not-Offered"
"""The response header that names the request's tools the model was not offered (hosted
tools this server does not run, tools deferred to a tool search), as ``type`` or
``type:name``, comma-separated."""

TOOL_NAME = re.compile(r"[A-Za-z0-9_.:\-]{1,128}")
"""Tool names accepted: OpenAI's ``^[a-zA-Z0-9_-]{1,64}$`` widened to Anthropic's length
and the dots and colons some MCP servers use. Nothing in it needs escaping in JSON."""

_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""llguidance JSON options for forced arguments: the spacing of Python's ``json.dumps``,
which is how both families' templates write calls, and no free whitespace for a small
model to loop on."""


class ToolFormat(Enum):
    """How a model writes tool calls (see the module docstring)."""

    HERMES = "hermes"
    LLAMA3_JSON = "llama3_json"
    MISTRAL = "mistral"


def call_markers(fmt: ToolFormat) -> tuple[str, ...]:
    """The marker texts that ``fmt``'s calls are written with (none for LLAMA3_JSON's bare
    JSON): a model may have them as single tokens, which the grammar then names as tokens
    and the detokenizer keeps in the text for :class:`ToolCallParser` even where they are
    special tokens."""
    return {
        ToolFormat.HERMES: (TOOL_CALL_OPEN, TOOL_CALL_CLOSE),
        ToolFormat.LLAMA3_JSON: (),
        ToolFormat.MISTRAL: (TOOL_CALLS,),
    }[fmt]


def tool_format(chat_template: str | None) -> ToolFormat:
    """The tool-call format of the model whose chat template text is ``chat_template``.

    A template that writes ``<tool_call>`` is HERMES; one that writes ``[TOOL_CALLS]``
    is MISTRAL. One that takes ``tools`` and is of the Llama 3 family (``<|eot_id|>``,
    ``<|python_tag|>`` or a ``"parameters"`` call instruction) is LLAMA3_JSON. Anything
    else, a template without tool support included (the tokenizer then lists the tools in
    a Hermes-style system prompt itself), is HERMES.
    """
    text = chat_template or ""
    if TOOL_CALL_OPEN in text:
        return ToolFormat.HERMES
    if TOOL_CALLS in text:
        return ToolFormat.MISTRAL
    if re.search(r"\btools\b", text) and any(mark in text for mark in ("<|eot_id|>", PYTHON_TAG, '"parameters"')):
        return ToolFormat.LLAMA3_JSON
    return ToolFormat.HERMES


class ToolChoiceMode(Enum):
    """OpenAI's ``tool_choice``: none, auto, required, or one named function."""

    NONE = "none"
    AUTO = "auto"
    REQUIRED = "required"
    NAMED = "named"


@dataclass(frozen=True)
class ToolChoice:
    """A request's tool choice; ``name`` is the function's for :attr:`ToolChoiceMode.NAMED`."""

    mode: ToolChoiceMode
    name: str | None = None


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: ``arguments`` is JSON text of an object; ``id`` is
    ``call_`` and 24 hex digits, new for each call."""

    id: str
    name: str
    arguments: str

    @staticmethod
    def new(name: str, arguments: dict[str, Any]) -> ToolCall:
        """A call with a fresh id and ``arguments`` written as JSON (non-ASCII kept)."""
        return ToolCall(
            id=f"call_{secrets.token_hex(12)}", name=name, arguments=json.dumps(arguments, ensure_ascii=False)
        )


def openai_tool_choice(value: Any) -> ToolChoice:
    """OpenAI's ``tool_choice``: ``"none"``, ``"auto"``, ``"required"`` or ``{"type":
    "function", "function": {"name": ...}}``.

    Raises:
        ValueError: any other value.
    """
    if isinstance(value, str) and value in ("none", "auto", "required"):
        return ToolChoice(ToolChoiceMode(value))
    if isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("function"), dict):
        name = value["function"].get("name")
        if isinstance(name, str):
            return ToolChoice(ToolChoiceMode.NAMED, name)
    raise ValueError(
        'tool_choice: expected "none", "auto", "required" or {"type": "function", "function": {"name": ...}}'
    )


def tool_names(tools: list[dict[str, Any]] | None) -> set[str]:
    """The function names of ``tools`` (checked ones: see :func:`check_tools`)."""
    return {tool["function"]["name"] for tool in tools or ()}


def check_tools(tools: list[dict[str, Any]], choice: ToolChoice) -> None:
    """Check OpenAI-style function tools and the tool choice against them.

    Raises:
        ValueError: naming the first problem by its path (``tools[1].function.name ...``):
            tools not a list, a tool that is not a ``function`` tool, a missing or malformed
            name (see :data:`TOOL_NAME`), a description that is not a string, a
            ``parameters`` schema that is not a JSON object schema, a duplicate name; or a
            ``required`` / named choice with no tools, a named choice not among the tools.
    """
    if not isinstance(tools, list):
        raise ValueError("tools must be a list of function tools")
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise ValueError(f"{where} must be an object with type 'function'")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise ValueError(f"{where}.function must be an object")
        name = function.get("name")
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise ValueError(
                f"{where}.function.name must be 1 to 128 letters, digits, '_', '-', '.' or ':', got {name!r}"
            )
        if name in seen:
            raise ValueError(f"{where}.function.name {name!r} is used by an earlier tool")
        seen.add(name)
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise ValueError(f"{where}.function.description must be a string")
        parameters = function.get("parameters")
        if parameters is not None and (
            not isinstance(parameters, dict) or parameters.get("type", "object") != "object"
        ):
            raise ValueError(f"{where}.function.parameters must be a JSON schema of type 'object'")
        if function.get("strict") not in (None, True, False):
            raise ValueError(f"{where}.function.strict must be a boolean")
        problem = strict_schema_problem(parameters) if function.get("strict") else None
        if problem:
            raise ValueError(f"{where}.function.parameters: a strict schema's {problem}")
    if choice.mode in (ToolChoiceMode.REQUIRED, ToolChoiceMode.NAMED) and not tools:
        raise ValueError("tool_choice asks for a tool call, which needs at least one tool in tools")
    if choice.mode is ToolChoiceMode.NAMED and choice.name not in seen:
        raise ValueError(f"tool_choice names function {choice.name!r}, which is not among the tools")


def check_history(messages: list[dict[str, Any]]) -> None:
    """Check the tool calls and results in a chat's history (Hugging Face format).

    Raises:
        ValueError: naming the first malformed entry by its path: an assistant
            ``tool_calls`` that is not a list, an entry without a function name, one whose
            ``arguments`` are not a JSON object (a dict, or text that parses as one); a
            ``tool`` message whose ``tool_call_id`` is given but matches no earlier call's
            ``id``, or whose ``name`` (OpenAI's ``name``, Ollama's ``tool_name``) names no
            earlier call's function.
    """
    call_ids: set[str] = set()
    call_names: set[str] = set()
    for i, message in enumerate(messages):
        role = message.get("role")
        calls = message.get("tool_calls")
        if role == "assistant" and calls is not None:
            if not isinstance(calls, list):
                raise ValueError(f"messages[{i}].tool_calls must be a list")
            for j, call in enumerate(calls):
                where = f"messages[{i}].tool_calls[{j}]"
                function = call.get("function") if isinstance(call, dict) else None
                if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
                    raise ValueError(f"{where}.function.name is missing")
                if call_arguments(function.get("arguments")) is None:
                    raise ValueError(
                        f"{where}.function.arguments is not a JSON object: {str(function.get('arguments'))[:200]!r}"
                    )
                if isinstance(call.get("id"), str):
                    call_ids.add(call["id"])
                call_names.add(function["name"])
        elif role == "tool":
            if message.get("tool_call_id") is not None and message["tool_call_id"] not in call_ids:
                raise ValueError(
                    f"messages[{i}].tool_call_id {message['tool_call_id']!r} matches no earlier assistant tool call"
                )
            if message.get("name") is not None and message["name"] not in call_names:
                raise ValueError(
                    f"messages[{i}]: the tool result's name {message['name']!r} names no earlier assistant tool call"
                )


def strict_schemas(tools: list[dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """The ``parameters`` schema of each of ``tools`` (checked ones) marked ``strict``, by
    name: the calls whose arguments must match it."""
    return {
        t["function"]["name"]: t["function"].get("parameters") or ANY_OBJECT
        for t in tools or ()
        if t["function"].get("strict")
    }


def _call_from(value: Any, names: set[str], strict: Mapping[str, dict[str, Any]]) -> ToolCall | None:
    """A call from a parsed JSON value ``{"name", "arguments" | "parameters"}`` naming one
    of ``names`` (its arguments valid under its schema where ``strict`` holds one); None
    when it is not one."""
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    parsed = call_arguments(arguments)
    if parsed is None:
        return None
    schema = strict.get(value["name"])
    if schema is not None and not matches_schema(parsed, schema):
        return None
    return ToolCall.new(value["name"], parsed)


class _JsonEnd:
    """Finds where a JSON object or array ends in a growing text: call :meth:`find` with the
    text so far each time it grows (the scan goes on where it stopped)."""

    def __init__(self, start: int) -> None:
        self._pos = start  # the next character to read; the value's first is at ``start``
        self._depth = 0
        self._in_string = False
        self._escape = False

    def find(self, text: str) -> int | None:
        """The index just past the value's closing bracket, or None while it is open."""
        while self._pos < len(text):
            ch = text[self._pos]
            self._pos += 1
            if self._in_string:
                if self._escape:
                    self._escape = False
                elif ch == "\\":
                    self._escape = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "[{":
                self._depth += 1
            elif ch in "]}":
                self._depth -= 1
                if self._depth == 0:
                    return self._pos
        return None


def _may_open_calls(text: str) -> bool:
    """Whether ``text``, which starts with ``{`` or ``[``, may still begin a call object or
    a list of them (``{"`` or ``[{"``, whitespace between)."""
    if text.startswith("["):
        text = text[1:].lstrip()
        if not text:
            return True
        if not text.startswith("{"):
            return False
    text = text[1:].lstrip()
    return not text or text.startswith('"')


class _WholeReplyCalls:
    """Reads a reply that may be, whole, the JSON calls models fall back to writing (see the
    module docstring): one call object (where ``objects``) or a list of them, bare or in a
    code fence with the info string ``json`` or none, whitespace around it.

    Call :meth:`read` with the whole text so far each time it grows.
    """

    def __init__(self, parse: Callable[[Any], list[ToolCall] | None], objects: bool) -> None:
        self._parse = parse
        self._objects = objects
        self._stage = "start"  # start, info (after the fence), open (before the value), value, tail
        self._fenced = False
        self._pos = 0  # the next character of the text to read
        self._start = 0  # where the JSON value starts
        self._end: _JsonEnd | None = None
        self.calls: list[ToolCall] = []

    def read(self, text: str, final: bool) -> bool | None:
        """True when ``text``, the output ended (``final``), is such a reply (its calls are
        :attr:`calls`); False when it is not and cannot become one; None while not known."""
        if self._stage in ("start", "open"):
            rest = text[self._pos :].lstrip()
            self._pos = len(text) - len(rest)
            if not rest:
                return False if final else None
            if self._stage == "start" and rest.startswith(FENCE):
                self._fenced, self._stage, self._pos = True, "info", self._pos + len(FENCE)
            elif self._stage == "start" and FENCE.startswith(rest):
                return False if final else None
            elif rest[0] == "[" or (rest[0] == "{" and (self._objects or self._fenced)):
                self._stage, self._start, self._end = "value", self._pos, _JsonEnd(self._pos)
            else:
                return False
        if self._stage == "info":
            info = re.match(r"[A-Za-z]*", text[self._pos :])
            assert info is not None  # it matches the empty string
            word = info.group().lower()
            if self._pos + len(word) == len(text) and not final:
                return None if "json".startswith(word) else False
            if word not in ("", "json"):
                return False
            self._stage, self._pos = "open", self._pos + len(word)
            return self.read(text, final)
        if self._stage == "value":
            assert self._end is not None
            if not _may_open_calls(text[self._start : self._start + 64]):
                return False
            end = self._end.find(text)
            if end is None:
                return False if final else None
            try:
                calls = self._parse(json.loads(text[self._start : end]))
            except ValueError:
                return False
            if calls is None:
                return False
            self.calls, self._stage, self._pos = calls, "tail", end
        rest = text[self._pos :].strip()
        if self._fenced and rest.startswith(FENCE):
            rest = rest[len(FENCE) :].strip()
        elif self._fenced and FENCE.startswith(rest) and not final:
            return None  # (part of) the closing fence may come
        if rest:
            return False
        return True if final else None


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that is a proper beginning of ``marker``."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ToolCallParser:
    """Splits a model's streamed output into content text and tool calls.

    Feed text deltas of any size (split anywhere, inside a marker too); each :meth:`feed`
    returns the content text and complete calls now known, in order, and :meth:`finish`
    the rest at the end of the output. Text that may begin a call is held back until it is
    known, so call text never comes out as content. A call whose JSON does not parse or
    that names a tool not in ``tool_names`` comes out as content text, whole.

    HERMES: calls are ``<tool_call>...</tool_call>`` blocks anywhere in the text; the
    whitespace next to a call is dropped, the rest of the text is content. A block still
    open at the end is a call if its JSON is a complete call, content otherwise.
    MISTRAL: likewise, a call list being ``[TOOL_CALLS]`` then a JSON list of calls (or
    one call object), whitespace between; it is content unless each is a call.
    LLAMA3_JSON: the reply is calls only if it starts (after whitespace, and an optional
    ``<|python_tag|>``) with ``{`` and each JSON object in it (separated by whitespace or
    ``;``) is ``{"name", "parameters" | "arguments"}``; otherwise it is all content.

    Every format: a reply that is, whole, a JSON call object or list of calls, bare or in
    a code fence (the module docstring) is those calls. Such a reply is held back until
    it is decided, at the end of the output when it is calls, else as soon as it cannot
    be (a reply starting with other than ``{``, ``[`` or a fence is not held back for it).
    LLAMA3_JSON's own reading takes the bare objects (calls as soon as each is complete).
    """

    def __init__(
        self, fmt: ToolFormat, tool_names: set[str], strict: Mapping[str, dict[str, Any]] | None = None
    ) -> None:
        self._fmt = fmt
        self._names = set(tool_names)
        self._strict = dict(strict or {})
        self._buffer = ""  # text not yet given out
        self._whole: _WholeReplyCalls | None = _WholeReplyCalls(
            self._calls, objects=fmt is not ToolFormat.LLAMA3_JSON
        )  # None once not such a reply
        self._open = TOOL_CALLS if fmt is ToolFormat.MISTRAL else TOOL_CALL_OPEN  # HERMES, MISTRAL
        self._in_call = False  # HERMES, MISTRAL: after a call's opening marker
        self._list_end: _JsonEnd | None = None  # MISTRAL: the call list's end, once it has begun
        self._made_call = False
        self._after_call = False  # HERMES, MISTRAL: whitespace after a call is dropped
        self._space = ""  # HERMES, MISTRAL: the whitespace dropped before the open call
        self._mode = "start"  # LLAMA3_JSON: "start" (undecided), "calls", "content"
        self._pos = 0  # LLAMA3_JSON: the next character of the buffer to scan
        self._start = 0  # where the open JSON object began
        self._object: _JsonEnd | None = None  # the open JSON object's end, while it is open

    def feed(self, text: str) -> list[str | ToolCall]:
        """Content text and complete calls from ``text`` and what was held back before."""
        self._buffer += text
        return self._read(final=False)

    def finish(self) -> list[str | ToolCall]:
        """Everything still held back, at the end of the output."""
        out = self._read(final=True)
        self._buffer = ""
        return out

    def _read(self, final: bool) -> list[str | ToolCall]:
        if self._whole is not None:
            whole = self._whole.read(self._buffer, final)
            if whole is None:
                return []
            if whole:
                self._buffer = ""
                return list(self._whole.calls)
            self._whole = None  # not such a reply: the format's own reading, from its start
        if self._fmt is ToolFormat.LLAMA3_JSON:
            return self._llama(final)
        return self._tagged(final)

    def _calls(self, value: Any) -> list[ToolCall] | None:
        """The calls of a parsed JSON call object or non-empty list of them; None unless
        each is a call (:func:`_call_from`)."""
        values = value if isinstance(value, list) else [value]
        calls = [_call_from(v, self._names, self._strict) for v in values]
        if not calls or None in calls:
            return None
        return [call for call in calls if call is not None]

    def _tagged(self, final: bool) -> list[str | ToolCall]:
        """HERMES and MISTRAL: calls after an opening marker, text around them."""
        out: list[str | ToolCall] = []
        while True:
            if self._in_call:
                body = self._call_body(final)
                if body is None:
                    return _merged(out)
                text, used, close = body
                self._buffer = self._buffer[used:]
                self._in_call, self._list_end = False, None
                calls = self._parse_body(text)
                if calls is None:  # content, with the whitespace it came with
                    out.append(self._space + self._open + text + close)
                else:
                    out.extend(calls)
                    self._made_call = self._after_call = True
                continue
            if self._after_call:
                self._buffer = self._buffer.lstrip()
                self._after_call = not self._buffer
            start = self._buffer.find(self._open)
            if start >= 0:
                before = self._buffer[:start]
                text = before.rstrip()
                out.append(text)
                self._space = before[len(text) :]
                self._buffer = self._buffer[start + len(self._open) :]
                self._in_call = True
                continue
            if final:
                tail = self._buffer
                if tail.strip() or not self._made_call:
                    out.append(tail)
                self._buffer = ""
                return _merged(out)
            keep = partial_suffix(self._buffer, self._open)
            head = self._buffer[: len(self._buffer) - keep]
            sent = head.rstrip()  # whitespace before a call is dropped: hold it back too
            if sent:
                out.append(sent)
            self._buffer = self._buffer[len(sent) :]
            return _merged(out)

    def _call_body(self, final: bool) -> tuple[str, int, str] | None:
        """The open call's text in the buffer, the characters it takes there and its
        closing marker's text (or ""); None while not known. HERMES: up to
        ``</tool_call>`` (or the end of the output). MISTRAL: whitespace and a JSON list or
        object (to the end of the output while open; nothing where the text after the
        marker cannot open one)."""
        if self._fmt is ToolFormat.HERMES:
            close = self._buffer.find(TOOL_CALL_CLOSE)
            if close >= 0:
                return self._buffer[:close], close + len(TOOL_CALL_CLOSE), TOOL_CALL_CLOSE
            return (self._buffer, len(self._buffer), "") if final else None
        if self._list_end is None:
            rest = self._buffer.lstrip()
            if not rest:
                return (self._buffer, len(self._buffer), "") if final else None
            if rest[0] not in "[{":
                return "", 0, ""
            self._list_end = _JsonEnd(len(self._buffer) - len(rest))
        end = self._list_end.find(self._buffer)
        if end is None:
            return (self._buffer, len(self._buffer), "") if final else None
        return self._buffer[:end], end, ""

    def _parse_body(self, body: str) -> list[ToolCall] | None:
        try:
            value = json.loads(body)
        except ValueError:
            return None
        if self._fmt is ToolFormat.HERMES:
            call = _call_from(value, self._names, self._strict)
            return None if call is None else [call]
        return self._calls(value)

    def _llama(self, final: bool) -> list[str | ToolCall]:
        if self._mode == "start":
            rest = self._buffer.lstrip()
            if rest.startswith(PYTHON_TAG):
                rest = rest[len(PYTHON_TAG) :].lstrip()
            if rest.startswith("{"):
                self._mode, self._pos = "calls", len(self._buffer) - len(rest)
            elif not final and (not rest or PYTHON_TAG.startswith(rest)):
                return []  # whitespace or (part of) the tag: not yet known
            else:
                self._mode = "content"
        out: list[str | ToolCall] = []
        if self._mode == "calls":
            out, complete = self._scan_calls()
            if complete and not (final and self._object is not None):
                if final:
                    self._buffer = ""
                return out
            self._mode = "content"  # not calls after all: what is left is content
            if self._made_call:  # text after calls: without the separator before it
                self._buffer = self._buffer.lstrip().lstrip(";").lstrip()
        if self._buffer:
            out.append(self._buffer)
            self._buffer = ""
        return out

    def _scan_calls(self) -> tuple[list[str | ToolCall], bool]:
        """Calls completed in the buffer (cut from it); False once text that is not a
        call (or a separator) is met."""
        out: list[str | ToolCall] = []
        text = self._buffer
        while True:
            if self._object is None:
                while self._pos < len(text) and (text[self._pos].isspace() or text[self._pos] == ";"):
                    self._pos += 1
                if self._pos == len(text):
                    return out, True
                if text[self._pos] != "{":
                    return out, False
                self._start, self._object = self._pos, _JsonEnd(self._pos)
            end = self._object.find(text)
            if end is None:
                return out, True
            self._object = None
            calls = self._parse_body(text[self._start : end])
            if calls is None:
                return out, False
            out.extend(calls)
            self._made_call = True
            text = self._buffer = text[end:]
            self._pos = 0


def _merged(items: list[str | ToolCall]) -> list[str | ToolCall]:
    """``items`` with adjacent texts joined and empty texts dropped."""
    out: list[str | ToolCall] = []
    for item in items:
        if isinstance(item, str):
            if not item:
                continue
            if out and isinstance(out[-1], str):
                out[-1] += item
                continue
        out.append(item)
    return out


def _arguments_schema(tool: dict[str, Any]) -> dict[str, Any]:
    schema = dict(tool["function"].get("parameters") or {"type": "object"})
    schema["x-guidance"] = {**_JSON_STYLE, **(schema.get("x-guidance") or {})}
    return schema


def tool_call_grammar(
    fmt: ToolFormat, tools: list[dict[str, Any]], choice: ToolChoice, marker_tokens: Mapping[str, int] | None = None
) -> str | None:
    """An llguidance grammar (its JSON text, for ``SamplingParams.grammar``) that forces
    exactly one call in ``fmt``: of any of ``tools`` for REQUIRED, of the named one for
    NAMED, its arguments matching the tool's ``parameters`` schema (written with
    ``json.dumps``'s spacing). After the call only the end of the output may follow (EOS).
    None for NONE and AUTO (nothing is forced). ``tools`` and ``choice`` are checked ones
    (:func:`check_tools`). Built as Lark text with ``%json`` embedded schemas
    (llguidance's syntax, docs/syntax.md in its repository).

    ``marker_tokens`` holds the call markers (:func:`call_markers`) that are one added
    token of the model's vocabulary, by text, with the token's id: the grammar names those
    as the token (``<[id]>``), the others as text. llguidance takes every added token as
    special, never as its text, so a marker written as text where the model has it as a
    token allows that token and then rejects it.

    Raises:
        ValueError: a tool's ``parameters`` schema that llguidance cannot compile, naming
            the tool.
    """
    import llguidance

    if choice.mode in (ToolChoiceMode.NONE, ToolChoiceMode.AUTO):
        return None
    chosen = [t for t in tools if choice.mode is ToolChoiceMode.REQUIRED or t["function"]["name"] == choice.name]
    if not chosen:
        raise ValueError(f"tool_choice {choice.mode.value!r} has no tool to call")
    tokens = marker_tokens or {}

    def marker(text: str) -> str:
        return f"<[{tokens[text]}]>" if text in tokens else json.dumps(text)

    key = "parameters" if fmt is ToolFormat.LLAMA3_JSON else "arguments"
    rules = []
    for i, tool in enumerate(chosen):
        name = tool["function"]["name"]
        schema = json.dumps(_arguments_schema(tool))
        problem = llguidance.LLMatcher.validate_grammar(
            llguidance.LLMatcher.grammar_from_lark(f"start: %json {schema}")
        )
        if problem:
            raise ValueError(f"tools: the parameters schema of function {name!r} cannot be enforced: {problem}")
        call = f'{{"name": {json.dumps(name)}, "{key}": '
        if fmt is ToolFormat.HERMES:
            head, tail = [marker(TOOL_CALL_OPEN), json.dumps("\n" + call)], [json.dumps("}\n"), marker(TOOL_CALL_CLOSE)]
        elif fmt is ToolFormat.MISTRAL:  # as its template writes calls: "[TOOL_CALLS] [{...}]"
            head, tail = [marker(TOOL_CALLS), json.dumps(" [" + call)], [json.dumps("}]")]
        else:
            head, tail = [json.dumps(call)], [json.dumps("}")]
        rules.append(f"call_{i}: {' '.join(head)} %json {schema} {' '.join(tail)}")
    lark = "start: " + " | ".join(f"call_{i}" for i in range(len(chosen))) + "\n" + "\n".join(rules) + "\n"
    grammar = llguidance.LLMatcher.grammar_from_lark(lark)
    problem = llguidance.LLMatcher.validate_grammar(grammar)
    if problem:
        raise ValueError(f"tools: the tool-call grammar does not compile: {problem}")
    return str(grammar)
