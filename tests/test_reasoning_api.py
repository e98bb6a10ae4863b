"""A reasoning model's thinking through each API, in process: the requests' thinking
switches, :class:`~shardline.api.text_stream.Generation` on scripted token streams (a fake
node and tokenizer), and each API's answer and stream checked against the official
``openai``, ``anthropic`` and ``ollama`` packages' types."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import anthropic.types as at
import ollama
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from shardline.api import anthropic as anthropic_api
from shardline.api import ollama as ollama_api
from shardline.api import openai as openai_api
from shardline.api.anthropic_request import MessagesRequest
from shardline.api.keep_alive import KeepAlive
from shardline.api.responses_output import OutputBuilder, Piece, usage_object
from shardline.api.responses_request import check_fields, to_generation
from shardline.api.text_stream import Chunk, Generation, GenerationRequest
from shardline.api.tools import ToolCall, ToolChoice, ToolChoiceMode
from shardline.runner.protocol import SamplingParams, TokenEvent

pytestmark = pytest.mark.fast

THINK_TEMPLATE = "{{ '<|im_start|>assistant\\n<think>\\n' }}"  # a reasoning model's (it writes <think>)
PLAIN_TEMPLATE = "{{ '<|im_start|>assistant\\n' }}"
VOCAB = [
    "<|im_end|>",
    "<|im_start|>",
    "assistant\n",
    "<think>",
    "</think>",
    "\n",
    "Let",
    " me",
    " see",
    ".",
    "\n\n",
    "Paris",
    "<tool_call>",
    '\n{"name": "f", "arguments": {}}\n',
    "</tool_call>",
    "</",
    "think>",
]
ID = {piece: i for i, piece in enumerate(VOCAB)}
END = ID["<|im_end|>"]


class FakeTokenizer:
    """A tokenizer whose tokens are :data:`VOCAB`'s pieces (``<|im_end|>`` and
    ``<|im_start|>`` special; ``<think>`` and ``</think>`` added tokens, not special, as
    Qwen3's)."""

    eos_token_ids = [END]
    vocab_size = len(VOCAB)
    supports_tools = False

    def __init__(self, template: str) -> None:
        self.chat_template = template
        self.reasons = "<think>" in template

    def decode(self, ids, skip_special_tokens=True, keep=()):
        return "".join(VOCAB[i] for i in ids if not (skip_special_tokens and i <= 1 and i not in keep))

    def added_token_id(self, text):
        return ID[text] if text in ("<think>", "</think>", "<|im_end|>", "<|im_start|>") else None

    def piece(self, token_id):
        return VOCAB[token_id]


class FakeRouter:
    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens

    async def generate(self, request, task_id, ran_on, on):
        for i, token in enumerate(self.tokens):
            yield TokenEvent(0, token, "stop" if token == END else ("length" if i == len(self.tokens) - 1 else None))


def ids(*pieces: str) -> list[int]:
    return [ID[p] for p in pieces]


def generation(
    output: list[str],
    *,
    opened: bool = False,
    template: str = THINK_TEMPLATE,
    chat: bool = True,
    tools: bool = False,
    grammar: str | None = None,
) -> Generation:
    """A generation whose output is ``output``'s tokens; its prompt ends with ``<think>``
    where ``opened``."""
    prompt = ids("<|im_start|>", "assistant\n", *(["<think>", "\n"] if opened else []))
    req = GenerationRequest(
        model="m",
        prompt=[{"role": "user", "content": "hi"}] if chat else prompt,
        sampling=SamplingParams(1.0, 1.0, 0, None, grammar=grammar),
    )
    if tools:
        req.tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
        req.tool_choice = ToolChoice(ToolChoiceMode.AUTO)
    node = SimpleNamespace(router=FakeRouter(ids(*output)))
    inst = SimpleNamespace(
        context=100, instance_id="i" * 12, sharding="pipeline", ranks=(0,), dtype="float32", quantize=None
    )
    return Generation(node, req, prompt, inst, FakeTokenizer(template))  # type: ignore[arg-type]


