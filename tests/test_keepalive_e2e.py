"""A long prompt's stream keeps its client's idle timeout from firing (issue 41): 3,900-token
prompts streamed at once to the Anthropic, OpenAI (Chat Completions and Responses) and
Ollama endpoints of one node (prefilled together, tens of seconds on two cores) each get
their API's keep-alive at least every heartbeat interval (set short here,
``--stream-heartbeat 0.5``) until their first token. The heartbeat is a timer: a longer
prompt (20,000 tokens on a model that takes them) only gets more of them."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from conftest import free_port_block

from shardline.local_cluster import LocalCluster
from shardline.models.store import DEFAULT_MODEL_ID

pytestmark = pytest.mark.slow

M = DEFAULT_MODEL_ID
HEARTBEAT_S = 0.5
LONG = "Here is a long list of numbers to remember. " + " ".join(str(i) for i in range(1000))  # 3,900 tokens


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("keepalive")
    cluster = LocalCluster(
        nodes=1,
        base_port=free_port_block(1),
        runner_threads=1,
        log_dir=str(log_dir),
        data_dir=str(log_dir),
        node_args={0: ["--stream-heartbeat", str(HEARTBEAT_S)]},
    )
    try:
        cluster.start()
        cluster.place(None, "pipeline", context=8192, max_batch=4)
        yield cluster.url(0)
    finally:
        cluster.stop()


def _gaps_until_output(url: str, path: str, body: dict, is_output) -> tuple[list[float], int, float]:
    """Stream ``body`` to ``path``: the seconds between the lines received up to the first
    line ``is_output`` takes as output, how many lines came before it, and the seconds to
    it."""
    gaps, before = [], 0
    start = last = time.monotonic()
    with httpx.stream("POST", f"{url}{path}", json=body, timeout=300) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            now = time.monotonic()
            gaps.append(now - last)
            last = now
            if is_output(line):
                return gaps, before, now - start
            before += 1
    raise AssertionError(f"{path}: the stream ended without output")


def _anthropic_text(line: str) -> bool:
    return line.startswith("data:") and json.loads(line[5:]).get("type") == "content_block_delta"


def _openai_text(line: str) -> bool:
    if not line.startswith("data:") or line == "data: [DONE]":
        return False
    data = json.loads(line[5:])
    return bool(data.get("delta")) or any(c.get("delta", {}).get("content") for c in data.get("choices", []))


def _ollama_text(line: str) -> bool:
    data = json.loads(line)
    return bool(data.get("message", {}).get("content") or data.get("response"))


CASES = {
    "anthropic": (
        "/v1/messages",
        {"max_tokens": 2, "messages": [{"role": "user", "content": LONG}]},
        _anthropic_text,
        "event: ping",
    ),
    "openai-chat": (
        "/v1/chat/completions",
        {"max_tokens": 2, "messages": [{"role": "user", "content": LONG}]},
        _openai_text,
        ": keep-alive",
    ),
    "openai-responses": ("/v1/responses", {"max_output_tokens": 2, "input": LONG}, _openai_text, ": keep-alive"),
    "ollama": (
        "/api/chat",
        {"messages": [{"role": "user", "content": LONG}], "options": {"num_predict": 2}},
        _ollama_text,
        '"content":""',
    ),
}


def _heartbeats(url: str, api: str) -> tuple[list[float], int, float, list[str]]:
    """Stream ``api``'s case: the gaps before its first output, how many keep-alives came,
    the seconds to the first output and the lines."""
    path, body, is_output, keepalive = CASES[api]
    body = {"model": M, "stream": True, **body}
    lines: list[str] = []

    def record(line: str) -> bool:
        lines.append(line)
        return is_output(line)

    gaps, _, first_s = _gaps_until_output(url, path, body, record)
    beats = sum(keepalive in line.replace(" ", "") if api == "ollama" else line.startswith(keepalive) for line in lines)
    return gaps, beats, first_s, lines


def test_a_long_prefill_streams_keepalives(url):
    with ThreadPoolExecutor(len(CASES)) as pool:
        results = dict(zip(CASES, pool.map(lambda api: _heartbeats(url, api), CASES)))
    for api, (gaps, beats, first_s, lines) in results.items():
        assert first_s > 4 * HEARTBEAT_S, f"{api}: the prefill took {first_s:.1f} s: too short to show heartbeats"
        assert beats >= first_s / HEARTBEAT_S / 2, (api, beats, first_s, lines[:10])
        # a line at least every heartbeat (with room for a loaded machine), never the 10 s the issue allows
        assert max(gaps) < 4 * HEARTBEAT_S, (api, gaps)
