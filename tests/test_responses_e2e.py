"""OpenAI's Responses API on the 1-node cluster with the real model, through the official
``openai`` package."""

from __future__ import annotations

import httpx
import openai
import pytest
from conftest import CAPITAL_QUESTION, capital_answer

from shardline.models.store import DEFAULT_MODEL_ID

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def client(cluster1) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster1.url(0)}/v1", api_key="unused", timeout=120, max_retries=0)


def test_create_answers_as_chat_completions_do(cluster1, client):
    response = client.responses.create(
        model=DEFAULT_MODEL_ID, input=CAPITAL_QUESTION, temperature=0, max_output_tokens=12
    )
    assert response.output_text == capital_answer(cluster1.url(0)) and "Paris" in response.output_text
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.status in ("completed", "incomplete") and response.usage is not None
    assert response.usage.input_tokens > 10 and 0 < response.usage.output_tokens <= 12
    assert response.output[0].type == "message" and response.output[0].role == "assistant"
    assert client.responses.retrieve(response.id).output_text == response.output_text


def test_max_output_tokens_leaves_it_incomplete(client):
    response = client.responses.create(
        model=DEFAULT_MODEL_ID, input=CAPITAL_QUESTION, temperature=0, max_output_tokens=3
    )
    assert response.status == "incomplete" and response.usage is not None and response.usage.output_tokens == 3
    assert response.incomplete_details is not None and response.incomplete_details.reason == "max_output_tokens"


def test_stream_events_build_the_same_text(client):
    whole = client.responses.create(model=DEFAULT_MODEL_ID, input=CAPITAL_QUESTION, temperature=0, max_output_tokens=12)
    with client.responses.stream(
        model=DEFAULT_MODEL_ID, input=CAPITAL_QUESTION, temperature=0, max_output_tokens=12
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] in (
        "response.completed",
        "response.incomplete",
    )
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == whole.output_text == final.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_previous_response_id_continues_the_conversation(cluster1, client):
    greedy = {"model": DEFAULT_MODEL_ID, "temperature": 0, "max_output_tokens": 16}
    first = client.responses.create(input="The secret code is 4821.", **greedy)
    second = client.responses.create(previous_response_id=first.id, input="What is the secret code?", **greedy)
    alone = client.responses.create(input="What is the secret code?", **greedy)
    assert "4821" in second.output_text and "4821" not in alone.output_text
    assert second.previous_response_id == first.id
    chat = httpx.post(
        f"{cluster1.url(0)}/v1/chat/completions",
        timeout=120,
        json={
            "model": DEFAULT_MODEL_ID,
            "temperature": 0,
            "max_tokens": 16,
            "messages": [
                {"role": "user", "content": "The secret code is 4821."},
                {"role": "assistant", "content": first.output_text},
                {"role": "user", "content": "What is the secret code?"},
            ],
        },
    ).json()
    assert second.output_text == chat["choices"][0]["message"]["content"]  # the same conversation
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.create(model=DEFAULT_MODEL_ID, previous_response_id=first.id, input="again")
    assert info.value.body["param"] == "previous_response_id"  # type: ignore[index]


def test_store_false_is_not_kept(client):
    response = client.responses.create(model=DEFAULT_MODEL_ID, input="hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"input": "hi", "frobnicate": True}, "frobnicate"),
        ({"input": "hi", "reasoning": {"effort": "huge"}}, "reasoning.effort"),
        (
            {
                "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}],
                "_": None,
            },
            "input[0].content[0].type",
        ),
        ({"input": "hi", "temperature": 3}, "temperature"),
    ],
)
def test_refused_fields_are_named(cluster1, body, param):
    body = {k: v for k, v in body.items() if k != "_"}
    response = httpx.post(f"{cluster1.url(0)}/v1/responses", json={"model": DEFAULT_MODEL_ID, **body}, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert param.split("[")[0] in error["message"] or "text only" in error["message"]


def test_the_client_raises_on_an_unknown_field(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=DEFAULT_MODEL_ID, input="hi", extra_body={"frobnicate": 1})
    assert "frobnicate" in str(info.value)
