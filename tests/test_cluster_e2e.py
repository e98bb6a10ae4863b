"""End to end: real node processes on 127.0.0.1 serving SmolLM2-135M-Instruct."""

from __future__ import annotations

import json
import os

import httpx
import psutil
import pytest
from conftest import CAPITAL_QUESTION, placed, runners_of

from shardline.models.store import DEFAULT_MODEL_ID, default_model_path

pytestmark = pytest.mark.timeout(300)

PROMPTS = [
    CAPITAL_QUESTION,
    "Write a haiku about the sea.",
    "List three primary colours.",
    "Explain what a CPU does in one sentence.",
]


def chat(url: str, content: str, **extra) -> httpx.Response:
    body = {"model": DEFAULT_MODEL_ID, "messages": [{"role": "user", "content": content}], "temperature": 0, **extra}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)


def test_capital_of_france_is_paris(cluster3):
    response = chat(cluster3.url(0), CAPITAL_QUESTION)
    assert response.status_code == 200
    body = response.json()
    assert "Paris" in body["choices"][0]["message"]["content"]
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["object"] == "chat.completion"
    usage = body["usage"]
    assert usage["prompt_tokens"] > 10 and usage["completion_tokens"] > 0
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_node_processes_never_load_torch_only_their_runners_do(cluster3):
    """A node tokenizes and serves without torch (transformers would import it: seconds of
    CPU at start-up and ~200 MB held); its runners compute with it."""
    assert chat(cluster3.url(1), "Hi", max_tokens=2).status_code == 200  # tokenizers loaded
    for proc in cluster3.procs:
        assert proc is not None
        node = psutil.Process(proc.pid)
        assert not any("libtorch" in m.path for m in node.memory_maps())
        runners = runners_of(proc.pid)
        assert runners and any("libtorch" in m.path for m in runners[0].memory_maps())


def test_three_node_pipeline_matches_one_node(cluster3, cluster1):
    for i, prompt in enumerate(PROMPTS):
        # Ask a different node of the 3-node cluster each time: any node serves.
        three = chat(cluster3.url(i % 3), prompt, max_tokens=32).json()
        one = chat(cluster1.url(0), prompt, max_tokens=32).json()
        assert three["choices"][0]["message"]["content"] == one["choices"][0]["message"]["content"]
        assert three["usage"] == one["usage"]


def test_each_rank_reads_only_its_layers(cluster3):
    instance = httpx.get(f"{cluster3.url(0)}/cluster/instances").json()["instances"][0]
    ranks = instance["ranks"]
    assert len(ranks) == 3
    file_bytes = os.path.getsize(default_model_path())
    covered = []
    for rank in ranks:
        loaded = rank["loaded"]
        assert loaded["layers_read"] == list(range(rank["layer_start"], rank["layer_end"]))
        assert loaded["bytes_read"] < file_bytes * 0.6
        covered += loaded["layers_read"]
    assert covered == list(range(30))
    # Rank 0 reads the embedding, the last rank reads it again as the tied LM head;
    # the middle rank reads neither, so it reads the least.
    assert ranks[1]["loaded"]["bytes_read"] < min(ranks[0]["loaded"]["bytes_read"], ranks[2]["loaded"]["bytes_read"])


