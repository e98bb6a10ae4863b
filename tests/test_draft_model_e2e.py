"""A draft model placed beside the model (``POST /cluster/instances`` ``draft_model``): a
2-node pipeline of the real model, the model its own draft model on the last node; the
greedy text with drafts is the text without, the drafts are taken, and a draft model
that is not one is refused naming the parameter."""

from __future__ import annotations

import re

import httpx
import pytest
from conftest import local_cluster

from shardline.models.store import DEFAULT_MODEL_ID as M

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cluster = local_cluster(2, tmp_path_factory.mktemp("draft-model"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def _accepted(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(r"^shardline_rank_accepted_draft_tokens_total\{.*\} (\S+)$", text, re.M))


def test_the_last_rank_drafts_with_the_draft_model_and_the_text_is_the_same(cluster):
    instance = cluster.place(None, "pipeline", draft_model=M)
    assert instance["draft_model"] == M
    url = cluster.url(1)  # the sampling rank's node counts its drafts
    body = {
        "model": M,
        "messages": [{"role": "user", "content": "Write a short poem about the sea."}],
        "max_tokens": 48,
        "temperature": 0,
    }
    plain = httpx.post(f"{cluster.url(0)}/v1/chat/completions", json={**body, "speculative.n_max": 0}, timeout=120)
    before = _accepted(url)
    drafted = httpx.post(f"{cluster.url(0)}/v1/chat/completions", json=body, timeout=120)
    assert plain.status_code == drafted.status_code == 200, (plain.text, drafted.text)
    assert drafted.json()["choices"][0]["message"] == plain.json()["choices"][0]["message"]
    assert _accepted(url) > before  # its own guesses: most are taken


@pytest.mark.parametrize(
    "draft,status",
    [
        ("/nowhere/nothing.gguf", 400),  # a path that is no model
        ("", 400),
        ("nobody/no-such-model", 404),  # an id no node holds
    ],
)
@pytest.mark.parametrize("path", ["/cluster/instances", "/cluster/placements/preview"])
def test_a_draft_model_that_is_no_model_is_refused_naming_it(cluster, draft, status, path):
    response = httpx.post(f"{cluster.url(0)}{path}", json={"model": M, "draft_model": draft}, timeout=60)
    assert response.status_code == status and response.json()["error"]["param"] == "draft_model", response.text


def test_the_preview_counts_the_draft_model_on_the_sampling_rank(cluster):
    def ranks(**extra) -> dict:
        response = httpx.post(f"{cluster.url(0)}/cluster/placements/preview", json={"model": M, **extra}, timeout=60)
        assert response.status_code == 200, response.text
        return {tuple(c["node_ids"]): c["rank_bytes"] for c in response.json()["candidates"] if c["feasible"]}

    plain, drafting = ranks(), ranks(draft_model=M)
    two = next(ids for ids in plain if len(ids) == 2)
    assert drafting[two][0] == plain[two][0] and drafting[two][1] > plain[two][1] + 100_000_000  # weights + KV
