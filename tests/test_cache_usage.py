"""The prompt tokens a prefix cache held, as each API reports them (in process: a
:class:`~shardline.api.text_stream.Generation` on a scripted stream whose events say 128
of its 200 prompt tokens were cached and 64 more were left in the cache), checked against
the official ``openai``, ``anthropic`` and ``ollama`` packages' types."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import anthropic.types as at
import ollama
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.responses import Response
from test_reasoning_api import END, ID, PLAIN_TEMPLATE, FakeTokenizer, drain, sse_data

from shardline.api import anthropic as anthropic_api
from shardline.api import ollama as ollama_api
from shardline.api import openai as openai_api
from shardline.api.anthropic_request import MessagesRequest
from shardline.api.keep_alive import KeepAlive
from shardline.api.responses_output import OutputBuilder, Piece, usage_object
from shardline.api.responses_request import check_fields
from shardline.api.text_stream import Chunk, Generation, GenerationRequest
from shardline.runner.protocol import PrefillProgress, SamplingParams, TokenEvent

pytestmark = pytest.mark.fast

PROMPT, CACHED, WRITTEN = 200, 128, 64


class CachedRouter:
    """The events of a request whose prompt resumed from a cached prefix."""

    async def generate(self, request, task_id, ran_on, on):
        yield PrefillProgress(0, 192, PROMPT, cached=CACHED)
        yield PrefillProgress(0, PROMPT, PROMPT, cached=CACHED)
        yield TokenEvent(0, ID["Paris"], None, PROMPT, cached_tokens=CACHED)
        yield TokenEvent(0, END, "stop", PROMPT, cached_tokens=CACHED, cache_written=WRITTEN)


def generation() -> Generation:
    req = GenerationRequest(
        model="m", prompt=[{"role": "user", "content": "hi"}], sampling=SamplingParams(1.0, 1.0, 0, None)
    )
    inst = SimpleNamespace(
        context=400, instance_id="i" * 12, sharding="pipeline", ranks=(0,), dtype="float32", quantize=None
    )
    node = SimpleNamespace(router=CachedRouter())
    return Generation(node, req, [ID["Paris"]] * PROMPT, inst, FakeTokenizer(PLAIN_TEMPLATE))  # type: ignore[arg-type]


def run(gen: Generation) -> list[Chunk]:
    async def collect():
        return [c async for c in gen.texts() if isinstance(c, Chunk)]

    return asyncio.run(collect())


def test_openai_chat_reports_cached_prompt_tokens_and_llama_cpp_progress():
    req = openai_api.ChatCompletionRequest(
        model="m",
        messages=[{"role": "user", "content": "hi"}],
        stream=True,
        stream_options={"include_usage": True},
        return_progress=True,
    )
    gen = generation()
    shape = openai_api.ChatShape(req, [gen], "chatcmpl-1", 0)
    chunks = sse_data(asyncio.run(drain(openai_api._stream([gen], shape, True, req.stream_options, 60))))
    progress = [c["prompt_progress"] for c in chunks if "prompt_progress" in c]
    assert [(p["total"], p["cache"], p["processed"]) for p in progress] == [(200, 128, 192), (200, 128, 200)]
    usage = ChatCompletionChunk.model_validate(chunks[-1]).usage
    assert usage is not None and usage.prompt_tokens == PROMPT
    assert usage.prompt_tokens_details is not None and usage.prompt_tokens_details.cached_tokens == CACHED

    whole = generation()
    shape = openai_api.ChatShape(openai_api.ChatCompletionRequest(model="m", messages=req.messages), [whole], "c-2", 0)
    answer = ChatCompletion.model_validate(shape.whole([shape.choice(0, run(whole), "stop")]))
    assert answer.usage is not None and answer.usage.prompt_tokens_details is not None
    assert answer.usage.prompt_tokens_details.cached_tokens == CACHED


def test_responses_report_cached_and_written_input_tokens():
    builder = OutputBuilder(check_fields({"model": "m", "input": "hi"}), "resp_1", 0)
    builder.feed(Piece(text="Paris"))
    builder.finish("stop", usage_object(PROMPT, 2, 0, CACHED, WRITTEN))
    usage = Response.model_validate(builder.response).usage
    assert usage is not None and usage.input_tokens == PROMPT
    assert usage.input_tokens_details.cached_tokens == CACHED
    assert (usage.input_tokens_details.model_extra or {}).get("cache_write_tokens", WRITTEN) == WRITTEN


def test_anthropic_usage_splits_the_prompt_into_read_written_and_input():
    expected = {
        "input_tokens": PROMPT - CACHED - WRITTEN,
        "cache_creation_input_tokens": WRITTEN,
        "cache_read_input_tokens": CACHED,
    }
    req = MessagesRequest(model="m", max_tokens=16, stream=True, messages=[{"role": "user", "content": "hi"}])
    events = sse_data(asyncio.run(drain(anthropic_api._stream(generation(), req, "msg_1", [], 60))))
    start, delta = events[0], next(e for e in events if e["type"] == "message_delta")
    assert start["message"]["usage"]["input_tokens"] == PROMPT  # before the prompt was looked up
    usage = at.MessageDeltaUsage.model_validate(delta["usage"])
    assert (usage.input_tokens, usage.cache_creation_input_tokens, usage.cache_read_input_tokens) == tuple(
        expected.values()
    )
    gen = generation()
    run(gen)
    whole = at.Usage.model_validate(dict(anthropic_api._input_usage(gen), output_tokens=2))
    assert whole.model_dump(include=set(expected)) == expected


def test_ollama_counts_only_the_prompt_tokens_it_computed():
    req = ollama_api.ChatRequest(model="m", messages=[{"role": "user", "content": "hi"}])
    lines = asyncio.run(
        drain(ollama_api._stream(None, generation(), req, ollama_api._chat_message, KeepAlive(), [], None, 0.0, 60))
    )
    last = ollama.ChatResponse.model_validate(json.loads(lines[-1]))
    assert last.done and last.prompt_eval_count == PROMPT - CACHED


def test_metrics_give_each_ranks_prefix_cache_and_hit_rate():
    from prometheus_client import CollectorRegistry, generate_latest

    from shardline.api.metrics import _ClusterCollector

    node = SimpleNamespace(
        live_node_ids=lambda: ["n"],
        instances={},
        info=lambda: SimpleNamespace(available_bytes=1),
        router=SimpleNamespace(continuations={}),
        engine_stats={
            "inst": {
                "running": (),
                "waiting": (),
                "cached_tokens": 640,
                "cached_bytes": 640 * 2304,
                "prompt_tokens": 1000,
                "reused_tokens": 576,
                "drafted_tokens": 300,
                "accepted_tokens": 210,
            }
        },
    )
    registry = CollectorRegistry()
    registry.register(_ClusterCollector(node))  # type: ignore[arg-type]
    text = generate_latest(registry).decode()
    for line in (
        'shardline_prefix_cache_tokens{instance="inst"} 640.0',
        'shardline_prefix_cache_bytes{instance="inst"} 1.47456e+06',
        'shardline_rank_prompt_tokens_total{instance="inst"} 1000.0',
        'shardline_rank_reused_prompt_tokens_total{instance="inst"} 576.0',
        'shardline_rank_drafted_tokens_total{instance="inst"} 300.0',
        'shardline_rank_accepted_draft_tokens_total{instance="inst"} 210.0',
    ):
        assert line in text, text
