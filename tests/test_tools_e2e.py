"""Tool calling round trips (call -> result -> answer) through the official ``openai``,
``anthropic`` and ``ollama`` clients, on tiny random-weight chat models with a Qwen2.5-style
and a Llama-3-style template (tests/tiny_chat.py). Their text is noise, so the call is
forced: ``tool_choice`` required or named, which constrained decoding turns into exactly one
well-formed call in the family's format; the rest checks that the call is parsed out of the
text, and that results go back through the template. A third model has ``<tool_call>`` and
``</tool_call>`` as special tokens, as Qwen2.5's vocabulary has them: forced calls on each
API are calls there too. A fourth, scripted (tests/scripted_model.py), calls a tool of its
own accord under ``tool_choice`` auto, as Qwen2.5 writes calls (after its ``<tool_call>``
token), and answers the tool's result with text: the round trip an agent makes, on each
API, streamed."""

from __future__ import annotations

import json

import anthropic
import httpx
import ollama
import openai
import pytest
from conftest import free_port_block
from scripted_model import tool_call_text, write_scripted_model
from tiny_chat import write_tiny_chat_model

from shardline.api.structured import matches_schema
from shardline.local_cluster import LocalCluster

STYLES = ("qwen", "llama")
MARKED = "qwen-tokens"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city now.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time in a time zone.",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
SCRIPTED = "scripted"
SCRIPTED_CALL = {"city": 'Paris, "FR"'}
"""The arguments :data:`SCRIPTED` calls ``get_weather`` with (escaped quotes included); it
answers "Done." once a tool result is in the prompt."""


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    """One node serving the tiny chat models (their ids: "qwen", "llama", "qwen-tokens",
    whose call markers are special tokens, and :data:`SCRIPTED`)."""
    root = tmp_path_factory.mktemp("tools")
    for style in STYLES:
        write_tiny_chat_model(root / "models" / style, style)
    write_tiny_chat_model(root / "models" / MARKED, "qwen", marker_tokens=True)
    write_scripted_model(
        root / "models" / SCRIPTED, tool_call_text("get_weather", SCRIPTED_CALL), "Done.", context=4096
    )
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
        for style in (*STYLES, MARKED, SCRIPTED):
            cluster.place(str(root / "models" / style), "pipeline")
        yield cluster.url(0)
    finally:
        cluster.stop()


@pytest.mark.parametrize("style", STYLES)
def test_openai_tool_round_trip(url, style):
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    first = client.chat.completions.create(
        model=style,
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice="required",
        temperature=0,
        max_tokens=60,
        parallel_tool_calls=False,
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name in ("get_weather", "get_time") and call.id.startswith("call_")
    assert isinstance(json.loads(call.function.arguments), dict)

    named = client.chat.completions.create(
        model=style,
        messages=ASK,
        tools=[WEATHER, TIME],
        temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_tokens=60,
    )
    [timed] = named.choices[0].message.tool_calls
    assert timed.function.name == "get_time" and json.loads(timed.function.arguments)["zone"] in ("UTC", "CET")

    streamed = client.chat.completions.create(
        model=style,
        messages=ASK,
        tools=[WEATHER, TIME],
        stream=True,
        tool_choice="required",
        temperature=0,
        max_tokens=60,
    )
    calls, content, finish = [], "", None
    for chunk in streamed:
        for c in chunk.choices:
            content += c.delta.content or ""
            calls += c.delta.tool_calls or []
            finish = c.finish_reason or finish
    assert finish == "tool_calls" and "tool_call" not in content and "{" not in content
    assert [(c.function.name, c.function.arguments) for c in calls] == [(call.function.name, call.function.arguments)]

    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"},
    ]
    answer = client.chat.completions.create(
        model=style, messages=history, tools=[WEATHER, TIME], tool_choice="none", temperature=0, max_tokens=5
    )
    assert answer.choices[0].finish_reason in ("length", "stop") and not answer.choices[0].message.tool_calls
    alone = client.chat.completions.create(
        model=style, messages=ASK, tools=[WEATHER, TIME], tool_choice="none", max_tokens=1
    )
    assert answer.usage.prompt_tokens > alone.usage.prompt_tokens + 10  # the call and its result are in the prompt

    bad_history = [
        *ASK,
        {
            "role": "assistant",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{not json"}}
            ],
        },
    ]
    for messages, tools, param in ((bad_history, [WEATHER], "messages"), (ASK, "garbage", "tools")):
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model=style, messages=messages, tools=tools, max_tokens=5)
        assert refused.value.body["param"] == param  # type: ignore[index]
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model=style,
            messages=ASK,
            tools=[WEATHER],
            max_tokens=5,
            tool_choice={"type": "function", "function": {"name": "nope"}},
        )


