"""A client that leaves a request taken by a node that does not serve its model: the node
that does stops it at once (2 real node processes, the default model on one of them).

The node asked forwards the request to the serving node (``/internal/generate``); the
client's disconnect closes that upstream stream, and the serving node cancels the
request on its ranks as it does for a client of its own (it decoded on to ``max_tokens``,
15.8 s after the client left)."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest
from conftest import CAPITAL_QUESTION, free_port_block

from shardline.local_cluster import LocalCluster
from shardline.models.store import DEFAULT_MODEL_ID

pytestmark = pytest.mark.timeout(300)

STOP_WITHIN_S = 2.0
"""How soon after its client left the serving node's batch must be empty (the direct path
takes well under a second; a loaded 2-core machine gets some slack)."""


def body(content: str, **extra) -> dict:
    return {"model": DEFAULT_MODEL_ID, "messages": [{"role": "user", "content": content}], "temperature": 0, **extra}


LONG = body("Tell me a very long story.", max_tokens=1500, ignore_eos=True)


@pytest.fixture(scope="module")
def forwarded(tmp_path_factory):
    """A 2-node cluster with the default model on one node only: the url of the node that
    serves it and of the one that forwards to it."""
    root = tmp_path_factory.mktemp("forward-cancel")
    cluster = LocalCluster(
        nodes=2, base_port=free_port_block(2), runner_threads=1, log_dir=str(root), data_dir=str(root)
    )
    cluster.start()
    try:
        cluster.place(None, "pipeline", on=[1])
        yield cluster.url(1), cluster.url(0)
    finally:
        cluster.stop()


def running(url: str) -> tuple[int, ...]:
    """The task ids in the batch of the node at ``url``'s rank of the (one) instance."""
    instances = httpx.get(f"{url}/cluster/instances", timeout=5).json()["instances"]
    return tuple(instances[0]["local_engine"]["running"]) if instances[0]["local_engine"] else ()


def seconds_until_idle(url: str, left: float, limit_s: float = 20.0) -> float:
    """Seconds from ``left`` until the batch of the node at ``url`` is empty (polled;
    ``limit_s`` at most, to measure how late a request that is not cancelled ends)."""
    while running(url):
        assert time.monotonic() - left < limit_s, "the request ran on past the limit"
        time.sleep(0.02)
    return time.monotonic() - left


def assert_serves_promptly(serving: str, asked: str) -> None:
    """A short request through the node asked is answered (the batch is free)."""
    response = httpx.post(f"{asked}/v1/chat/completions", json=body(CAPITAL_QUESTION, max_tokens=12), timeout=30)
    assert response.status_code == 200, response.text
    assert "Paris" in response.json()["choices"][0]["message"]["content"]
    assert not running(serving)


def test_a_forwarded_stream_whose_client_leaves_is_cancelled_where_it_runs(forwarded):
    serving, asked = forwarded
    with httpx.stream("POST", f"{asked}/v1/chat/completions", json=dict(LONG, stream=True), timeout=60) as response:
        assert response.status_code == 200
        lines = response.iter_lines()  # advanced by hand: leaving a for loop closes it
        received = 0
        while received < 5:
            received += next(lines).startswith("data: ")
        assert running(serving), "the request is not running on the serving node"
    stopped_s = seconds_until_idle(serving, time.monotonic())
    print(f"\nforwarded stream: the serving node stopped {stopped_s:.2f} s after the client left")
    assert stopped_s < STOP_WITHIN_S
    assert_serves_promptly(serving, asked)


def test_a_forwarded_non_streamed_request_whose_client_leaves_is_cancelled_where_it_runs(forwarded):
    serving, asked = forwarded
    host, port = asked.removeprefix("http://").split(":")
    payload = json.dumps(LONG).encode()
    with socket.create_connection((host, int(port)), timeout=10) as client:  # whose close is the leaving
        client.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (host.encode(), len(payload), payload)
        )
        deadline = time.monotonic() + 30
        while not running(serving):
            assert time.monotonic() < deadline, "the request never ran on the serving node"
            time.sleep(0.02)
    stopped_s = seconds_until_idle(serving, time.monotonic())
    print(f"\nforwarded non-streamed request: the serving node stopped {stopped_s:.2f} s after the client left")
    assert stopped_s < STOP_WITHIN_S
    assert_serves_promptly(serving, asked)
