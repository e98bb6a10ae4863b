"""The Responses API's pure parts: request checks and mapping, the output and its events
(checked against the official ``openai`` package's types), and the bounded store."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from shardline.api.logprobs import TokenLogprob, TopLogprob
from shardline.api.response_store import ResponseStore, StoredResponse
from shardline.api.responses_output import OutputBuilder, Piece, usage_object
from shardline.api.responses_request import (
    ToolSet,
    chat_messages,
    check_fields,
    normalize_input,
    parse_tools,
    sampling,
    text_format,
    to_generation,
)
from shardline.api.text_stream import APIError

pytestmark = pytest.mark.fast

BASE = {"model": "m", "input": "hi"}


def refused(call, *args) -> APIError:
    with pytest.raises(APIError) as info:
        call(*args)
    assert info.value.status in (400, 404)
    return info.value


@pytest.mark.parametrize(
    "extra, param, code",
    [
        ({"foo": 1}, "foo", "unknown_parameter"),
        ({"messages": []}, "messages", "unknown_parameter"),
        ({"conversation": "conv_1"}, "conversation", "unsupported_parameter"),
        ({"prompt": {"id": "p"}}, "prompt", "unsupported_parameter"),
        ({"moderation": {"model": "x"}}, "moderation", "unsupported_parameter"),
        ({"prompt_cache_retention": "24h"}, "prompt_cache_retention", "unsupported_parameter"),
        ({"truncation": "auto"}, "truncation", "unsupported_parameter"),
        ({"truncation": "sometimes"}, "truncation", None),
        ({"reasoning": {"effort": "huge"}}, "reasoning.effort", "invalid_value"),
        ({"reasoning": {"budget": 1}}, "reasoning.budget", "unknown_parameter"),
        ({"background": True}, "background", "unsupported_parameter"),
        ({"service_tier": "flex"}, "service_tier", "unsupported_parameter"),
        ({"include": ["nonsense"]}, "include[0]", "invalid_value"),
        ({"stream_options": {"include_obfuscation": False}}, "stream_options", None),
        ({"stream": True, "stream_options": {"x": 1}}, "stream_options.x", "unknown_parameter"),
        ({"temperature": 2.5}, "temperature", None),
        ({"top_p": 1.5}, "top_p", None),
        ({"top_logprobs": 21}, "top_logprobs", None),
        ({"top_logprobs": 3}, "top_logprobs", None),  # without include's logprobs it would do nothing
        ({"max_output_tokens": 0}, "max_output_tokens", None),
        ({"metadata": {"k": "v" * 513}}, "metadata", None),
        ({"text": {"format": {"type": "grammar"}}}, "text.format.type", None),
        ({"text": {"verbosity": "loud"}}, "text.verbosity", None),
        ({"input": []}, "input", None),
    ],
)
def test_fields_refused_name_the_parameter(extra, param, code):
    error = refused(check_fields, dict(BASE, **extra))
    assert error.status == 400 and error.param == param and error.code == code
    assert param.split(".")[0].split("[")[0] in error.message


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"temperature": None, "top_p": None, "instructions": None, "max_output_tokens": None},
        {"top_p": 0},
        {"conversation": None, "prompt": None, "context_management": []},
        {"reasoning": None},
        {"reasoning": {"effort": None}},
        {"truncation": "disabled"},
        {"service_tier": "auto"},
        {"include": ["message.output_text.logprobs"], "top_logprobs": 3},
        {"store": False, "user": "u"},
        {"stream": True, "stream_options": {"include_obfuscation": False}},
        {"metadata": {"k": "v"}},
        {
            "text": {
                "format": {
                    "type": "json_schema",
                    "name": "x",
                    "strict": True,
                    "schema": {"type": "object", "properties": {}, "additionalProperties": False},
                }
            }
        },
    ],
)
def test_fields_accepted(extra):
    assert check_fields(dict(BASE, **extra)).model == "m"


def test_a_string_input_is_one_user_message():
    assert normalize_input("hi", "m") == [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}
    ]


def test_input_items_are_normalized():
    items = normalize_input(
        [
            {"role": "developer", "content": "be brief"},
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}],
            },
            {
                "id": "msg_1",
                "type": "message",
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": "c", "annotations": []}],
            },
            {
                "type": "function_call",
                "call_id": "c1",
                "name": "f",
                "arguments": "{}",
                "id": "fc_1",
                "status": "completed",
            },
            {"type": "function_call_output", "call_id": "c1", "output": "42"},
        ],
        "m",
    )
    assert [i.get("role", i["type"]) for i in items] == [
        "developer",
        "user",
        "assistant",
        "function_call",
        "function_call_output",
    ]
    assert items[1]["content"] == [{"type": "input_text", "text": "ab"}]
    assert items[3] == {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}


@pytest.mark.parametrize(
    "item, param, words",
    [
        (
            {"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]},
            "input[0].content[0].type",
            "model m takes text only",
        ),
        (
            {"role": "user", "content": [{"type": "input_file", "file_id": "f"}]},
            "input[0].content[0].type",
            "text only",
        ),
        ({"role": "user", "content": []}, "input[0].content", "non-empty"),
        ({"role": "tool", "content": "x"}, "input[0].role", "expected"),
        ({"role": "user", "content": "x", "name": "bob"}, "input[0].name", "Unknown parameter"),
        ({"type": "reasoning", "summary": [], "thoughts": "x"}, "input[0].thoughts", "Unknown parameter"),
        ({"type": "local_shell_call", "id": "lsc_1"}, "input[0].type", "not supported"),
        ({"type": "item_reference", "id": "msg_1"}, "input[0].type", "not supported"),
        ({"type": "function_call", "call_id": "c", "name": "", "arguments": "{}"}, "input[0].name", "string"),
        ({"type": "function_call_output", "output": "x"}, "input[0].call_id", "string"),
    ],
)
def test_bad_input_items_are_named(item, param, words):
    error = refused(normalize_input, [item], "m")
    assert error.param == param and words in error.message


def test_chat_messages_in_chat_template_format():
    items = normalize_input(
        [
            {"role": "developer", "content": "dev"},
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": "Let me look."},
            {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": '{"city": "Paris"}'},
            {"type": "function_call", "call_id": "c2", "name": "time", "arguments": ""},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        ],
        "m",
    )
    assert chat_messages("sys", items) == [
        {"role": "system", "content": "sys"},
        {"role": "system", "content": "dev"},
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": "Let me look.",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}},
                {"id": "c2", "type": "function", "function": {"name": "time", "arguments": {}}},
            ],
        },
        {"role": "tool", "content": "sunny", "tool_call_id": "c1", "name": "weather"},
    ]


@pytest.mark.parametrize(
    "items, first_new, param",
    [
        ([{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}], 0, "input[0].arguments"),
        ([{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}], 0, "input[0].arguments"),
        (
            [
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "x"}]},
                {"type": "function_call_output", "call_id": "c", "output": "x"},
            ],
            1,
            "input[0].call_id",
        ),
        (
            [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "1"}],
            1,
            "previous_response_id.arguments",
        ),
    ],
)
def test_malformed_calls_in_the_history_are_named(items, first_new, param):
    assert refused(chat_messages, None, items, first_new).param == param


def test_function_tools_map_to_chat_template_tools():
    offered = parse_tools(
        [
            {"type": "function", "name": "f", "description": "d", "parameters": {"type": "object"}, "strict": True},
            {"type": "function", "name": "g", "parameters": None, "strict": None},
        ],
        {"type": "function", "name": "g"},
    )
    tools, mode, name = offered.tools, offered.mode, offered.name
    assert tools == [
        {
            "type": "function",
            "function": {"name": "f", "description": "d", "parameters": {"type": "object"}, "strict": True},
        },
        {
            "type": "function",
            "function": {"name": "g", "description": "", "parameters": {"type": "object", "properties": {}}},
        },
    ]
    assert (mode, name) == ("named", "g")
    allowed = parse_tools(
        [{"type": "function", "name": n, "parameters": None} for n in "abc"],
        {"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "b"}]},
    )
    assert [t["function"]["name"] for t in allowed.tools] == ["b"] and allowed.mode == "required"
    assert parse_tools(None, None) == ToolSet() and parse_tools([], "none").mode == "none"


def test_codex_tools_are_offered_as_the_model_can_call_them():
    """Codex's default tools: functions, a namespace's functions (calls name it), a custom
    (freeform) tool as a function of one string; hosted and deferred tools are not offered
    and are named."""
    offered = parse_tools(
        [
            {"type": "function", "name": "exec_command", "parameters": {"type": "object"}, "strict": False},
            {
                "type": "namespace",
                "name": "multi_agent_v1",
                "description": "agents",
                "tools": [{"type": "function", "name": "spawn_agent", "parameters": {"type": "object"}}],
            },
            {
                "type": "custom",
                "name": "apply_patch",
                "description": "patch files",
                "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"},
            },
            {"type": "web_search", "external_web_access": False},
            {"type": "function", "name": "later", "defer_loading": True},
            {"type": "tool_search", "execution": "client"},
        ],
        "auto",
    )
    assert [t["function"]["name"] for t in offered.tools] == ["exec_command", "spawn_agent", "apply_patch"]
    assert offered.namespaces == {"spawn_agent": "multi_agent_v1"} and offered.custom == {"apply_patch"}
    patch = offered.tools[2]["function"]
    assert patch["parameters"]["required"] == ["input"] and "start: /.+/" in patch["description"]
    assert offered.not_offered == ("web_search", "function:later", "tool_search")


def test_codex_fields_are_taken():
    """What Codex sends on every request validates and asks for nothing a model without
    reasoning must do."""
    req = check_fields(
        {
            "model": "m",
            "input": "hi",
            "reasoning": {"summary": "auto", "effort": "medium"},
            "include": ["reasoning.encrypted_content"],
            "client_metadata": {"turn_id": "t"},
            "text": {"verbosity": "low"},
            "store": False,
            "prompt_cache_key": "k",
        }
    )
    generation = to_generation(req, [], normalize_input(req.input, "m"))
    assert generation.sampling.logprobs is None and generation.sampling.grammar is None


def test_codex_history_items_render():
    """A namespaced call, a custom tool's call and output, and a reasoning item (dropped)."""
    items = normalize_input(
        [
            {"type": "message", "role": "user", "content": "go"},
            {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "xyz"},
            {
                "type": "function_call",
                "call_id": "c1",
                "name": "spawn_agent",
                "arguments": "{}",
                "namespace": "multi_agent_v1",
            },
            {"type": "function_call_output", "call_id": "c1", "output": "spawned"},
            {"type": "custom_tool_call", "call_id": "c2", "name": "apply_patch", "input": "*** Begin Patch"},
            {"type": "custom_tool_call_output", "call_id": "c2", "output": "done"},
        ],
        "m",
    )
    messages = chat_messages(None, items)
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant", "tool"]
    assert messages[3]["tool_calls"][0]["function"] == {
        "name": "apply_patch",
        "arguments": {"input": "*** Begin Patch"},
    }


