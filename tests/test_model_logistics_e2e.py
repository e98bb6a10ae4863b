"""Model logistics on a 3-node cluster (127.0.0.1): a model added to one node's store is
copied to the nodes of its shard and served; a node with no rank copies only the
tokenizer; memory admission refuses a node short of memory, and ``--force`` overrides it;
a safetensors model placed with ``--quantize int4`` is held in 4-bit groups.
Driven through the ``shardline`` CLI, as a user would."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from conftest import CAPITAL_QUESTION, free_port_block

from shardline.local_cluster import LocalCluster
from shardline.models.config import RankShare
from shardline.models.rank_reads import RankReads
from shardline.models.store import ModelStore, default_model_path

pytestmark = pytest.mark.timeout(400)

MODEL = "test/smollm2"


def shardline(*args: str) -> subprocess.CompletedProcess:
    """The command's output to a pipe (no $COLUMNS: tables take the pipe's width)."""
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    return subprocess.run(
        [sys.executable, "-m", "shardline.cli", *args], capture_output=True, text=True, timeout=300, env=env
    )


def ask(url: str) -> str:
    response = httpx.post(
        f"{url}/v1/chat/completions",
        timeout=120,
        json={
            "model": MODEL,
            "temperature": 0,
            "max_tokens": 12,
            "messages": [{"role": "user", "content": CAPITAL_QUESTION}],
        },
    )
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """3 nodes with empty stores; node 2 offers models only 10 MB of memory. Each takes
    local models from ``local-models/`` (``--model-dir``)."""
    tmp = tmp_path_factory.mktemp("logistics")
    (tmp / "local-models").mkdir()
    cluster = LocalCluster(
        nodes=3,
        base_port=free_port_block(3),
        runner_threads=1,
        log_dir=str(tmp),
        data_dir=str(tmp),
        node_args={2: ["--memory-limit", "10MB"]},
        model_dirs=[tmp / "local-models"],
    )
    cluster.start()
    yield cluster
    cluster.stop()


def store_of(cluster: LocalCluster, i: int) -> ModelStore:
    return ModelStore(cluster.node_data_dir(i) / "models")


def node_ids(cluster: LocalCluster) -> list[str]:
    return [httpx.get(f"{cluster.url(i)}/health", timeout=5).json()["node_id"] for i in range(cluster.n)]


@pytest.mark.slow
def test_a_model_added_on_one_node_is_copied_to_its_ranks_and_served(cluster):
    ids = node_ids(cluster)
    added = shardline(
        "models", "add", str(default_model_path()), "--id", MODEL, "--data-dir", str(cluster.node_data_dir(0))
    )
    assert added.returncode == 0, added.stderr
    assert MODEL in added.stdout
    assert store_of(cluster, 1).model_ids() == [] and store_of(cluster, 2).model_ids() == []

    listed = shardline("models", "list", "--url", cluster.url(2))
    assert listed.returncode == 0, listed.stderr
    assert MODEL in listed.stdout and ids[0] in listed.stdout
    # Ollama's list names it before it is placed (a request would load it), as a peer's
    tags = {t["name"]: t for t in httpx.get(f"{cluster.url(2)}/api/tags", timeout=10).json()["models"]}
    assert MODEL in tags and tags[MODEL]["size"] > 0 and "sharding" not in tags[MODEL]["details"]

    placed = shardline(
        "place", MODEL, "--sharding", "pipeline", "--nodes", f"{ids[0]},{ids[1]}", "--url", cluster.url(1)
    )
    assert placed.returncode == 0, placed.stdout + placed.stderr
    assert "ready" in placed.stdout
    gguf = default_model_path().name
    # Node 1 (the last rank) holds of the GGUF file the header and its rank's tensors.
    held = store_of(cluster, 1).held_ranges(MODEL, gguf)
    assert held and gguf not in store_of(cluster, 1).present(MODEL)
    copy, whole = (store_of(cluster, 1).model_dir(MODEL) / gguf).read_bytes(), default_model_path().read_bytes()
    assert len(copy) == len(whole) and all(copy[a:b] == whole[a:b] for a, b in held)
    instance = httpx.get(f"{cluster.url(0)}/cluster/instances", timeout=5).json()["instances"][0]
    rank1 = instance["ranks"][1]
    assert rank1["fetched"]["done_bytes"] == rank1["fetched"]["total_bytes"] < len(whole)

    # Node 2 holds no rank: it copies the tokenizer (a few MB), not the weights, and serves
    # (forwarding to a node with a rank), streamed too.
    assert "Paris" in ask(cluster.url(2))
    with httpx.stream(
        "POST",
        f"{cluster.url(2)}/v1/chat/completions",
        timeout=120,
        json={
            "model": MODEL,
            "stream": True,
            "max_tokens": 8,
            "temperature": 0,
            "ignore_eos": True,
            "messages": [{"role": "user", "content": "Say hello."}],
        },
    ) as response:
        chunks = [line for line in response.iter_lines() if line.startswith("data: {")]
    assert len(chunks) >= 3 and response.status_code == 200  # role, text, finish
    present = store_of(cluster, 2).present(MODEL)
    assert present and gguf not in present and all(p.startswith("tokenizer/") for p in present)

    shown = shardline("instances", "--url", cluster.url(2))
    assert instance["instance_id"] in shown.stdout and MODEL in shown.stdout
    nodes = shardline("nodes", "--url", cluster.url(0))
    assert all(i in nodes.stdout for i in ids)
    assert "memory: free / offered, placed" in nodes.stdout  # one line a header: 80 columns wrapped it
    rows = [
        cell
        for line in nodes.stdout.splitlines()
        if line.startswith("│") and (cell := line.split("│")[1].strip()) in ids
    ]
    assert rows == sorted(ids)  # one order, whichever node is asked
    deleted = shardline("delete", instance["instance_id"], "--url", cluster.url(2))
    assert deleted.returncode == 0, deleted.stderr
    assert httpx.get(f"{cluster.url(0)}/cluster/instances", timeout=5).json()["instances"] == []


@pytest.mark.slow
def test_a_node_short_of_memory_is_refused_unless_forced(cluster):
    ids = node_ids(cluster)
    if MODEL not in store_of(cluster, 0).model_ids():
        store_of(cluster, 0).add_local(default_model_path(), MODEL)
    refused = shardline("place", MODEL, "--sharding", "pipeline", "--url", cluster.url(0))
    assert refused.returncode == 1
    assert f"node {ids[2]} needs" in refused.stderr and "short by" in refused.stderr

    forced = shardline("place", MODEL, "--sharding", "pipeline", "--force", "--url", cluster.url(0))
    assert forced.returncode == 0, forced.stdout + forced.stderr
    instance = httpx.get(f"{cluster.url(0)}/cluster/instances", timeout=5).json()["instances"][0]
    assert instance["force"] is True
    layers = {r["node_id"]: r["layer_end"] - r["layer_start"] for r in instance["ranks"]}
    assert layers[ids[2]] == 1 and layers[ids[0]] + layers[ids[1]] == 29  # ranges follow memory
    assert store_of(cluster, 2).held_ranges(MODEL, default_model_path().name)  # its rank's pieces
    assert "Paris" in ask(cluster.url(2))


def test_a_local_path_given_to_any_node_is_placed_and_each_rank_copies_only_its_files(cluster):
    from tiny_models import hf_model

    source = Path(cluster.model_dirs[0]) / "tiny-split"  # under the nodes' --model-dir
    hf_model("llama", num_layers=4).save_pretrained(source, safe_serialization=True, max_shard_size="60KB")
    ids = node_ids(cluster)
    asked = max(range(3), key=lambda i: ids[i])  # not the coordinator (the smallest id)
    placed = shardline(
        "place", str(source), "--sharding", "pipeline", "--force", "--quantize", "int4", "--url", cluster.url(asked)
    )
    assert placed.returncode == 0, placed.stdout + placed.stderr
    instance = next(
        i
        for i in httpx.get(f"{cluster.url(0)}/cluster/instances", timeout=5).json()["instances"]
        if i["model_id"] == "tiny-split"
    )
    assert instance["status"] == "ready" and instance["quantize"] == "int4"
    for rank in instance["ranks"]:  # float32 files held in 5 bits a weight (norms in 16)
        assert rank["loaded"]["param_bytes"] < 0.25 * rank["loaded"]["bytes_read"], rank
    manifest = store_of(cluster, asked).manifest("tiny-split")  # adopted by the node asked
    assert store_of(cluster, asked).present("tiny-split") == {f.path for f in manifest.files}
    weights = {f.path for f in manifest.files if f.weights}
    ranks = instance["ranks"]
    for rank_index, rank in enumerate(ranks):
        i = ids.index(rank["node_id"])
        if i == asked:
            continue
        reads = RankReads.of(
            "pipeline", rank_index, RankShare(rank["layer_start"], rank["layer_end"]), manifest.config["num_layers"]
        )
        needed = set(manifest.shard_files(reads))
        assert store_of(cluster, i).present("tiny-split") == needed
    middle = ids.index(ranks[1]["node_id"])
    if middle != asked:
        assert store_of(cluster, middle).present("tiny-split") & weights < weights
    # a served model's files stay unless forced; once its instance is deleted they go
    data_dir = str(cluster.node_data_dir(asked))
    kept = shardline("models", "remove", "tiny-split", "--data-dir", data_dir, "--url", cluster.url(0))
    assert kept.returncode == 1 and instance["instance_id"] in kept.stderr, kept.stderr
    assert "--force" in kept.stderr and store_of(cluster, asked).present("tiny-split")
    httpx.delete(f"{cluster.url(0)}/cluster/instances/{instance['instance_id']}", timeout=30)
    removed = shardline("models", "remove", "tiny-split", "--data-dir", data_dir, "--url", cluster.url(0))
    assert removed.returncode == 0, removed.stderr
    assert "tiny-split" not in store_of(cluster, asked).model_ids()
    # the others hold only their shards' files: placing it again is refused at once
    again = httpx.post(
        f"{cluster.url(0)}/cluster/instances",
        timeout=60,
        json={"model": "tiny-split", "sharding": "pipeline", "force": True},
    )
    assert again.status_code == 404 and "holds all of model 'tiny-split'" in again.text, again.text
