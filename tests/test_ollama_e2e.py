"""Ollama's API (``/api/chat``, ``/api/generate``, ``/api/tags``) on the 3-node cluster."""

from __future__ import annotations

import json

import httpx
import pytest
from conftest import CAPITAL_QUESTION

from shardline.models.store import DEFAULT_MODEL_ID

pytestmark = pytest.mark.timeout(300)

GREEDY = {"temperature": 0, "num_predict": 12}


def post(url: str, path: str, **body) -> httpx.Response:
    return httpx.post(f"{url}{path}", json={"model": DEFAULT_MODEL_ID, **body}, timeout=120)


def openai_text(url: str, max_tokens: int) -> str:
    response = httpx.post(
        f"{url}/v1/chat/completions",
        timeout=120,
        json={
            "model": DEFAULT_MODEL_ID,
            "temperature": 0,
            "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": CAPITAL_QUESTION}],
        },
    )
    return response.json()["choices"][0]["message"]["content"]


def ndjson(url: str, path: str, **body) -> list[dict]:
    with httpx.stream("POST", f"{url}{path}", json={"model": DEFAULT_MODEL_ID, **body}, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson")
        return [json.loads(line) for line in r.iter_lines() if line]


def test_chat_answers_as_the_openai_api_does(cluster3):
    body = post(
        cluster3.url(0),
        "/api/chat",
        stream=False,
        options=GREEDY,
        messages=[{"role": "user", "content": CAPITAL_QUESTION}],
    ).json()
    assert body["done"] is True and body["message"]["role"] == "assistant"
    assert "Paris" in body["message"]["content"]
    assert body["message"]["content"] == openai_text(cluster3.url(1), 12)
    assert body["prompt_eval_count"] > 10 and 0 < body["eval_count"] <= 12
    assert body["total_duration"] >= body["eval_duration"] > 0 and body["done_reason"] in ("stop", "length")


def test_chat_streams_by_default(cluster3):
    whole = post(
        cluster3.url(0),
        "/api/chat",
        stream=False,
        options=GREEDY,
        messages=[{"role": "user", "content": CAPITAL_QUESTION}],
    ).json()
    lines = ndjson(
        cluster3.url(2), "/api/chat", options=GREEDY, messages=[{"role": "user", "content": CAPITAL_QUESTION}]
    )
    assert [line["done"] for line in lines] == [False] * (len(lines) - 1) + [True]
    assert "".join(line["message"]["content"] for line in lines) == whole["message"]["content"]
    assert lines[-1]["eval_count"] == whole["eval_count"]


def test_generate_applies_the_chat_template_unless_raw(cluster3):
    templated = post(cluster3.url(1), "/api/generate", prompt=CAPITAL_QUESTION, stream=False, options=GREEDY).json()
    assert templated["response"] == openai_text(cluster3.url(0), 12)
    raw = ndjson(
        cluster3.url(1),
        "/api/generate",
        prompt="The capital of France is the city of",
        raw=True,
        options={"temperature": 0, "num_predict": 5},
    )
    assert "Paris" in "".join(line["response"] for line in raw)
    assert raw[-1]["done_reason"] == "length" and raw[-1]["eval_count"] == 5


def test_tags_list_the_served_model_and_names_take_ollamas_tag(cluster3):
    tags = httpx.get(f"{cluster3.url(0)}/api/tags", timeout=10).json()["models"]
    assert [t["name"] for t in tags] == [DEFAULT_MODEL_ID] and tags[0]["size"] > 0
    assert httpx.get(f"{cluster3.url(0)}/api/version", timeout=10).json()["version"]
    loaded = httpx.post(f"{cluster3.url(0)}/api/generate", json={"model": DEFAULT_MODEL_ID + ":latest"}).json()
    assert loaded["done"] is True and loaded["done_reason"] == "load"
    tagged = httpx.post(
        f"{cluster3.url(0)}/api/chat",
        timeout=120,
        json={
            "model": DEFAULT_MODEL_ID + ":latest",
            "stream": False,
            "options": GREEDY,
            "messages": [{"role": "user", "content": CAPITAL_QUESTION}],
        },
    )
    assert tagged.status_code == 200 and "Paris" in tagged.json()["message"]["content"]


@pytest.mark.parametrize(
    "path, body, status",
    [
        ("/api/chat", {"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}, 404),
        ("/api/generate", {"model": "no-such-model"}, 404),
        ("/api/chat", {"model": DEFAULT_MODEL_ID, "messages": [], "keep_alive": "soon"}, 400),
        (
            "/api/chat",
            {"model": DEFAULT_MODEL_ID, "messages": [{"role": "user", "content": "hi"}], "options": {"top_p": 5}},
            400,
        ),
        ("/api/no-such-endpoint", {}, 404),
        # a tool result naming no call made before it
        (
            "/api/chat",
            {
                "model": DEFAULT_MODEL_ID,
                "stream": False,
                "messages": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "1", "tool_name": "f"}],
            },
            400,
        ),
        ("/api/chat", [], 400),  # a body that is no object (was a 500)
    ],
)
def test_bad_requests_get_ollama_errors(cluster3, path, body, status):
    response = httpx.post(f"{cluster3.url(2)}{path}", json=body, timeout=60)
    assert response.status_code == status, response.text
    assert isinstance(response.json()["error"], str) and response.json()["error"]