@pytest.mark.parametrize("style", STYLES)
def test_anthropic_tool_round_trip(url, style):
    client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
    tool = {
        "name": "get_weather",
        "description": "The weather in a city now.",
        "input_schema": WEATHER["function"]["parameters"],
    }
    greedy = {"temperature": 0}  # the client no longer lists temperature; the API takes it
    first = client.messages.create(
        model=style, max_tokens=60, messages=ASK, tools=[tool], extra_body=greedy, tool_choice={"type": "any"}
    )
    assert first.stop_reason == "tool_use"
    [use] = [b for b in first.content if b.type == "tool_use"]
    assert use.name == "get_weather" and isinstance(use.input, dict) and use.id.startswith("toolu_")

    with client.messages.stream(
        model=style,
        max_tokens=60,
        messages=ASK,
        tools=[tool],
        extra_body=greedy,
        tool_choice={"type": "tool", "name": "get_weather"},
    ) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == [(use.name, use.input)]
    # the streamed blocks are the answer's: no empty text block before a forced call
    assert [b.type for b in final.content] == [b.type for b in first.content] == ["tool_use"]

    history = [
        *ASK,
        {"role": "assistant", "content": [use.model_dump()]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "Sunny"}]},
    ]
    answer = client.messages.create(
        model=style, max_tokens=5, messages=history, tools=[tool], extra_body=greedy, tool_choice={"type": "none"}
    )
    assert answer.stop_reason in ("max_tokens", "end_turn") and answer.content[0].type == "text"
    alone = client.messages.create(model=style, max_tokens=1, messages=ASK, tools=[tool], tool_choice={"type": "none"})

    def prompt(usage):  # the whole prompt: computed, read from the prefix cache, left cached
        return usage.input_tokens + (usage.cache_read_input_tokens or 0) + (usage.cache_creation_input_tokens or 0)

    assert prompt(answer.usage) > prompt(alone.usage) + 5
    counted = client.messages.count_tokens(model=style, messages=history, tools=[tool])
    assert counted.input_tokens > 0


@pytest.mark.parametrize("style", STYLES)
def test_ollama_tool_round_trip(url, style):
    client = ollama.Client(host=url)
    # Ollama's API has no tool_choice: shardline takes OpenAI's as an extension, sent here
    # through the client's own request path so its response type parses the answer.
    first = client._request(
        ollama.ChatResponse,
        "POST",
        "/api/chat",
        json={
            "model": style,
            "messages": ASK,
            "tools": [WEATHER],
            "tool_choice": "required",
            "stream": False,
            "options": {"temperature": 0, "num_predict": 60},
        },
    )
    [call] = first.message.tool_calls
    assert call.function.name == "get_weather" and isinstance(call.function.arguments, dict)
    assert first.done_reason == "stop" and first.message.content == ""

    history = [
        *ASK,
        {"role": "assistant", "content": "", "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_name": "get_weather", "content": "Sunny"},
    ]
    answer = client.chat(model=style, messages=history, tools=[WEATHER], options={"temperature": 0, "num_predict": 5})
    # the tool's answer is prefilled after the first turn's prompt, which the prefix cache
    # held: Ollama's prompt_eval_count counts the tokens computed
    assert answer.done and 0 < answer.prompt_eval_count
    streamed = list(
        client.chat(
            model=style, messages=history, tools=[WEATHER], stream=True, options={"temperature": 0, "num_predict": 5}
        )
    )
    assert "".join(p.message.content or "" for p in streamed) == answer.message.content
    bad = httpx.post(
        f"{url}/api/chat",
        timeout=30,
        json={
            "model": style,
            "tools": [WEATHER],
            "messages": [
                *ASK,
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [{"function": {"name": "get_weather", "arguments": "oops"}}],
                },
            ],
        },
    )
    assert bad.status_code == 400 and "arguments" in bad.json()["error"]


