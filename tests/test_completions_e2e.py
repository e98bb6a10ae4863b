"""OpenAI's legacy Completions (``POST /v1/completions``) on the 3-node cluster."""

from __future__ import annotations

import json

import httpx
import pytest

from shardline.models.store import DEFAULT_MODEL_ID

pytestmark = pytest.mark.timeout(300)

PROMPT = "The capital of France is the city of"


def complete(url: str, **body) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"model": DEFAULT_MODEL_ID, "temperature": 0, **body}, timeout=120)


def test_a_text_prompt_is_continued(cluster3):
    response = complete(cluster3.url(0), prompt=PROMPT, max_tokens=6)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    choice = body["choices"][0]
    assert "Paris" in choice["text"] and not choice["text"].startswith(PROMPT)
    assert choice["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 6
    echoed = complete(cluster3.url(1), prompt=[PROMPT], max_tokens=6, echo=True).json()
    assert echoed["choices"][0]["text"] == PROMPT + choice["text"]
    default = complete(cluster3.url(2), prompt="Once upon a time", ignore_eos=True).json()
    assert default["usage"]["completion_tokens"] == 16  # OpenAI's default max_tokens here


def test_streamed_text_equals_the_whole_answer(cluster3):
    whole = complete(cluster3.url(0), prompt=PROMPT, max_tokens=8).json()["choices"][0]["text"]
    with httpx.stream(
        "POST",
        f"{cluster3.url(2)}/v1/completions",
        timeout=120,
        json={
            "model": DEFAULT_MODEL_ID,
            "prompt": PROMPT,
            "max_tokens": 8,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    ) as response:
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == whole
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    assert chunks[-1]["usage"]["completion_tokens"] == 8
    assert all("usage" in c and c["usage"] is None for c in chunks[:-1])


def test_token_id_prompts_are_taken_as_they_are(cluster3):
    echoed = complete(cluster3.url(0), prompt=PROMPT, max_tokens=1, echo=True).json()
    tokens = echoed["usage"]["prompt_tokens"]
    by_ids = complete(cluster3.url(0), prompt=list(range(100, 100 + tokens)), max_tokens=4, echo=True)
    assert by_ids.status_code == 200 and by_ids.json()["usage"]["prompt_tokens"] == tokens
    # one prompt in a batch of token-id lists (lm-evaluation-harness sends that), with a
    # special token: echoed as its piece, the text and the tokens in step
    scored = complete(cluster3.url(0), prompt=[[1, 504, 3575]], max_tokens=0, echo=True, logprobs=1)
    assert scored.status_code == 200, scored.text
    choice = scored.json()["choices"][0]
    assert choice["text"].startswith("<|im_start|>") and "".join(choice["logprobs"]["tokens"]) == choice["text"]
    assert len(choice["logprobs"]["tokens"]) == 3 and choice["logprobs"]["token_logprobs"][0] is None
    offsets = choice["logprobs"]["text_offset"]
    assert offsets == sorted(offsets)


def test_echo_with_logprobs_scores_the_prompt_as_lm_evaluation_harness_reads_it(cluster3):
    """``echo`` with ``logprobs`` (how lm-evaluation-harness scores a continuation): each
    prompt token's log-probability (the first null) before the generated ones'; scoring
    a greedy continuation as part of a prompt gives it back as the top token at each of
    its positions, with about the log-probabilities its decoding reported; streamed, the
    echoed prompt and its log-probabilities come first, once it is prefilled."""
    greedy = complete(cluster3.url(0), prompt=PROMPT, max_tokens=3, logprobs=1).json()["choices"][0]
    body = complete(cluster3.url(1), prompt=PROMPT + greedy["text"], max_tokens=1, logprobs=1, echo=True).json()
    choice, n = body["choices"][0], body["usage"]["prompt_tokens"]
    scores = choice["logprobs"]
    assert len(scores["tokens"]) == len(scores["token_logprobs"]) == n + 1
    assert scores["token_logprobs"][0] is None and scores["top_logprobs"][0] is None
    assert all(lp <= 0 for lp in scores["token_logprobs"][1:])
    assert "".join(scores["tokens"][:n]) == PROMPT + greedy["text"]
    assert scores["text_offset"][:2] == [0, len(scores["tokens"][0])]
    continuation = range(n - 3, n)  # the greedy tokens, now in the prompt
    assert [scores["tokens"][i] for i in continuation] == greedy["logprobs"]["tokens"]
    for i, decoded in zip(continuation, greedy["logprobs"]["token_logprobs"]):
        assert list(scores["top_logprobs"][i]) == [scores["tokens"][i]]  # greedy at each
        assert scores["token_logprobs"][i] == pytest.approx(decoded, abs=0.1)  # prefill, decode
    with httpx.stream(
        "POST",
        f"{cluster3.url(2)}/v1/completions",
        timeout=120,
        json={
            "model": DEFAULT_MODEL_ID,
            "prompt": PROMPT,
            "max_tokens": 2,
            "temperature": 0,
            "logprobs": 0,
            "echo": True,
            "stream": True,
        },
    ) as response:
        chunks = [
            json.loads(line[6:])
            for line in response.iter_lines()
            if line.startswith("data: ") and line != "data: [DONE]"
        ]
    opening = chunks[0]["choices"][0]
    assert opening["text"] == PROMPT and opening["logprobs"]["token_logprobs"][0] is None
    assert len(opening["logprobs"]["tokens"]) == n - 3 and opening["logprobs"]["top_logprobs"][1] == {}
    # max_tokens 0: the prompt scored alone, as the legacy API did
    alone = complete(cluster3.url(0), prompt=PROMPT + greedy["text"], max_tokens=0, logprobs=1, echo=True).json()
    assert alone["choices"][0]["text"] == PROMPT + greedy["text"]
    assert alone["choices"][0]["finish_reason"] == "length" and alone["usage"]["completion_tokens"] == 0
    assert alone["choices"][0]["logprobs"]["token_logprobs"] == scores["token_logprobs"][:n]


def test_logprobs_describe_the_text_sent(cluster3):
    """The tokens that spelled any of a stop string are not in ``logprobs`` (its text is
    not in the answer), and ``text_offset`` follows the text through characters split
    across tokens, streamed or whole."""
    greedy = complete(cluster3.url(0), prompt=PROMPT, max_tokens=8, logprobs=0).json()["choices"][0]
    # a stop string that starts inside a token, after the first two
    stop = next(t for t in greedy["logprobs"]["tokens"][2:] if len(t) >= 2)[1:]
    for stream in (False, True):
        body = {
            "model": DEFAULT_MODEL_ID,
            "temperature": 0,
            "prompt": PROMPT,
            "max_tokens": 8,
            "logprobs": 0,
            "stop": [stop],
            "stream": stream,
        }
        if stream:
            with httpx.stream("POST", f"{cluster3.url(1)}/v1/completions", json=body, timeout=120) as response:
                chunks = [
                    json.loads(line[6:])["choices"][0]
                    for line in response.iter_lines()
                    if line.startswith("data: ") and line != "data: [DONE]"
                ]
            text = "".join(c["text"] for c in chunks)
            tokens = [t for c in chunks if c["logprobs"] for t in c["logprobs"]["tokens"]]
        else:
            choice = httpx.post(f"{cluster3.url(1)}/v1/completions", json=body, timeout=120).json()["choices"][0]
            text, tokens = choice["text"], choice["logprobs"]["tokens"]
        cut = greedy["text"].find(stop)  # (the stop string may come before the 4th token)
        kept = [
            t for t, at in zip(greedy["logprobs"]["tokens"], greedy["logprobs"]["text_offset"]) if at + len(t) <= cut
        ]
        assert text == greedy["text"][:cut] and tokens == kept
    odd = "Tokyo is 東京 🙂, café."
    scored = complete(cluster3.url(2), prompt="Say: " + odd, max_tokens=0, echo=True, logprobs=5).json()
    choice = scored["choices"][0]
    tokens, offsets = choice["logprobs"]["tokens"], choice["logprobs"]["text_offset"]
    assert any(t.startswith("bytes:") for t in tokens)  # some characters are split across tokens
    assert offsets == sorted(offsets) and offsets[-1] < len(choice["text"])
    for token, offset in zip(tokens, offsets):
        if not token.startswith("bytes:"):
            assert choice["text"][offset : offset + len(token)] == token
    assert offsets[-1] + len(tokens[-1]) == len(choice["text"])
    assert all(len(top) == 5 for top in choice["logprobs"]["top_logprobs"][1:])  # none overwritten
    # an output that ends inside a character keeps the text before it, and reads U+FFFD
    for max_tokens in (1, 2):
        cut = complete(cluster3.url(0), prompt="🎉🎉🎉🎉🎉", max_tokens=max_tokens, logprobs=0).json()["choices"][0]
        last, at = cut["logprobs"]["tokens"][-1], cut["logprobs"]["text_offset"][-1]
        assert last.startswith("bytes:") and at < len(cut["text"]) and cut["text"].endswith("\ufffd"), cut


@pytest.mark.parametrize(
    "body, param, words",
    [
        ({"prompt": [1, 2, 10**9]}, "prompt", "outside the vocabulary"),
        ({"prompt": ["one", "two"]}, "prompt", "one prompt per request"),
        ({"prompt": [[1, 2], [3]]}, "prompt", "one prompt per request"),
        ({"prompt": ""}, "prompt", None),
        ({"prompt": "hi", "max_tokens": 0}, "max_tokens", "0 only with echo"),
        ({"prompt": "hi", "max_tokens": 10**6}, "max_tokens", "context"),
        ({"prompt": "hi", "suffix": "tail"}, "suffix", None),
    ],
)
def test_bad_completions_get_openai_errors(cluster3, body, param, words):
    response = complete(cluster3.url(1), **body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    if words:
        assert words in error["message"]
    assert complete(cluster3.url(1), prompt=PROMPT, max_tokens=2).status_code == 200
