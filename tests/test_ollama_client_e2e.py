"""The official ``ollama`` package against a node: ``show()``, ``ps()``, ``list()``,
``chat()`` streamed and not, and ``keep_alive`` (which unloads: on a cluster of its own)."""

from __future__ import annotations

import time

import httpx
import ollama
import pytest
from conftest import CAPITAL_QUESTION, start_cluster

from shardline.models.store import DEFAULT_MODEL_ID

pytestmark = pytest.mark.timeout(400)

QUESTION = [{"role": "user", "content": CAPITAL_QUESTION}]
GREEDY = {"temperature": 0, "num_predict": 12}


def test_show_ps_and_list_describe_the_served_model(cluster1):
    client = ollama.Client(host=cluster1.url(0), timeout=120)
    shown = client.show(DEFAULT_MODEL_ID)
    assert shown.details.format == "gguf" and shown.details.family == "llama"
    assert shown.details.parameter_size == "134.52M" and shown.details.quantization_level == "Q4_1"
    assert shown.modelinfo["general.architecture"] == "llama" and shown.modelinfo["llama.block_count"] == 30
    assert shown.modelinfo["general.parameter_count"] == 134_515_008
    assert "<|im_start|>" in shown.template and shown.capabilities == ["completion"]
    assert "temperature" in shown.parameters and f"FROM {DEFAULT_MODEL_ID}" in shown.modelfile

    listed = client.list().models
    assert [m.model for m in listed] == [DEFAULT_MODEL_ID]
    assert listed[0].size == 98_362_432 and len(listed[0].digest) == 64  # the GGUF file's bytes
    assert listed[0].details.quantization_level == "Q4_1"

    running = client.ps().models
    assert [m.model for m in running] == [DEFAULT_MODEL_ID] and running[0].digest == listed[0].digest
    assert running[0].size > 50_000_000 and running[0].size_vram == 0  # runners compute on the CPU
    assert running[0].expires_at.year == 9999  # no keep_alive: kept
    assert client.list().models[0].digest == listed[0].digest  # stable
    with pytest.raises(ollama.ResponseError) as caught:
        client.show("no-such-model")
    assert caught.value.status_code == 404 and "not found" in caught.value.error


def test_chat_streamed_and_not_agree(cluster1):
    client = ollama.Client(host=cluster1.url(0), timeout=120)
    whole = client.chat(DEFAULT_MODEL_ID, messages=QUESTION, options=GREEDY)
    assert "Paris" in whole.message.content and whole.done and whole.eval_count <= 12
    parts = list(client.chat(DEFAULT_MODEL_ID, messages=QUESTION, options=GREEDY, stream=True))
    assert "".join(p.message.content for p in parts) == whole.message.content and parts[-1].done
    loaded = client.chat(DEFAULT_MODEL_ID, messages=[])  # the preload idiom
    assert loaded.done and loaded.done_reason == "load"
    with pytest.raises(ollama.ResponseError) as caught:
        client.chat("no-such-model", messages=[])
    assert caught.value.status_code == 404


def test_embeddings_are_refused_for_a_placed_model(cluster1):
    for path in ("/api/embed", "/api/embeddings"):
        response = httpx.post(cluster1.url(0) + path, json={"model": DEFAULT_MODEL_ID, "input": "hi"}, timeout=30)
        assert response.status_code == 400
        assert response.json()["error"] == f"model '{DEFAULT_MODEL_ID}' does not support embeddings"
    response = httpx.post(
        cluster1.url(0) + "/v1/embeddings", json={"model": DEFAULT_MODEL_ID, "input": "hi"}, timeout=30
    )
    assert response.status_code == 400 and response.json()["error"]["param"] == "model"


def test_cluster_errors_allow_and_request_id_on_a_running_node(cluster1):
    url = cluster1.url(0)
    missing = httpx.delete(f"{url}/cluster/instances/no-such-instance", headers={"X-Request-Id": "r-1"}, timeout=10)
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "instance_id"
    assert missing.headers["x-request-id"] == "r-1"
    wrong = httpx.put(f"{url}/cluster/instances", timeout=10)
    assert wrong.status_code == 405 and wrong.headers["allow"] == "GET, POST"
    assert len(wrong.headers["x-request-id"]) == 32


def _gone(url: str, deadline_s: float) -> float:
    """Seconds until the node's table has no instance of the default model, polling."""
    started = time.monotonic()
    while time.monotonic() - started < deadline_s:
        instances = httpx.get(f"{url}/cluster/instances", timeout=10).json()["instances"]
        if not any(i["model_id"] == DEFAULT_MODEL_ID for i in instances):
            return time.monotonic() - started
        time.sleep(0.2)
    raise AssertionError(f"the model was still placed after {deadline_s} s")


@pytest.mark.slow
def test_keep_alive_unloads(tmp_path):
    cluster = start_cluster(1, tmp_path)
    try:
        url = cluster.url(0)
        client = ollama.Client(host=url, timeout=120)
        # A duration: kept while idle for 3 s after the request, then unloaded.
        answer = client.chat(DEFAULT_MODEL_ID, messages=QUESTION, options=GREEDY, keep_alive="3s")
        assert "Paris" in answer.message.content
        expires = client.ps().models[0].expires_at.timestamp()
        assert 0 < expires - time.time() <= 3.5
        assert 1.5 < _gone(url, 30) < 12
        assert client.ps().models == []

        # 0 with messages: the answer, then unloaded.
        cluster.place(None, "pipeline")
        answer = client.chat(DEFAULT_MODEL_ID, messages=QUESTION, options=GREEDY, keep_alive=0)
        assert "Paris" in answer.message.content
        assert _gone(url, 10) < 5

        # 0 without a prompt: unloaded before the answer.
        cluster.place(None, "pipeline")
        unloaded = client.generate(DEFAULT_MODEL_ID, keep_alive=0)
        assert unloaded.done and unloaded.done_reason == "unload"
        assert _gone(url, 5) < 1 and client.ps().models == []
        # As in Ollama, a request loads the model again (placed by the cluster, waited for).
        loaded = client.generate(DEFAULT_MODEL_ID)
        assert loaded.done and loaded.done_reason == "load"
        assert [m.model for m in client.ps().models] == [DEFAULT_MODEL_ID]
        client.generate(DEFAULT_MODEL_ID, keep_alive=0)
        assert _gone(url, 5) < 1
        answer = client.chat(DEFAULT_MODEL_ID, messages=QUESTION, options=GREEDY)  # loads it too
        assert "Paris" in answer.message.content
        # the load is timed, and part of the total, as Ollama reports it
        assert 0 < answer.load_duration < answer.total_duration, answer
        assert client.chat(DEFAULT_MODEL_ID, messages=QUESTION, options=GREEDY).load_duration == 0
    finally:
        cluster.stop()
