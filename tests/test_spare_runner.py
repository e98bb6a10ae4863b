"""The pre-started runner (``Worker(spare=True)``): the next rank placed on a node runs in
it, none starts while a rank loads, one that exits while waiting is replaced, one that
keeps exiting soon after it starts is given up, and a node starts a new one once idle."""

from __future__ import annotations

import queue
import socket
import subprocess
import sys

import pytest
from conftest import capital_answer, free_port_block, runners_of
from conftest import wait_until as wait_for

from shardline.models.config import RankShare
from shardline.node.runner_processes import SPARE_MAX_EARLY_EXITS, Spare, Worker, runner_environment, spawn_runner
from shardline.runner.protocol import Failed, RunnerSpec

pytestmark = pytest.mark.timeout(180)


def spec(instance_id: str = "inst") -> RunnerSpec:
    """A one-rank spec whose weights do not exist: the runner fails at once after its spec."""
    return RunnerSpec(
        instance_id=instance_id,
        node_id="node",
        model_path="/nonexistent",
        rank=0,
        world_size=1,
        share=RankShare(0, 1),
        master_addr="127.0.0.1",
        master_port=1,
        host="127.0.0.1",
        threads=1,
    )


def test_the_next_rank_runs_in_the_spare_and_another_is_started():
    messages: queue.Queue[object] = queue.Queue()
    worker = Worker(lambda _instance, message: messages.put(message), spare=True)
    try:
        worker.start_spare()
        first = worker.spare
        assert first is not None and first.process.poll() is None
        handle = worker.start(spec())
        assert handle.process is first.process  # the pre-started process got the spec
        worker.start_spare()
        assert worker.spare is None  # none starts while that rank loads
        message = messages.get(timeout=60)
        assert isinstance(message, Failed) and "nonexistent" in message.error, message
        wait_for(lambda: not worker.loading(), what="the failed rank to stop loading")
        worker.start_spare()
        second = worker.spare
        assert second is not None and second.process.pid != first.process.pid
        assert second.process.poll() is None
    finally:
        worker.stop_all()
    assert second.process.poll() is not None  # stop_all takes the spare down too


def test_a_spare_that_exits_is_replaced_and_one_that_keeps_exiting_is_given_up():
    worker = Worker(lambda _instance, _message: None, spare=True)
    try:
        worker.start_spare()
        seen = set()
        for _ in range(SPARE_MAX_EARLY_EXITS):
            spare = wait_for(lambda: worker.spare, what="a spare")
            assert spare.process.pid not in seen
            seen.add(spare.process.pid)
            spare.process.kill()
            wait_for(lambda s=spare: worker.spare is not s, what="the killed spare to be noticed")
        assert wait_for(lambda: not worker.spare_enabled, what="giving up"), "still pre-starting"
        assert worker.spare is None
        handle = worker.start(spec())  # runners still start: cold, as without a spare
        assert handle.process.pid not in seen
    finally:
        worker.stop_all()


def test_a_local_cluster_places_its_model_in_the_pre_started_runner(tmp_path):
    from shardline.local_cluster import LocalCluster

    cluster = LocalCluster(
        1, free_port_block(1), runner_threads=1, log_dir=str(tmp_path), data_dir=str(tmp_path), spare_runners=True
    )

    def runners() -> set[int]:
        return {p.pid for p in runners_of(cluster.procs[0].pid)}

    try:
        cluster.start()
        before = wait_for(runners, what="the node's pre-started runner")
        assert len(before) == 1
        cluster.place(None, "pipeline", context=256, max_batch=1)
        after = wait_for(lambda: r if len(r := runners()) == 2 else None, what="a new spare once the node is idle")
        assert before < after  # the rank runs in the process started ahead, beside a new spare
        answer = capital_answer(cluster.url(0))
        assert answer is not None and "Paris" in answer
    finally:
        cluster.stop()


def test_a_runner_started_before_the_node_is_kept_as_its_spare_or_else_stopped():
    kept = Worker(lambda _instance, _message: None, spare=True)
    refused = Worker(lambda _instance, _message: None, spare=False)
    early = Spare(*spawn_runner())
    unwanted = Spare(*spawn_runner())
    try:
        kept.start_spare(early)
        assert kept.spare is early  # the runner started ahead, not a new one
        refused.start_spare(unwanted)
        assert refused.spare is None
        unwanted.process.wait(timeout=60)  # its end of the socket closed: it exits
    finally:
        kept.stop_all()
        refused.stop_all()
        unwanted.process.kill()
    assert early.process.wait(timeout=60) is not None


def test_a_runner_whose_node_leaves_before_its_spec_exits_quietly():
    """A pre-started runner whose node stops (Ctrl-C during a cluster's start) exits with
    0 and no traceback when its socket closes before a spec came."""
    ours, theirs = socket.socketpair()
    process = subprocess.Popen(
        [sys.executable, "-m", "shardline.runner", str(theirs.fileno())],
        pass_fds=(theirs.fileno(),),
        stderr=subprocess.PIPE,
        text=True,
    )
    theirs.close()
    ours.close()
    _, err = process.communicate(timeout=120)
    assert process.returncode == 0 and "Traceback" not in err, err


@pytest.mark.fast
@pytest.mark.parametrize(
    "env, want",
    [
        ({}, {"TORCH_CPP_LOG_LEVEL": "ERROR", "RES_OPTIONS": "timeout:1 attempts:1"}),
        # what the user set wins; everything else passes through
        (
            {"RES_OPTIONS": "timeout:3", "GLOO_SOCKET_IFNAME": "eth1"},
            {"TORCH_CPP_LOG_LEVEL": "ERROR", "RES_OPTIONS": "timeout:3", "GLOO_SOCKET_IFNAME": "eth1"},
        ),
    ],
)
def test_a_runners_environment_waits_1_s_for_dns_unless_the_user_says(env, want):
    assert runner_environment(env) == want
