"""End to end: a model that answers in harmony messages (gpt-oss's format), through a node:
its analysis channel is the reasoning, its call to ``functions.get_weather`` a tool call,
its final channel the answer, on the OpenAI and Anthropic APIs.

The model is tests/scripted_model.py's (a hand-set Qwen2 that writes a given text, then
another once a tool result is in the prompt) with a chat template that is the ``"qwen"``
one plus a comment naming harmony's markers, so the node reads its output as harmony (the
markers are plain text here, where gpt-oss has them as special tokens: the splitter reads
text either way, and the detokenizer keeps the special ones)."""

from __future__ import annotations

import json

import anthropic
import openai
import pytest
from conftest import free_port_block
from scripted_model import write_scripted_model

from shardline.local_cluster import LocalCluster

pytestmark = pytest.mark.timeout(120)

FIRST = (
    "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary"
    ' to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}'
)
AFTER = "<|channel|>analysis<|message|>Got it.<|end|><|start|>assistant<|channel|>final<|message|>Sunny."
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    root = tmp_path_factory.mktemp("harmony")
    model = write_scripted_model(root / "models" / "harmony", FIRST, AFTER, context=4096)
    template = model / "chat_template.jinja"
    template.write_text(template.read_text() + "{#- harmony: <|channel|> <|message|> -#}")
    cluster = LocalCluster(
        nodes=1,
        base_port=free_port_block(1),
        runner_threads=1,
        log_dir=str(root),
        data_dir=str(root),
        model_dirs=[root / "models"],
    )
    cluster.start()
    try:
        cluster.place(str(model), "pipeline")
        yield cluster.url(0)
    finally:
        cluster.stop()


def test_chat_completions_reasoning_call_and_answer(url):
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    first = client.chat.completions.create(model="harmony", messages=ASK, tools=[WEATHER], max_tokens=200)
    message = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls", first
    assert message.model_extra["reasoning_content"] == "Need the weather."
    [call] = message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
    assert not message.content
    history = [
        *ASK,
        message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
    ]
    stream = client.chat.completions.create(
        model="harmony", messages=history, tools=[WEATHER], max_tokens=200, stream=True
    )
    content, reasoning = "", ""
    for chunk in stream:
        if chunk.choices:
            delta = chunk.choices[0].delta
            content += delta.content or ""
            reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
    assert (reasoning, content) == ("Got it.", "Sunny.")


def test_anthropic_thinking_block_and_tool_use(url):
    client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
    tool = {
        "name": "get_weather",
        "description": "The weather in a city.",
        "input_schema": WEATHER["function"]["parameters"],
    }
    answer = client.messages.create(
        model="harmony",
        max_tokens=2000,
        messages=ASK,
        tools=[tool],
        thinking={"type": "enabled", "budget_tokens": 1024},
    )
    assert [b.type for b in answer.content] == ["thinking", "tool_use"], answer
    assert answer.content[0].thinking == "Need the weather."
    assert answer.content[1].input == {"city": "Paris"} and answer.stop_reason == "tool_use"
