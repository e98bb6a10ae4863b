"""Memory of a K-quant model on a real cluster (127.0.0.1): a Qwen2 GGUF in llama.cpp's
Q4_K_M mix of types (Q4_K and Q6_K; random weights, SmolLM2's tokenizer) placed on 1 node,
as tensor-2 and as pipeline-3. Each rank holds about its shard's file bytes, placement's
estimate is within 15% of what it holds after a fixed workload, and loading peaks at most
1.2x that."""

from __future__ import annotations

import httpx
import pytest

import tiny_models as tm
from conftest import free_port_block
from shardline.bench.memory import rank_memory
from shardline.local_cluster import LocalCluster
from shardline.models.store import default_model_path

pytestmark = pytest.mark.timeout(600)

MIB = 2**20
PROMPT = " ".join(f"Fact {i}: {i} squared is {i * i}." for i in range(14))  # ~210 tokens


@pytest.fixture(scope="module")
def kquant(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("kquant-memory")
    path = tm.write_q4_k_m_gguf(tmp / "qwen2-q4_k_m.gguf", default_model_path(), layers=8,
                                hidden=1024, intermediate=2816, heads=16, kv_heads=4)
    cluster = LocalCluster(nodes=3, base_port=free_port_block(3), runner_threads=1,
                           log_dir=str(tmp), data_dir=str(tmp))
    cluster.start()
    try:
        yield cluster, str(path)
    finally:
        cluster.stop()


@pytest.mark.parametrize("sharding, nodes", [("pipeline", [0]), ("tensor", [0, 1]),
                                             ("pipeline", [0, 1, 2])])
def test_a_q4_k_m_rank_holds_about_its_file_bytes(kquant, sharding, nodes):
    cluster, path = kquant
    inst = cluster.place(path, sharding, on=nodes, context=512, max_batch=1)
    try:
        model = inst["model_id"]
        response = httpx.post(f"{cluster.url(0)}/v1/completions", timeout=180, json={
            "model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0})
        assert response.status_code == 200, response.text
        rows = rank_memory(cluster.url(0), model)
        assert len(rows) == len(nodes)
        for row in rows:
            file_bytes, steady = row["file_bytes"], row["rss_bytes"]
            print(f"\n{sharding} {len(nodes)} rank {row['rank']} {row['share']}: file "
                  f"{file_bytes / MIB:.0f} MiB, estimate {row['estimated_bytes'] / MIB:.0f}, runtime "
                  f"{row['runtime_rss_bytes'] / MIB:.0f}, steady {steady / MIB:.0f}, load peak "
                  f"{row['load_peak_rss_bytes'] / MIB:.0f}, peak {row['peak_rss_bytes'] / MIB:.0f}")
            held = steady - row["runtime_rss_bytes"]  # weights, KV cache and scratch
            assert held <= 1.15 * file_bytes + 64 * MIB  # + the prefill's dequant scratch
            assert 0.85 * steady <= row["estimated_bytes"] <= 1.15 * steady
            assert row["load_peak_rss_bytes"] <= 1.2 * steady
    finally:
        cluster.clear([inst["instance_id"]])