@pytest.mark.parametrize("style", STYLES)
def test_responses_tool_round_trip(url, style):
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    tool = {"type": "function", **WEATHER["function"]}
    first = client.responses.create(
        model=style,
        input="What is the weather in Paris?",
        tools=[tool],
        tool_choice="required",
        temperature=0,
        max_output_tokens=60,
    )
    [call] = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and isinstance(json.loads(call.arguments), dict)
    assert not [item for item in first.output if item.type == "message" and item.content[0].text]
    answer = client.responses.create(
        model=style,
        previous_response_id=first.id,
        tools=[tool],
        tool_choice="none",
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny"}],
        temperature=0,
        max_output_tokens=5,
    )
    assert answer.status in ("completed", "incomplete") and answer.output[0].type == "message"
    alone = client.responses.create(
        model=style,
        input="What is the weather in Paris?",
        tools=[tool],
        tool_choice="none",
        max_output_tokens=1,
        store=False,
    )
    assert answer.usage.input_tokens > alone.usage.input_tokens + 10  # the call and its output are in the prompt


def test_a_call_in_the_output_never_reaches_the_content(url):
    """tool_choice auto on noise: whatever the text, no call markup in the content."""
    body = httpx.post(
        f"{url}/v1/chat/completions",
        timeout=60,
        json={"model": "qwen", "messages": ASK, "tools": [WEATHER], "max_tokens": 20, "temperature": 0},
    ).json()
    message = body["choices"][0]["message"]
    assert "<tool_call>" not in (message["content"] or "")


def test_forced_calls_are_calls_where_the_markers_are_special_tokens(url):
    """tool_choice required / any and named, on OpenAI chat, Anthropic messages and
    Responses: the grammar forces the <tool_call> token and the text keeps it for the
    parser, so each answer is one call whose arguments match the schema."""
    schema = WEATHER["function"]["parameters"]
    chat = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        answer = chat.chat.completions.create(
            model=MARKED, messages=ASK, tools=[WEATHER, TIME], tool_choice=choice, temperature=0, max_tokens=60
        ).choices[0]
        assert answer.finish_reason == "tool_calls" and answer.message.content is None, answer
        [call] = answer.message.tool_calls
        assert call.function.name in ("get_weather", "get_time")
        called = json.loads(call.function.arguments)
        assert matches_schema(called, schema if call.function.name == "get_weather" else TIME["function"]["parameters"])
    streamed = chat.chat.completions.create(
        model=MARKED, messages=ASK, tools=[WEATHER], tool_choice="required", stream=True, temperature=0, max_tokens=60
    )
    deltas = [c.delta for chunk in streamed for c in chunk.choices]
    assert not "".join(d.content or "" for d in deltas) and [
        c.function.name for d in deltas for c in d.tool_calls or []
    ] == ["get_weather"]

    messages = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
    tool = {"name": "get_weather", "description": "The weather in a city now.", "input_schema": schema}
    for choice in ({"type": "any"}, {"type": "tool", "name": "get_weather"}):
        reply = messages.messages.create(
            model=MARKED, max_tokens=60, messages=ASK, tools=[tool], tool_choice=choice, extra_body={"temperature": 0}
        )
        assert reply.stop_reason == "tool_use" and [b.type for b in reply.content] == ["tool_use"], reply
        assert reply.content[0].name == "get_weather" and matches_schema(reply.content[0].input, schema)

    function = {"type": "function", **WEATHER["function"]}
    for choice in ("required", {"type": "function", "name": "get_weather"}):
        response = chat.responses.create(
            model=MARKED,
            input="What is the weather in Paris?",
            tools=[function],
            tool_choice=choice,
            temperature=0,
            max_output_tokens=60,
        )
        [item] = response.output
        assert item.type == "function_call" and item.name == "get_weather", response.output
        assert matches_schema(json.loads(item.arguments), schema)


