"""A stream whose instance fails after it gave tokens goes on: the node that streams it
continues it on the instance placed again (real model in float32, real processes, a
runner or a node SIGKILLed mid-stream). The client sees a pause, no error, and at
temperature 0 the text of an undisturbed run; a seeded sample gives its text too, a
``json_schema`` answer and a forced tool call parse (their grammar's matcher advanced
over the tokens given). Where the model cannot be placed again, the client gets the error
within the continuation's bound (60 s). A stored Responses API response, and an Ollama
``keep_alive`` deadline, are served by every node, also after the node that took them
died."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime

import httpx
import psutil
import pytest
from conftest import free_port_block, runners_of, wait_until

from shardline.local_cluster import LocalCluster
from shardline.models.store import DEFAULT_MODEL_ID

pytestmark = pytest.mark.timeout(300)

STORY = [{"role": "user", "content": "Tell me a very long story about a lighthouse keeper."}]
CITY = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 40},
        "population": {"type": "integer"},
        "landmarks": {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 4},
    },
    "required": ["city", "population", "landmarks"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city now.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}


@dataclass
class Streamed:
    """What a client read of one streamed chat completion."""

    text: str = ""
    tokens: list[str] = field(default_factory=list)  # each token's text, from its logprobs entry
    logprobs: list[float] = field(default_factory=list)
    calls: list[dict] = field(default_factory=list)  # tool-call deltas
    finish: str | None = None
    usage: dict | None = None
    error: dict | None = None
    fingerprints: list[str] = field(default_factory=list)
    killed_at: float | None = None  # time.monotonic()
    resumed_at: float | None = None  # the first token after the kill

    @property
    def gap_s(self) -> float | None:
        """Seconds from the kill to the next token."""
        if self.killed_at is None or self.resumed_at is None:
            return None
        return self.resumed_at - self.killed_at

    def arguments(self) -> str:
        return "".join(c.get("function", {}).get("arguments") or "" for c in self.calls)


def stream_chat(
    url: str, body: dict, kill_after: int | None = None, kill: Callable[[], None] | None = None, timeout_s: float = 120
) -> Streamed:
    """Stream a chat completion (logprobs and usage asked for); with ``kill``, call it once
    ``kill_after`` tokens have come."""
    payload = {
        "model": DEFAULT_MODEL_ID,
        "stream": True,
        "logprobs": True,
        "stream_options": {"include_usage": True},
        **body,
    }
    out = Streamed()
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=payload, timeout=timeout_s) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            if "error" in chunk:
                out.error = chunk["error"]
                break
            out.fingerprints.append(chunk.get("system_fingerprint"))
            out.usage = chunk.get("usage") or out.usage
            for choice in chunk.get("choices", []):
                delta = choice.get("delta", {})
                out.text += delta.get("content") or ""
                out.calls += delta.get("tool_calls") or []
                out.finish = choice.get("finish_reason") or out.finish
                entries = (choice.get("logprobs") or {}).get("content") or []
                if entries and out.killed_at is not None and out.resumed_at is None:
                    out.resumed_at = time.monotonic()
                for entry in entries:
                    out.tokens.append(entry["token"])
                    out.logprobs.append(entry["logprob"])
            if kill is not None and out.killed_at is None and len(out.tokens) >= (kill_after or 0):
                kill()
                out.killed_at = time.monotonic()
    return out


def node_ids(cluster: LocalCluster) -> list[str]:
    return [httpx.get(f"{cluster.url(i)}/health", timeout=5).json()["node_id"] for i in range(cluster.n)]


def roles(cluster: LocalCluster, live: list[int]) -> tuple[int, int]:
    """The client's node (the coordinator: it survives) and the victim's (another) among ``live``."""
    coordinator = httpx.get(f"{cluster.url(live[0])}/cluster/nodes", timeout=5).json()["coordinator"]
    ids = node_ids(cluster) if len(live) == cluster.n else None
    client = next(
        i
        for i in live
        if (ids[i] if ids else httpx.get(f"{cluster.url(i)}/health", timeout=5).json()["node_id"]) == coordinator
    )
    victim = max(i for i in live if i != client)
    return client, victim


def serving(cluster: LocalCluster, url: str, ranks: int, timeout_s: float = 90) -> dict:
    """The one ready instance, of ``ranks`` ranks, once the node at ``url`` serves it."""

    def ready() -> dict | None:
        instances = httpx.get(f"{url}/cluster/instances", timeout=5).json()["instances"]
        ok = [i for i in instances if i["status"] == "ready" and len(i["ranks"]) == ranks]
        if len(ok) != 1 or len(instances) != 1:
            return None
        answer = httpx.post(
            f"{url}/v1/chat/completions",
            timeout=60,
            json={"model": DEFAULT_MODEL_ID, "max_tokens": 2, "temperature": 0, "messages": STORY},
        )
        return ok[0] if answer.status_code == 200 else None

    return wait_until(ready, timeout_s, f"a ready {ranks}-rank instance", interval_s=0.3, tolerate=(httpx.HTTPError,))


def killer(cluster: LocalCluster, victim: int, what: str) -> Callable[[], None]:
    node = psutil.Process(cluster.procs[victim].pid)

    def kill() -> None:
        if what == "runner":
            runners_of(node.pid)[0].kill()
        else:
            for proc in [*runners_of(node.pid), node]:
                proc.kill()

    return kill


def check_continued(reference: Streamed, disturbed: Streamed, max_tokens: int, what: str) -> None:
    print(
        f"\n{what}: next token {disturbed.gap_s} s after the kill; fingerprints "
        f"{disturbed.fingerprints[0]} -> {disturbed.fingerprints[-1]}"
    )
    assert disturbed.error is None, disturbed.error
    assert disturbed.killed_at is not None and disturbed.resumed_at is not None
    assert disturbed.fingerprints[0] != disturbed.fingerprints[-1]  # the instance placed again finished it
    assert disturbed.tokens == reference.tokens  # nothing repeated, nothing skipped
    assert disturbed.text == reference.text and disturbed.arguments() == reference.arguments()
    assert disturbed.logprobs == pytest.approx(reference.logprobs, abs=1e-3)  # prefill's, then decode's
    assert disturbed.finish == reference.finish
    assert disturbed.usage == reference.usage
    assert reference.usage is not None  # the end token counts, with no logprobs entry
    assert reference.usage["completion_tokens"] == len(reference.tokens) + (reference.finish != "length")
    if reference.finish == "length":
        assert len(reference.tokens) == max_tokens


def instances_of(url: str) -> list[dict]:
    """The instance table as the node at ``url`` holds it."""
    return httpx.get(f"{url}/cluster/instances", timeout=5).json()["instances"]


def metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.fixture(scope="module")
def pipeline3(tmp_path_factory):
    """Three nodes, the default model as a float32 pipeline on all three."""
    tmp = tmp_path_factory.mktemp("continue3")
    cluster = LocalCluster(nodes=3, base_port=free_port_block(3), runner_threads=1, log_dir=str(tmp), data_dir=str(tmp))
    cluster.start()
    try:
        cluster.place(None, "pipeline", dtype="float32")
        yield cluster
    finally:
        cluster.stop()


GREEDY = {"messages": STORY, "max_tokens": 200, "temperature": 0, "ignore_eos": True}
SEEDED = {"messages": STORY, "max_tokens": 120, "temperature": 0.9, "top_p": 0.95, "seed": 1234, "ignore_eos": True}
JSON = {
    "messages": [{"role": "user", "content": "Describe Paris as JSON."}],
    "max_tokens": 150,
    "temperature": 0,
    "response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}},
}
TOOL = {
    "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
    "max_tokens": 80,
    "temperature": 0,
    "tools": [WEATHER],
    "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
}


def ollama_chat(url: str, kill_after: int | None = None, kill: Callable[[], None] | None = None) -> tuple[str, dict]:
    """A streamed Ollama chat (greedy, 200 tokens at most): its text and last object;
    with ``kill``, called once ``kill_after`` objects with text have come."""
    text, last, pieces = "", {}, 0
    body = {"model": DEFAULT_MODEL_ID, "messages": STORY, "options": {"temperature": 0, "num_predict": 200}}
    with httpx.stream("POST", f"{url}/api/chat", json=body, timeout=120) as response:
        for line in response.iter_lines():
            if not line:
                continue
            last = json.loads(line)
            assert "error" not in last, last
            piece = last.get("message", {}).get("content") or ""
            text += piece
            pieces += bool(piece)
            if kill is not None and pieces == kill_after:
                kill()
                kill = None  # once: empty objects (heartbeats) come during the pause
    return text, last


@pytest.mark.slow
def test_an_ollama_stream_and_a_request_not_streamed_are_continued_too(pipeline3):
    """The continuation is the node's, under every API: an Ollama stream, its runner
    killed after 50 pieces, and a chat completion not streamed, its runner killed at
    about a third of its decode, give an undisturbed run's text and counts."""
    client, target = roles(pipeline3, [0, 1, 2])
    url = pipeline3.url(client)
    text, last = ollama_chat(url)
    assert last["eval_count"] > 60, last
    serving(pipeline3, url, 3)
    again, last_again = ollama_chat(url, 50, killer(pipeline3, target, "runner"))
    assert again == text and last_again["eval_count"] == last["eval_count"]
    assert last_again["done_reason"] == last["done_reason"]

    body = {"model": DEFAULT_MODEL_ID, **GREEDY}
    serving(pipeline3, url, 3)
    started = time.monotonic()
    reference = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120).json()
    took = time.monotonic() - started
    serving(pipeline3, url, 3)
    timer = threading.Timer(took / 3, killer(pipeline3, target, "runner"))
    timer.start()
    disturbed = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120).json()
    timer.join()
    assert "error" not in disturbed, disturbed
    assert disturbed["choices"][0]["message"] == reference["choices"][0]["message"]
    assert disturbed["usage"] == reference["usage"]
    assert disturbed["choices"][0]["finish_reason"] == "length"
    assert disturbed["system_fingerprint"] != reference["system_fingerprint"]  # the instance placed again
    print(f"\nnot streamed: {took:.1f} s undisturbed, the runner killed after {took / 3:.1f} s")
    serving(pipeline3, url, 3)