@pytest.mark.parametrize(
    "tools, choice, param",
    [
        ([{"type": "weather_station"}], None, "tools[0].type"),
        ([{"type": "namespace", "name": "n", "tools": [{"type": "web_search"}]}], None, "tools[0].tools[0].type"),
        ([{"type": "custom", "name": "c", "format": {"type": "grammar"}}], None, "tools[0].format"),
        *(
            (
                [{"type": "custom", "name": "c", "format": {"type": "grammar", "syntax": syntax, "definition": bad}}],
                None,
                "tools[0].format.definition",
            )  # grammars that do not compile (found by a trial)
            for syntax, bad in (("lark", "start: ((("), ("lark", "start: foo"), ("lark", ""), ("regex", "[a-"))
        ),
        (["f"], None, "tools[0].type"),
        ([{"type": "function", "name": ""}], None, "tools[0].name"),
        ([{"type": "function", "name": "f", "parameters": "x"}], None, "tools[0].parameters"),
        ([{"type": "function", "name": "f", "async": True}], None, "tools[0].async"),
        ([{"type": "function", "name": "f", "color": 1}], None, "tools[0].color"),
        ([], {"type": "mcp", "server_label": "x"}, "tool_choice"),
        ([], "sometimes", "tool_choice"),
    ],
)
def test_bad_tools_are_named(tools, choice, param):
    assert refused(parse_tools, tools, choice).param == param


