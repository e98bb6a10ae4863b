"""Every API parameter works or is refused (issue 15): the rows of
:data:`shardline.api.params.PARAMETERS` that name this file, on one node serving the real
model (conftest's ``cluster1``)."""

from __future__ import annotations

import json
import math

import httpx
import pytest
from conftest import CAPITAL_QUESTION

from shardline.api.params import PARAMETERS, Endpoint
from shardline.models.store import DEFAULT_MODEL_ID, default_model_path
from shardline.models.tokenizer import Tokenizer

M = DEFAULT_MODEL_ID
CHAT = [{"role": "user", "content": CAPITAL_QUESTION}]
BANANAS = [{"role": "user", "content": "Write the word banana twenty times, separated by spaces."}]

# A body for each endpoint that it serves as it is; a parameter is added to it.
BASE = {
    Endpoint.CHAT: ("/v1/chat/completions", {"model": M, "messages": CHAT, "max_tokens": 4}),
    Endpoint.COMPLETIONS: ("/v1/completions", {"model": M, "prompt": "The capital of France is", "max_tokens": 4}),
    Endpoint.MESSAGES: ("/v1/messages", {"model": M, "messages": CHAT, "max_tokens": 4}),
    Endpoint.COUNT_TOKENS: ("/v1/messages/count_tokens", {"model": M, "messages": CHAT}),
    Endpoint.RESPONSES: ("/v1/responses", {"model": M, "input": CAPITAL_QUESTION, "max_output_tokens": 4}),
    Endpoint.OLLAMA_CHAT: ("/api/chat", {"model": M, "messages": CHAT, "stream": False, "options": {"num_predict": 4}}),
    Endpoint.OLLAMA_GENERATE: (
        "/api/generate",
        {"model": M, "prompt": CAPITAL_QUESTION, "stream": False, "options": {"num_predict": 4}},
    ),
}


@pytest.fixture(scope="module")
def url(cluster1) -> str:
    return cluster1.url(0)


def _post(url: str, endpoint: Endpoint, **extra) -> httpx.Response:
    path, body = BASE[endpoint]
    return httpx.post(f"{url}{path}", json={**body, **extra}, timeout=120)


def _options(url: str, endpoint: Endpoint, **options) -> httpx.Response:
    path, body = BASE[endpoint]
    return httpx.post(f"{url}{path}", json={**body, "options": {**body["options"], **options}}, timeout=120)


def _chat(url: str, **extra) -> dict:
    response = httpx.post(
        f"{url}/v1/chat/completions",
        timeout=120,
        json={"model": M, "messages": CHAT, "max_tokens": 12, "temperature": 0, **extra},
    )
    assert response.status_code == 200, response.text
    return response.json()


def _named(response: httpx.Response, param: str) -> bool:
    """The error body names ``param`` (each API's format)."""
    body = response.json()
    error = body.get("error")
    text = json.dumps(body)
    if isinstance(error, dict) and "param" in error and error["param"] is not None:
        return error["param"] == param
    return param in text


REFUSED = [p for p in PARAMETERS if not p.works]


@pytest.mark.parametrize("row", REFUSED, ids=[f"{p.endpoint.name}-{p.name}" for p in REFUSED])
def test_refused_parameters(url, row):
    """Each refused parameter at a value that asks for something: 400 naming it; at the
    value that asks for nothing (where the table allows one): served."""
    if row.endpoint is Endpoint.OLLAMA_OPTIONS:
        for endpoint in (Endpoint.OLLAMA_CHAT, Endpoint.OLLAMA_GENERATE):
            response = _options(url, endpoint, **{row.name: "asks-for-something"})
            assert response.status_code == 400 and f"options.{row.name}" in response.json()["error"]
            for value in row.allowed:
                assert _options(url, endpoint, **{row.name: value}).status_code == 200
        return
    response = _post(url, row.endpoint, **{row.name: "asks-for-something"})
    assert response.status_code == 400, response.text
    assert _named(response, row.name), response.text
    for value in row.allowed:
        response = _post(url, row.endpoint, **{row.name: value})
        assert response.status_code == 200, (value, response.text)


