"""Memory on a real 3-node cluster (127.0.0.1), each node capped with --memory-limit:
what each rank holds against its file bytes and placement's estimate, load peaks, and a
cap that refuses a placement that would not fit."""

from __future__ import annotations

import httpx
import pytest

from conftest import free_port_block
from shardline.local_cluster import LocalCluster, LocalClusterError
from shardline.models.store import DEFAULT_MODEL_ID
from shardline.placement.memory import RUNTIME_BASELINE_BYTES, prefill_scratch_bytes

pytestmark = pytest.mark.timeout(300)

CAP = 600_000_000  # bytes each node offers
MIB = 2**20


@pytest.fixture(scope="module")
def capped(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("memory")
    cluster = LocalCluster(nodes=3, base_port=free_port_block(3), runner_threads=1,
                           log_dir=str(tmp), data_dir=str(tmp),
                           node_args={i: ["--memory-limit", str(CAP)] for i in range(3)})
    cluster.start()
    try:
        inst = cluster.place(None, "pipeline", context=256, max_batch=1)
        yield cluster, inst
    finally:
        cluster.stop()


def rank_memory(cluster, inst) -> list[dict]:
    """Each rank's local_memory, asked of its own node, after a short chat."""
    response = httpx.post(f"{cluster.url(0)}/v1/chat/completions", timeout=120, json={
        "model": DEFAULT_MODEL_ID, "temperature": 0, "max_tokens": 16,
        "messages": [{"role": "user", "content": "What is the capital of France?"}]})
    assert "Paris" in response.json()["choices"][0]["message"]["content"]
    out = []
    for rank in inst["ranks"]:
        views = httpx.get(f"http://{rank['address']}/cluster/instances", timeout=10).json()
        view = next(v for v in views["instances"] if v["instance_id"] == inst["instance_id"])
        out.append(view["local_memory"])
    return out


def test_each_rank_holds_about_its_file_bytes_and_what_placement_counted(capped):
    cluster, inst = capped
    config_scratch = prefill_scratch_bytes(576, 1536, 2 * 1536 * 576)  # SmolLM2's shape
    memory = rank_memory(cluster, inst)
    for rank, mem in zip(inst["ranks"], memory):
        loaded = httpx.get(f"{cluster.url(0)}/cluster/instances").json()["instances"][0]["ranks"]
        file_bytes = next(r for r in loaded if r["node_id"] == rank["node_id"])["loaded"]["bytes_read"]
        kv = 256 * 2 * 3 * 64 * 2 * (rank["layer_end"] - rank["layer_start"])
        steady, load_peak, estimate = mem["rss_bytes"], mem["load_peak_rss_bytes"], rank["estimated_bytes"]
        print(f"\nlayers {rank['layer_start']}-{rank['layer_end'] - 1}: file {file_bytes / MIB:.0f} "
              f"MiB, estimate {estimate / MIB:.0f}, steady {steady / MIB:.0f}, load peak "
              f"{load_peak / MIB:.0f}, peak {mem['peak_rss_bytes'] / MIB:.0f}")
        assert steady <= 1.15 * file_bytes + kv + RUNTIME_BASELINE_BYTES + config_scratch
        assert abs(estimate - steady) <= 0.25 * steady  # measured 10-18% over
        assert load_peak <= 1.3 * steady
        assert mem["peak_rss_bytes"] <= CAP  # the cap holds


def test_the_cap_refuses_a_second_placement_and_nodes_show_what_is_committed(capped):
    cluster, inst = capped
    with pytest.raises(LocalClusterError, match="short by"):
        cluster.place(None, "pipeline", context=256, max_batch=1)
    nodes = httpx.get(f"{cluster.url(1)}/cluster/nodes", timeout=10).json()["nodes"]
    estimates = {r["node_id"]: r["estimated_bytes"] for r in inst["ranks"]}
    for node in nodes:
        assert node["offered_bytes"] == CAP
        assert node["committed_bytes"] == estimates[node["node_id"]]
        assert node["free_bytes"] == CAP - node["committed_bytes"]
