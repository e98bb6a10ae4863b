"""The first requests of the coding agents people point at a local server (Claude Code,
Codex, opencode, aider, llm), recorded from the real clients (tests/fixtures/clients,
whose README says how to refresh them), replayed against a node as they were sent,
headers and all: each gets a 2xx and a stream whose every event is one of its API's types
in the official SDK (issue 41).

The node serves a tiny random-weight model with SmolLM2's tokenizer, a trained context of
65,536 tokens (the requests hold 1-13 thousand tokens of prompt and ask for up to 32,000
more) and a head that ends every answer at once (tests/tiny_chat.py: ``ends_at_once``), so
each replay takes a prefill and a step. Only the model id is changed."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from anthropic.types import RawMessageStreamEvent
from conftest import free_port_block
from openai.types.chat import ChatCompletionChunk
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter
from tiny_chat import write_tiny_chat_model

from shardline.api.tools import NOT_OFFERED_HEADER
from shardline.local_cluster import LocalCluster

FIXTURES = Path(__file__).parent / "fixtures" / "clients"
RECORDED = sorted(FIXTURES.glob("*/*.json"))
MODEL = "agent"
ANTHROPIC_EVENT = TypeAdapter(RawMessageStreamEvent)
RESPONSES_EVENT = TypeAdapter(ResponseStreamEvent)
SENT_BY_HTTPX = {"host", "content-length", "connection", "accept-encoding"}


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    root = tmp_path_factory.mktemp("clients")
    write_tiny_chat_model(root / "models" / MODEL, "qwen", context=65536, ends_at_once=True)
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
        cluster.place(str(root / "models" / MODEL), "pipeline", context=65536, max_batch=2)
        yield cluster.url(0)
    finally:
        cluster.stop()


def _events(response: httpx.Response) -> list[tuple[str | None, str]]:
    """The server-sent events of ``response``: (event name or None, data), comments
    (keep-alives) skipped."""
    events, name = [], None
    for line in response.iter_lines():
        if line.startswith("event:"):
            name = line[len("event:") :].strip()
        elif line.startswith("data:"):
            events.append((name, line[len("data:") :].strip()))
            name = None
    return events


def _check_anthropic(events: list[tuple[str | None, str]]) -> None:
    events = [(name, data) for name, data in events if name != "ping"]  # the SDK's stream skips pings
    parsed = [ANTHROPIC_EVENT.validate_json(data) for _, data in events]
    assert [name for name, _ in events] == [event.type for event in parsed]
    assert parsed[0].type == "message_start" and parsed[-1].type == "message_stop"
    assert parsed[-2].type == "message_delta" and parsed[-2].delta.stop_reason in ("end_turn", "max_tokens")


def _check_chat(events: list[tuple[str | None, str]]) -> None:
    assert events[-1][1] == "[DONE]"
    chunks = [ChatCompletionChunk.model_validate_json(data) for _, data in events[:-1]]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")


def _check_responses(events: list[tuple[str | None, str]]) -> None:
    parsed = [RESPONSES_EVENT.validate_json(data) for _, data in events]
    assert parsed[0].type == "response.created" and parsed[-1].type == "response.completed"
    assert [e.sequence_number for e in parsed] == list(range(len(parsed)))


CHECKS = {"/v1/messages": _check_anthropic, "/v1/chat/completions": _check_chat, "/v1/responses": _check_responses}


@pytest.mark.parametrize("recorded", RECORDED, ids=[f"{p.parent.name}/{p.stem}" for p in RECORDED])
def test_a_clients_first_request_is_served(url, recorded):
    fixture = json.loads(recorded.read_text())
    headers = {k: v for k, v in fixture["headers"].items() if k.lower() not in SENT_BY_HTTPX}
    body = dict(fixture["body"], model=MODEL)
    with httpx.stream(fixture["method"], url + fixture["path"], headers=headers, json=body, timeout=120) as response:
        assert response.status_code == 200, (fixture["client"], response.read())
        assert response.headers["content-type"].startswith("text/event-stream")
        events = _events(response)
    CHECKS[fixture["path"].split("?")[0]](events)
    hosted = [t["type"] for t in body.get("tools", []) if t.get("type") in ("web_search", "tool_search")]
    if hosted:  # Codex's hosted tools: served without them, and said so
        assert set(response.headers[NOT_OFFERED_HEADER].split(", ")) >= set(hosted)


def test_every_client_is_recorded():
    assert {p.parent.name for p in RECORDED} == {"claude-code", "codex", "opencode", "aider", "llm"}