@pytest.mark.parametrize("endpoint", list(BASE))
def test_unknown_parameters_are_refused(url, endpoint):
    response = _post(url, endpoint, no_such_parameter=1)
    assert response.status_code == 400 and _named(response, "no_such_parameter"), response.text


def test_null_is_the_default(url):
    plain = _chat(url)
    nulls = _chat(url, top_p=None, seed=None, stop=None, n=None, logit_bias=None)
    assert nulls["choices"][0]["message"] == plain["choices"][0]["message"]
    response = httpx.post(
        f"{url}/v1/chat/completions",
        timeout=60,
        json={"model": M, "messages": CHAT, "max_tokens": 2, "temperature": None},
    )
    assert response.status_code == 200, response.text


def test_top_p_zero_is_greedy(url):
    greedy = _chat(url)["choices"][0]["message"]["content"]
    assert "Paris" in greedy
    for seed in (1, 2):
        top_p_zero = _chat(url, temperature=1.0, top_p=0, seed=seed)
        assert top_p_zero["choices"][0]["message"]["content"] == greedy


def test_seed_reproduces_a_sample(url):
    texts = {_chat(url, temperature=1.0, seed=7, max_tokens=16)["choices"][0]["message"]["content"] for _ in range(2)}
    assert len(texts) == 1


def test_n_choices(url):
    body = _chat(url, n=3, temperature=1.0, seed=3, max_tokens=8)
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert body["usage"]["completion_tokens"] <= 3 * 8 and body["usage"]["completion_tokens"] >= 3
    assert body["system_fingerprint"].startswith("fp_") and "pipeline1" in body["system_fingerprint"]
    seen: dict[int, str] = {}
    finished = set()
    with httpx.stream(
        "POST",
        f"{url}/v1/chat/completions",
        timeout=120,
        json={"model": M, "messages": CHAT, "max_tokens": 6, "n": 2, "temperature": 0, "stream": True},
    ) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            for choice in json.loads(line[6:])["choices"]:
                seen[choice["index"]] = seen.get(choice["index"], "") + (choice["delta"].get("content") or "")
                if choice["finish_reason"]:
                    finished.add(choice["index"])
    assert finished == {0, 1} and seen[0] == seen[1] and "Paris" in seen[0]
    too_many = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={"model": M, "messages": CHAT, "n": 9})
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "n"


def test_penalties_change_a_repetitive_answer(url):
    prompt = "banana banana banana banana banana banana banana banana"

    def text(**extra) -> str:
        body = httpx.post(
            f"{url}/v1/completions",
            timeout=120,
            json={"model": M, "prompt": prompt, "max_tokens": 16, "temperature": 0, **extra},
        ).json()
        return body["choices"][0]["text"]

    plain = text()
    assert plain.lower().count("banana") >= 5, plain
    for extra in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0}, {"repetition_penalty": 1.5}):
        penalised = text(**extra)
        assert penalised.lower().count("banana") < plain.lower().count("banana"), (extra, penalised)
    assert text(frequency_penalty=0.0, presence_penalty=0.0, repetition_penalty=1.0) == plain
    for extra in ({"frequency_penalty": 2.5}, {"presence_penalty": -3}, {"repetition_penalty": 0}):
        response = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={"model": M, "messages": BANANAS, **extra})
        assert response.status_code == 400 and response.json()["error"]["param"] == next(iter(extra))
    ollama = [
        httpx.post(
            f"{url}/api/generate",
            timeout=120,
            json={
                "model": M,
                "prompt": prompt,
                "raw": True,
                "stream": False,
                "options": {"temperature": 0, "num_predict": 16, **options},
            },
        ).json()["response"]
        for options in ({}, {"repeat_penalty": 1.5}, {"frequency_penalty": 2.0}, {"presence_penalty": 2.0})
    ]
    assert ollama[0] == plain and all(o.lower().count("banana") < plain.lower().count("banana") for o in ollama[1:])