def stream_events(
    url: str, path: str, body: dict, kill_after: int | None = None, kill: Callable[[], None] | None = None
) -> tuple[str, list[dict]]:
    """Stream an Anthropic Messages or a Responses API request: its text and every event;
    with ``kill``, called once ``kill_after`` events with text have come."""
    text, events, pieces = "", [], 0
    with httpx.stream(
        "POST", f"{url}{path}", json={"model": DEFAULT_MODEL_ID, "stream": True, **body}, timeout=120
    ) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line[len("data: ") :])
            events.append(event)
            if event["type"] == "content_block_delta":
                piece = event["delta"].get("text") or ""
            else:
                piece = event.get("delta") or "" if event["type"] == "response.output_text.delta" else ""
            text += piece
            pieces += bool(piece)
            if kill is not None and pieces == kill_after:
                kill()
                kill = None
    return text, events


@pytest.mark.slow
def test_anthropic_and_responses_streams_are_continued_too(pipeline3):
    """An Anthropic Messages stream and a Responses API stream, their runner killed after
    50 text events: no error event, an undisturbed run's text, stop reason and usage."""
    client, target = roles(pipeline3, [0, 1, 2])
    url = pipeline3.url(client)
    story = "Tell me a very long story about a lighthouse keeper."
    for path, body, end in (
        ("/v1/messages", {"messages": STORY, "max_tokens": 200, "temperature": 0}, "message_delta"),
        ("/v1/responses", {"input": story, "max_output_tokens": 200, "temperature": 0}, "response.incomplete"),
    ):
        serving(pipeline3, url, 3)
        text, events = stream_events(url, path, body)
        assert sum(e["type"] in ("content_block_delta", "response.output_text.delta") for e in events) > 60, text
        serving(pipeline3, url, 3)
        continued = metric(url, 'shardline_continuations_total{outcome="continued"}')
        again, disturbed = stream_events(url, path, body, 50, killer(pipeline3, target, "runner"))
        assert metric(url, 'shardline_continuations_total{outcome="continued"}') == continued + 1, path
        assert not [e for e in disturbed if e["type"] in ("error", "response.failed")], path
        assert again == text, path
        ends = (end, "response.completed")  # a Responses answer that ended before max_output_tokens
        (last,), (last_again,) = [e for e in events if e["type"] in ends], [e for e in disturbed if e["type"] in ends]
        if end == "message_delta":
            assert last_again["delta"] == last["delta"] and last_again["usage"] == last["usage"]
        else:
            assert last_again["response"]["usage"] == last["response"]["usage"]
            assert last_again["response"]["status"] == last["response"]["status"]
    serving(pipeline3, url, 3)


