"""Shared fixtures: local clusters of real node processes on 127.0.0.1 with the real model.

pytest puts this folder on sys.path, so tests import the helpers in ``tiny_models`` directly.
"""

from __future__ import annotations

import contextlib
import socket
import time

import httpx
import psutil
import pytest

from shardline.local_cluster import LocalCluster
from shardline.models.config import RankShare, Sharding
from shardline.node.signing import SignedAuth, signing_key
from shardline.node.status import InstanceStatus, RankStatus
from shardline.node.table import Instance, RankPlacement


def wait_until(
    check,
    timeout_s: float = 60.0,
    what: str = "a condition",
    interval_s: float = 0.1,
    tolerate: tuple[type[BaseException], ...] = (),
):
    """Call ``check`` every ``interval_s`` seconds until it returns something truthy, and
    return that; an exception of a ``tolerate`` type counts as not yet.

    Raises:
        AssertionError: not within ``timeout_s`` seconds (naming ``what``).
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            result = check()
        except tolerate:
            result = None
        if result:
            return result
        time.sleep(interval_s)
    raise AssertionError(f"not within {timeout_s} s: {what}")


def member_client(cluster_key: str, timeout_s: float = 5.0) -> httpx.Client:
    """An HTTP client that signs its requests as a member of the cluster with
    ``cluster_key`` would (for tests that read or send ``/internal`` messages)."""
    return httpx.Client(auth=SignedAuth(signing_key(cluster_key)), timeout=timeout_s)


LISTEN_PORTS = (20000, 32000)
"""Where :func:`free_port_block` looks: below Linux's ephemeral range (32768-60999 by
default), from which every outgoing connection (the nodes' polls, httpx, gloo) takes its
local port. A block taken from the ephemeral range was once taken between the check and
the node's bind (uvicorn's start-up failure, exit code 3, in CI)."""


def free_port_block(count: int) -> int:
    """A base port with ``count`` consecutive ports free a moment ago."""
    import random

    for _ in range(200):
        base = random.randrange(LISTEN_PORTS[0], LISTEN_PORTS[1] - count)
        ok = True
        for port in range(base, base + count):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    ok = False
                    break
        if ok:
            return base
    raise RuntimeError("no free block of ports")


def placed(url: str) -> list[dict]:
    """The instance table, without the live figures: the answering node's rank's batch and
    memory, and ``speed`` (predicted from the nodes' profiles now, which a node re-measures
    when idle, beside the measured rate), which change from one second to the next."""
    instances = httpx.get(f"{url}/cluster/instances", timeout=10).json()["instances"]
    return [{k: v for k, v in inst.items() if not k.startswith("local_") and k != "speed"} for inst in instances]


CAPITAL_QUESTION = "What is the name of the capital of France?"
"""A question the default model answers with "Paris" by a clear margin: its greedy first
token stays "The" in float32 and bfloat16 alike (top-2 logit gap ~2.6 on SmolLM2-135M
Q8_0), where "What is the capital of France?" is a near-tie (0.03 in bfloat16 on a CPU
with AMX, whose answer then starts "L'Étoile")."""


def capital_answer(url: str) -> str | None:
    """The default model's greedy answer to :data:`CAPITAL_QUESTION` from the node
    at ``url`` (``http://host:port``), or None while it cannot serve."""
    from shardline.models.store import DEFAULT_MODEL_ID

    try:
        response = httpx.post(
            f"{url}/v1/chat/completions",
            timeout=60,
            json={
                "model": DEFAULT_MODEL_ID,
                "temperature": 0,
                "max_tokens": 12,
                "messages": [{"role": "user", "content": CAPITAL_QUESTION}],
            },
        )
    except httpx.HTTPError:
        return None
    return response.json()["choices"][0]["message"]["content"] if response.status_code == 200 else None


def local_cluster(nodes: int, log_dir, **settings) -> LocalCluster:
    """``nodes`` local nodes (not started) on free ports, one runner thread each, their logs
    and data in ``log_dir``; ``settings``: LocalCluster's others (``api_key``, ...)."""
    return LocalCluster(
        nodes=nodes,
        base_port=free_port_block(nodes),
        runner_threads=1,
        log_dir=str(log_dir),
        data_dir=str(log_dir),
        **settings,
    )


def start_cluster(nodes: int, log_dir, **options) -> LocalCluster:
    """Start ``nodes`` local nodes and place the default model across all of them."""
    cluster = local_cluster(nodes, log_dir)
    try:
        cluster.start()
        cluster.place(None, "pipeline", **options)
    except BaseException:
        cluster.stop()
        raise
    return cluster


@pytest.fixture(scope="session")
def cluster3(tmp_path_factory):
    """A 3-node pipeline cluster serving the embedded default model."""
    cluster = start_cluster(3, tmp_path_factory.mktemp("cluster3"))
    yield cluster
    cluster.stop()


@pytest.fixture(scope="session")
def cluster1(tmp_path_factory):
    """A 1-node cluster serving the embedded default model."""
    cluster = start_cluster(1, tmp_path_factory.mktemp("cluster1"))
    yield cluster
    cluster.stop()


def runners_of(pid: int, recursive: bool = False) -> list[psutil.Process]:
    """The live runner processes of the node process ``pid`` (one that has exited, a
    zombie until its node reaps it, is not; nor one that is gone meanwhile)."""
    runners = []
    for child in psutil.Process(pid).children(recursive=recursive):
        with contextlib.suppress(psutil.Error):
            if "shardline.runner" in " ".join(child.cmdline()):
                runners.append(child)
    return runners


def one_rank_instance(
    instance_id: str,
    status: InstanceStatus = InstanceStatus.READY,
    created_at: float = 0.0,
    node: str = "a",
    context: int = 256,
    model: str = "m",
    **fields,
) -> Instance:
    """A pipeline instance of ``model`` with one ready rank, on ``node`` (``fields``: the
    instance's other fields: ``given_up``, ``replaced``, ``error``, ...), for table tests."""
    return Instance(
        instance_id,
        model,
        Sharding.PIPELINE,
        (RankPlacement(node, f"{node}:1", RankShare(0, 1), status=RankStatus.READY),),
        node,
        1,
        context,
        1,
        status=status,
        created_at=created_at,
        **fields,
    )


@pytest.fixture(scope="session")
def blocks_of_32(tmp_path_factory):
    """A tiny Qwen3 of 64-wide heads in int4: KV blocks of 32 positions (SmolLM2's), shorter
    than a whole chunk's class needs (:data:`~shardline.models.native_dequant.AMX_PREFILL_MIN_ROWS`),
    and where the compiled kernels are built, chunks of up to 64 rows take the fused
    layers, whose bits differ from a whole chunk's."""
    import tiny_models as tm
    import torch

    from shardline.models.config import Quantize
    from shardline.models.shard_loader import load_shard
    from shardline.models.weights import open_weights

    path = tmp_path_factory.mktemp("tiny-qwen3")
    tm.save_hf(tm.hf_model("qwen3", num_layers=2, seed=4, head_dim=64), path)
    shard = load_shard(open_weights(path), 0, 2, dtype=torch.bfloat16, quantize=Quantize.INT4)
    return shard


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny random Llama of 4 layers (seed 7) saved as Hugging Face files: the runner
    processes' model in the lockstep, prefix cache and speculation tests (a module may
    define its own)."""
    import tiny_models as tm

    path = tmp_path_factory.mktemp("tiny-llama")
    tm.save_hf(tm.hf_model("llama", num_layers=4, seed=7), path)
    return path