def run(gen: Generation) -> list[Chunk]:
    async def collect():
        return [c async for c in gen.texts() if isinstance(c, Chunk)]

    return asyncio.run(collect())


QWEN3_OUTPUT = ["<think>", "\n", "Let", " me", " see", ".", "\n", "</think>", "\n\n", "Paris", ".", "<|im_end|>"]


def test_generation_splits_a_streamed_output():
    gen = generation(QWEN3_OUTPUT)
    chunks = run(gen)
    assert "".join(c.reasoning for c in chunks) == "Let me see."
    assert "".join(c.text for c in chunks) == "Paris."
    assert [c.reasoning for c in chunks if c.reasoning][:2] == ["Let", " me"]  # streamed as it comes
    assert chunks[-1].finish == "stop"
    assert gen.completion_tokens == 12 and gen.reasoning_tokens == 8  # <think> ... </think>


def test_a_prompt_that_opened_thinking_and_a_split_marker():
    gen = generation(["Let", " me", "</", "think>", "\n\n", "Paris", "<|im_end|>"], opened=True)
    chunks = run(gen)
    assert ("".join(c.reasoning for c in chunks), "".join(c.text for c in chunks)) == ("Let me", "Paris")
    assert gen.reasoning_tokens == 4


def test_an_output_cut_off_while_thinking_is_all_reasoning():
    chunks = run(generation(["Let", " me", " see"], opened=True))
    assert ("".join(c.reasoning for c in chunks), "".join(c.text for c in chunks)) == ("Let me see", "")
    assert chunks[-1].finish == "length"


def test_tool_calls_are_parsed_from_the_answer_only():
    chunks = run(
        generation(
            [
                "<think>",
                "<tool_call>",
                "</think>",
                "<tool_call>",
                '\n{"name": "f", "arguments": {}}\n',
                "</tool_call>",
                "<|im_end|>",
            ],
            tools=True,
        )
    )
    assert "".join(c.reasoning for c in chunks) == "<tool_call>"
    assert [call.name for c in chunks for call in c.tool_calls] == ["f"]
    assert "".join(c.text for c in chunks) == "" and chunks[-1].finish == "tool_calls"


@pytest.mark.parametrize("kind", ["plain template", "text prompt", "grammar"])
def test_outputs_that_are_not_split(kind):
    """A model that does not reason, a text prompt (Completions, Ollama raw), and a
    constrained output where the prompt opened thinking: the output is all text."""
    gen = generation(
        ["Let", "</think>", "Paris", "<|im_end|>"],
        opened=kind == "grammar",
        template=PLAIN_TEMPLATE if kind == "plain template" else THINK_TEMPLATE,
        chat=kind != "text prompt",
        grammar="start: /.*/" if kind == "grammar" else None,
    )
    chunks = run(gen)
    assert "".join(c.text for c in chunks) == "Let</think>Paris"
    assert all(not c.reasoning for c in chunks) and gen.reasoning_tokens == 0


# -- the requests' switches --------------------------------------------------------------


@pytest.mark.parametrize(
    "body, thinking",
    [
        ({}, True),
        ({"reasoning_effort": "low"}, True),
        ({"reasoning_effort": "none"}, False),
        ({"chat_template_kwargs": {"enable_thinking": False}}, False),
        ({"reasoning_effort": "none", "chat_template_kwargs": {"enable_thinking": True}}, True),
    ],
)
def test_chat_completions_thinking(body, thinking):
    req = openai_api.ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], **body)
    assert req.to_generation().thinking is thinking


def test_chat_template_kwargs_take_enable_thinking_only():
    with pytest.raises(ValueError, match="extra"):
        openai_api.ChatCompletionRequest(
            model="m",
            messages=[{"role": "user", "content": "hi"}],
            chat_template_kwargs={"tools_in_user_message": True},
        )


@pytest.mark.parametrize(
    "thinking, on",
    [
        (None, False),
        ({"type": "disabled"}, False),
        ({"type": "enabled", "budget_tokens": 2048}, True),
        ({"type": "adaptive"}, True),
        ({"type": "adaptive", "display": "omitted"}, True),
    ],
)
def test_anthropic_thinking(thinking, on):
    body = {"model": "m", "max_tokens": 4096, "messages": [{"role": "user", "content": "hi"}]}
    req = MessagesRequest(**body, **({"thinking": thinking} if thinking else {}))
    assert req.to_generation().thinking is on


