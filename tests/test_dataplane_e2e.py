"""The data plane's sockets: a 2-node instance on 127.0.0.1 whose runners listen on
127.0.0.1 only (torch's tcp:// rendezvous had rank 0's store on ``::``, every interface),
and rank 0 finding its rendezvous port taken fails with a clear report, not a hang."""

from __future__ import annotations

import queue
import socket
import time

import psutil
import pytest
from conftest import capital_answer, runners_of, start_cluster

from shardline.models.config import RankShare
from shardline.node.runner_processes import Worker
from shardline.runner.protocol import Failed, Loaded, RunnerSpec

pytestmark = pytest.mark.timeout(300)


def listening(process: psutil.Process) -> list[tuple[str, int]]:
    """(address, port) of each TCP socket ``process`` listens on."""
    return sorted(
        (c.laddr.ip, c.laddr.port) for c in process.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN
    )


def test_runners_listen_on_the_node_address_only_and_serve(tmp_path):
    cluster = start_cluster(2, tmp_path)
    try:
        instance = cluster.instance
        runners = [r for p in cluster.procs if p is not None for r in runners_of(p.pid, recursive=True)]
        assert len(runners) == 2, [r.cmdline() for r in runners]
        sockets = {r.pid: listening(r) for r in runners}
        # Rank 0: the store and gloo; rank 1: gloo. Every one on 127.0.0.1.
        assert all(sockets.values()), sockets
        assert all(ip == "127.0.0.1" for found in sockets.values() for ip, _ in found), sockets
        stores = [pid for pid, found in sockets.items() if ("127.0.0.1", instance["master_port"]) in found]
        assert len(stores) == 1, (instance["master_port"], sockets)
        answer = capital_answer(cluster.url(1))
        assert answer is not None and "Paris" in answer
    finally:
        cluster.stop()


def test_rank0_finding_its_port_taken_reports_failed():
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        messages: queue.Queue[object] = queue.Queue()
        worker = Worker(lambda _instance, message: messages.put(message))
        worker.start(
            RunnerSpec(
                instance_id="inst",
                node_id="node",
                model_path="/nonexistent",
                rank=0,
                world_size=2,
                share=RankShare(0, 1),
                master_addr="127.0.0.1",
                master_port=port,
                host="127.0.0.1",
                threads=1,
                collective_timeout_s=60,
            )
        )
        try:
            started = time.monotonic()
            message = messages.get(timeout=60)
            waited = time.monotonic() - started
        finally:
            worker.stop_all()
    assert isinstance(message, Failed) and not isinstance(message, Loaded)
    assert f"cannot listen on 127.0.0.1:{port}" in message.error, message.error
    assert "in use" in message.error
    assert waited < 30  # the process's start and imports; not the 60 s store timeout
