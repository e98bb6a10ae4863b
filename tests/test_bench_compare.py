"""``shardline bench``'s pure parts: the workloads it plans, the interleaved order, ratios,
medians over rounds, the comparison's rows and printed table, the prompts and the options
it refuses (no server; milliseconds each)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from shardline import cli
from shardline.api.params import Endpoint, screen
from shardline.bench.bench import (
    agent_system_prompt,
    build_prompt,
    chat_question,
    edit_request,
    run_conversation,
    run_edits,
    stream_request,
)
from shardline.bench.compare import (
    LEVEL_FIGURES,
    Workload,
    combine_rounds,
    figures_of,
    interleave,
    plan_workloads,
    ratio,
    report_rows,
)
from shardline.bench.report import conversation_line, edit_line

pytestmark = pytest.mark.fast


@pytest.mark.parametrize(
    "prompts, concurrency, runs, chat, expected",
    [
        ([512], [1], 3, 0, [("prompt 512 c=1", "level", 512, 1, 3)]),
        (
            [128, 2048],
            [1, 8],
            3,
            4,
            [
                ("prompt 128 c=1", "level", 128, 1, 3),
                ("prompt 128 c=8", "level", 128, 8, 8),
                ("prompt 2048 c=1", "level", 2048, 1, 3),
                ("prompt 2048 c=8", "level", 2048, 8, 8),
                ("short chat", "chat", None, 1, 4),
            ],
        ),
        ([32], [2], 1, 2, [("prompt 32 c=2", "level", 32, 2, 2), ("short chat", "chat", None, 1, 2)]),
    ],
)
def test_plan_workloads(prompts, concurrency, runs, chat, expected):
    assert plan_workloads(prompts, concurrency, runs, chat) == [Workload(*e) for e in expected]


def test_a_conversation_comes_last():
    assert plan_workloads([32], [1], 1, 0, turns=8, turn_tokens=250)[-1] == Workload(
        "conversation 8 turns", "turns", 250, 1, 8
    )


@pytest.mark.parametrize(
    "workloads, servers, rounds, expected",
    [
        (["w"], ["a"], 1, [(0, "w", "a")]),
        (
            ["w", "v"],
            ["a", "b"],
            2,
            [
                (0, "w", "a"),
                (0, "w", "b"),
                (0, "v", "a"),
                (0, "v", "b"),
                (1, "w", "a"),
                (1, "w", "b"),
                (1, "v", "a"),
                (1, "v", "b"),
            ],
        ),
        (
            ["w"],
            ["a", "b"],
            3,
            [(0, "w", "a"), (0, "w", "b"), (1, "w", "a"), (1, "w", "b"), (2, "w", "a"), (2, "w", "b")],
        ),
        (["w"], ["a", "b"], 0, []),
    ],
)
def test_interleave_alternates_servers_within_every_unit(workloads, servers, rounds, expected):
    assert interleave(workloads, servers, rounds) == expected


@pytest.mark.parametrize(
    "value, other, expected",
    [
        (94.0, 182.0, 94.0 / 182.0),
        (33.0, 83.0, 33.0 / 83.0),
        (5.0, 5.0, 1.0),
        (None, 3.0, None),
        (3.0, None, None),
        (3.0, 0.0, None),
        (0.0, 3.0, 0.0),
    ],
)
def test_ratio(value, other, expected):
    assert ratio(value, other) == expected


def _level(ttft, prefill, decode, aggregate, prompt=100, completion=8, requests=1, usage="usage"):
    return {
        "median_ttft_ms": ttft,
        "median_prefill_tokens_per_s": prefill,
        "median_decode_tokens_per_s": decode,
        "aggregate_decode_tokens_per_s": aggregate,
        "median_prompt_tokens": prompt,
        "median_completion_tokens": completion,
        "requests": requests,
        "usage_from": usage,
    }


@pytest.mark.parametrize(
    "rounds, expected",
    [
        (
            [_level(10, 100, 50, 40)],
            {
                "median_ttft_ms": 10,
                "median_prefill_tokens_per_s": 100,
                "median_decode_tokens_per_s": 50,
                "aggregate_decode_tokens_per_s": 40,
                "requests": 1,
                "usage_from": "usage",
            },
        ),
        # medians per figure, each over its own rounds: an outlier round moves none of them
        (
            [_level(10, 100, 50, 40), _level(90, 10, 5, 4), _level(12, 120, 52, 42)],
            {
                "median_ttft_ms": 12,
                "median_prefill_tokens_per_s": 100,
                "median_decode_tokens_per_s": 50,
                "aggregate_decode_tokens_per_s": 40,
                "requests": 3,
                "usage_from": "usage",
            },
        ),
        (
            [_level(10, 100, None, 40), _level(20, 200, 60, 50, usage="chunks")],
            {
                "median_ttft_ms": 15,
                "median_prefill_tokens_per_s": 150,
                "median_decode_tokens_per_s": 60,
                "aggregate_decode_tokens_per_s": 45,
                "requests": 2,
                "usage_from": "chunks",
            },
        ),
    ],
)
def test_combine_rounds_takes_medians(rounds, expected):
    out = combine_rounds(rounds, LEVEL_FIGURES)
    assert {k: out[k] for k in expected} == expected


def _workload(name, kind, a, b):
    return {"name": name, "kind": kind, "results": {"shardline": {"figures": a}, "other": {"figures": b}}}


def test_report_rows_give_both_values_the_ratio_and_the_direction():
    level_a = {
        "median_ttft_ms": 50.0,
        "median_prefill_tokens_per_s": 2000.0,
        "median_decode_tokens_per_s": 100.0,
        "aggregate_decode_tokens_per_s": None,
    }
    level_b = {
        "median_ttft_ms": 100.0,
        "median_prefill_tokens_per_s": 500.0,
        "median_decode_tokens_per_s": 200.0,
        "aggregate_decode_tokens_per_s": 150.0,
    }
    rows = report_rows(
        [
            _workload("prompt 512 c=1", "level", level_a, level_b),
            _workload("short chat", "chat", {"median_ttft_ms": 33.0}, {"median_ttft_ms": 83.0}),
        ]
    )
    got = [(r["workload"], r["figure"], r["shardline"], r["other"], r["ratio"], r["better"]) for r in rows]
    assert got == [
        ("prompt 512 c=1", "TTFT ms", 50.0, 100.0, 0.5, "lower"),
        ("prompt 512 c=1", "prefill tok/s", 2000.0, 500.0, 4.0, "higher"),
        ("prompt 512 c=1", "decode tok/s", 100.0, 200.0, 0.5, "higher"),
        ("prompt 512 c=1", "aggregate tok/s", None, 150.0, None, "higher"),
        ("short chat", "TTFT ms", 33.0, 83.0, 33.0 / 83.0, "lower"),
    ]


def test_comparison_table_prints_both_servers_and_the_ratio():
    from rich.console import Console

    from shardline.bench.report import print_comparison

    def server(name, url):
        return {
            "name": name,
            "url": url,
            "model": "m",
            "nodes": None,
            "sharding": None,
            "prompts": [{"target": 512, "words": 300, "tokens": 511}],
            "chat_prompt_tokens": 37,
            "usage_from": "usage",
        }

    report = {
        "config": {"prompt_tokens": [512], "gen_tokens": 128, "concurrency": [1], "rounds": 3},
        "servers": [server("shardline", "http://a:1"), server("other", "http://b:2")],
        "aggregate_definition": "aggregate",
        "rows": [
            {
                "workload": "prompt 2048 c=8",
                "figure": "aggregate tok/s",
                "shardline": 12345.6,
                "other": 2345.6,
                "ratio": 12345.6 / 2345.6,
                "better": "higher",
            },
            {
                "workload": "short chat",
                "figure": "TTFT ms",
                "shardline": 33.0,
                "other": 83.0,
                "ratio": 33.0 / 83.0,
                "better": "lower",
            },
        ],
    }
    console = Console(record=True, width=80)  # a terminal's usual width: nothing cut short
    print_comparison(report, console)
    text = console.export_text()
    line = next(line for line in text.splitlines() if "short chat" in line)
    assert [c.strip() for c in line.split("│") if c.strip()] == [
        "short chat",
        "TTFT ms",
        "33.0",
        "83.0",
        "0.40x",
        "lower",
    ]
    assert "http://b:2" in text and "512→511" in text and "3 rounds" in text
    assert "…" not in text and "12,345.6" in text and "5.26x" in text


def test_prompts_differ_from_request_to_request():
    texts = [build_prompt(40, v) for v in range(240)]
    assert len({t.split("\n\n", 1)[1][:60] for t in texts}) == 240  # different right after the instruction
    assert all(len(t.split("\n\n", 1)[1].split()) == 40 for t in texts)
    assert len({chat_question(v) for v in range(12)}) == 12


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--against-model", "m"], "--against-model needs --against URL"),
        (["--against-api-key", "k"], "--against-api-key needs --against URL"),
        (["--rounds", "0"], "--rounds must be at least 1"),
        (["--chat-requests", "-1"], "--chat-requests must be at least 0"),
        (["--prompt-tokens", "128", "0"], "--prompt-tokens values must be at least 1"),
        (["--prompt-tokens", "128", "128"], "--prompt-tokens values must differ (each gives its own levels)"),
        (["--concurrency", "1", "4", "1"], "--concurrency values must differ (each gives its own levels)"),
    ],
)
def test_bad_options_are_one_line_errors(argv, message, capsys):
    assert cli.main(["bench", "--url", "http://127.0.0.1:1", *argv]) == 1
    assert capsys.readouterr().err.strip() == f"shardline bench: {message}"


def _sse(*events: dict) -> bytes:
    return b"".join(f"data: {json.dumps(e)}\n\n".encode() for e in events) + b"data: [DONE]\n\n"


@pytest.mark.parametrize(
    "usage, expected",
    [
        # the stream's usage wins over the chunks counted
        ({"prompt_tokens": 40, "completion_tokens": 3}, (40, 3, "usage")),
        # no usage (a server without stream_options): content chunks counted, calibrated prompt length
        (None, (37, 2, "chunks")),
    ],
)
def test_stream_request_counts_chunks_where_the_stream_has_no_usage(usage, expected):
    events = [
        {"choices": [{"delta": {"role": "assistant"}}]},
        {"choices": [{"delta": {"content": "Hel"}}]},
        {"choices": [{"delta": {"content": "lo"}}]},
        {"choices": [{"delta": {}, "finish_reason": "length"}]},
    ]
    if usage:
        events.append({"choices": [], "usage": usage})
    bodies = []

    def handler(request: httpx.Request) -> httpx.Response:
        bodies.append(request.content)
        return httpx.Response(200, content=_sse(*events), headers={"content-type": "text/event-stream"})

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await stream_request(client, "http://x", "m", "hi", 3, prompt_tokens=37)

    result = asyncio.run(go())
    assert (result.prompt_tokens, result.completion_tokens, result.usage_from) == expected
    assert len(result.chunk_times_s) == 2 and result.ttft_s == result.chunk_times_s[0]
    body = json.loads(bodies[0])
    # only fields vLLM and llama-server take, and shardline's parameter screen lets pass
    assert set(body) == {"model", "messages", "temperature", "max_tokens", "ignore_eos", "stream", "stream_options"}
    assert body["stream_options"] == {"include_usage": True}
    assert screen(Endpoint.CHAT, body) == body


def test_a_conversation_sends_the_chat_so_far_with_each_answer_then_again_without_the_cache():
    bodies = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        bodies.append(body)
        turn = (len(bodies) + 1) // 2
        uncached = body.get("cache_prompt") is False
        events = [
            {"choices": [{"delta": {"content": f"{'again' if uncached else 'answer'} {turn}"}}]},
            {
                "choices": [],
                "usage": {
                    "prompt_tokens": 100 * turn,
                    "completion_tokens": 2,
                    "prompt_tokens_details": {"cached_tokens": 0 if uncached else 90 * (turn - 1)},
                },
            },
        ]
        return httpx.Response(200, content=_sse(*events), headers={"content-type": "text/event-stream"})

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await run_conversation(client, "http://x", "m", ["one", "two", "three"], 2, system="tools")

    result = asyncio.run(go())
    cached, again = bodies[0::2], bodies[1::2]
    assert [m["content"] for m in cached[-1]["messages"]] == ["tools", "one", "answer 1", "two", "answer 2", "three"]
    assert [m["role"] for m in cached[-1]["messages"]] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert [len(b["messages"]) for b in cached] == [2, 4, 6]
    assert all("cache_prompt" not in b for b in cached)
    assert [b["messages"] for b in again] == [b["messages"] for b in cached]  # the same turn, uncached
    assert all(b["cache_prompt"] is False and b["max_tokens"] == 2 for b in again)
    assert result["requests"] == 3 and result["median_prompt_tokens"] == 300
    assert [r["cached_tokens"] for r in result["per_request"]] == [0, 90, 180]
    assert [r["uncached_cached_tokens"] for r in result["per_request"]] == [0, 0, 0]
    assert result["first_ttft_ms"] > 0 and result["last_ttft_ms"] > 0 and result["last_uncached_ttft_ms"] > 0
    line = conversation_line({"figures": result, "rounds": [result]})
    assert "conversation of 3 turns" in line and "without the cache" in line


def test_an_agents_system_prompt_is_tool_definitions_of_about_the_words_asked():
    text = agent_system_prompt(2000, 3)
    assert 2000 <= len(text.split()) < 2100
    tools = [json.loads(line) for line in text.splitlines()[3:]]
    assert tools[0]["name"] == "tool_3_0" and tools[0]["parameters"]["required"] == ["path"]
    assert agent_system_prompt(2000, 4).split("\n")[3] != text.split("\n")[3]  # variants differ


def test_runs_0_measures_no_level():
    assert plan_workloads([32], [1, 4], 0, 2, turns=3) == [
        Workload("short chat", "chat", None, 1, 2),
        Workload("conversation 3 turns", "turns", 250, 1, 3),
    ]


@pytest.mark.parametrize("runs, named", [(0, False), (3, True)])
def test_the_header_names_the_levels_prompts_only_where_they_ran(runs, named):
    from shardline.bench.report import _header, _server_line

    config = {"prompt_tokens": [512], "gen_tokens": 64, "concurrency": [1], "runs": runs, "rounds": 1}
    server = {"url": "http://h:1", "model": "m", "prompts": [{"target": 512, "tokens": 509}] if runs else []}
    server |= {"chat_prompt_tokens": None, "nodes": None, "sharding": None}
    assert ("prompt 512 tokens" in _header({"config": config})) is named
    assert ("calibrated" in _server_line(server)) is named


@pytest.mark.parametrize(
    "given, root",
    [
        ("127.0.0.1:8080", "http://127.0.0.1:8080"),
        ("http://h:1/", "http://h:1"),
        ("http://h:1/v1", "http://h:1"),
        ("https://h/v1/", "https://h"),  # an OpenAI client's base URL
    ],
)
def test_a_server_url_is_its_root(given, root):
    from shardline.bench.command import _normal_url

    assert _normal_url(given) == root


def test_a_conversation_thinks_half_before_each_uncached_prompt_and_half_before_each_turn():
    sent: list[float] = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(time.perf_counter())
        events = [
            {"choices": [{"delta": {"content": "answer"}}]},
            {"choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": 1}},
        ]
        return httpx.Response(200, content=_sse(*events), headers={"content-type": "text/event-stream"})

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await run_conversation(client, "http://x", "m", ["one", "two", "three"], 1, think_s=0.2)

    began = time.perf_counter()
    result = asyncio.run(go())
    elapsed = time.perf_counter() - began
    # turn, (half) again, (half) turn, (half) again, (half) turn, (half) again
    gaps = [b - a for a, b in zip(sent, sent[1:])]
    assert len(gaps) == 5 and all(g >= 0.1 for g in gaps)
    assert result["requests"] == 3 and result["wall_s"] <= elapsed - 0.5  # the waits are not its time


def test_the_code_editing_workload_comes_last():
    assert plan_workloads([32], [1], 1, 0, turns=2, edits=3)[-1] == Workload("code editing", "edit", None, 1, 3)


def test_code_editing_sends_each_file_without_then_with_speculation():
    bodies = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        bodies.append(body)
        events = [
            {"choices": [{"delta": {"content": "def"}}]},
            {"choices": [{"delta": {"content": " first_step"}}]},
            {"choices": [], "usage": {"prompt_tokens": 900, "completion_tokens": 2}},
        ]
        return httpx.Response(200, content=_sse(*events), headers={"content-type": "text/event-stream"})

    prompts = [edit_request(30, v) for v in (1, 2)]

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await run_edits(client, "http://x", "m", prompts, 2, 8)

    result = asyncio.run(go())
    assert [b["speculative.n_max"] for b in bodies] == [0, 0, 8, 8]
    assert [b["messages"][0]["content"] for b in bodies] == prompts * 2
    assert all(screen(Endpoint.CHAT, b) == b for b in bodies)  # shardline's screen lets it pass
    assert result["requests"] == 2 and result["speculative_requests"] == 2
    assert result["median_decode_tokens_per_s"] > 0 and result["speculative_median_decode_tokens_per_s"] > 0
    assert "def step_29(" in prompts[0] and prompts[0] != prompts[1]
    figures = combine_rounds([result], figures_of("edit"))
    assert "with speculative decoding" in edit_line(figures)
