"""Memory on a real 3-node cluster (127.0.0.1), the nodes capped with --memory-limit at
800, 400 and 250 MB (the issue's case, where ranks used 1327, 967 and 1064 MB): what each
rank holds against its file bytes and placement's estimate, load peaks, every rank under
its node's cap, and caps that refuse a second placement that would not fit."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import psutil
import pytest
from conftest import CAPITAL_QUESTION, free_port_block, wait_until
from memory_bounds import MIB, check_rank, describe

from shardline.bench.memory import rank_memory
from shardline.local_cluster import LocalCluster, LocalClusterError
from shardline.models.store import DEFAULT_MODEL_ID

pytestmark = pytest.mark.timeout(300)

CAPS = [800_000_000, 400_000_000, 250_000_000]  # bytes each node offers: one placement fits


@pytest.fixture(scope="module")
def capped(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("memory")
    cluster = LocalCluster(
        nodes=3,
        base_port=free_port_block(3),
        runner_threads=1,
        log_dir=str(tmp),
        data_dir=str(tmp),
        node_args={i: ["--memory-limit", str(cap)] for i, cap in enumerate(CAPS)},
    )
    cluster.start()
    try:
        wait_until(
            lambda: all(
                (n["profile"] or {}).get("runtime_baseline_bytes")
                for n in httpx.get(f"{cluster.url(0)}/cluster/nodes").json()["nodes"]
            ),
            120,
            "every node's measured runtime baseline (else placement counts 256 MiB)",
            interval_s=0.5,
            tolerate=(httpx.HTTPError,),
        )
        inst = cluster.place(None, "pipeline", context=256, max_batch=1)
        yield cluster, inst
    finally:
        cluster.stop()


LONG = " ".join(f"Fact {i}: {i} squared is {i * i}." for i in range(14))  # ~210 tokens in all


def run_workload(cluster) -> None:
    """A fixed workload: a prompt of a few hundred tokens (one prefill chunk's scratch) and a
    short chat; then a heartbeat passes, so the runners' reports are from after it, idle."""
    long = httpx.post(
        f"{cluster.url(0)}/v1/chat/completions",
        timeout=120,
        json={
            "model": DEFAULT_MODEL_ID,
            "temperature": 0,
            "max_tokens": 8,
            "messages": [{"role": "user", "content": LONG + " What is 7 squared?"}],
        },
    )
    assert long.status_code == 200, long.text
    response = httpx.post(
        f"{cluster.url(0)}/v1/chat/completions",
        timeout=120,
        json={
            "model": DEFAULT_MODEL_ID,
            "temperature": 0,
            "max_tokens": 16,
            "messages": [{"role": "user", "content": CAPITAL_QUESTION}],
        },
    )
    assert "Paris" in response.json()["choices"][0]["message"]["content"]
    time.sleep(2.5)  # idle 0.5 s, a runner hands its scratch back; it reports every second


def runner_breakdown(cluster, address: str) -> str:
    """What the runner under the node at ``address`` holds, by kind (anonymous, file,
    shared) and its largest mappings, from /proc: printed when a bound fails."""
    node = cluster.procs[int(address.rsplit(":", 1)[1]) - cluster.base_port]
    lines = []
    for child in psutil.Process(node.pid).children(recursive=True):
        try:
            status = Path(f"/proc/{child.pid}/status").read_text()
            maps = psutil.Process(child.pid).memory_maps(grouped=True)
        except (OSError, psutil.Error):
            continue
        kinds = [
            line.replace("\t", " ")
            for line in status.splitlines()
            if line.startswith(("RssAnon", "RssFile", "RssShmem", "Threads"))
        ]
        top = sorted(maps, key=lambda m: m.rss, reverse=True)[:6]
        lines.append(
            f"  pid {child.pid}: {', '.join(' '.join(k.split()) for k in kinds)}; "
            + "; ".join(f"{Path(m.path).name or m.path} {m.rss / MIB:.0f}" for m in top)
        )
    return "\n".join(lines)


def test_each_rank_holds_about_its_file_bytes_and_what_placement_counted(capped):
    cluster, inst = capped
    run_workload(cluster)
    rows = rank_memory(cluster.url(0), DEFAULT_MODEL_ID)
    loaded = httpx.get(f"{cluster.url(0)}/cluster/instances").json()["instances"][0]["ranks"]
    caps = node_caps(cluster)
    for rank, row in zip(loaded, rows):
        param_bytes = rank["loaded"]["param_bytes"]
        print("\n" + describe(row, param_bytes))
        print(runner_breakdown(cluster, rank["address"]))
        check_rank(row, param_bytes)
        assert row["peak_rss_bytes"] <= caps[rank["node_id"]]  # the cap holds


def node_caps(cluster) -> dict[str, int]:
    return {httpx.get(f"{cluster.url(i)}/health", timeout=5).json()["node_id"]: cap for i, cap in enumerate(CAPS)}


def test_the_cap_refuses_a_second_placement_and_nodes_show_what_is_committed(capped):
    cluster, inst = capped
    with pytest.raises(LocalClusterError, match="short by"):
        cluster.place(None, "pipeline", context=256, max_batch=1)
    nodes = httpx.get(f"{cluster.url(1)}/cluster/nodes", timeout=10).json()["nodes"]
    assert [n["node_id"] for n in nodes] == sorted(n["node_id"] for n in nodes)  # not the asked node first
    estimates = {r["node_id"]: r["estimated_bytes"] for r in inst["ranks"]}
    caps = node_caps(cluster)
    for node in nodes:
        cap = caps[node["node_id"]]
        assert node["offered_bytes"] == cap
        assert node["committed_bytes"] == estimates[node["node_id"]]
        assert node["free_bytes"] == cap - node["committed_bytes"]


def test_a_kv_pool_too_small_for_a_context_or_a_context_over_the_trained_one_is_a_400(capped):
    cluster, inst = capped
    assert inst["kv_tokens"] == 256 and inst["kv_cache_bytes"] is None  # 1 x 256 tokens
    response = httpx.post(
        f"{cluster.url(0)}/cluster/instances",
        timeout=30,
        json={"model": None, "sharding": "pipeline", "context": 256, "kv_cache_bytes": 1000},
    )
    assert response.status_code == 400
    assert "kv_cache_bytes 1000 holds 0 tokens" in response.json()["error"]["message"]
    preview = httpx.post(
        f"{cluster.url(0)}/cluster/placements/preview",
        timeout=30,
        json={"model": None, "sharding": "pipeline", "context": 256, "kv_cache_bytes": 1000},
    )
    assert preview.status_code == 400 and "kv_cache_bytes" in preview.json()["error"]["message"]
    for route in ("/cluster/instances", "/cluster/placements/preview"):  # over SmolLM2's 8192
        over = httpx.post(
            f"{cluster.url(0)}{route}", timeout=30, json={"model": None, "sharding": "pipeline", "context": 16384}
        )
        assert over.status_code == 400 and "trained context of 8192" in over.json()["error"]["message"]
