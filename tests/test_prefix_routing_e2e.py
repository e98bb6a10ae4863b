"""Routing by cached prefix across instances, on a real cluster: two instances of the
default model on the second of two nodes, every request sent to the first (which
forwards them). A conversation started while another ran on the older instance went to
the other, idle one; its next turn goes back there (for its cache), not to the older."""

from __future__ import annotations

import json

import httpx
import pytest
from conftest import free_port_block

from shardline.bench.bench import build_prompt
from shardline.local_cluster import LocalCluster
from shardline.models.store import DEFAULT_MODEL_ID as M

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def two_instances(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("prefix-routing")
    cluster = LocalCluster(
        nodes=2, base_port=free_port_block(2), runner_threads=1, log_dir=str(log_dir), data_dir=str(log_dir)
    )
    try:
        cluster.start()
        older = cluster.place(None, "pipeline", on=[1])
        newer = cluster.place(None, "pipeline", on=[1])
        yield cluster, older["instance_id"], newer["instance_id"]
    finally:
        cluster.stop()


def ask(url: str, messages: list[dict]) -> tuple[str, int, str]:
    """(answer, cached prompt tokens, system_fingerprint) of one greedy request."""
    body = httpx.post(
        f"{url}/v1/chat/completions",
        timeout=120,
        json={"model": M, "messages": messages, "temperature": 0, "max_tokens": 8},
    ).json()
    return (
        body["choices"][0]["message"]["content"],
        body["usage"]["prompt_tokens_details"]["cached_tokens"],
        body["system_fingerprint"],
    )


def test_a_conversations_next_turn_goes_to_the_instance_that_holds_its_prefix(two_instances):
    cluster, older, newer = two_instances
    url = cluster.url(0)
    a = [{"role": "system", "content": build_prompt(400, 301)}, {"role": "user", "content": "Summarise it."}]
    b = [{"role": "system", "content": build_prompt(400, 302)}, {"role": "user", "content": "Summarise it."}]
    with httpx.stream(
        "POST",
        f"{url}/v1/chat/completions",
        timeout=120,
        json={"model": M, "messages": a, "temperature": 0, "max_tokens": 600, "ignore_eos": True, "stream": True},
    ) as running:  # still running when b comes
        lines = running.iter_lines()
        first = json.loads(next(line for line in lines if line.startswith("data:"))[5:])
        assert first["system_fingerprint"].startswith(f"fp_{older[:12]}")  # the oldest, both idle
        answer_b, cached_b, where_b = ask(url, b)  # while a runs there: the idle one
        for _ in lines:
            pass
    assert where_b.startswith(f"fp_{newer[:12]}") and cached_b == 0
    b += [{"role": "assistant", "content": answer_b}, {"role": "user", "content": "Shorter."}]
    _, cached, where = ask(url, b)
    assert where.startswith(f"fp_{newer[:12]}"), "the next turn went elsewhere than its prefix"
    assert cached > 300, cached  # of ~470: whole blocks, resumed where a cold prefill cuts
