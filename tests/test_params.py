"""The table of API parameters (:mod:`shardline.api.params`): the screen by tables, and the
table kept true to the request models, the tests it names and docs/api.md."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from shardline.api import anthropic_request, completions, ollama, openai
from shardline.api.params import PARAMETERS, Endpoint, Param, ParamError, render_table, screen
from shardline.api.request_body import parse_raw
from shardline.api.responses_request import ResponsesRequest
from shardline.api.text_stream import APIError

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parent.parent
T = (
    Param(Endpoint.CHAT, "model", True, "", "t"),
    Param(Endpoint.CHAT, "store", False, "not kept", "t", (False,)),
    Param(Endpoint.CHAT, "audio", False, "text only", "t"),
    Param(Endpoint.MESSAGES, "model", True, "", "t"),
    Param(Endpoint.OLLAMA_OPTIONS, "top_k", True, "", "t"),
)


@pytest.mark.parametrize(
    "endpoint,data,out",
    [
        (Endpoint.CHAT, {"model": "m"}, {"model": "m"}),
        (Endpoint.CHAT, {"model": "m", "audio": None, "store": None}, {"model": "m"}),  # null: the default
        (Endpoint.CHAT, {"model": "m", "store": False}, {"model": "m", "store": False}),  # asks for nothing
        (Endpoint.CHAT, ["not", "an", "object"], ["not", "an", "object"]),  # the model refuses it
    ],
)
def test_screen_passes(endpoint, data, out):
    assert screen(endpoint, data, T) == out


@pytest.mark.parametrize(
    "endpoint,data,param,words",
    [
        (Endpoint.CHAT, {"model": "m", "store": True}, "store", "store: not kept"),
        (Endpoint.CHAT, {"audio": {"voice": "x"}}, "audio", "audio: text only"),
        (Endpoint.CHAT, {"foo": 1}, "foo", "Unrecognized request argument supplied: foo"),
        (Endpoint.MESSAGES, {"foo": 1}, "foo", "foo: Extra inputs are not permitted"),
        (Endpoint.OLLAMA_OPTIONS, {"mirostat_x": 1}, "mirostat_x", "mirostat_x: not an option"),
        (Endpoint.OLLAMA_CHAT, {"foo": 1}, "foo", "foo: not a parameter of this endpoint"),
    ],
)
def test_screen_refuses(endpoint, data, param, words):
    with pytest.raises(ParamError) as caught:
        screen(endpoint, data, T)
    assert caught.value.param == param and words in caught.value.message


MODELS = {
    Endpoint.CHAT: openai.ChatCompletionRequest,
    Endpoint.COMPLETIONS: completions.CompletionRequest,
    Endpoint.MESSAGES: anthropic_request.MessagesRequest,
    Endpoint.COUNT_TOKENS: anthropic_request.CountTokensRequest,
    Endpoint.OLLAMA_CHAT: ollama.ChatRequest,
    Endpoint.OLLAMA_GENERATE: ollama.GenerateRequest,
    Endpoint.OLLAMA_OPTIONS: ollama.Options,
    Endpoint.RESPONSES: ResponsesRequest,
}


@pytest.mark.parametrize("endpoint", list(MODELS))
def test_every_field_of_a_request_model_has_a_row(endpoint):
    """A field the model validates is a row of the table, and every row that works is a
    field (a refused one may be a field too, to validate its allowed value)."""
    fields = {f.alias or name for name, f in MODELS[endpoint].model_fields.items()}
    rows = {p.name: p for p in PARAMETERS if p.endpoint is endpoint}
    assert fields - set(rows) == set()
    assert {name for name, p in rows.items() if p.works} - fields == set()


def test_each_row_names_a_test_that_exists():
    missing = []
    for p in PARAMETERS:
        file, name = p.test.split("::")
        path = ROOT / "tests" / file
        if not path.is_file() or not re.search(rf"^(async )?def {re.escape(name)}\(", path.read_text(), re.M):
            missing.append(f"{p.endpoint.name} {p.name}: {p.test}")
    assert missing == []


def test_each_parameter_has_one_row():
    keys = [(p.endpoint, p.name) for p in PARAMETERS]
    assert len(keys) == len(set(keys))


def test_the_docs_table_is_the_table():
    page = (ROOT / "docs" / "api.md").read_text()
    start, end = "<!-- parameters: begin -->", "<!-- parameters: end -->"
    assert start in page and end in page, "docs/api.md lacks the parameter table's markers"
    table = page.split(start, 1)[1].split(end, 1)[0].strip()
    assert table == render_table().strip(), (
        "run: python -m shardline.api.params > table; paste it between the markers in docs/api.md"
    )


def refused(model, body: dict) -> APIError:
    """What ``parse_raw`` raises for a minimal valid request of ``model`` with ``body``."""
    base = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    if model is completions.CompletionRequest:
        base = {"model": "m", "prompt": "x"}
    if model is anthropic_request.MessagesRequest:
        base["max_tokens"] = 8
    with pytest.raises(APIError) as caught:
        parse_raw(json.dumps({**base, **body}).encode(), model)
    return caught.value


@pytest.mark.parametrize(
    "model,body,param",
    [
        (openai.ChatCompletionRequest, {"max_tokens": "3"}, "max_tokens"),
        (openai.ChatCompletionRequest, {"max_tokens": True}, "max_tokens"),
        (openai.ChatCompletionRequest, {"max_tokens": 3.5}, "max_tokens"),
        (openai.ChatCompletionRequest, {"temperature": "0.5"}, "temperature"),
        (openai.ChatCompletionRequest, {"stream": 1}, "stream"),
        (openai.ChatCompletionRequest, {"logit_bias": {"x": 1}}, "logit_bias.x"),
        (openai.ChatCompletionRequest, {"stop": 5}, "stop"),
        (ollama.ChatRequest, {"format": "xml"}, "format"),
        (completions.CompletionRequest, {"echo": "true"}, "echo"),
        (anthropic_request.MessagesRequest, {"max_tokens": "16"}, "max_tokens"),
        (ollama.ChatRequest, {"stream": "false"}, "stream"),
        (ollama.ChatRequest, {"options": {"num_predict": "8"}}, "options.num_predict"),
    ],
)
def test_parse_refuses_values_of_the_wrong_json_type(model, body, param):
    """A string or boolean where a number belongs (or the reverse) is a 400 naming the
    field, not coerced: "3" is not 3 and true is not 1."""
    error = refused(model, body)
    assert error.status == 400 and error.param == param, error.message


def test_parse_keeps_what_json_means():
    """Integers pass for floats, and logit_bias's object keys are read as token ids."""
    req = parse_raw(
        json.dumps(
            {
                "model": "m",
                "messages": [{"role": "user", "content": "x"}],
                "temperature": 1,
                "logit_bias": {"7042": -100},
            }
        ).encode(),
        openai.ChatCompletionRequest,
    )
    assert req.temperature == 1.0 and req.logit_bias == {7042: -100.0}


