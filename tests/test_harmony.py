"""gpt-oss's harmony output split into reasoning, answer and tool calls (api/harmony.py):
tables, fed whole and a character at a time."""

import json

import pytest

from shardline.api.harmony import HarmonySplitter, template_is_harmony
from shardline.api.tools import ToolCall, ToolCallParser, ToolFormat

pytestmark = pytest.mark.fast

CALL = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}'


@pytest.mark.parametrize(
    "output, reasoning, answer",
    [
        (
            "<|channel|>analysis<|message|>The user greets.<|end|><|start|>assistant<|channel|>final<|message|>Hello!",
            "The user greets.",
            "Hello!",
        ),
        ("<|channel|>final<|message|>Paris.", "", "Paris."),
        ("<|channel|>analysis<|message|>Still thinking", "Still thinking", ""),  # cut short
        ("Plain text, no header.", "", "Plain text, no header."),
        (
            "<|channel|>commentary<|message|>Let me look.<|end|><|start|>assistant<|channel|>final<|message|>Done.",
            "",
            "Let me look.Done.",
        ),  # a preamble is answer text
        ("<|channel|>final<|message|>if a < b then <|x|>", "", "if a < b then <|x|>"),
        ("<|channel|>final<|message|>Hi<|end|> and text after the end", "", "Hi and text after the end"),
    ],
)
@pytest.mark.parametrize("step", [None, 1])
def test_channels_split_into_reasoning_and_answer(output, reasoning, answer, step):
    splitter = HarmonySplitter()
    pieces = [output] if step is None else list(output)
    got = [splitter.feed(p) for p in pieces] + [splitter.flush()]
    assert "".join(r for r, _ in got) == reasoning
    assert "".join(a for _, a in got) == answer


@pytest.mark.parametrize(
    "output",
    [
        "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant" + CALL,
        "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant to=functions.get_weather"
        '<|channel|>commentary json<|message|>{"city": "Paris"}',  # the recipient before the channel
    ],
)
@pytest.mark.parametrize("step", [None, 3])
def test_a_call_to_a_function_is_a_tool_call(output, step):
    splitter = HarmonySplitter()
    parser = ToolCallParser(ToolFormat.HERMES, ["get_weather"], {})
    pieces = [output] if step is None else [output[i : i + step] for i in range(0, len(output), step)]
    reasoning, items = "", []
    for piece in pieces:
        r, a = splitter.feed(piece)
        reasoning += r
        items += parser.feed(a)
    r, a = splitter.flush()
    items += parser.feed(a) + parser.finish()
    calls = [i for i in items if isinstance(i, ToolCall)]
    assert reasoning == "Need weather."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
    assert not [i for i in items if isinstance(i, str) and i.strip()]


def test_a_harmony_template_is_recognised():
    assert template_is_harmony("{{ '<|start|>assistant<|channel|>final<|message|>' }}")
    assert not template_is_harmony("{{ '<|im_start|>assistant' }}")