@pytest.mark.parametrize("reasoning, on", [(None, True), ({"effort": "high"}, True), ({"effort": "none"}, False)])
def test_responses_thinking(reasoning, on):
    req = check_fields({"model": "m", "input": "hi", **({"reasoning": reasoning} if reasoning else {})})
    assert (
        to_generation(
            req, [], [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}]
        ).thinking
        is on
    )


@pytest.mark.parametrize("think", [None, True, False])
def test_ollama_think(think):
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        **({} if think is None else {"think": think}),
    }
    assert ollama_api.ChatRequest(**body).to_generation().thinking is think
    body = {"model": "m", "prompt": "hi", **({} if think is None else {"think": think})}
    assert ollama_api.GenerateRequest(**body).to_generation().thinking is think


# -- each API's answer and stream --------------------------------------------------------


def sse_data(lines: list[str]) -> list[dict]:
    return [
        json.loads(line.split("data: ", 1)[1])
        for text in lines
        for line in text.split("\n")
        if line.startswith("data: ") and line != "data: [DONE]"
    ]


async def drain(stream) -> list[str]:
    return [item async for item in stream]


def test_chat_completions_reasoning_content():
    req = openai_api.ChatCompletionRequest(
        model="m", messages=[{"role": "user", "content": "hi"}], stream=True, stream_options={"include_usage": True}
    )
    gen = generation(QWEN3_OUTPUT)
    shape = openai_api.ChatShape(req, [gen], "chatcmpl-1", 0)
    chunks = sse_data(asyncio.run(drain(openai_api._stream([gen], shape, False, req.stream_options, 60))))
    parsed = [ChatCompletionChunk.model_validate(c) for c in chunks]
    deltas = [c.choices[0].delta for c in parsed if c.choices]
    assert "".join((d.model_extra or {}).get("reasoning_content", "") for d in deltas) == "Let me see."
    assert "".join(d.content or "" for d in deltas) == "Paris."
    usage = parsed[-1].usage
    assert usage is not None and usage.completion_tokens_details is not None
    assert usage.completion_tokens_details.reasoning_tokens == 8

    whole = generation(QWEN3_OUTPUT)
    shape = openai_api.ChatShape(req, [whole], "chatcmpl-2", 0)
    answer = ChatCompletion.model_validate(shape.whole([shape.choice(0, run(whole), "stop")]))
    message = answer.choices[0].message
    assert message.content == "Paris." and (message.model_extra or {})["reasoning_content"] == "Let me see."
    assert answer.usage is not None and answer.usage.completion_tokens_details is not None
    assert answer.usage.completion_tokens_details.reasoning_tokens == 8


def test_chat_completions_of_a_model_that_does_not_reason_are_unchanged():
    req = openai_api.ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}])
    gen = generation(["Paris", "<|im_end|>"], template=PLAIN_TEMPLATE)
    shape = openai_api.ChatShape(req, [gen], "chatcmpl-3", 0)
    answer = shape.whole([shape.choice(0, run(gen), "stop")])
    assert answer["choices"][0]["message"] == {"role": "assistant", "content": "Paris"}
    assert "completion_tokens_details" not in answer["usage"]


def anthropic_request(thinking: dict | None, stream: bool = True) -> MessagesRequest:
    return MessagesRequest(
        model="m",
        max_tokens=4096,
        stream=stream,
        messages=[{"role": "user", "content": "hi"}],
        **({"thinking": thinking} if thinking else {}),
    )


STREAM_EVENT = TypeAdapter(at.RawMessageStreamEvent)


def anthropic_stream(req: MessagesRequest, output: list[str], **kwargs) -> list[dict]:
    events = sse_data(asyncio.run(drain(anthropic_api._stream(generation(output, **kwargs), req, "msg_1", [], 60))))
    events = [e for e in events if e["type"] != "ping"]  # no type of the SDK's: clients skip it
    for event in events:
        STREAM_EVENT.validate_python(event)
    return events


