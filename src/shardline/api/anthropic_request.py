"""The Anthropic Messages API's request (``POST /v1/messages`` and ``/v1/messages/count_tokens``),
validated and mapped to a :class:`~shardline.api.text_stream.GenerationRequest`, and its
context-management edits: pure functions over values.

Shapes from Anthropic's Messages API reference as the ``anthropic`` package 2.15.0 types
them (``anthropic/types/message_create_params.py``, ``thinking_config_*_param.py``,
``output_config_param.py``, ``beta/beta_context_management_config_param.py`` and the
edits it names). What a field does here, or why it is refused, is in
:data:`shardline.api.params.PARAMETERS`.

Reasoning (``thinking``, ``output_config.effort``) is accepted as Anthropic's API accepts
it. A reasoning model (Qwen3's kind) thinks where ``thinking`` asks for it (enabled,
adaptive, between_tools) and not otherwise, and its thinking is a ``thinking`` block of
the answer; the budget and the effort do not bound it (the effort is given to the chat
template: gpt-oss's writes its level, :func:`~shardline.models.tokenizer.reasoning_level`).
A model that does not reason spends none of the budget, and its answer has no thinking
blocks. Thinking blocks of earlier
turns are taken and left out of the prompt, as reasoning models' chat templates leave out
earlier turns' reasoning.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from shardline.api.content import check_parts
from shardline.api.params import Endpoint, StopString
from shardline.api.structured import json_grammar
from shardline.api.text_stream import APIError, GenerationRequest
from shardline.api.tools import ToolChoice, ToolChoiceMode
from shardline.runner.protocol import SamplingParams

CLEARED_TOOL_RESULT = "[tool result cleared to save context]"
"""The text that stands for a tool result (or a call's input) a ``clear_tool_uses`` edit
cleared, so the model knows something was there."""

VOLATILE_LINE = re.compile(r"^x-anthropic-[a-z0-9-]+:[^\n]*;[ \t]*(?:\n|$)", re.MULTILINE)
"""A line of the system prompt that changes with every request and means nothing to the
model: Claude Code starts its system prompt with ``x-anthropic-billing-header:
cc_version=…; cc_entrypoint=…; cch=…;``, whose ``cch`` is a hash of the request. Left in,
a prompt differs from the last turn's a few tokens in and the prefix cache
(:mod:`shardline.runner.prefix_cache`) misses the thousands of tokens after it; exo
strips such lines for the same reason."""


def system_text(system: str | list[TextBlock]) -> str:
    """The system prompt's text (blocks joined as they are) without its volatile lines
    (:data:`VOLATILE_LINE`): blocks that are one (Claude Code sends its header as a block
    of its own), then lines."""
    if not isinstance(system, str):
        system = "".join(b.text for b in system if not VOLATILE_LINE.fullmatch(b.text.strip()))
    return VOLATILE_LINE.sub("", system)


class TextBlock(BaseModel):
    model_config = ConfigDict(extra="allow")  # e.g. cache_control, citations
    type: Literal["text"]
    text: str


class ThinkingBlock(BaseModel):
    """An earlier turn's reasoning: ``{type: "thinking", thinking, signature}``; left out of
    the prompt."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None
    cache_control: dict | None = None


class RedactedThinkingBlock(BaseModel):
    """An earlier turn's encrypted reasoning: ``{type: "redacted_thinking", data}``; left
    out of the prompt."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["redacted_thinking"]
    data: str
    cache_control: dict | None = None


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


Block = Annotated[
    TextBlock | ThinkingBlock | RedactedThinkingBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")
]


class Message(BaseModel):
    """A turn of ``messages``. ``system`` turns (Claude Code sends them between the others)
    are rendered as system turns where they stand."""

    model_config = ConfigDict(extra="forbid")
    role: Literal["user", "assistant", "system"]
    content: str | list[Block]

    @model_validator(mode="after")
    def _system_is_text(self) -> Message:
        if self.role == "system" and any(not isinstance(b, TextBlock) for b in self.blocks()):
            raise ValueError("content: a system turn takes text blocks only")
        return self

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(b.text for b in self.content if isinstance(b, TextBlock))

    def blocks(self) -> list[Any]:
        return [] if isinstance(self.content, str) else list(self.content)

    def chat(self) -> list[dict[str, Any]]:
        """The turn in the chat template's form: tool results first, as ``tool`` messages,
        then the text; an assistant's tool_use blocks as its ``tool_calls``; thinking
        blocks left out."""
        blocks = self.blocks()
        out: list[dict[str, Any]] = [
            {"role": "tool", "content": b.text(), "tool_call_id": b.tool_use_id}
            for b in blocks
            if isinstance(b, ToolResultBlock)
        ]
        calls = [
            {"id": b.id, "type": "function", "function": {"name": b.name, "arguments": b.input}}
            for b in blocks
            if isinstance(b, ToolUseBlock)
        ]
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
    strict: bool | None = None
    eager_input_streaming: bool | None = None  # how the client would like input streamed: one delta here
    defer_loading: bool | None = None  # true: found by a tool search, which is not run here: not offered
    input_examples: list[dict[str, Any]] | None = None  # examples for the model; not rendered

    def function(self) -> dict[str, Any]:
        function: dict[str, Any] = {"name": self.name, "parameters": self.input_schema}
        if self.description is not None:
            function["description"] = self.description
        if self.strict:
            function["strict"] = True
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
        return ToolChoice(
            {"auto": ToolChoiceMode.AUTO, "any": ToolChoiceMode.REQUIRED, "none": ToolChoiceMode.NONE}[self.type]
        )


class Metadata(BaseModel):
    model_config = ConfigDict(extra="forbid")
    user_id: str | None = Field(default=None, max_length=256)


class Thinking(BaseModel):
    """``thinking``: ``{type: enabled, budget_tokens}``, ``{type: adaptive}``, ``{type:
    disabled}`` or ``{type: between_tools}``, with an optional ``display`` (``omitted``:
    thinking blocks with no text). A reasoning model thinks unless it is disabled; a model
    that does not reason spends none of the budget."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["enabled", "adaptive", "disabled", "between_tools"]
    budget_tokens: int | None = Field(default=None, ge=1024)
    display: Literal["summarized", "omitted"] | None = None

    @model_validator(mode="after")
    def _budget(self) -> Thinking:
        if self.type == "enabled" and self.budget_tokens is None:
            raise ValueError("budget_tokens: Field required")
        if self.type != "enabled" and self.budget_tokens is not None:
            raise ValueError(f"budget_tokens: Extra inputs are not permitted with type {self.type}")
        return self

    @property
    def on(self) -> bool:
        """Whether a reasoning model thinks."""
        return self.type != "disabled"


class InputTokens(BaseModel):
    """A count of the prompt's tokens: ``{type: input_tokens, value}``."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["input_tokens"]
    value: int = Field(ge=0)


class ToolUses(BaseModel):
    """A count of tool uses: ``{type: tool_uses, value}``."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["tool_uses"]
    value: int = Field(ge=0)


class ClearToolUses(BaseModel):
    """The ``clear_tool_uses_20250919`` edit: once the prompt passes ``trigger`` (100,000
    input tokens unless set; or a count of tool uses), the oldest tool results, all but the
    last ``keep`` tool uses (3 unless set) and those of ``exclude_tools``, are replaced by
    :data:`CLEARED_TOOL_RESULT`; their calls' inputs too with ``clear_tool_inputs`` (true,
    or the tools it lists); nothing is cleared where that frees fewer than
    ``clear_at_least`` input tokens."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["clear_tool_uses_20250919"]
    trigger: Annotated[InputTokens | ToolUses, Field(discriminator="type")] = InputTokens(
        type="input_tokens", value=100_000
    )
    keep: ToolUses = ToolUses(type="tool_uses", value=3)
    clear_at_least: InputTokens | None = None
    clear_tool_inputs: bool | list[str] = False
    exclude_tools: list[str] | None = None


class ThinkingTurns(BaseModel):
    """``{type: thinking_turns, value}``: the last ``value`` assistant turns keep their thinking."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["thinking_turns"]
    value: int = Field(ge=0)


class AllThinkingTurns(BaseModel):
    """``{type: all}``: every turn keeps its thinking."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["all"]


class ClearThinking(BaseModel):
    """The ``clear_thinking_20251015`` edit: thinking blocks of all but the last ``keep``
    assistant turns (1 unless set; ``all`` keeps every one) are removed."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["clear_thinking_20251015"]
    keep: Annotated[ThinkingTurns | AllThinkingTurns, Field(discriminator="type")] | Literal["all"] = ThinkingTurns(
        type="thinking_turns", value=1
    )

    def kept(self, turns: int) -> int:
        """How many of ``turns`` assistant turns with thinking keep it."""
        if isinstance(self.keep, ThinkingTurns):
            return min(turns, self.keep.value)
        return turns


class ContextManagement(BaseModel):
    """``context_management``: ``{edits: [...]}`` applied to the conversation before it is
    rendered (:func:`apply_edits`)."""

    model_config = ConfigDict(extra="forbid")
    edits: list[Annotated[ClearToolUses | ClearThinking, Field(discriminator="type")]] = []

    @property
    def counts_tokens(self) -> bool:
        """Whether an edit's trigger or minimum needs the prompt's tokens counted."""
        return any(
            isinstance(e, ClearToolUses) and (e.trigger.type == "input_tokens" or e.clear_at_least) for e in self.edits
        )


class CountTokensRequest(BaseModel):
    """``POST /v1/messages/count_tokens``: the prompt part of a Messages request
    (:data:`shardline.api.params.PARAMETERS` lists its fields)."""

    ENDPOINT: ClassVar[Endpoint] = Endpoint.COUNT_TOKENS
    model_config = ConfigDict(extra="forbid")
    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    thinking: Thinking | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoiceParam | None = None
    context_management: ContextManagement | None = None

    @staticmethod
    def check_raw(data: Any) -> None:
        """Refuse, in the raw body (before its strict JSON validation), an empty or media block, by name
        (:func:`~shardline.api.content.check_parts`)."""
        check_parts(data, "anthropic")

    def chat(self) -> list[dict]:
        """The conversation as chat-template messages (the system prompt first)."""
        chat: list[dict] = []
        if self.system and (system := system_text(self.system)):
            chat.append({"role": "system", "content": system})
        for m in self.messages:
            chat += m.chat()
        return chat

    def not_offered(self) -> list[str]:
        """The tools the model is not offered, as ``custom:name``: those with
        ``defer_loading`` (Anthropic's tool search finds them; this server runs none)."""
        return [f"custom:{t.name}" for t in self.tools or [] if t.defer_loading]

    def to_generation(self) -> GenerationRequest:
        """A last assistant message is the start of the reply (a prefill): continued, not
        answered with a new turn.

        Raises:
            APIError: 400 for a ``tool_choice`` naming a tool with ``defer_loading``."""
        choice = self.tool_choice or ToolChoiceParam(type="auto")
        if choice.type == "tool" and f"custom:{choice.name}" in self.not_offered():
            raise APIError(
                400,
                f"tool_choice.name: tool {choice.name!r} has defer_loading: it is found by a tool "
                "search, which this server does not run, so it is not offered to the model",
                param="tool_choice.name",
            )
        return GenerationRequest(
            model=self.model,
            prompt=self.chat(),
            api="anthropic",
            prompt_param="messages",
            continue_final_message=self.messages[-1].role == "assistant",
            tools=[t.function() for t in self.tools or [] if not t.defer_loading],
            tool_choice=choice.choice(),
            max_tool_calls=1 if choice.disable_parallel_tool_use else None,
            thinking=self.thinks,
        )

    @property
    def thinks(self) -> bool:
        """Whether a reasoning model thinks: ``thinking`` is given and not disabled
        (Anthropic's default is no thinking)."""
        return self.thinking is not None and self.thinking.on

    @property
    def shows_thinking(self) -> bool:
        """Whether thinking blocks carry the thinking's text (``display`` is not ``omitted``)."""
        return self.thinking is None or self.thinking.display != "omitted"


class OutputFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(BaseModel):
    """``output_config``: ``format`` (structured output by constrained decoding) and
    ``effort`` (a reasoning model's; it thinks as it would without it)."""

    model_config = ConfigDict(extra="forbid")
    format: OutputFormat | None = None
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None

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

    @model_validator(mode="after")
    def _thinking_fits(self) -> MessagesRequest:
        budget = self.thinking.budget_tokens if self.thinking is not None else None
        if budget is not None and budget >= self.max_tokens:
            raise ValueError("max_tokens: `max_tokens` must be greater than `thinking.budget_tokens`")
        return self

    def to_generation(self) -> GenerationRequest:
        return dataclasses.replace(
            super().to_generation(),
            max_tokens=self.max_tokens,
            sampling=SamplingParams(
                self.temperature,
                self.top_p,
                self.top_k,
                None,
                grammar=None if self.output_config is None else self.output_config.grammar(),
            ),
            stop=list(self.stop_sequences or []),
            effort=None if self.output_config is None else self.output_config.effort,
        )


# -- context management ------------------------------------------------------------------


def apply_edits(
    messages: list[Message], management: ContextManagement | None, input_tokens: int | None, count: Callable[[str], int]
) -> tuple[list[Message], list[dict[str, Any]]]:
    """``messages`` after ``management``'s edits, in order, and Anthropic's
    ``applied_edits`` for the response (an edit that cleared nothing is not listed).

    Args:
        messages: the request's turns (not changed: edited turns are copies).
        input_tokens: the prompt's tokens before the edits (None where no edit needs them:
            :attr:`ContextManagement.counts_tokens`).
        count: the tokens of a text (the model's tokenizer), for what an edit clears.
    """
    applied: list[dict[str, Any]] = []
    for edit in management.edits if management is not None else ():
        if isinstance(edit, ClearThinking):
            messages, cleared_turns = _clear_thinking(messages, edit)
            if cleared_turns:
                applied.append(
                    {"type": edit.type, "cleared_thinking_turns": cleared_turns, "cleared_input_tokens": 0}
                )  # thinking is never in the prompt here
        else:
            messages, uses, tokens = _clear_tool_uses(messages, edit, input_tokens, count)
            if uses:
                applied.append({"type": edit.type, "cleared_tool_uses": uses, "cleared_input_tokens": tokens})
                if input_tokens is not None:
                    input_tokens -= tokens
    return messages, applied


def _clear_thinking(messages: list[Message], edit: ClearThinking) -> tuple[list[Message], int]:
    thinking = [
        i
        for i, m in enumerate(messages)
        if m.role == "assistant" and any(isinstance(b, ThinkingBlock | RedactedThinkingBlock) for b in m.blocks())
    ]
    cleared = thinking[: len(thinking) - edit.kept(len(thinking))]
    out = list(messages)
    for i in cleared:
        kept = [b for b in out[i].blocks() if not isinstance(b, ThinkingBlock | RedactedThinkingBlock)]
        out[i] = out[i].model_copy(update={"content": kept or ""})
    return out, len(cleared)


def _clear_tool_uses(
    messages: list[Message], edit: ClearToolUses, input_tokens: int | None, count: Callable[[str], int]
) -> tuple[list[Message], int, int]:
    """The turns with the edit applied, the tool uses cleared and the tokens that freed."""
    uses = [(i, b) for i, m in enumerate(messages) for b in m.blocks() if isinstance(b, ToolUseBlock)]
    triggered = (
        len(uses) > edit.trigger.value
        if edit.trigger.type == "tool_uses"
        else (input_tokens is not None and input_tokens > edit.trigger.value)
    )
    if not triggered:
        return messages, 0, 0
    excluded = set(edit.exclude_tools or ())
    keep = edit.keep.value
    clear = [b for _, b in (uses[:-keep] if keep else uses) if b.name not in excluded]
    inputs = edit.clear_tool_inputs
    clear_input = {b.id for b in clear if inputs is True or (isinstance(inputs, list) and b.name in inputs)}
    ids = {b.id for b in clear}
    placeholder = count(CLEARED_TOOL_RESULT)
    freed = 0
    out = []
    for message in messages:
        blocks = message.blocks()
        if not any(
            isinstance(b, ToolResultBlock)
            and b.tool_use_id in ids
            or isinstance(b, ToolUseBlock)
            and b.id in clear_input
            for b in blocks
        ):
            out.append(message)
            continue
        edited: list[Any] = []
        for b in blocks:
            if isinstance(b, ToolResultBlock) and b.tool_use_id in ids:
                freed += max(0, count(b.text()) - placeholder)
                b = b.model_copy(update={"content": CLEARED_TOOL_RESULT, "is_error": False})
            elif isinstance(b, ToolUseBlock) and b.id in clear_input:
                freed += max(0, count(str(b.input)) - placeholder)
                b = b.model_copy(update={"input": {"cleared": CLEARED_TOOL_RESULT}})
            edited.append(b)
        out.append(message.model_copy(update={"content": edited}))
    if not clear or (edit.clear_at_least is not None and freed < edit.clear_at_least.value):
        return messages, 0, 0
    return out, len(clear), freed