@pytest.mark.parametrize("number", ["NaN", "Infinity", "-Infinity"])
def test_parse_refuses_numbers_json_does_not_have(number):
    """Python's json reads NaN and the infinities; JSON (RFC 8259) has no such numbers, and
    a NaN temperature was refused as "less than or equal to 2"."""
    raw = ('{"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": %s}' % number).encode()
    with pytest.raises(APIError) as caught:
        parse_raw(raw, openai.ChatCompletionRequest)
    assert caught.value.status == 400 and f"{number} is not a JSON number" in caught.value.message


def test_parse_refuses_a_lone_surrogate_by_name():
    """``"\\ud800"`` parses in Python but is no character: a 400 that says so, naming no
    parameter (pydantic's "unexpected end of hex escape" came back as param "Invalid JSON")."""
    raw = b'{"model": "m", "messages": [{"role": "user", "content": "\\ud800 hi"}]}'
    with pytest.raises(APIError) as caught:
        parse_raw(raw, openai.ChatCompletionRequest)
    assert caught.value.status == 400 and caught.value.param is None
    assert "lone surrogate \\ud800" in caught.value.message
    pair = '{"model": "m", "messages": [{"role": "user", "content": "\\ud83d\\ude00"}]}'.encode()
    assert parse_raw(pair, openai.ChatCompletionRequest).messages[0].content == "\U0001f600"


