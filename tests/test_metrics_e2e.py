"""Prometheus metrics (``GET /metrics``) of a node of the 3-node cluster."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from shardline.models.store import DEFAULT_MODEL_ID

pytestmark = pytest.mark.timeout(120)


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    response = httpx.get(f"{url}/metrics", timeout=10)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(response.text)
        for s in family.samples
    }


def test_requests_tokens_and_ttft_are_counted_where_taken(cluster3):
    url = cluster3.url(2)
    before = scrape(url)
    chat = httpx.post(
        f"{url}/v1/chat/completions",
        timeout=120,
        json={
            "model": DEFAULT_MODEL_ID,
            "max_tokens": 5,
            "temperature": 0,
            "messages": [{"role": "user", "content": "Hello"}],
        },
    ).json()
    message = httpx.post(
        f"{url}/v1/messages",
        timeout=120,
        json={
            "model": DEFAULT_MODEL_ID,
            "max_tokens": 4,
            "temperature": 0,
            "messages": [{"role": "user", "content": "Hello"}],
        },
    ).json()
    after = scrape(url)

    def grew(name: str, labels: dict | None = None) -> float:
        key = (name, tuple(sorted((labels or {}).items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    chat_finish = chat["choices"][0]["finish_reason"]
    assert grew("shardline_requests_total", {"api": "openai", "finish_reason": chat_finish}) == 1
    anthropic_finish = "length" if message["stop_reason"] == "max_tokens" else "stop"
    assert grew("shardline_requests_total", {"api": "anthropic", "finish_reason": anthropic_finish}) == 1
    assert (
        grew("shardline_generation_tokens_total")
        == chat["usage"]["completion_tokens"] + message["usage"]["output_tokens"]
    )
    assert grew("shardline_prompt_tokens_total") == chat["usage"]["prompt_tokens"] + message["usage"]["input_tokens"]
    assert grew("shardline_time_to_first_token_seconds_count") == 2
    assert grew("shardline_request_duration_seconds_sum") > 0
    assert after[("shardline_nodes_live", ())] == 3
    assert after[("shardline_instances", (("status", "ready"),))] == 1
    assert after[("shardline_available_memory_bytes", ())] > 0
    instance = httpx.get(f"{url}/cluster/instances", timeout=10).json()["instances"][0]["instance_id"]
    assert after[("shardline_running_sequences", (("instance", instance),))] == 0
    # Requests taken by another node are counted there, not here.
    httpx.post(
        f"{cluster3.url(0)}/v1/completions",
        timeout=120,
        json={"model": DEFAULT_MODEL_ID, "prompt": "Hi", "max_tokens": 2},
    )
    assert scrape(url)[("shardline_generation_tokens_total", ())] == after[("shardline_generation_tokens_total", ())]