def test_logit_bias_bans_a_token(url):
    tokenizer = Tokenizer(default_model_path())
    paris = tokenizer.encode(" Paris", add_special_tokens=False)
    assert len(paris) == 1
    plain = _chat(url)["choices"][0]["message"]["content"]
    assert " Paris" in plain
    banned = _chat(url, logit_bias={str(paris[0]): -100})["choices"][0]["message"]["content"]
    assert " Paris" not in banned and banned != plain
    for bias, words in (
        ({"99999999": 1}, "outside the vocabulary"),
        ({str(paris[0]): 101}, "between -100 and 100"),
        ({"x": 1}, "logit_bias"),
    ):
        response = httpx.post(
            f"{url}/v1/chat/completions", timeout=60, json={"model": M, "messages": CHAT, "logit_bias": bias}
        )
        assert response.status_code == 400 and words in response.text, response.text


def _check_logprobs(entries: list[dict], k: int) -> None:
    for entry in entries:
        top = entry["top_logprobs"]
        assert len(top) == k
        assert top[0]["token"] == entry["token"] and math.isclose(top[0]["logprob"], entry["logprob"], abs_tol=1e-5)
        assert sum(math.exp(t["logprob"]) for t in top) <= 1.0 + 1e-5
        assert [t["logprob"] for t in top] == sorted((t["logprob"] for t in top), reverse=True)
        assert bytes(entry["bytes"]).decode("utf-8", errors="replace") == entry["token"]


def test_logprobs_match_the_greedy_choice(url):
    body = _chat(url, logprobs=True, top_logprobs=3)
    choice = body["choices"][0]
    entries = choice["logprobs"]["content"]
    assert "".join(e["token"] for e in entries) == choice["message"]["content"]
    _check_logprobs(entries, 3)
    assert _chat(url)["choices"][0]["logprobs"] is None
    alone = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={"model": M, "messages": CHAT, "top_logprobs": 2})
    assert alone.status_code == 400 and alone.json()["error"]["param"] == "top_logprobs"
    over = httpx.post(
        f"{url}/v1/chat/completions",
        timeout=60,
        json={"model": M, "messages": CHAT, "logprobs": True, "top_logprobs": 21},
    )
    assert over.status_code == 400 and over.json()["error"]["param"] == "top_logprobs"

    completion = httpx.post(
        f"{url}/v1/completions",
        timeout=60,
        json={"model": M, "prompt": "The capital of France is", "max_tokens": 5, "temperature": 0, "logprobs": 2},
    ).json()["choices"][0]
    lp = completion["logprobs"]
    assert "".join(lp["tokens"]) == completion["text"] and len(lp["token_logprobs"]) == len(lp["tokens"])
    assert all(max(top, key=top.get) == token for top, token in zip(lp["top_logprobs"], lp["tokens"]))
    assert lp["text_offset"][0] == 0

    for path, body in (("/api/chat", {"messages": CHAT}), ("/api/generate", {"prompt": CAPITAL_QUESTION})):
        answer = httpx.post(
            f"{url}{path}",
            timeout=60,
            json={
                "model": M,
                **body,
                "stream": False,
                "logprobs": True,
                "top_logprobs": 2,
                "options": {"temperature": 0, "num_predict": 8},
            },
        ).json()
        _check_logprobs(answer["logprobs"], 2)


def test_identifiers_are_accepted(url):
    plain = _chat(url)["choices"][0]["message"]
    tagged = _chat(url, user="u-1", safety_identifier="s-1", prompt_cache_key="k-1")
    assert tagged["choices"][0]["message"] == plain
    response = _post(url, Endpoint.MESSAGES, metadata={"user_id": "u-1"}, cache_control={"type": "ephemeral"})
    assert response.status_code == 200, response.text