# The node victim last: it leaves two nodes.
@pytest.mark.slow
@pytest.mark.parametrize(
    "body, kill_after, victim",
    [(GREEDY, 50, "runner"), (SEEDED, 40, "runner"), (JSON, 8, "runner"), (TOOL, 6, "runner"), (GREEDY, 50, "node")],
    ids=["greedy-runner", "seeded-runner", "json-runner", "tool-runner", "greedy-node"],
)
def test_a_pipeline_stream_continues_on_the_instance_placed_again(pipeline3, body, kill_after, victim):
    live = [i for i, p in enumerate(pipeline3.procs) if p is not None and p.poll() is None]
    assert len(live) == 3
    client, target = roles(pipeline3, live)
    url = pipeline3.url(client)
    serving(pipeline3, url, 3)
    continued = metric(url, 'shardline_continuations_total{outcome="continued"}')
    reference = stream_chat(url, body)
    disturbed = stream_chat(url, body, kill_after, killer(pipeline3, target, victim))
    check_continued(reference, disturbed, body["max_tokens"], f"pipeline-3, {victim} killed after {kill_after}")
    if body is JSON:
        parsed = json.loads(disturbed.text)
        assert set(parsed) == {"city", "population", "landmarks"}
    if body is TOOL:
        assert disturbed.finish == "tool_calls" and disturbed.calls[0]["function"]["name"] == "get_weather"
        assert set(json.loads(disturbed.arguments())) == {"city", "unit"}
    assert metric(url, 'shardline_continuations_total{outcome="continued"}') == continued + 1
    serving(pipeline3, url, 3 if victim == "runner" else 2)