def test_streaming_chunks_follow_openai_format(cluster3):
    body = {
        "model": DEFAULT_MODEL_ID,
        "messages": [{"role": "user", "content": "Count from 1 to 20."}],
        "temperature": 0,
        "max_tokens": 10,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    events = []
    with httpx.stream("POST", f"{cluster3.url(1)}/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: ") :])
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 10
    assert all("usage" in c and c["usage"] is None for c in chunks[:-1])  # OpenAI's: null before
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    plain = chat(cluster3.url(0), "Count from 1 to 20.", max_tokens=10).json()
    assert text == plain["choices"][0]["message"]["content"]
    # OpenAI's obfuscation, on by default: a text chunk's padding evens its size to 16s
    texts = [c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")]
    assert texts and all((len(c["choices"][0]["delta"]["content"]) + len(c["obfuscation"])) % 16 == 0 for c in texts)
    body["stream_options"] = {"include_obfuscation": False}
    with httpx.stream("POST", f"{cluster3.url(1)}/v1/chat/completions", json=body, timeout=120) as r:
        plain_chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert plain_chunks and not any("obfuscation" in c for c in plain_chunks)


def test_long_prompt_streams_prefill_progress_when_asked(cluster3):
    content = "Summarize: " + "the quick brown fox jumps over the lazy dog. " * 120
    body = {
        "model": DEFAULT_MODEL_ID,
        "messages": [{"role": "user", "content": content}],
        "temperature": 0,
        "max_tokens": 3,
        "stream": True,
        "return_progress": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", f"{cluster3.url(1)}/v1/chat/completions", json=body, timeout=120) as r:
        chunks = [
            json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"
        ]
    prompt_tokens = chunks[-1]["usage"]["prompt_tokens"]
    assert prompt_tokens > 1100  # three 512-token prefill chunks
    progress = [c["prompt_progress"] for c in chunks if "prompt_progress" in c]
    assert [p["processed"] for p in progress] == [512, 1024, prompt_tokens]
    assert all(p["total"] == prompt_tokens and p["time_ms"] >= 0 for p in progress)
    first_text = next(i for i, c in enumerate(chunks) if c["choices"] and c["choices"][0]["delta"].get("content"))
    last_progress = max(i for i, c in enumerate(chunks) if "prompt_progress" in c)
    assert last_progress < first_text
    assert all(c["choices"][0]["delta"] == {} for c in chunks if "prompt_progress" in c)


def test_stop_string_ends_the_text(cluster3):
    full = chat(cluster3.url(0), "Count from 1 to 20.", max_tokens=40).json()["choices"][0]["message"]["content"]
    assert "5" in full
    cut = chat(cluster3.url(0), "Count from 1 to 20.", max_tokens=40, stop=["5"]).json()
    assert cut["choices"][0]["finish_reason"] == "stop"
    assert cut["choices"][0]["message"]["content"] == full[: full.index("5")]


@pytest.mark.parametrize(
    "raw, status, param",
    [
        (b"{not json", 400, None),
        (json.dumps({"model": DEFAULT_MODEL_ID}).encode(), 400, "messages"),
        (json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode(), 400, "model"),
        (json.dumps({"model": DEFAULT_MODEL_ID, "messages": "hi"}).encode(), 400, "messages"),
        (
            json.dumps(
                {"model": DEFAULT_MODEL_ID, "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}
            ).encode(),
            400,
            "temperature",
        ),
        (
            json.dumps({"model": DEFAULT_MODEL_ID, "messages": [{"role": "wizard", "content": "hi"}]}).encode(),
            400,
            "messages.0.role",
        ),
        (
            json.dumps(
                {"model": DEFAULT_MODEL_ID, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}
            ).encode(),
            400,
            "max_tokens",
        ),
        (
            json.dumps({"model": "no-such/model", "messages": [{"role": "user", "content": "hi"}]}).encode(),
            404,
            "model",
        ),
        # SmolLM2's template renders no names: accepted, it would do nothing
        (
            json.dumps(
                {"model": DEFAULT_MODEL_ID, "messages": [{"role": "user", "content": "hi", "name": "bob"}]}
            ).encode(),
            400,
            "messages.0.name",
        ),
    ],
)
def test_bad_requests_get_openai_errors_and_server_keeps_serving(cluster3, raw, status, param):
    response = httpx.post(
        f"{cluster3.url(2)}/v1/chat/completions", content=raw, timeout=30, headers={"Content-Type": "application/json"}
    )
    assert response.status_code == status
    error = response.json()["error"]
    assert error["message"] and error["type"]
    assert error["param"] == param
    assert chat(cluster3.url(2), "Say hi.", max_tokens=4).status_code == 200


def test_unknown_model_error_code(cluster3):
    response = httpx.post(
        f"{cluster3.url(0)}/v1/chat/completions",
        timeout=30,
        json={"model": "no-such/model", "messages": [{"role": "user", "content": "hi"}]},
    )
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "model_not_found"
    assert response.json()["error"]["type"] == "invalid_request_error"  # as OpenAI types it
    assert DEFAULT_MODEL_ID in response.json()["error"]["message"]


def test_models_lists_the_served_model(cluster3):
    body = httpx.get(f"{cluster3.url(1)}/v1/models").json()
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == [DEFAULT_MODEL_ID]


def test_prompt_longer_than_context_is_refused(cluster3):
    response = chat(cluster3.url(0), "word " * 5000)
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "context_length_exceeded"


def test_completion_longer_than_the_context_is_refused(cluster3):
    response = chat(cluster3.url(0), "Hi", max_tokens=5000)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == "max_tokens"


def test_retrieve_one_model(cluster3):
    found = httpx.get(f"{cluster3.url(0)}/v1/models/{DEFAULT_MODEL_ID}")
    assert found.status_code == 200 and found.json()["id"] == DEFAULT_MODEL_ID
    missing = httpx.get(f"{cluster3.url(0)}/v1/models/no-such/model")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_unknown_sharding_is_a_bad_request(cluster3):
    response = httpx.post(f"{cluster3.url(0)}/cluster/instances", json={"sharding": "diagonal"}, timeout=30)
    assert response.status_code == 400
    assert "diagonal" in response.json()["error"]["message"]


def test_one_instance_by_id(cluster3):
    listed = httpx.get(f"{cluster3.url(0)}/cluster/instances").json()["instances"][0]
    one = httpx.get(f"{cluster3.url(1)}/cluster/instances/{listed['instance_id']}")
    assert one.status_code == 200 and one.json()["ranks"] == listed["ranks"]
    assert httpx.get(f"{cluster3.url(1)}/cluster/instances/nope").status_code == 404


@pytest.mark.parametrize(
    "extra, words",
    [
        ({"nodes": ["a", "b", "a"]}, "listed twice: a"),
        ({"context": -5}, "context"),
        ({"max_batch": 0}, "max_batch"),
        ({"nodes": []}, "nodes"),
        ({"nodes": ["a"], "min_nodes": 1}, "not both"),
        ({"min_nodes": 3, "max_nodes": 2}, "min_nodes 3 is above max_nodes 2"),
        ({"model": "no-such/model"}, "shardline models add no-such/model"),
        ({"model": "/no/such/dir/x.gguf"}, "nor a path under a --model-dir"),
    ],
)
def test_bad_placements_are_refused_before_anything_starts(cluster3, extra, words):
    before = placed(cluster3.url(0))
    response = httpx.post(f"{cluster3.url(0)}/cluster/instances", json={"sharding": "pipeline", **extra}, timeout=30)
    assert response.status_code == (404 if extra.get("model") == "no-such/model" else 400)
    assert words in response.json()["error"]["message"]
    assert placed(cluster3.url(0)) == before


@pytest.mark.parametrize("path", ["/cluster/instances", "/cluster/placements/preview"])
def test_an_unknown_sharding_is_refused_naming_it(cluster3, path):
    response = httpx.post(f"{cluster3.url(0)}{path}", json={"sharding": "zigzag"}, timeout=30)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "sharding" and "sharding 'zigzag' is not supported" in error["message"]


def test_preview_keeps_to_the_sharding_asked_for(cluster3):
    response = httpx.post(f"{cluster3.url(2)}/cluster/placements/preview", json={"sharding": "tensor"}, timeout=60)
    candidates = response.json()["candidates"]
    assert candidates and {c["sharding"] for c in candidates} == {"tensor"}
    response = httpx.post(
        f"{cluster3.url(2)}/cluster/placements/preview",
        json={"sharding": "auto", "min_nodes": 2, "max_nodes": 2},
        timeout=60,
    )
    counts = {len(c["node_ids"]) for c in response.json()["candidates"]}
    assert counts == {2}


def test_preview_shows_the_kv_pool_each_placement_would_have(cluster3):
    asked = {"sharding": "pipeline", "context": 1024, "max_batch": 4}
    response = httpx.post(
        f"{cluster3.url(1)}/cluster/placements/preview", timeout=60, json=dict(asked, kv_cache_bytes=2048 * 23040)
    )  # SmolLM2: 23,040 B a token
    feasible = [c for c in response.json()["candidates"] if c["feasible"]]
    assert feasible and {c["kv_tokens"] for c in feasible} == {2048}
    capped = httpx.post(
        f"{cluster3.url(1)}/cluster/placements/preview", timeout=60, json=dict(asked, kv_cache_bytes=10**12)
    ).json()["candidates"]
    assert {c["kv_tokens"] for c in capped if c["feasible"]} == {4 * 1024}  # max_batch x context