@pytest.mark.parametrize(
    "text, expected",
    [
        (None, ("text", None)),
        ({"format": {"type": "text"}}, ("text", None)),
        ({"format": {"type": "json_object"}}, ("json_object", None)),
        (
            {"format": {"type": "json_schema", "name": "a-b_1", "schema": {"type": "object"}}},
            ("json_schema", {"type": "object"}),
        ),
    ],
)
def test_text_formats(text, expected):
    assert text_format(text) == expected


@pytest.mark.parametrize(
    "text, param",
    [
        ({"format": {"type": "json_schema", "schema": {}}}, "text.format.name"),
        ({"format": {"type": "json_schema", "name": "bad name", "schema": {}}}, "text.format.name"),
        ({"format": {"type": "json_schema", "name": "x", "schema": "{}"}}, "text.format.schema"),
        ({"format": {"type": "json_object", "schema": {}}}, "text.format.schema"),
        ({"fmt": {}}, "text.fmt"),
    ],
)
def test_bad_text_formats_are_named(text, param):
    assert refused(text_format, text).param == param


@pytest.mark.parametrize(
    "extra, temperature, top_p, logprobs, greedy",
    [
        ({}, 1.0, 1.0, None, False),
        ({"temperature": None, "top_p": None}, 1.0, 1.0, None, False),
        ({"temperature": 0.7, "top_p": 0.9}, 0.7, 0.9, None, False),
        ({"temperature": 0.7, "top_p": 0}, 0.7, 0.0, None, True),  # top_p 0: greedy
        ({"temperature": 0}, 0.0, 1.0, None, True),
        ({"top_logprobs": 0}, 1.0, 1.0, None, False),  # logprobs only with include
        ({"include": ["message.output_text.logprobs"]}, 1.0, 1.0, 0, False),
        ({"include": ["message.output_text.logprobs"], "top_logprobs": 5}, 1.0, 1.0, 5, False),
    ],
)
def test_sampling(extra, temperature, top_p, logprobs, greedy):
    params = sampling(check_fields(dict(BASE, **extra)))
    assert (params.temperature, params.top_p, params.logprobs, params.greedy) == (temperature, top_p, logprobs, greedy)