@pytest.mark.slow
@pytest.mark.parametrize("sharding, ranks", [("tensor", 2), ("ring", 2)])
def test_a_tensor_or_ring_stream_continues_after_a_runner_and_then_a_node_is_lost(tmp_path, sharding, ranks):
    """Three nodes, the default model as a float32 tensor or ring instance on two: a
    runner killed after 50 tokens of a 200-token greedy stream (the instance placed again
    on the same nodes), then, in a second stream, the node of the other rank killed
    (placed again on the node left: tensor-1, and a pipeline of one rank for the ring,
    which needs two): each time the text of an undisturbed run."""
    cluster = LocalCluster(
        nodes=3, base_port=free_port_block(3), runner_threads=1, log_dir=str(tmp_path), data_dir=str(tmp_path)
    )
    cluster.start()
    try:
        client, victim = roles(cluster, [0, 1, 2])
        cluster.place(None, sharding, on=[client, victim] if ranks == 2 else None, dtype="float32")
        url = cluster.url(client)
        for what in ("runner", "node"):
            serving(cluster, url, ranks)
            reference = stream_chat(url, GREEDY)
            disturbed = stream_chat(url, GREEDY, 50, killer(cluster, victim, what))
            check_continued(reference, disturbed, GREEDY["max_tokens"], f"{sharding}-{ranks}, {what} killed after 50")
    finally:
        cluster.stop()


@pytest.mark.slow
def test_a_stream_whose_model_cannot_be_placed_again_ends_with_the_error_in_time(tmp_path):
    """The model on one node; the two others offer 10 MB (it fits on neither); a stream
    asked of another node, its model's node killed after 20 tokens: nothing can serve
    it again, and the client gets the error, as before continuations, within the bound
    (60 s) and a little."""
    cluster = LocalCluster(
        nodes=3,
        base_port=free_port_block(3),
        runner_threads=1,
        log_dir=str(tmp_path),
        data_dir=str(tmp_path),
        node_args={0: ["--memory-limit", "10MB"], 2: ["--memory-limit", "10MB"]},
    )
    cluster.start()
    try:
        cluster.place(None, "pipeline", on=[1])
        disturbed = stream_chat(cluster.url(0), GREEDY, 20, killer(cluster, 1, "node"))
        ended_s = time.monotonic() - (disturbed.killed_at or 0.0)
        print(f"\nmodel not placed again: the client's error {ended_s:.1f} s after the kill: {disturbed.error}")
        assert disturbed.error is not None and disturbed.error.get("code") == "instance_failed", disturbed.error
        assert ended_s < 65
        assert metric(cluster.url(0), 'shardline_continuations_total{outcome="failed"}') == 1
    finally:
        cluster.stop()


