"""A runner or a node dies, or a runner freezes, mid-stream: the stream is continued on
the instance placed again, nothing of the failed one is left running; before a request's
first output, the request waits for the model placed again and is answered (2- and
3-node pipelines, real model, real processes)."""

from __future__ import annotations

import contextlib
import json
import signal
import threading
import time
from collections.abc import Iterator

import httpx
import psutil
import pytest
from conftest import CAPITAL_QUESTION, free_port_block, runners_of, start_cluster

from shardline.local_cluster import LocalCluster
from shardline.models.store import DEFAULT_MODEL_ID

pytestmark = pytest.mark.timeout(300)


class Stream(threading.Thread):
    """A long streamed completion; records when each token came, when it ended and how;
    :meth:`leave` closes it (the client goes away)."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.tokens = 0
        self.times: list[float] = []  # time.monotonic() of each token's chunk
        self.error: str | None = None
        self.code: str | None = None  # the error's code
        self.ended_at: float | None = None
        self.left = threading.Event()

    def run(self) -> None:
        payload = {
            "model": DEFAULT_MODEL_ID,
            "stream": True,
            "max_tokens": 3000,
            "ignore_eos": True,
            "messages": [{"role": "user", "content": "Tell me a very long story."}],
        }
        try:
            with httpx.stream("POST", f"{self.url}/v1/chat/completions", json=payload, timeout=120) as response:
                for line in response.iter_lines():
                    if self.left.is_set():
                        break
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[len("data: ") :])
                    if "error" in chunk:
                        self.error, self.code = chunk["error"]["message"], chunk["error"].get("code")
                        break
                    self.tokens += 1
                    self.times.append(time.monotonic())
        except httpx.HTTPError as exc:
            self.error = f"connection: {exc}"
        self.ended_at = time.monotonic()

    def leave(self) -> None:
        self.left.set()
        self.join(30)

    def token_after(self, at: float, timeout_s: float) -> float:
        """Seconds from ``at`` (time.monotonic()) to the first token after it.

        Raises:
            AssertionError: none within ``timeout_s``, or the stream ended first.
        """
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            after = [t for t in self.times if t > at]
            if after:
                return after[0] - at
            assert self.ended_at is None, f"the stream ended: {self.error}"
            time.sleep(0.05)
        raise AssertionError(f"no token within {timeout_s} s")


def wait_until_serving(cluster, node: int, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            response = httpx.post(
                f"{cluster.url(node)}/v1/chat/completions",
                timeout=60,
                json={
                    "model": DEFAULT_MODEL_ID,
                    "temperature": 0,
                    "messages": [{"role": "user", "content": CAPITAL_QUESTION}],
                },
            )
            if response.status_code == 200:
                return response.json()["choices"][0]["message"]["content"]
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"not serving again within {timeout_s} s")


@contextlib.contextmanager
def two_nodes(tmp_path, on: str = "both") -> Iterator[tuple[LocalCluster, int, int]]:
    """A 2-node local cluster serving the default model as a pipeline on both nodes, or
    (``on="other"``) on the one that does not coordinate only; yields the cluster, the
    index of that node (the larger id: the victim) and of the coordinator."""
    cluster = LocalCluster(
        nodes=2, base_port=free_port_block(2), runner_threads=1, log_dir=str(tmp_path), data_dir=str(tmp_path)
    )
    cluster.start()
    try:
        ids = [httpx.get(f"{cluster.url(i)}/health", timeout=5).json()["node_id"] for i in range(2)]
        other = ids.index(max(ids))
        cluster.place(None, "pipeline", on=None if on == "both" else [other])
        if on == "both":
            wait_until_serving(cluster, 1 - other, 60)
        yield cluster, other, 1 - other
    finally:
        cluster.stop()


def ask_capital(url: str) -> tuple[httpx.Response, float]:
    """A short greedy chat request to ``url`` and the seconds it took."""
    started = time.monotonic()
    response = httpx.post(
        f"{url}/v1/chat/completions",
        timeout=60,
        json={
            "model": DEFAULT_MODEL_ID,
            "messages": [{"role": "user", "content": CAPITAL_QUESTION}],
            "max_tokens": 16,
            "temperature": 0,
        },
    )
    return response, time.monotonic() - started


def coordinator_index(cluster) -> int:
    coordinator = httpx.get(f"{cluster.url(0)}/cluster/nodes").json()["coordinator"]
    ids = [httpx.get(f"{cluster.url(i)}/health").json()["node_id"] for i in range(cluster.n)]
    return ids.index(coordinator)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """One 3-node pipeline cluster for every victim: after a failure the model is placed
    again by itself, and the next victim strikes the re-placed instance."""
    cluster = start_cluster(3, tmp_path_factory.mktemp("failure3"))
    yield cluster
    cluster.stop()


def three_live_nodes_and_a_three_rank_instance(cluster, timeout_s: float = 90) -> None:
    """What each victim starts from. In the listed order the previous victim left it so
    (the node victim runs last); run in another order, a killed node is started again
    (it keeps its id) and a 2-rank instance is replaced by a 3-rank one."""
    dead = [i for i, p in enumerate(cluster.procs) if p is None or p.poll() is not None]
    for i in dead:
        cluster.start_node(i)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if all(
                sum(n["live"] for n in httpx.get(f"{cluster.url(i)}/cluster/nodes", timeout=5).json()["nodes"])
                == cluster.n
                for i in range(cluster.n)
            ):
                break
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        time.sleep(0.3)
    else:
        raise AssertionError(f"nodes {dead} did not rejoin within {timeout_s} s")
    instances = httpx.get(f"{cluster.url(0)}/cluster/instances").json()["instances"]
    if [len(i["ranks"]) for i in instances if i["status"] == "ready"] == [3] and len(instances) == 1:
        return
    for inst in instances:
        httpx.delete(f"{cluster.url(0)}/cluster/instances/{inst['instance_id']}", timeout=30)
    while time.monotonic() < deadline and (
        httpx.get(f"{cluster.url(0)}/cluster/instances").json()["instances"]
        or any(runners_of(p.pid) for p in cluster.procs)
    ):
        time.sleep(0.2)
    cluster.place(None, "pipeline", timeout_s=max(1.0, deadline - time.monotonic()))


def test_a_deletion_mid_stream_tells_the_client_so(cluster):
    """The client of a node that is not the coordinator (whose runner the deletion stops
    first, so the client's ranks see their peer go) hears that the instance was deleted,
    not that a rank lost contact with another."""
    three_live_nodes_and_a_three_rank_instance(cluster)
    coordinator = coordinator_index(cluster)
    (inst_id,) = [i["instance_id"] for i in httpx.get(f"{cluster.url(0)}/cluster/instances").json()["instances"]]
    stream = Stream(cluster.url((coordinator + 1) % cluster.n))
    stream.start()
    while stream.tokens < 5:
        assert stream.ended_at is None, stream.error
        time.sleep(0.05)
    assert httpx.delete(f"{cluster.url(coordinator)}/cluster/instances/{inst_id}", timeout=30).status_code == 200
    stream.join(timeout=30)
    assert stream.error is not None and "deleted" in stream.error, stream.error
    assert stream.code == "instance_deleted"


def test_a_request_whose_runner_dies_before_its_first_token_is_answered_by_the_next_instance(cluster):
    """A runner killed while a long prompt is prefilled (at its first progress report, so
    surely before its first token): the stream has sent no token yet, so the node waits
    for the model to be placed again and runs the request there; the client reads a whole
    answer, no error, its first chunk's fingerprint naming the old instance and its last
    the new one."""
    three_live_nodes_and_a_three_rank_instance(cluster)
    coordinator = coordinator_index(cluster)
    target = 2 if coordinator != 2 else 1
    (client_node,) = {0, 1, 2} - {coordinator, target}
    (old_id,) = [i["instance_id"] for i in httpx.get(f"{cluster.url(0)}/cluster/instances").json()["instances"]]
    payload = {
        "model": DEFAULT_MODEL_ID,
        "stream": True,
        "max_tokens": 8,
        "ignore_eos": True,
        "return_progress": True,  # a chunk after each 512 prompt tokens prefilled
        "messages": [{"role": "user", "content": "Summarize: " + "the cat sat on the mat. " * 250}],
    }
    texts, errors, fingerprints, killed_at = [], [], [], None
    started = time.monotonic()
    with httpx.stream("POST", f"{cluster.url(client_node)}/v1/chat/completions", json=payload, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[len("data: ") :])
                if "prompt_progress" in chunk and killed_at is None:
                    runners_of(cluster.procs[target].pid)[0].kill()
                    killed_at = time.monotonic() - started
                if "error" in chunk:
                    errors.append(chunk["error"])
                fingerprints.append(chunk.get("system_fingerprint"))
                for choice in chunk.get("choices", []):
                    texts.append(choice["delta"].get("content") or "")
    took = time.monotonic() - started
    print(f"\nanswered {took:.1f} s after it was sent, its runner killed at {killed_at} s: {''.join(texts)!r}")
    assert killed_at is not None and not errors and "".join(texts), errors
    ready = [i for i in httpx.get(f"{cluster.url(0)}/cluster/instances").json()["instances"] if i["status"] == "ready"]
    assert [i["instance_id"] != old_id for i in ready] == [True]
    assert fingerprints[0].startswith(f"fp_{old_id[:12]}-"), fingerprints  # sent before the failure
    assert fingerprints[-1].startswith(f"fp_{ready[0]['instance_id'][:12]}-"), fingerprints  # what ran it
    assert took < 30


def test_a_request_while_its_model_is_placed_waits_for_it(cluster):
    """A model deleted and placed again: a request sent as the placement is answered
    ("status": "loading") waits for the new instance and is answered by it, not refused
    with a 503."""
    three_live_nodes_and_a_three_rank_instance(cluster)
    for inst in httpx.get(f"{cluster.url(0)}/cluster/instances").json()["instances"]:
        httpx.delete(f"{cluster.url(0)}/cluster/instances/{inst['instance_id']}", timeout=30)
    deadline = time.monotonic() + 30
    while any(runners_of(p.pid) for p in cluster.procs) and time.monotonic() < deadline:
        time.sleep(0.2)  # the deleted instance's runners gone: the new one loads from nothing
    nodes = [httpx.get(f"{cluster.url(i)}/health", timeout=5).json()["node_id"] for i in range(cluster.n)]
    placed = httpx.post(
        f"{cluster.url(0)}/cluster/instances", timeout=60, json={"sharding": "pipeline", "nodes": nodes}
    )
    assert placed.status_code == 201 and placed.json()["status"] == "loading", placed.text
    started = time.monotonic()
    response = httpx.post(
        f"{cluster.url(1)}/v1/chat/completions",
        timeout=60,
        json={
            "model": DEFAULT_MODEL_ID,
            "temperature": 0,
            "max_tokens": 16,
            "messages": [{"role": "user", "content": CAPITAL_QUESTION}],
        },
    )
    took = time.monotonic() - started
    print(f"\nanswered {took:.1f} s after it was sent, its model loading: {response.text[:200]}")
    assert response.status_code == 200, response.text
    assert "Paris" in response.json()["choices"][0]["message"]["content"]
    assert response.json()["system_fingerprint"].startswith(f"fp_{placed.json()['instance_id'][:12]}-")
    assert took < 30


# The node victim last: the others need a third node, which it leaves dead.
@pytest.mark.parametrize("victim", ["runner", pytest.param("frozen runner", marks=pytest.mark.slow), "node"])
def test_a_death_mid_stream_is_continued_and_the_model_is_placed_again(cluster, victim):
    """A rank's runner killed, frozen (the watchdog kills it) or its node killed after 5
    tokens of a stream: the stream pauses and goes on, continued on the instance placed
    again (tests/test_continuation_e2e.py checks its text); nothing of the failed
    instance is left running."""
    three_live_nodes_and_a_three_rank_instance(cluster)
    # The victim is neither the coordinator nor the node the client talks to.
    coordinator = coordinator_index(cluster)
    target = 2 if coordinator != 2 else 1
    (client_node,) = {0, 1, 2} - {coordinator, target}
    nodes = [psutil.Process(p.pid) for p in cluster.procs]
    old_runners = [r for n in nodes for r in runners_of(n.pid)]
    assert len(old_runners) == 3
    (old_id,) = [i["instance_id"] for i in httpx.get(f"{cluster.url(0)}/cluster/instances").json()["instances"]]
    stream = Stream(cluster.url(client_node))
    stream.start()
    try:
        while stream.tokens < 5:
            assert stream.ended_at is None, stream.error
            time.sleep(0.05)
        killed_at = time.monotonic()
        if victim == "runner":
            runners_of(nodes[target].pid)[0].kill()
        elif victim == "frozen runner":
            runners_of(nodes[target].pid)[0].suspend()  # SIGSTOP: alive but silent
        else:
            for proc in [*runners_of(nodes[target].pid), nodes[target]]:
                proc.kill()
        gap_s = stream.token_after(killed_at + 0.5, timeout_s=60) + 0.5  # a token in flight may come at once
        serving_s = time.monotonic() - killed_at
        assert stream.ended_at is None and stream.error is None, stream.error
    finally:
        stream.leave()
    gone, alive = psutil.wait_procs(old_runners, timeout=15)
    assert not alive, f"runners of the failed instance still running: {alive}"
    answer = wait_until_serving(cluster, client_node, timeout_s=60)
    assert "Paris" in answer
    instances = httpx.get(f"{cluster.url(client_node)}/cluster/instances").json()["instances"]
    ready = [i for i in instances if i["status"] == "ready"]
    assert len(ready) == 1 and len(ready[0]["ranks"]) == (2 if victim == "node" else 3)
    # The id the client was given still answers: with the instance placed in its place.
    named = httpx.get(f"{cluster.url(client_node)}/cluster/instances/{old_id}").json()
    assert named["instance_id"] == ready[0]["instance_id"] != old_id and old_id in named["replaced"]
    print(f"\n{victim} killed: the stream's next token {gap_s:.1f} s later (serving again)")
    assert serving_s < (40 if victim == "frozen runner" else 30)  # the watchdog is 10 s


@pytest.mark.slow
def test_a_model_whose_runners_cannot_load_fails_with_the_reason(tmp_path):
    """Placement reads only config.json; the runners find a layer missing and fail. The
    coordinator tries again a few times, then leaves the failed instance and its reason."""
    import tiny_models as tm
    from safetensors.torch import load_file, save_file

    from shardline.local_cluster import LocalCluster, LocalClusterError

    model_dir = tmp_path / "broken-model"
    tm.save_hf(tm.hf_model("llama", num_layers=2, seed=1), model_dir)
    weights = next(model_dir.glob("*.safetensors"))
    tensors = load_file(weights)
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, weights, metadata={"format": "pt"})

    from conftest import free_port_block

    with LocalCluster(
        nodes=1,
        base_port=free_port_block(1),
        runner_threads=1,
        log_dir=str(tmp_path / "logs"),
        data_dir=str(tmp_path / "logs"),
        model_dirs=[model_dir],
    ) as cluster:
        cluster.start()
        with pytest.raises(LocalClusterError, match="down_proj"):
            cluster.place(str(model_dir), timeout_s=60)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # retried, then given up, the reason kept
            instances = httpx.get(f"{cluster.url(0)}/cluster/instances").json()["instances"]
            if len(instances) == 1 and instances[0]["retries"] == 3 and instances[0]["status"] == "failed":
                time.sleep(8)  # past the re-placement delay: no further attempt
                again = httpx.get(f"{cluster.url(0)}/cluster/instances").json()["instances"]
                assert [i["instance_id"] for i in again] == [instances[0]["instance_id"]]
                break
            time.sleep(0.5)
        else:
            raise AssertionError(f"never gave up: {instances}")
        assert "model.layers.1.mlp.down_proj.weight" in instances[0]["error"]
        response = httpx.post(
            f"{cluster.url(0)}/v1/chat/completions",
            timeout=30,
            json={"model": "broken-model", "messages": [{"role": "user", "content": "hi"}]},
        )
        assert response.status_code == 503
        assert "down_proj" in response.json()["error"]["message"]
        runners = runners_of(cluster.procs[0].pid)
        assert runners == []


@pytest.mark.slow
def test_a_request_forwarded_to_a_node_that_stops_answering_goes_on_when_its_instance_fails(tmp_path):
    """The model on one node only; a long stream asked of the other node, which forwards
    it; the model's node paused (SIGSTOP: its connections stay open, nothing comes): the
    forwarding node gives up on the forwarded stream once the instance fails in its
    table (not when the node answers again: trial 7, 165 s, the length of the cut), and
    continues it on the instance placed again on the node left."""
    with two_nodes(tmp_path, on="other") as (cluster, holder, asker):
        stream = Stream(cluster.url(asker))
        stream.start()
        deadline = time.monotonic() + 60
        while stream.tokens < 5 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert stream.tokens >= 5, stream.error
        cluster.procs[holder].send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            gap_s = stream.token_after(stopped + 0.5, timeout_s=60) + 0.5
            print(f"\nforwarded stream continued {gap_s:.1f} s after its node paused")
            assert stream.error is None and gap_s < 40
        finally:
            stream.leave()
            cluster.procs[holder].send_signal(signal.SIGCONT)


@pytest.mark.slow
def test_a_request_while_a_rank_is_paused_runs_on_the_instance_placed_again(tmp_path):
    """A pipeline on 2 nodes; the one that does not coordinate paused (SIGSTOP: it takes
    connections and answers nothing); a new request to the other: its hand-off to the
    paused node hangs until the instance fails in the table (the node found down), not
    to the hand-off's 10 s timeout (trial 9); having sent nothing yet, the request then
    waits for the model to be placed again on the node left and is answered there (a
    200, not the 503 it got before)."""
    with two_nodes(tmp_path) as (cluster, paused, asker):
        cluster.procs[paused].send_signal(signal.SIGSTOP)
        try:
            response, took = ask_capital(cluster.url(asker))
            print(f"\nrequest ended {took:.1f} s after it was sent: {response.status_code} {response.text[:300]}")
            assert response.status_code == 200, response.text
            assert "Paris" in response.json()["choices"][0]["message"]["content"]
            assert took < 30
            instances = httpx.get(f"{cluster.url(asker)}/cluster/instances", timeout=5).json()["instances"]
            assert [len(i["ranks"]) for i in instances if i["status"] == "ready"] == [1], instances
        finally:
            cluster.procs[paused].send_signal(signal.SIGCONT)


@pytest.mark.slow
def test_a_request_that_finds_its_instance_failed_waits_for_it_to_be_placed_again(tmp_path):
    """A pipeline on 2 nodes; the one that does not coordinate killed (node and runners);
    once the other shows the instance failed, and before the model is placed again, a new
    request: it waits and is answered by the instance placed on the node left, where it
    was a 503."""
    with two_nodes(tmp_path) as (cluster, victim, asker):
        node = psutil.Process(cluster.procs[victim].pid)
        for proc in [*runners_of(node.pid), node]:
            proc.kill()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not any(
            i["status"] == "failed"
            for i in httpx.get(f"{cluster.url(asker)}/cluster/instances", timeout=5).json()["instances"]
        ):
            time.sleep(0.1)
        response, took = ask_capital(cluster.url(asker))
        print(f"\nrequest sent as the instance showed failed: {response.status_code} after {took:.1f} s")
        assert response.status_code == 200, response.text
        assert "Paris" in response.json()["choices"][0]["message"]["content"]
        assert took < 30