def test_a_request_maps_to_a_generation_request():
    req = check_fields(dict(BASE, instructions="be brief", max_output_tokens=20, temperature=0))
    gen = to_generation(
        req,
        [
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"}]},
            {
                "id": "msg_1",
                "type": "message",
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": "b", "annotations": []}],
            },
        ],
        normalize_input(req.input, req.model),
    )
    assert gen.prompt == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "hi"},
    ]
    assert (gen.model, gen.max_tokens, gen.sampling.temperature) == ("m", 20, 0.0)
    assert (gen.max_tokens_param, gen.prompt_param) == ("max_output_tokens", "input")
    assert refused(to_generation, check_fields(dict(BASE, tool_choice="required")), [], []).param == "tool_choice"


# -- output ------------------------------------------------------------------------------

EVENTS: TypeAdapter = TypeAdapter(ResponseStreamEvent)


def build(extra: dict, pieces: list[Piece], finish: str) -> tuple[OutputBuilder, list[dict]]:
    builder = OutputBuilder(check_fields(dict(BASE, **extra)), "resp_1", 1700000000)
    events = builder.start()
    for piece in pieces:
        events += builder.feed(piece)
    events += builder.finish(finish, usage_object(7, 3), now=1700000001)
    for event in events:
        EVENTS.validate_python(event)  # each event is one of the official types
    return builder, events


def test_text_streams_as_the_reference_events_and_builds_the_response():
    builder, events = build({"stream": True}, [Piece("The"), Piece(" capital"), Piece("", "stop")], "stop")
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert all("obfuscation" in e for e in events if e["type"].endswith(".delta"))
    response = Response.model_validate(events[-1]["response"])
    assert response.output_text == "The capital" and response.status == "completed"
    assert response.usage is not None and response.usage.total_tokens == 10
    assert response.id == "resp_1" and response.output[0].id.startswith("msg_")  # type: ignore[union-attr]
    assert events[-1]["response"] == builder.response


def test_length_leaves_the_response_incomplete():
    _, events = build({}, [Piece("a", "length")], "length")
    response = Response.model_validate(events[-1]["response"])
    assert events[-1]["type"] == "response.incomplete" and response.status == "incomplete"
    assert response.incomplete_details is not None and response.incomplete_details.reason == "max_output_tokens"
    assert response.output[0].status == "incomplete"  # type: ignore[union-attr]
    assert not any("obfuscation" in e for e in events)  # not streamed


def test_an_empty_output_is_an_empty_message():
    _, events = build({}, [Piece("", "stop")], "stop")
    assert Response.model_validate(events[-1]["response"]).output_text == ""


def test_tool_calls_are_function_call_items():
    call = SimpleNamespace(id="call_1", name="f", arguments='{"x": 1}')
    other = SimpleNamespace(id="call_2", name="g", arguments="{}")
    _, events = build(
        {"stream": True, "stream_options": {"include_obfuscation": False}},
        [Piece("Sure."), Piece("", "tool_calls", (call, other))],
        "tool_calls",
    )
    response = Response.model_validate(events[-1]["response"])
    assert [item.type for item in response.output] == ["message", "function_call", "function_call"]
    first = response.output[1]
    assert first.type == "function_call" and (first.call_id, first.name, first.arguments) == ("call_1", "f", '{"x": 1}')
    assert "response.function_call_arguments.done" in [e["type"] for e in events]
    assert not any("obfuscation" in e for e in events)
    _, events = build({"parallel_tool_calls": False}, [Piece("", "tool_calls", (call, other))], "tool_calls")
    assert [item.type for item in Response.model_validate(events[-1]["response"]).output] == ["function_call"]