def test_sampling_extensions_are_checked(url):
    for extra in ({"top_k": -1}, {"min_p": 1.5}):
        response = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={"model": M, "messages": CHAT, **extra})
        assert response.status_code == 400 and response.json()["error"]["param"] == next(iter(extra))
    # top_k 1 and min_p 1 keep only the most likely token: greedy whatever the seed
    greedy = _chat(url)["choices"][0]["message"]["content"]
    for extra in ({"top_k": 1}, {"min_p": 1.0}):
        assert _chat(url, temperature=1.0, seed=5, **extra)["choices"][0]["message"]["content"] == greedy
    long = _chat(url, ignore_eos=True, max_tokens=40)
    assert long["usage"]["completion_tokens"] == 40 and long["choices"][0]["finish_reason"] == "length"


def test_speculative_decoding_is_the_same_greedy_text(url):
    """llama.cpp's ``speculative.n_max``: drafts by prompt lookup (0: none; absent: the
    dense model's default), the same greedy text and the same seeded sample; a value out
    of range is refused naming it."""
    quote = "The quick brown fox jumps over the lazy dog near the river bank. " * 3
    body = {"messages": [{"role": "user", "content": f"Repeat exactly: {quote}"}], "max_tokens": 48}
    plain = _chat(url, **body, **{"speculative.n_max": 0})["choices"][0]["message"]["content"]
    drafted = _chat(url, **body, **{"speculative.n_max": 8})["choices"][0]["message"]["content"]
    default = _chat(url, **body)["choices"][0]["message"]["content"]
    assert drafted == plain == default and len(plain) > 40
    seeded = body | {"temperature": 0.7, "seed": 7}
    plain = _chat(url, **seeded, **{"speculative.n_max": 0})["choices"][0]["message"]["content"]
    drafted = _chat(url, **seeded, **{"speculative.n_max": 8})["choices"][0]["message"]["content"]
    assert drafted == plain and plain  # a seeded sample drafts too, the same text
    response = httpx.post(
        f"{url}/v1/completions", timeout=60, json={"model": M, "prompt": "Hi", "speculative.n_max": 99}
    )
    assert response.status_code == 400 and response.json()["error"]["param"] == "speculative.n_max"


def test_response_format_json_schema_parses(url):
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 24},
            "population": {"type": "integer", "maximum": 10**9},
        },
        "required": ["city", "population"],
        "additionalProperties": False,
    }
    body = _chat(
        url,
        max_tokens=80,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema, "strict": True}},
    )
    assert body["choices"][0]["finish_reason"] == "stop", body
    value = json.loads(body["choices"][0]["message"]["content"])
    assert set(value) == {"city", "population"} and isinstance(value["population"], int)
    anything = _chat(url, max_tokens=200, response_format={"type": "json_object"})["choices"][0]
    assert anything["finish_reason"] == "stop", anything
    assert isinstance(json.loads(anything["message"]["content"]), dict)
    bad = httpx.post(
        f"{url}/v1/chat/completions",
        timeout=60,
        json={
            "model": M,
            "messages": CHAT,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}},
        },
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "response_format", bad.text


def test_ollama_format_parses(url):
    schema = {"type": "object", "properties": {"capital": {"type": "string", "maxLength": 24}}, "required": ["capital"]}
    for fmt in ("json", schema):
        answer = httpx.post(
            f"{url}/api/chat",
            timeout=120,
            json={
                "model": M,
                "messages": CHAT,
                "stream": False,
                "format": fmt,
                "options": {"temperature": 0, "num_predict": 200},
            },
        ).json()
        assert answer["done_reason"] == "stop", answer
        value = json.loads(answer["message"]["content"])
        assert isinstance(value, dict) and (fmt == "json" or isinstance(value["capital"], str))