def test_a_forwarded_stream_is_continued_once_and_a_stored_response_and_a_keep_alive_outlive_their_node(tmp_path):
    """Two nodes, the model (float32) on the second. A stream the first forwards there, the
    runner killed after 50 tokens, is continued once, by the first (it streams to the
    client), with an undisturbed run's text. A response stored by the first (which forwards
    its request): the second retrieves it and continues from it (``previous_response_id``),
    a deletion there reaches the first, and once the first is killed the second still
    continues from the first's response. An Ollama ``keep_alive`` given to the first is
    the second's ``/api/ps`` deadline too, and the model is unloaded at it though the first
    died (each node kept its own deadlines before)."""
    cluster = LocalCluster(
        nodes=2, base_port=free_port_block(2), runner_threads=1, log_dir=str(tmp_path), data_dir=str(tmp_path)
    )
    cluster.start()
    try:
        cluster.place(None, "pipeline", on=[1], dtype="float32")
        first, second = cluster.url(0), cluster.url(1)
        body = {**GREEDY, "max_tokens": 100}
        reference = stream_chat(first, body)
        disturbed = stream_chat(first, body, 50, killer(cluster, 1, "runner"))
        check_continued(reference, disturbed, 100, "forwarded, runner killed")
        continued = 'shardline_continuations_total{outcome="continued"}'
        assert (metric(first, continued), metric(second, continued)) == (1, 0)
        serving(cluster, first, 1)
        greedy = {"model": DEFAULT_MODEL_ID, "temperature": 0, "max_output_tokens": 16}

        def create(url: str, **body) -> dict:
            response = httpx.post(f"{url}/v1/responses", json={**greedy, **body}, timeout=60)
            assert response.status_code == 200, response.text
            return response.json()

        def text(response: dict) -> str:
            return "".join(
                part["text"]
                for item in response["output"]
                if item["type"] == "message"
                for part in item["content"]
                if part["type"] == "output_text"
            )

        stored = create(first, input="The secret code is 4821.")
        assert httpx.get(f"{second}/v1/responses/{stored['id']}", timeout=10).json() == stored
        asked = {"previous_response_id": stored["id"], "input": "What is the secret code?"}
        here, there = create(first, **asked), create(second, **asked)
        assert "4821" in text(here) and text(there) == text(here)
        assert httpx.delete(f"{second}/v1/responses/{there['id']}", timeout=10).status_code == 200
        assert httpx.get(f"{first}/v1/responses/{there['id']}", timeout=10).status_code == 404
        kept = httpx.post(
            f"{first}/api/chat",
            json={"model": DEFAULT_MODEL_ID, "messages": [{"role": "user", "content": "Hi"}], "stream": False}
            | {"options": {"temperature": 0, "num_predict": 4}, "keep_alive": "12s"},
            timeout=60,
        )
        assert kept.status_code == 200, kept.text
        kept_at = time.time()

        def expires_at() -> str | None:
            (model,) = httpx.get(f"{second}/api/ps", timeout=5).json()["models"]
            return None if model["expires_at"].startswith("9999") else model["expires_at"]

        expires = datetime.fromisoformat(wait_until(expires_at, 10, "the deadline on the other node")).timestamp()
        assert 11 < expires - kept_at <= 12.5
        psutil.Process(cluster.procs[0].pid).kill()
        cluster.procs[0].wait(10)
        after = create(second, **asked)
        assert text(after) == text(here)
        wait_until(lambda: not instances_of(second), 30, "the model unloaded at its deadline")
        assert time.time() >= expires - 1.0
    finally:
        cluster.stop()
