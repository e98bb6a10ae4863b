"""Memory per rank on a real cluster (127.0.0.1): a Qwen2 GGUF in llama.cpp's Q4_K_M mix
of types (Q4_K and Q6_K; random weights, SmolLM2's tokenizer) placed on 1 node, as
tensor-2 and as pipeline-3, and SmolLM2's Q4_1 GGUF on 1 node and as tensor-2
(tests/test_memory_e2e.py has it on pipeline-3). Each rank holds about its shard's file
bytes of weights and, idle after a fixed workload, about its file bytes and the runtime;
placement's estimate is within 15% of the workload's peak (weights, KV cache, a full
prefill chunk's scratch, the runtime), and loading peaks at most 1.2x the idle memory
(:mod:`memory_bounds`)."""

from __future__ import annotations

import time

import httpx
import pytest
import tiny_models as tm
from conftest import free_port_block
from memory_bounds import check_rank, describe

from shardline.bench.memory import rank_memory
from shardline.local_cluster import LocalCluster
from shardline.models.store import default_model_path

pytestmark = pytest.mark.timeout(600)

PROMPT = " ".join(f"Fact {i}: {i} squared is {i * i}." for i in range(40))
"""~620 tokens: more than one 512-token prefill chunk, whose scratch placement counts."""
HEARTBEAT_S = 1.0  # a runner reports its memory every second


@pytest.fixture(scope="module")
def kquant(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("kquant-memory")
    path = tm.write_q4_k_m_gguf(
        tmp / "qwen2-q4_k_m.gguf", default_model_path(), layers=8, hidden=1024, intermediate=2816, heads=16, kv_heads=4
    )
    cluster = LocalCluster(
        nodes=3,
        base_port=free_port_block(3),
        runner_threads=1,
        log_dir=str(tmp),
        data_dir=str(tmp),
        model_dirs=[path.parent],
    )
    cluster.start()
    try:
        yield cluster, str(path)
    finally:
        cluster.stop()


@pytest.mark.parametrize(
    "model, sharding, nodes",
    [
        ("q4_k_m", "pipeline", [0]),
        ("q4_k_m", "tensor", [0, 1]),
        pytest.param("q4_k_m", "pipeline", [0, 1, 2], marks=pytest.mark.slow),
        pytest.param("smollm2", "pipeline", [0], marks=pytest.mark.slow),
        pytest.param("smollm2", "tensor", [0, 1], marks=pytest.mark.slow),
    ],
)
def test_a_rank_holds_about_its_file_bytes(kquant, model, sharding, nodes):
    cluster, path = kquant
    inst = cluster.place(path if model == "q4_k_m" else None, sharding, on=nodes, context=1024, max_batch=1)
    try:
        model = inst["model_id"]
        response = httpx.post(
            f"{cluster.url(0)}/v1/completions",
            timeout=180,
            json={"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0},
        )
        assert response.status_code == 200, response.text
        time.sleep(0.5 + 2 * HEARTBEAT_S)  # a report from after the idle release (0.5 s)
        rows = rank_memory(cluster.url(0), model)
        assert len(rows) == len(nodes)
        view = next(i for i in cluster.instances() if i["instance_id"] == inst["instance_id"])
        weights = {r["node_id"]: r["loaded"]["param_bytes"] for r in view["ranks"]}
        for row in rows:
            print(f"\n{model} {sharding} {len(nodes)}", describe(row, weights[row["node_id"]]))
            check_rank(row, weights[row["node_id"]])
    finally:
        cluster.clear([inst["instance_id"]])