def test_a_call_the_model_chooses_and_its_result_on_each_api(url):
    """tool_choice auto (each API's default), streamed, at temperature 1: the scripted
    model's call, opened by the ``<tool_call>`` token, is a call with its arguments as
    written; the history with the tool's result gets the text answer, ending the turn."""
    chat = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    deltas = [
        c
        for chunk in chat.chat.completions.create(
            model=SCRIPTED, messages=ASK, tools=[WEATHER, TIME], stream=True, temperature=1
        )
        for c in chunk.choices
    ]
    calls = [call for c in deltas for call in c.delta.tool_calls or []]
    assert not "".join(c.delta.content or "" for c in deltas) and deltas[-1].finish_reason == "tool_calls"
    [call] = calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == SCRIPTED_CALL
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": call.function.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny"},
    ]
    deltas = [
        c
        for chunk in chat.chat.completions.create(
            model=SCRIPTED, messages=history, tools=[WEATHER, TIME], stream=True, temperature=1
        )
        for c in chunk.choices
    ]
    assert "".join(c.delta.content or "" for c in deltas) == "Done." and deltas[-1].finish_reason == "stop"

    messages = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
    tool = {
        "name": "get_weather",
        "description": "The weather in a city now.",
        "input_schema": WEATHER["function"]["parameters"],
    }
    with messages.messages.stream(model=SCRIPTED, max_tokens=200, messages=ASK, tools=[tool]) as stream:
        first = stream.get_final_message()
    assert first.stop_reason == "tool_use" and [b.type for b in first.content] == ["tool_use"], first
    use = first.content[0]
    assert use.name == "get_weather" and use.input == SCRIPTED_CALL
    history = [
        *ASK,
        {"role": "assistant", "content": [use.model_dump()]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "Sunny"}]},
    ]
    with messages.messages.stream(model=SCRIPTED, max_tokens=200, messages=history, tools=[tool]) as stream:
        answer = stream.get_final_message()
    assert answer.stop_reason == "end_turn" and [(b.type, b.text) for b in answer.content] == [("text", "Done.")]

    function = {"type": "function", **WEATHER["function"]}
    with chat.responses.stream(model=SCRIPTED, input="What is the weather in Paris?", tools=[function]) as stream:
        response = stream.get_final_response()
    [item] = response.output
    assert item.type == "function_call" and item.name == "get_weather", response.output
    assert json.loads(item.arguments) == SCRIPTED_CALL
    with chat.responses.stream(
        model=SCRIPTED,
        previous_response_id=response.id,
        tools=[function],
        input=[{"type": "function_call_output", "call_id": item.call_id, "output": "Sunny"}],
    ) as stream:
        answer = stream.get_final_response()
    assert answer.status == "completed" and answer.output_text == "Done."

    client = ollama.Client(host=url)
    parts = list(client.chat(model=SCRIPTED, messages=ASK, tools=[WEATHER], stream=True))
    [called] = [c for p in parts for c in p.message.tool_calls or []]
    assert called.function.name == "get_weather" and called.function.arguments == SCRIPTED_CALL
    assert not "".join(p.message.content or "" for p in parts)
    history = [
        *ASK,
        {"role": "assistant", "content": "", "tool_calls": [called.model_dump()]},
        {"role": "tool", "tool_name": "get_weather", "content": "Sunny"},
    ]
    parts = list(client.chat(model=SCRIPTED, messages=history, tools=[WEATHER], stream=True))
    assert "".join(p.message.content or "" for p in parts) == "Done." and parts[-1].done_reason == "stop"
