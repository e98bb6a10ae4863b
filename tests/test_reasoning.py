"""A reasoning model's output split into reasoning and answer (:mod:`shardline.api.reasoning`),
on scripted text streams cut at every position."""

from __future__ import annotations

import pytest

from shardline.api.reasoning import ReasoningSplitter, prompt_opens_thinking

pytestmark = pytest.mark.fast

# (output, the prompt opened <think>, reasoning, answer)
CASES = [
    ("<think>\nLet me see.\n</think>\n\nParis.", False, "Let me see.", "Paris."),
    ("<think>a</think>b", False, "a", "b"),
    ("  <think>a\n\nb </think>c <think>d</think>", False, "a\n\nb", "c <think>d</think>"),
    ("<think>\n\n</think>\n\nHello", False, "", "Hello"),
    ("Hello <think>x</think>", False, "", "Hello <think>x</think>"),
    ("<thin", False, "", "<thin"),
    ("\n<thinking>x", False, "", "\n<thinking>x"),
    ("<think>cut off </thi", False, "cut off </thi", ""),
    ("<think>\nall thought\n", False, "all thought", ""),
    ("I think.\n</think>\n\nAnswer", True, "I think.", "Answer"),
    ("\nx < y </thinker> z</think>w", True, "x < y </thinker> z", "w"),
    ("no end", True, "no end", ""),
    ("</think>plain", True, "", "plain"),
    ("", True, "", ""),
    ("", False, "", ""),
]


def split(pieces: list[str], inside: bool) -> tuple[str, str]:
    """The reasoning and answer of ``pieces`` fed in turn, each feed's held text checked."""
    splitter = ReasoningSplitter(inside)
    reasoning, answer = "", ""
    for piece in pieces:
        r, a = splitter.feed(piece)
        reasoning, answer = reasoning + r, answer + a
    r, a = splitter.flush()
    return reasoning + r, answer + a


@pytest.mark.parametrize("output, inside, reasoning, answer", CASES)
def test_every_cut_splits_the_same(output, inside, reasoning, answer):
    assert split([output], inside) == (reasoning, answer)
    assert split(list(output), inside) == (reasoning, answer)  # a character at a time
    for cut in range(len(output) + 1):
        assert split([output[:cut], output[cut:]], inside) == (reasoning, answer), cut
    for first in range(len(output) + 1):  # three pieces: a marker cut twice
        for second in range(first, min(len(output), first + 9) + 1):
            pieces = [output[:first], output[first:second], output[second:]]
            assert split(pieces, inside) == (reasoning, answer), (first, second)


def test_reasoning_streams_as_it_comes():
    """Only a possible marker (and whitespace before it) is held back."""
    splitter = ReasoningSplitter(inside=False)
    assert splitter.feed("<th") == ("", "")
    assert splitter.feed("ink>\nStep one") == ("Step one", "")
    assert splitter.thinking
    assert splitter.feed(", two.\n</") == (", two.", "")
    assert splitter.feed("think>") == ("", "")
    assert not splitter.thinking
    assert splitter.feed("\n\n") == ("", "")
    assert splitter.feed("Done") == ("", "Done")
    assert splitter.feed(" <think>") == ("", " <think>")
    assert splitter.flush() == ("", "")


@pytest.mark.parametrize(
    "tail, opens",
    [
        ("<|im_start|>assistant\n<think>\n", True),
        ("<｜Assistant｜><think>", True),
        ("<|im_start|>assistant\n", False),
        ("<|im_start|>assistant\n<think>\n\n</think>\n\n", False),
        ("<think> in a user's words</think><|im_start|>assistant\n", False),
    ],
)
def test_prompt_opens_thinking(tail, opens):
    assert prompt_opens_thinking(tail) is opens