def test_ollama_options_work(url):
    def chat(**options) -> httpx.Response:
        return httpx.post(
            f"{url}/api/chat",
            timeout=120,
            json={"model": M, "messages": CHAT, "stream": False, "options": {"temperature": 0, **options}},
        )

    three = chat(num_predict=3).json()
    assert three["eval_count"] == 3 and three["done_reason"] == "length"
    assert chat(num_predict=12, stop=["Paris"]).json()["message"]["content"].find("Paris") == -1
    sampled = {chat(temperature=1.0, seed=11, num_predict=12).json()["message"]["content"] for _ in range(2)}
    assert len(sampled) == 1
    small = chat(num_ctx=8, num_predict=4)
    assert small.status_code == 400 and "8 tokens" in small.json()["error"]
    below = chat(num_predict=-3)  # -1 and -2 are Ollama's "no limit" and "fill the context"
    assert below.status_code == 400 and "num_predict" in below.json()["error"]
    assert chat(num_predict=-2).json()["done_reason"] in ("stop", "length")
    # beyond the context: generation stops at its end, as Ollama's does (not a 400)
    big = chat(num_ctx=64, num_predict=99_999_999, repeat_penalty=1.0).json()
    assert big["done_reason"] in ("stop", "length"), big
    assert big["prompt_eval_count"] + big["eval_count"] <= 64
    assert big["done_reason"] == "stop" or big["prompt_eval_count"] + big["eval_count"] == 64
    # a chat past num_ctx loses its oldest messages, not its system message nor its last
    history = [{"role": "system", "content": "Be brief."}]
    for i in range(6):
        history += [
            {"role": "user", "content": f"Fact {i}: " + "the sky is blue " * 10},
            {"role": "assistant", "content": "Noted."},
        ]
    history += CHAT

    def long_chat(num_ctx: int) -> dict:
        return httpx.post(
            f"{url}/api/chat",
            timeout=120,
            json={
                "model": M,
                "messages": history,
                "stream": False,
                "options": {"temperature": 0, "num_predict": 4, "num_ctx": num_ctx},
            },
        ).json()

    whole = long_chat(4096)["prompt_eval_count"]
    cut = long_chat(whole // 2)
    assert "error" not in cut, cut
    assert whole // 4 < cut["prompt_eval_count"] < whole // 2
    greedy = chat(num_predict=12).json()["message"]["content"]
    for options in (
        {"top_k": 1, "temperature": 1.0, "seed": 2},
        {"min_p": 1.0, "temperature": 1.0, "seed": 2},
        {"top_p": 0.0, "temperature": 1.0},
        {"repeat_last_n": 0, "repeat_penalty": 1.5},
    ):
        assert chat(num_predict=12, **options).json()["message"]["content"] == greedy, options


def test_assistant_prefill_is_continued(url):
    prefill = "The capital of France is"
    body = httpx.post(
        f"{url}/v1/messages",
        timeout=60,
        json={
            "model": M,
            "max_tokens": 6,
            "temperature": 0,
            "messages": [*CHAT, {"role": "assistant", "content": prefill}],
        },
    ).json()
    text = body["content"][0]["text"]
    assert "Paris" in text and not text.lstrip().startswith("The capital"), text


def test_count_tokens_matches_the_message_usage(url):
    for messages in (CHAT, [*CHAT, {"role": "assistant", "content": "The capital"}]):
        count = httpx.post(
            f"{url}/v1/messages/count_tokens",
            timeout=60,
            json={"model": M, "messages": messages, "system": "Be brief."},
        )
        assert count.status_code == 200, count.text
        used = httpx.post(
            f"{url}/v1/messages",
            timeout=60,
            json={"model": M, "messages": messages, "system": "Be brief.", "max_tokens": 1},
        ).json()
        assert count.json() == {"input_tokens": used["usage"]["input_tokens"]}
    unknown = httpx.post(f"{url}/v1/messages/count_tokens", timeout=60, json={"model": "nope", "messages": CHAT})
    assert unknown.status_code == 404 and unknown.json()["type"] == "error"


def test_anthropic_sampling_is_checked(url):
    for extra in ({"temperature": 1.5}, {"top_p": 2}, {"top_k": -1}):
        response = _post(url, Endpoint.MESSAGES, **extra)
        assert response.status_code == 400 and next(iter(extra)) in response.text
    greedy = _post(url, Endpoint.MESSAGES, temperature=0, max_tokens=12).json()["content"][0]["text"]
    for extra in ({"top_p": 0, "temperature": 1}, {"top_k": 1, "temperature": 1}):
        assert _post(url, Endpoint.MESSAGES, max_tokens=12, **extra).json()["content"][0]["text"] == greedy


def test_anthropic_output_format_parses(url):
    schema = {
        "type": "object",
        "properties": {"capital": {"type": "string", "maxLength": 24}},
        "required": ["capital"],
        "additionalProperties": False,
    }
    body = _post(
        url,
        Endpoint.MESSAGES,
        max_tokens=80,
        temperature=0,
        output_config={"format": {"type": "json_schema", "schema": schema}},
    ).json()
    assert body["stop_reason"] == "end_turn", body
    assert isinstance(json.loads(body["content"][0]["text"])["capital"], str)


def test_anthropic_reasoning_is_accepted(url):
    """A thinking budget or an effort on a model that does not reason is not spent: the
    greedy answer is the one without them, with no thinking block (as Claude Code sends
    them by default); a malformed budget is refused as Anthropic's API refuses it."""
    plain = _post(url, Endpoint.MESSAGES, temperature=0, max_tokens=12).json()
    for extra in (
        {"thinking": {"type": "adaptive"}, "output_config": {"effort": "high"}},
        {"thinking": {"type": "enabled", "budget_tokens": 1024}, "max_tokens": 2048},
        {"thinking": {"type": "disabled"}},
        {"output_config": {"effort": "max"}},
        {"thinking": {"type": "adaptive", "display": "omitted"}},
    ):
        body = _post(url, Endpoint.MESSAGES, **{"temperature": 0, "max_tokens": 12, **extra}).json()
        assert [b["type"] for b in body["content"]] == ["text"], (extra, body)
        assert body["content"][0]["text"].startswith(plain["content"][0]["text"]), (extra, body)
    counted = _post(url, Endpoint.COUNT_TOKENS, thinking={"type": "adaptive"})
    assert counted.status_code == 200 and counted.json()["input_tokens"] > 5
    for extra, named in (
        ({"thinking": {"type": "enabled", "budget_tokens": 4096}, "max_tokens": 4096}, "max_tokens"),
        ({"thinking": {"type": "enabled", "budget_tokens": 100}, "max_tokens": 4096}, "budget_tokens"),
        ({"thinking": {"type": "enabled"}}, "budget_tokens"),
        ({"output_config": {"effort": "extreme"}}, "effort"),
    ):
        response = _post(url, Endpoint.MESSAGES, **extra)
        assert response.status_code == 400 and named in response.json()["error"]["message"], response.text


def test_reasoning_settings_are_not_spent(url):
    """Chat Completions' reasoning_effort and verbosity on a model that does not reason:
    the greedy answer is the one without them; a value outside the reference's is named."""
    plain = _chat(url)["choices"][0]["message"]
    for extra in ({"reasoning_effort": "high"}, {"reasoning_effort": "none", "verbosity": "low"}):
        assert _chat(url, **extra)["choices"][0]["message"] == plain, extra
    response = _post(url, Endpoint.CHAT, reasoning_effort="extreme")
    assert response.status_code == 400 and response.json()["error"]["param"] == "reasoning_effort", response.text


def test_anthropic_context_edits(url):
    """clear_tool_uses clears old tool results once the prompt passes its trigger (the
    answer says what it cleared and its prompt shrinks); clear_thinking removes earlier
    turns' thinking; count_tokens reports the count before the edits."""
    result = "The weather report for Paris: " + "sunny and warm, " * 40
    turns: list[dict] = []
    for i in range(4):
        turns += [
            {"role": "user", "content": f"Weather {i}?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "I should call the tool.", "signature": "x"},
                    {"type": "tool_use", "id": f"toolu_{i}", "name": "weather", "input": {"city": "Paris"}},
                ],
            },
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"toolu_{i}", "content": result}]},
        ]
    tools = [
        {
            "name": "weather",
            "description": "the weather",
            "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
        }
    ]
    edits = {
        "edits": [
            {"type": "clear_thinking_20251015"},
            {
                "type": "clear_tool_uses_20250919",
                "trigger": {"type": "input_tokens", "value": 500},
                "keep": {"type": "tool_uses", "value": 1},
            },
        ]
    }
    whole = _post(url, Endpoint.MESSAGES, messages=turns, tools=tools, max_tokens=2).json()
    body = _post(url, Endpoint.MESSAGES, messages=turns, tools=tools, max_tokens=2, context_management=edits).json()
    applied = {e["type"]: e for e in body["context_management"]["applied_edits"]}
    assert applied["clear_thinking_20251015"]["cleared_thinking_turns"] == 3, body
    assert applied["clear_tool_uses_20250919"]["cleared_tool_uses"] == 3, body
    freed = prompt_of(whole["usage"]) - prompt_of(body["usage"])
    assert freed > 300 and abs(applied["clear_tool_uses_20250919"]["cleared_input_tokens"] - freed) < 30, (freed, body)
    counted = _post(url, Endpoint.COUNT_TOKENS, messages=turns, tools=tools, context_management=edits).json()
    assert counted == {
        "input_tokens": prompt_of(body["usage"]),
        "context_management": {"original_input_tokens": prompt_of(whole["usage"])},
    }
    untriggered = {"edits": [{"type": "clear_tool_uses_20250919"}]}  # 100,000 tokens: not reached
    body = _post(
        url, Endpoint.MESSAGES, messages=turns, tools=tools, max_tokens=2, context_management=untriggered
    ).json()
    assert body["context_management"] == {"applied_edits": []}
    assert prompt_of(body["usage"]) == prompt_of(whole["usage"])
    assert body["usage"]["cache_read_input_tokens"] > 0  # whole's prompt, cached


