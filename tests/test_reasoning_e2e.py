"""A reasoning model's thinking through a node, with the official ``openai``, ``anthropic``
and ``ollama`` clients: a tiny random-weight Qwen3 model with a reasoning template whose
generation prompt opens ``<think>`` unless ``enable_thinking`` is false (tests/tiny_chat.py,
style "qwen3"). Its text is noise: an output cut off by its limit is all reasoning where
the prompt opened the thinking, all answer where it closed it; a logit bias on ``</think>``
(an added token, id 49153) closes it at once."""

from __future__ import annotations

import anthropic
import ollama
import openai
import pytest
from conftest import free_port_block
from tiny_chat import THINK_TOKENS, write_tiny_chat_model

from shardline.local_cluster import LocalCluster
from shardline.models.tokenizer import Tokenizer

pytestmark = pytest.mark.timeout(300)

MODEL = "qwen3"
CLOSE = THINK_TOKENS["</think>"]
ASK = [{"role": "user", "content": "What is the capital of France?"}]
NOISE = 6  # tokens of output: the limit of every request here


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(the node's URL, the model's directory): one node serving the tiny reasoning model."""
    root = tmp_path_factory.mktemp("reasoning")
    directory = write_tiny_chat_model(root / "models" / MODEL, MODEL)
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
        cluster.place(str(directory), "pipeline")
        yield cluster.url(0), directory
    finally:
        cluster.stop()


def test_thinking_off_is_rendered_as_enable_thinking_false(served):
    tokenizer = Tokenizer(served[1])
    assert tokenizer.reasons
    assert tokenizer.render_chat(ASK, thinking=False).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    for thinking in (True, None):
        assert tokenizer.render_chat(ASK, thinking=thinking).endswith("<|im_start|>assistant\n<think>\n")


def test_an_effort_reaches_a_template_that_reads_it(tmp_path):
    """gpt-oss's template writes ``Reasoning: <level>`` from ``reasoning_effort``
    (medium where none is given); a template that does not read it renders the same."""
    from tiny_chat import write_chat_tokenizer

    directory = write_chat_tokenizer(tmp_path / "effort", "qwen")
    (directory / "chat_template.jinja").write_text(
        "{%- if reasoning_effort is not defined %}{%- set reasoning_effort = 'medium' %}{%- endif -%}"
        "{{ 'Reasoning: ' + reasoning_effort + '\\n' }}{%- for m in messages %}{{ m.content }}{%- endfor -%}"
    )
    effortful = Tokenizer(directory)
    assert effortful.render_chat(ASK) == "Reasoning: medium\n" + ASK[0]["content"]
    for effort, level in (("minimal", "low"), ("high", "high"), ("max", "high")):
        assert effortful.render_chat(ASK, effort=effort).startswith(f"Reasoning: {level}\n")
        ids = effortful.encode_chat(ASK, effort=effort)
        assert effortful.decode(ids).startswith(f"Reasoning: {level}"), effort
    plain = Tokenizer(write_chat_tokenizer(tmp_path / "plain", "qwen"))
    assert plain.render_chat(ASK, effort="high") == plain.render_chat(ASK)


def test_chat_completions(served):
    client = openai.OpenAI(base_url=f"{served[0]}/v1", api_key="unused", max_retries=0)
    args = dict(model=MODEL, messages=ASK, max_tokens=NOISE, temperature=0)
    no_close = {"ignore_eos": True, "logit_bias": {str(CLOSE): -100}}

    thought = client.chat.completions.create(**args, extra_body=no_close)
    message = thought.choices[0].message
    reasoning = (message.model_extra or {})["reasoning_content"]
    assert reasoning and message.content == ""
    assert thought.usage.completion_tokens_details.reasoning_tokens == NOISE

    streamed = client.chat.completions.create(
        **args, extra_body=no_close, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(streamed)
    assert (
        "".join((c.choices[0].delta.model_extra or {}).get("reasoning_content") or "" for c in chunks if c.choices)
        == reasoning
    )
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == NOISE

    answered = client.chat.completions.create(**args, reasoning_effort="none", extra_body=no_close)
    message = answered.choices[0].message
    assert (message.model_extra or {})["reasoning_content"] is None and message.content
    assert answered.usage.completion_tokens_details.reasoning_tokens == 0

    closed = client.chat.completions.create(**args, extra_body={"ignore_eos": True, "logit_bias": {str(CLOSE): 100}})
    message = closed.choices[0].message
    assert (message.model_extra or {})["reasoning_content"] is None  # <think>\n</think>: no reasoning
    assert message.content == "</think>" * (NOISE - 1)  # after the first, the answer's text
    assert closed.usage.completion_tokens_details.reasoning_tokens == 1


def test_anthropic_thinking_blocks(served):
    client = anthropic.Anthropic(base_url=served[0], api_key="unused", max_retries=0)
    args = dict(model=MODEL, messages=ASK, max_tokens=NOISE, extra_body={"temperature": 0})  # not in this SDK's
    with client.messages.stream(**args, thinking={"type": "adaptive"}) as stream:
        message = stream.get_final_message()
    assert [b.type for b in message.content] == ["thinking", "text"]
    assert message.content[0].thinking and message.content[1].text == ""
    assert message.stop_reason == "max_tokens"
    whole = client.messages.create(**args, thinking={"type": "adaptive"})
    assert whole.content[0].type == "thinking" and whole.content[0].thinking == message.content[0].thinking
    plain = client.messages.create(**args)  # no thinking: the template closes it
    assert [b.type for b in plain.content] == ["text"] and plain.content[0].text


def test_responses_reasoning_item(served):
    client = openai.OpenAI(base_url=f"{served[0]}/v1", api_key="unused", max_retries=0)
    first = client.responses.create(model=MODEL, input="Hi", max_output_tokens=NOISE, temperature=0)
    assert [item.type for item in first.output] == ["reasoning", "message"]
    assert first.output[0].content[0].text
    assert first.usage.output_tokens_details.reasoning_tokens == first.usage.output_tokens
    then = client.responses.create(
        model=MODEL,
        input="And?",
        max_output_tokens=NOISE,
        temperature=0,
        previous_response_id=first.id,
        reasoning={"effort": "none"},
    )
    assert [item.type for item in then.output] == ["message"]  # the stored reasoning item left out
    assert then.usage.output_tokens_details.reasoning_tokens == 0


def test_ollama_think(served):
    client = ollama.Client(host=served[0])
    options = {"num_predict": NOISE, "temperature": 0}
    thought = client.chat(model=MODEL, messages=ASK, think=True, options=options)
    assert thought.message.thinking and thought.message.content == ""
    answered = client.chat(model=MODEL, messages=ASK, think=False, options=options)
    assert answered.message.thinking is None and answered.message.content
    generated = client.generate(model=MODEL, prompt="Hi", think=True, options=options)
    assert generated.thinking and generated.response == ""
