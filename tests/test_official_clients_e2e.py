"""The official ``openai``, ``anthropic`` and ``ollama`` packages against one node serving
the real model (conftest's ``cluster1``): chat streamed and not, structured output that
parses against its schema, and log-probabilities. (Tool round trips through the same
packages: tests/test_tools_e2e.py; Ollama's show/ps/list: tests/test_ollama_client_e2e.py.)"""

from __future__ import annotations

import json
import math

import anthropic
import ollama
import openai
import pytest
from conftest import CAPITAL_QUESTION

from shardline.models.store import DEFAULT_MODEL_ID as M

ASK = [{"role": "user", "content": CAPITAL_QUESTION}]
SCHEMA = {
    "type": "object",
    "properties": {"capital": {"type": "string", "maxLength": 24}},
    "required": ["capital"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def url(cluster1) -> str:
    return cluster1.url(0)


def test_openai_client(url):
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    whole = client.chat.completions.create(
        model=M, messages=ASK, temperature=0, max_tokens=12, logprobs=True, top_logprobs=3
    )
    text = whole.choices[0].message.content
    assert "Paris" in text
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(model=M, messages=ASK, temperature=0, max_tokens=12, stream=True)
        if c.choices
    )
    assert streamed == text
    entries = whole.choices[0].logprobs.content
    assert "".join(e.token for e in entries) == text
    for e in entries:  # at temperature 0 the chosen token is the most likely one
        assert e.top_logprobs[0].token == e.token and sum(math.exp(t.logprob) for t in e.top_logprobs) <= 1 + 1e-5
    structured = client.chat.completions.create(
        model=M,
        messages=ASK,
        temperature=0,
        max_tokens=80,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}},
    )
    assert isinstance(json.loads(structured.choices[0].message.content)["capital"], str)


def test_anthropic_client(url):
    client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
    greedy = {"temperature": 0}  # the client no longer lists temperature; the API takes it
    whole = client.messages.create(model=M, max_tokens=12, messages=ASK, extra_body=greedy)
    assert "Paris" in whole.content[0].text
    with client.messages.stream(model=M, max_tokens=12, messages=ASK, extra_body=greedy) as stream:
        assert "".join(stream.text_stream) == whole.content[0].text
    structured = client.messages.create(
        model=M,
        max_tokens=80,
        messages=ASK,
        extra_body=greedy,
        output_config={"format": {"type": "json_schema", "schema": SCHEMA}},
    )
    assert isinstance(json.loads(structured.content[0].text)["capital"], str)


def test_ollama_client(url):
    client = ollama.Client(host=url)
    options = {"temperature": 0, "num_predict": 12}
    whole = client.chat(model=M, messages=ASK, options=options, logprobs=True, top_logprobs=2)
    assert "Paris" in whole.message.content
    assert (
        "".join(p.message.content for p in client.chat(model=M, messages=ASK, options=options, stream=True))
        == whole.message.content
    )
    assert all(e.top_logprobs[0].token == e.token for e in whole.logprobs)
    structured = client.chat(model=M, messages=ASK, format=SCHEMA, options={"temperature": 0, "num_predict": 80})
    assert isinstance(json.loads(structured.message.content)["capital"], str)
