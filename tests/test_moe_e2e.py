"""End to end: a mixture-of-experts model (a tiny random Qwen3-MoE with SmolLM2's
tokenizer) placed on real node processes, one node, as a pipeline of 3, as 2 tensor ranks
and as 2 expert ranks, in float32: each answers a chat request with one node's text."""

from __future__ import annotations

import httpx
import pytest
import tiny_models as tm
from conftest import free_port_block
from test_sharding_e2e import placed, texts

from shardline.local_cluster import LocalCluster
from shardline.models.store import ModelStore

pytestmark = pytest.mark.timeout(300)

MODEL = "test/tiny-qwen3-moe"
PROMPTS = ["Hello there", "Write a haiku about the sea."]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Three nodes, each with the tiny MoE model in its store."""
    path = tm.save_with_tokenizer(tmp_path_factory.mktemp("moe") / "model", num_layers=3, arch="qwen3moe")
    log_dir = str(tmp_path_factory.mktemp("moe-cluster"))
    cluster = LocalCluster(nodes=3, base_port=free_port_block(3), runner_threads=1, log_dir=log_dir, data_dir=log_dir)
    try:
        cluster.start()
        for i in range(cluster.n):
            ModelStore(cluster.node_data_dir(i) / "models").add_local(path, MODEL)
        yield cluster
    finally:
        cluster.stop()


def test_an_moe_model_gives_one_nodes_text_as_a_pipeline_and_as_tensor_ranks(cluster):
    with placed(cluster, "pipeline", [0], "float32", model=MODEL) as inst:
        one = texts(cluster.url(0), PROMPTS, 12, MODEL)
        one_bytes = inst["ranks"][0]["loaded"]["param_bytes"]
    assert all(one), one
    with placed(cluster, "pipeline", [0, 1, 2], "float32", model=MODEL) as inst:
        assert [(r["layer_start"], r["layer_end"]) for r in inst["ranks"]] == [(0, 1), (1, 2), (2, 3)]
        assert texts(cluster.url(1), PROMPTS, 12, MODEL) == one
    with placed(cluster, "tensor", [0, 1], "float32", model=MODEL) as inst:
        assert texts(cluster.url(2), PROMPTS, 12, MODEL) == one
        # every rank holds half of every expert: well under the whole model's weights
        held = [r["loaded"]["param_bytes"] for r in inst["ranks"]]
        assert all(h < one_bytes for h in held), (held, one_bytes)
        tags = httpx.get(f"{cluster.url(0)}/api/tags", timeout=10).json()["models"]
        details = next(m["details"] for m in tags if m["name"].startswith(MODEL))
        assert details["family"] == "qwen3moe", details
    with placed(cluster, "expert", [1, 2], "float32", model=MODEL) as inst:
        assert [r["tensor_share"]["experts"] for r in inst["ranks"]] == [[0, 4], [4, 8]]
        assert texts(cluster.url(0), PROMPTS, 12, MODEL) == one
    preview = httpx.post(
        f"{cluster.url(0)}/cluster/placements/preview", json={"model": MODEL, "sharding": "auto"}, timeout=60
    ).json()
    shardings = {c["sharding"] for c in preview["candidates"] if c["feasible"]}
    assert {"pipeline", "tensor", "expert"} <= shardings, preview