def test_namespaced_and_custom_calls_are_their_items():
    """A namespace's function is called with its namespace; a custom tool's call is a
    ``custom_tool_call`` whose input is the string argument (the official types check
    both, and the custom input's events)."""
    tools = [
        {
            "type": "namespace",
            "name": "agents",
            "description": "d",
            "tools": [{"type": "function", "name": "spawn", "parameters": {"type": "object"}}],
        },
        {"type": "custom", "name": "apply_patch"},
        {"type": "web_search"},
    ]
    spawn = SimpleNamespace(id="call_1", name="spawn", arguments='{"task": "x"}')
    patch = SimpleNamespace(id="call_2", name="apply_patch", arguments='{"input": "*** Begin Patch"}')
    _, events = build({"stream": True, "tools": tools}, [Piece("", "tool_calls", (spawn, patch))], "tool_calls")
    response = Response.model_validate(events[-1]["response"])
    first, second = response.output
    assert first.type == "function_call" and first.namespace == "agents"
    assert second.type == "custom_tool_call" and (second.name, second.input) == ("apply_patch", "*** Begin Patch")
    assert "response.custom_tool_call_input.done" in [e["type"] for e in events]
    assert [t.type for t in response.tools] == ["namespace", "custom", "web_search"]


def test_logprobs_only_when_included():
    entry = TokenLogprob("a", -0.1, [97], (TopLogprob("a", -0.1, [97]), TopLogprob("b", -2.5, [98])))
    _, events = build(
        {"include": ["message.output_text.logprobs"], "top_logprobs": 2}, [Piece("a", None, (), (entry,))], "stop"
    )
    part = Response.model_validate(events[-1]["response"]).output[0].content[0]  # type: ignore[union-attr]
    assert part.logprobs[0].token == "a" and [t.token for t in part.logprobs[0].top_logprobs] == ["a", "b"]
    _, events = build({}, [Piece("a", None, (), (entry,))], "stop")
    assert events[-1]["response"]["output"][0]["content"][0]["logprobs"] == []


def test_failure_is_an_error_event_then_response_failed():
    builder = OutputBuilder(check_fields(BASE), "resp_1", 1)
    builder.start()
    events = builder.fail("instance failed", "server_error")
    assert [e["type"] for e in events] == ["error", "response.failed"]
    for event in events:
        EVENTS.validate_python(event)
    assert events[1]["response"]["error"] == {"code": "server_error", "message": "instance failed"}


# -- store -------------------------------------------------------------------------------


def entry(size: int) -> StoredResponse:
    return StoredResponse({"output": [{"type": "message"}]}, ({"type": "message", "role": "user"},), size)


@pytest.mark.parametrize(
    "max_entries, max_bytes, puts, reads, kept",
    [
        (3, 100, [("a", 1), ("b", 1), ("c", 1)], [], "abc"),
        (3, 100, [("a", 1), ("b", 1), ("c", 1), ("d", 1)], [], "bcd"),  # by count, oldest first
        (3, 100, [("a", 1), ("b", 1), ("c", 1), ("d", 1)], ["a"], "bcd"),  # a read after it was dropped
        (3, 100, [("a", 1), ("b", 1), ("c", 1), ("a!", 0), ("d", 1)], [], "acd"),  # "a!": read a before d
        (3, 10, [("a", 4), ("b", 4), ("c", 4)], [], "bc"),  # by bytes
        (3, 10, [("a", 4), ("b", 11)], [], "a"),  # one too large alone is not stored
        (3, 10, [("a", 4), ("a", 6), ("b", 4)], [], "ab"),  # replaced, counted once
    ],
)
def test_store_bounds(max_entries, max_bytes, puts, reads, kept):
    store = ResponseStore(max_entries, max_bytes)
    for key, size in puts:
        if key.endswith("!"):
            assert store.get(key[0]) is not None
        else:
            store.put(key, entry(size))
    for key in reads:
        assert store.get(key) is None
    assert [k for k in "abcd" if k in store] == list(kept)
    assert store.bytes == sum(store.get(k).size for k in kept)  # type: ignore[union-attr]
    assert store.bytes <= max_bytes and len(store) <= max_entries


def test_store_conversation_and_delete():
    store = ResponseStore()
    store.put("r", entry(5))
    assert store.get("r").conversation() == [{"type": "message", "role": "user"}, {"type": "message"}]  # type: ignore[union-attr]
    assert store.delete("r") and not store.delete("r") and store.get("r") is None and store.bytes == 0
    with pytest.raises(ValueError):
        ResponseStore(0)
