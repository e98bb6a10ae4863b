"""gpt-oss's output format (OpenAI's harmony) split into reasoning, answer and tool calls.

A harmony model answers in messages, each a header and a body::

    <|channel|>analysis<|message|>The user asks ...<|end|>
    <|start|>assistant<|channel|>final<|message|>Paris.<|return|>

    <|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>

(the chat template's generation prompt already wrote the first ``<|start|>assistant``; a
recipient ``to=functions.NAME`` may also stand before the channel). The channels, as
vLLM's and llama.cpp's servers read them: ``analysis`` is the reasoning (sent as
``reasoning_content``, a thinking block, ``thinking``); ``final`` is the answer;
``commentary`` addressed to ``functions.NAME`` is a call of tool NAME with the body as its
JSON arguments, and without a recipient it is answer text (a preamble). ``<|return|>``
and ``<|call|>`` end the output (the tokenizer's end tokens). Format reference: OpenAI's
"OpenAI Harmony Response Format" guide (cookbook.openai.com/articles/openai-harmony).

:class:`HarmonySplitter` reads the output text as it streams, with those markers kept in it
(they are special tokens: :data:`MARKERS`), and gives the reasoning and the answer as
:class:`~shardline.api.reasoning.ReasoningSplitter` does; each call comes out in the answer
as a Hermes ``<tool_call>`` block, which the tools' parser
(:class:`~shardline.api.tools.ToolCallParser`, HERMES) then takes as any other call.
"""

from __future__ import annotations

import json
import re

from shardline.api.tools import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, partial_suffix
from shardline.models.tokenizer import template_is_harmony

START, CHANNEL, MESSAGE, END, CONSTRAIN = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|constrain|>")
MARKERS = (START, CHANNEL, MESSAGE, END, CONSTRAIN)
"""The special tokens that structure the output (kept in its text for the splitter)."""

__all__ = ["MARKERS", "HarmonySplitter", "template_is_harmony"]

_RECIPIENT = re.compile(r"\bto=functions\.([^\s<]+)")
_CHANNEL = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")


class HarmonySplitter:
    """Splits streamed harmony output into reasoning and answer text (tool calls written
    into the answer as Hermes blocks), holding back only a header not yet complete, a call
    not yet complete, and text that may be the start of a marker."""

    def __init__(self) -> None:
        self._pending = ""
        self._header: str | None = ""  # the header being read; None inside a body
        self._channel = ""
        self._recipient: str | None = None
        self._call = ""  # a call's body so far

    @property
    def thinking(self) -> bool:
        """Whether the output is inside an analysis message."""
        return self._header is None and self._channel == "analysis" and self._recipient is None

    def feed(self, text: str) -> tuple[str, str]:
        """The reasoning and the answer that ``text`` (the next piece of output)
        completes; either may be empty."""
        self._pending += text
        reasoning: list[str] = []
        answer: list[str] = []
        while self._pending:
            if self._header is not None:  # reading a header, up to <|message|>
                header = self._header + self._pending
                if not _may_be_header(header):  # plain text, no harmony: all answer
                    self._header, self._channel, self._pending = None, "final", header
                    continue
                at = header.find(MESSAGE)
                if at < 0:
                    self._header, self._pending = header, ""
                    break
                self._open(header[:at])
                self._header, self._pending = None, header[at + len(MESSAGE) :]
                continue
            cut = self._body_end()
            if cut is None:  # the body goes on: keep back what may begin a marker
                keep = len(self._pending) - _held_back(self._pending)
                self._emit(self._pending[:keep], reasoning, answer)
                self._pending = self._pending[keep:]
                break
            self._emit(self._pending[:cut], reasoning, answer)
            rest = self._pending[cut:]
            self._pending = rest[len(END) :] if rest.startswith(END) else rest  # <|start|> opens the next header
            self._close(answer)
        return "".join(reasoning), "".join(answer)

    def flush(self) -> tuple[str, str]:
        """What is held back, at the end of the output (a call's body closes its call)."""
        reasoning: list[str] = []
        answer: list[str] = []
        if self._header is None:
            self._emit(self._pending, reasoning, answer)
            self._close(answer)
        elif self._header.strip() and MESSAGE not in self._header and not any(m in self._header for m in MARKERS):
            answer.append(self._header)  # text that never became a header
        self._pending = ""
        return "".join(reasoning), "".join(answer)

    def _open(self, header: str) -> None:
        channel = _CHANNEL.search(header)
        recipient = _RECIPIENT.search(header)
        self._channel = channel.group(1) if channel else "final"
        self._recipient = recipient.group(1) if recipient else None
        self._call = ""

    def _body_end(self) -> int | None:
        """Where the body in ``_pending`` ends (at ``<|end|>`` or a new ``<|start|>``)."""
        ends = [i for i in (self._pending.find(END), self._pending.find(START)) if i >= 0]
        return min(ends) if ends else None

    def _emit(self, piece: str, reasoning: list[str], answer: list[str]) -> None:
        if self._recipient is not None:
            self._call += piece
        elif self._channel == "analysis":
            reasoning.append(piece)
        else:
            answer.append(piece)

    def _close(self, answer: list[str]) -> None:
        """The end of a message: a call's block, then a new header may follow."""
        if self._recipient is not None:
            answer.append(_hermes_call(self._recipient, self._call))
        self._header, self._channel, self._recipient, self._call = "", "", None, ""


def _hermes_call(name: str, body: str) -> str:
    """A call of ``name`` with harmony body ``body`` (JSON arguments) as a Hermes block;
    a body that is not a JSON object is passed as the text it is (the parser then says
    so)."""
    try:
        arguments = json.loads(body or "{}")
    except json.JSONDecodeError:
        return f'{TOOL_CALL_OPEN}\n{{"name": {json.dumps(name)}, "arguments": {body}}}\n{TOOL_CALL_CLOSE}'
    return (
        f"{TOOL_CALL_OPEN}\n"
        + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
        + f"\n{TOOL_CALL_CLOSE}"
    )


def _may_be_header(text: str) -> bool:
    """Whether ``text`` may be (the start of) a message header: after whitespace it begins
    with a marker, a prefix of one, or a recipient."""
    head = text.lstrip()
    return not head or head.startswith("to=") or any(head.startswith(m) or m.startswith(head) for m in MARKERS)


def _held_back(text: str) -> int:
    """How many characters at the end of ``text`` may begin a marker that ends a body."""
    return max(partial_suffix(text, END), partial_suffix(text, START))
