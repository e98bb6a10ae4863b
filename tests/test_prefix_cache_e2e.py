"""A 3-turn chat through each of the official ``openai``, ``anthropic`` and ``ollama``
packages against one node serving the real model (conftest's ``cluster1``): turns 2 and 3
resume from the prefix cache, and each client reads the cached tokens where its API puts
them (Ollama's ``prompt_eval_count`` counts only the tokens computed)."""

from __future__ import annotations

import anthropic
import ollama
import openai
import pytest

from shardline.bench.bench import build_prompt
from shardline.models.store import DEFAULT_MODEL_ID as M

pytestmark = pytest.mark.timeout(180)

QUESTIONS = ["What is the text about?", "Name one place in it.", "And one person?"]


def system(variant: int) -> str:
    """A system prompt of about 300 tokens, its own per client from its first words: a hit
    from another test's is only the chat template's few tokens before it
    (:data:`TEMPLATE_HEADER`)."""
    return f"Conversation {variant}. " + build_prompt(220, 200 + variant)


TEMPLATE_HEADER = 8
"""At most the tokens every conversation's prompt starts with (SmolLM2's template:
``<|im_start|>system\n`` and the first words), which a first turn finds cached (the prefix
cache matches token by token)."""


@pytest.fixture(scope="module")
def url(cluster1) -> str:
    return cluster1.url(0)


def test_openai_client_sees_cached_tokens_on_later_turns(url):
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    messages: list[dict] = [{"role": "system", "content": system(1)}]
    cached = []
    for question in QUESTIONS:
        messages.append({"role": "user", "content": question})
        answer = client.chat.completions.create(model=M, messages=messages, temperature=0, max_tokens=8)
        assert answer.usage is not None and answer.usage.prompt_tokens_details is not None
        cached.append(answer.usage.prompt_tokens_details.cached_tokens)
        messages.append({"role": "assistant", "content": answer.choices[0].message.content})
    assert cached[0] <= TEMPLATE_HEADER and cached[1] > 150 and cached[2] > cached[1], cached


def test_anthropic_client_sees_cache_reads_on_later_turns(url):
    client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
    messages: list[dict] = []
    reads, totals = [], []
    for turn, question in enumerate(QUESTIONS):
        messages.append({"role": "user", "content": question})
        if turn < 2:
            answer = client.messages.create(
                model=M, max_tokens=8, system=system(2), messages=messages, extra_body={"temperature": 0}
            )
        else:  # streamed: the usage of message_delta, as the SDK accumulates it
            with client.messages.stream(
                model=M, max_tokens=8, system=system(2), messages=messages, extra_body={"temperature": 0}
            ) as stream:
                answer = stream.get_final_message()
        usage = answer.usage
        reads.append(usage.cache_read_input_tokens)
        totals.append(usage.input_tokens + (usage.cache_creation_input_tokens or 0) + (reads[-1] or 0))
        messages.append({"role": "assistant", "content": answer.content[0].text})
    assert reads[0] <= TEMPLATE_HEADER and reads[1] > 150 and reads[2] > reads[1], reads
    assert totals[0] < totals[1] < totals[2]  # the whole prompt, however it was split


def test_ollama_client_counts_only_the_tokens_it_computed(url):
    client = ollama.Client(host=url)
    messages: list[dict] = [{"role": "system", "content": system(3)}]
    computed = []
    for question in QUESTIONS:
        messages.append({"role": "user", "content": question})
        answer = client.chat(model=M, messages=messages, options={"temperature": 0, "num_predict": 8})
        computed.append(answer.prompt_eval_count)
        messages.append({"role": "assistant", "content": answer.message.content})
    assert computed[0] > 250 and computed[1] < computed[0] / 2 and computed[2] < computed[0] / 2, computed


def test_cache_prompt_false_prefills_the_whole_prompt(url):
    """llama.cpp's ``cache_prompt``: false takes nothing from the cache (the same greedy
    text); the next request, with it, still finds the prefix."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    messages = [{"role": "system", "content": system(4)}, {"role": "user", "content": QUESTIONS[0]}]

    def ask(**extra) -> tuple[int, str]:
        answer = client.chat.completions.create(
            model=M, messages=messages, temperature=0, max_tokens=8, extra_body=extra
        )
        assert answer.usage is not None and answer.usage.prompt_tokens_details is not None
        return answer.usage.prompt_tokens_details.cached_tokens, answer.choices[0].message.content

    first = ask()
    uncached = ask(cache_prompt=False)
    cached = ask(cache_prompt=True)
    assert first[0] <= TEMPLATE_HEADER and uncached[0] == 0 and cached[0] > 150, (first, uncached, cached)
    assert first[1] == uncached[1] == cached[1]