def blocks_of(events: list[dict]) -> list[dict]:
    """The content blocks a stream's events build (as the SDK's accumulator does)."""
    blocks: list[dict] = []
    for event in events:
        if event["type"] == "content_block_start":
            assert event["index"] == len(blocks)
            blocks.append(dict(event["content_block"]))
        elif event["type"] == "content_block_delta":
            block, delta = blocks[event["index"]], event["delta"]
            key = {
                "thinking_delta": "thinking",
                "text_delta": "text",
                "signature_delta": "signature",
                "input_json_delta": "partial_json",
            }[delta["type"]]
            block[key] = block.get(key, "") + delta[key]
    return blocks


@pytest.mark.parametrize(
    "thinking, shown",
    [
        ({"type": "enabled", "budget_tokens": 1024}, "Let me see."),
        ({"type": "adaptive", "display": "omitted"}, ""),
        ({"type": "disabled"}, None),
        (None, None),
    ],
)
def test_anthropic_thinking_blocks(thinking, shown):
    req = anthropic_request(thinking)
    events = anthropic_stream(req, QWEN3_OUTPUT)
    blocks = blocks_of(events)
    expected = ([{"type": "thinking", "thinking": shown, "signature": ""}] if shown is not None else []) + [
        {"type": "text", "text": "Paris."}
    ]
    assert blocks == expected
    if shown is not None:  # the thinking block's signature comes just before its stop
        stop = next(i for i, e in enumerate(events) if e["type"] == "content_block_stop")
        assert events[stop - 1]["delta"]["type"] == "signature_delta"
    whole = anthropic_api.answer_blocks(req, run(generation(QWEN3_OUTPUT)))
    assert whole == expected
    at.Message.model_validate(
        {
            "id": "msg_1",
            "type": "message",
            "role": "assistant",
            "model": "m",
            "content": whole,
            "stop_reason": "end_turn",
            "stop_sequence": None,
            "usage": {"input_tokens": 3, "output_tokens": 12},
        }
    )


def test_anthropic_thinking_then_a_call_and_thinking_cut_off():
    req = anthropic_request({"type": "adaptive"})
    call = [
        "<think>",
        "Let",
        "</think>",
        "<tool_call>",
        '\n{"name": "f", "arguments": {}}\n',
        "</tool_call>",
        "<|im_end|>",
    ]
    blocks = blocks_of(anthropic_stream(req, call, tools=True))
    assert [b["type"] for b in blocks] == ["thinking", "tool_use"]
    blocks = blocks_of(anthropic_stream(req, ["Let", " me"], opened=True))
    assert blocks == [{"type": "thinking", "thinking": "Let me", "signature": ""}, {"type": "text", "text": ""}]


EVENT = TypeAdapter(ResponseStreamEvent)


def test_responses_reasoning_item():
    req = check_fields({"model": "m", "input": "hi", "stream": True})
    builder = OutputBuilder(req, "resp_1", 0)
    events = builder.start()
    for piece in (
        Piece(reasoning="Let"),
        Piece(reasoning=" me"),
        Piece(text="Paris"),
        Piece(tool_calls=(ToolCall("call_1", "f", "{}"),)),
    ):
        events += builder.feed(piece)
    events += builder.finish("tool_calls", usage_object(3, 12, 8))
    for event in events:
        EVENT.validate_python(event)
    assert [e["type"] for e in events[2:8]] == [
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
    ]
    response = Response.model_validate(builder.response)
    assert [item.type for item in response.output] == ["reasoning", "message", "function_call"]
    reasoning = response.output[0]
    assert reasoning.type == "reasoning" and reasoning.id.startswith("rs_") and reasoning.summary == []
    assert reasoning.content is not None and reasoning.content[0].text == "Let me"
    assert response.usage is not None and response.usage.output_tokens_details.reasoning_tokens == 8


