"""A node copies only what its ranks read, on a 3-node cluster (127.0.0.1): a GGUF model
that only node 0 holds, placed as a 3-rank pipeline, is copied to nodes 1 and 2 as its
header and their ranks' tensors, in sparse files whose allocated blocks stay within 1.1x
of those bytes; the pipeline answers as one node does; placed again so that each of those
nodes reads other layers, each fetches only the pieces it lacks."""

from __future__ import annotations

import os
import re
import time

import httpx
import pytest
from conftest import CAPITAL_QUESTION, free_port_block
from test_sharding_e2e import texts

from shardline.local_cluster import LocalCluster
from shardline.models.byte_ranges import merged, total
from shardline.models.config import RankShare
from shardline.models.rank_reads import RankReads
from shardline.models.store import ModelStore, default_model_path

pytestmark = pytest.mark.timeout(420)

MODEL = "test/sparse"
GGUF = default_model_path().name


def ask(url: str) -> str:
    return texts(url, [CAPITAL_QUESTION], 16, MODEL)[0]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sparse")
    cluster = LocalCluster(nodes=3, base_port=free_port_block(3), runner_threads=1, log_dir=str(tmp), data_dir=str(tmp))
    cluster.start()
    yield cluster
    cluster.stop()


def store_of(cluster: LocalCluster, i: int) -> ModelStore:
    return ModelStore(cluster.node_data_dir(i) / "models")


def allocated(cluster: LocalCluster, i: int) -> int:
    """Bytes of disk the node's copy of the GGUF file takes (its allocated blocks)."""
    return os.stat(store_of(cluster, i).model_dir(MODEL) / GGUF).st_blocks * 512


def pieces_read(cluster: LocalCluster, instance: dict, node_index: int) -> list[tuple[int, int]]:
    """The byte ranges of the pieces (header included) the node's rank of ``instance`` reads."""
    manifest = store_of(cluster, 0).manifest(MODEL)
    node_id = httpx.get(f"{cluster.url(node_index)}/health", timeout=5).json()["node_id"]
    rank, placement = next((r, p) for r, p in enumerate(instance["ranks"]) if p["node_id"] == node_id)
    reads = RankReads.of(
        instance["sharding"],
        rank,
        RankShare(placement["layer_start"], placement["layer_end"]),
        manifest.config["num_layers"],
    )
    return [p.range for p in manifest.shard_pieces(reads)[GGUF]]


def copied_bytes(cluster: LocalCluster, i: int) -> list[int]:
    """The bytes of each copy of the model node ``i`` logged, in order."""
    text = (cluster.log_dir and open(os.path.join(cluster.log_dir, f"node-{i}.log"), errors="replace").read()) or ""
    return [int(n) for n in re.findall(rf"copied (\d+) bytes of {re.escape(MODEL)} from", text)]


@pytest.mark.slow
def test_nodes_copy_only_the_pieces_their_ranks_read(cluster):
    size = default_model_path().stat().st_size
    manifest = store_of(cluster, 0).add_local(default_model_path(), MODEL)
    tokenizer_bytes = sum(manifest.file(path).size for path in manifest.tokenizer_files())
    started = time.monotonic()
    cluster.place(MODEL, "pipeline", on=[0], force=True)
    alone = ask(cluster.url(0))
    cluster.clear()
    assert store_of(cluster, 1).model_ids() == [] and store_of(cluster, 2).model_ids() == []

    placed = time.monotonic()
    instance = cluster.place(MODEL, "pipeline", on=[0, 1, 2], force=True)
    took = time.monotonic() - placed
    assert ask(cluster.url(1)) == alone
    first = {}
    for i in (1, 2):
        needed = pieces_read(cluster, instance, i)
        first[i] = needed
        held = store_of(cluster, i).held_ranges(MODEL, GGUF)
        assert held == merged(needed)  # what its rank reads, no more
        assert GGUF not in store_of(cluster, i).present(MODEL)
        assert os.stat(store_of(cluster, i).model_dir(MODEL) / GGUF).st_size == size
        on_disk = allocated(cluster, i)
        print(
            f"node {i}: placed in {took:.1f} s; {on_disk} bytes on disk for {total(needed)} bytes "
            f"of header and tensors ({on_disk / total(needed):.3f}x); the file is {size}"
        )
        assert on_disk <= 1.1 * total(needed)
        assert sum(copied_bytes(cluster, i)) == total(needed) + tokenizer_bytes  # and the tokenizer's files

    # placed again in another order: nodes 1 and 2 each read other layers
    cluster.clear()
    instance = cluster.place(MODEL, "pipeline", on=[0, 2, 1], force=True)
    assert ask(cluster.url(2)) == alone
    for i in (1, 2):
        needed = pieces_read(cluster, instance, i)
        assert merged(needed) != merged(first[i])
        union = merged(first[i] + needed)
        assert store_of(cluster, i).held_ranges(MODEL, GGUF) == union
        fetched = total(union) - total(first[i])  # only what it lacked
        assert sum(copied_bytes(cluster, i)) == total(first[i]) + tokenizer_bytes + fetched
        on_disk = allocated(cluster, i)
        print(
            f"node {i} placed again: fetched {fetched} bytes; {on_disk} bytes on disk for {total(union)} "
            f"held ({on_disk / total(union):.3f}x)"
        )
        assert on_disk <= 1.1 * total(union)
    print(f"all in {time.monotonic() - started:.1f} s")