def prompt_of(usage: dict) -> int:
    """A prompt's tokens from Anthropic's usage: computed, written to the cache and read from it."""
    return usage["input_tokens"] + usage["cache_creation_input_tokens"] + usage["cache_read_input_tokens"]


def test_responses_format_and_logprobs(url):
    schema = {
        "type": "object",
        "properties": {"capital": {"type": "string", "maxLength": 24}},
        "required": ["capital"],
        "additionalProperties": False,
    }
    body = httpx.post(
        f"{url}/v1/responses",
        timeout=60,
        json={
            "model": M,
            "input": CAPITAL_QUESTION,
            "temperature": 0,
            "max_output_tokens": 80,
            "text": {"format": {"type": "json_schema", "name": "answer", "schema": schema}},
        },
    ).json()
    assert body["status"] == "completed", body
    assert isinstance(json.loads(body["output"][0]["content"][0]["text"])["capital"], str)
    body = httpx.post(
        f"{url}/v1/responses",
        timeout=60,
        json={
            "model": M,
            "input": CAPITAL_QUESTION,
            "temperature": 0,
            "max_output_tokens": 8,
            "top_logprobs": 2,
            "include": ["message.output_text.logprobs"],
        },
    ).json()
    part = body["output"][0]["content"][0]
    assert "".join(t["token"] for t in part["logprobs"]) == part["text"]
    _check_logprobs(part["logprobs"], 2)