@pytest.mark.parametrize("effort", [None, "none", "minimal", "low", "medium", "high", "xhigh", "max"])
def test_each_api_passes_the_effort_asked(effort):
    """OpenAI's levels, as asked, on Chat Completions and Responses (the template's level
    is :func:`~shardline.models.tokenizer.reasoning_level`'s); Ollama's think levels."""
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    chat = openai_api.ChatCompletionRequest(**body, **({"reasoning_effort": effort} if effort else {}))
    assert chat.to_generation().effort == effort
    req = check_fields({"model": "m", "input": "hi", **({"reasoning": {"effort": effort}} if effort else {})})
    assert (
        to_generation(
            req, [], [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}]
        ).effort
        == effort
    )
    anthropic = MessagesRequest(
        **body,
        max_tokens=64,
        **({"output_config": {"effort": effort}} if effort in ("low", "medium", "high", "xhigh", "max") else {}),
    )
    assert anthropic.to_generation().effort == (effort if effort in ("low", "medium", "high", "xhigh", "max") else None)
    if effort in (None, "low", "medium", "high", "max"):
        generation = ollama_api.ChatRequest(**body, **({"think": effort} if effort else {})).to_generation()
        assert (generation.thinking, generation.effort) == (True if effort else None, effort)


@pytest.mark.parametrize(
    "effort, level",
    [
        (None, None),
        ("none", "low"),
        ("minimal", "low"),
        ("low", "low"),
        ("medium", "medium"),
        ("high", "high"),
        ("xhigh", "high"),
        ("max", "high"),
    ],
)
def test_an_effort_is_given_to_the_template_as_one_of_gpt_oss_levels(effort, level):
    from shardline.models.tokenizer import reasoning_level

    assert reasoning_level(effort) == level


@pytest.mark.parametrize("think", ["banana", "true", 1])
def test_ollama_refuses_a_think_value_it_does_not_have_in_its_words(think):
    """Ollama's own message: clients read "invalid think value" to retry with true."""
    from shardline.api.request_body import parse_raw
    from shardline.api.text_stream import APIError

    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "think": think}
    with pytest.raises(APIError) as caught:
        parse_raw(json.dumps(body).encode(), ollama_api.ChatRequest)
    assert caught.value.status == 400 and caught.value.param == "think"
    assert caught.value.message == (
        f'invalid think value: {json.dumps(think)} (must be "high", "medium", "low", "max", true, or false)'
    )


def test_responses_reasoning_alone_gets_an_empty_message():
    builder = OutputBuilder(check_fields({"model": "m", "input": "hi"}), "resp_2", 0)
    builder.feed(Piece(reasoning="Let me"))
    builder.finish("length", usage_object(3, 2, 2))
    response = Response.model_validate(builder.response)
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert response.status == "incomplete"


@pytest.mark.parametrize("think", [None, True, False])
def test_ollama_thinking(think):
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        **({} if think is None else {"think": think}),
    }
    req = ollama_api.ChatRequest(**body)
    lines = asyncio.run(
        drain(
            ollama_api._stream(
                None, generation(QWEN3_OUTPUT), req, ollama_api._chat_message, KeepAlive(), [], None, 0.0, 60
            )
        )
    )
    parts = [ollama.ChatResponse.model_validate(json.loads(line)) for line in lines]
    assert "".join(p.message.content or "" for p in parts) == "Paris."
    assert "".join(p.message.thinking or "" for p in parts) == ("" if think is False else "Let me see.")
    req = ollama_api.GenerateRequest(model="m", prompt="hi", **({} if think is None else {"think": think}))
    lines = asyncio.run(
        drain(
            ollama_api._stream(
                None, generation(QWEN3_OUTPUT), req, ollama_api._generated, KeepAlive(), [], None, 0.0, 60
            )
        )
    )
    parts = [ollama.GenerateResponse.model_validate(json.loads(line)) for line in lines]
    assert "".join(p.response for p in parts) == "Paris."
    assert "".join(p.thinking or "" for p in parts) == ("" if think is False else "Let me see.")


def test_ollama_capabilities_name_thinking():
    assert ollama_api.capabilities(THINK_TEMPLATE) == ["completion", "thinking"]
    assert ollama_api.capabilities(PLAIN_TEMPLATE) == ["completion"]