@pytest.mark.parametrize(
    "model,body,param",
    [
        (openai.ChatCompletionRequest, {"stream_options": {"include_usage": True}}, "stream_options"),
        (openai.ChatCompletionRequest, {"tools": []}, "tools"),
        (openai.ChatCompletionRequest, {"messages": [{"role": "user", "content": None}]}, "messages.0.content"),
        (openai.ChatCompletionRequest, {"messages": [{"role": "tool", "tool_call_id": "c"}]}, "messages.0.content"),
        (openai.ChatCompletionRequest, {"seed": 2**70}, "seed"),
        (openai.ChatCompletionRequest, {"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        (completions.CompletionRequest, {"prompt": ""}, "prompt"),
        (ollama.ChatRequest, {"top_logprobs": 3}, "top_logprobs"),
    ],
)
def test_parse_refuses_what_would_be_ignored(model, body, param):
    """Values the reference refuses, or that would be accepted and do nothing (stream_options
    without a stream, top_logprobs without logprobs)."""
    base = (
        {"model": "m", "prompt": "x"}
        if model is completions.CompletionRequest
        else {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    )
    with pytest.raises(APIError) as caught:
        parse_raw(json.dumps({**base, **body}).encode(), model)
    assert caught.value.status == 400 and caught.value.param == param, caught.value.message


def test_echo_with_logprobs_asks_for_the_prompts_logprobs():
    """The sampling of a Completions request that echoes with logprobs scores the prompt
    (``prompt_logprobs``); without echo, or without logprobs, it does not."""

    def sampling(**body):
        return parse_raw(
            json.dumps({"model": "m", "prompt": "x", **body}).encode(), completions.CompletionRequest
        ).sampling()

    assert sampling(echo=True, logprobs=2).prompt_logprobs == 2
    assert sampling(echo=True).prompt_logprobs is None
    assert sampling(logprobs=2).prompt_logprobs is None


@pytest.mark.parametrize(
    "stop, sequences",
    [("Paris", ["Paris"]), ("a longer stop", ["a longer stop"]), (["a", "b", "c", "d"], ["a", "b", "c", "d"])],
)
def test_a_stop_string_of_any_length_is_one_sequence(stop, sequences):
    req = parse_raw(
        json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}], "stop": stop}).encode(),
        openai.ChatCompletionRequest,
    )
    assert req.to_generation().stop == sequences


@pytest.mark.parametrize(
    "model",
    [
        openai.ChatCompletionRequest,
        completions.CompletionRequest,
        anthropic_request.MessagesRequest,
        ollama.ChatRequest,
        ollama.GenerateRequest,
        ResponsesRequest,
    ],
)
@pytest.mark.parametrize("body", ["[]", "null", '"x"', "5"])
def test_parse_refuses_a_body_that_is_not_an_object(model, body):
    """Every endpoint answers a JSON body that is no object with a 400 (the Ollama ones
    raised an AttributeError, a 500)."""
    with pytest.raises(APIError) as caught:
        parse_raw(body.encode(), model)
    assert caught.value.status == 400 and "object" in caught.value.message, caught.value.message


@pytest.mark.parametrize(
    "model, body, param",
    [
        (openai.ChatCompletionRequest, {"stop": ""}, "stop"),
        (openai.ChatCompletionRequest, {"stop": ["x", ""]}, "stop.1"),
        (completions.CompletionRequest, {"stop": ""}, "stop"),
        (anthropic_request.MessagesRequest, {"stop_sequences": [""]}, "stop_sequences.0"),
        (ollama.ChatRequest, {"options": {"stop": [""]}}, "options.stop.0"),
    ],
)
def test_parse_refuses_an_empty_stop_string(model, body, param):
    """An empty stop sequence was dropped (accepted and ignored): now a 400 naming it."""
    error = refused(model, body)
    assert error.status == 400 and error.param == param and "empty" in error.message, error.message
