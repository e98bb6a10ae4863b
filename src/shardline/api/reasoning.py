"""A reasoning model's output split into its reasoning and its answer, as vLLM's and
llama.cpp's servers split Qwen3's, QwQ's and DeepSeek-R1's.

Such a model writes its thinking between ``<think>`` and ``</think>`` before the answer;
its chat template writes ``<think>``
(:attr:`~shardline.models.tokenizer.Tokenizer.reasons`). Where the template's generation
prompt already opened it (QwQ, DeepSeek-R1 distills; Qwen3 with thinking on writes it
itself), the output starts inside the thinking (:func:`prompt_opens_thinking`).
:class:`ReasoningSplitter` takes the output text as it streams.
"""

from __future__ import annotations

from enum import Enum

from shardline.api.tools import partial_suffix
from shardline.models.tokenizer import THINK_OPEN

THINK_CLOSE = "</think>"


def prompt_opens_thinking(prompt_text: str) -> bool:
    """Whether a prompt (its text, or the text of its last tokens) leaves the output inside
    the thinking: it ends with ``<think>``, whitespace after it aside."""
    return prompt_text.rstrip().endswith(THINK_OPEN)


class _State(Enum):
    START = "start"  # the output may open <think>
    INSIDE = "inside"  # reasoning until </think>
    CLOSED = "closed"  # after </think>: whitespace before the answer is dropped
    ANSWER = "answer"


class ReasoningSplitter:
    """Splits streamed output text into reasoning (between ``<think>`` and ``</think>``)
    and answer, holding back only what may be part of a marker (and whitespace that would
    end the reasoning or begin the answer, which is dropped: the reasoning and the answer
    come without the blank lines around the markers).

    Output that does not begin with ``<think>`` (whitespace aside) is all answer, unless
    ``inside``: the prompt opened the thinking, so the output is reasoning until
    ``</think>``. A ``<think>`` later in the answer is answer text. Output that ends inside
    the thinking is all reasoning.
    """

    def __init__(self, inside: bool) -> None:
        self._state = _State.INSIDE if inside else _State.START
        self._pending = ""
        self._leading = True  # no reasoning yet: whitespace is dropped

    @property
    def thinking(self) -> bool:
        """Whether the text so far leaves the output inside the thinking."""
        return self._state is _State.INSIDE

    def feed(self, text: str) -> tuple[str, str]:
        """The reasoning and the answer text that ``text`` (the next piece of output)
        completes; either may be empty."""
        self._pending += text
        reasoning, answer = "", ""
        while self._pending:
            if self._state is _State.START:
                stripped = self._pending.lstrip()
                if stripped.startswith(THINK_OPEN):
                    self._pending, self._state = stripped[len(THINK_OPEN) :], _State.INSIDE
                elif THINK_OPEN.startswith(stripped):  # whitespace, or part of <think>: wait
                    break
                else:
                    self._state = _State.ANSWER
            elif self._state is _State.INSIDE:
                if self._leading:
                    self._pending = self._pending.lstrip()
                    if not self._pending:
                        break
                    self._leading = False
                end = self._pending.find(THINK_CLOSE)
                if end >= 0:
                    reasoning += self._pending[:end].rstrip()
                    self._pending, self._state = self._pending[end + len(THINK_CLOSE) :], _State.CLOSED
                    continue
                keep = len(self._pending) - _held(self._pending)
                reasoning += self._pending[:keep]
                self._pending = self._pending[keep:]
                break
            elif self._state is _State.CLOSED:
                self._pending = self._pending.lstrip()
                if self._pending:
                    self._state = _State.ANSWER
            else:
                answer, self._pending = self._pending, ""
        return reasoning, answer

    def flush(self) -> tuple[str, str]:
        """The reasoning and the answer text held back, the output having ended (a
        partial marker is text; whitespace at the end of the reasoning is dropped)."""
        pending, self._pending = self._pending, ""
        if self._state is _State.INSIDE:
            return pending.rstrip(), ""
        if self._state is _State.START:
            return "", pending
        return "", ""


def _held(text: str) -> int:
    """How many characters at the end of reasoning ``text`` to hold back: a beginning of
    ``</think>`` and the whitespace before it (which ``</think>`` would drop)."""
    marker = partial_suffix(text, THINK_CLOSE)
    body = text[: len(text) - marker]
    return marker + len(body) - len(body.rstrip())
