"""The local cluster: its node processes do not outlive the process that started them, a
node that exits leaves the others serving (or, with restart, is started again), and a
cluster started again serves its kept model once, not twice; one on ports in use is
refused."""

import socket
import subprocess
import sys

import psutil
import pytest
from conftest import free_port_block, runners_of

from shardline.local_cluster import (
    SHARED_SPIN_COUNT,
    LocalCluster,
    LocalClusterError,
    kept_instances,
    node_environment,
    node_memory_limit,
    ports_in_use,
    table_model_id,
    views_formed,
)
from shardline.models.store import DEFAULT_MODEL_ID


@pytest.mark.timeout(90)
def test_nodes_stop_when_their_launcher_is_killed(tmp_path):
    base = free_port_block(2)
    launcher = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time; from shardline.local_cluster import LocalCluster; "
            f"c = LocalCluster(2, {base}, log_dir={str(tmp_path)!r}, data_dir={str(tmp_path)!r}); c.start(); "
            "print('up', flush=True); time.sleep(600)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    nodes = []
    try:
        assert launcher.stdout.readline().strip() == "up"
        nodes = psutil.Process(launcher.pid).children()
        assert len(nodes) == 2
        launcher.kill()  # SIGKILL: no chance to stop its nodes itself
        launcher.wait()
        gone, alive = psutil.wait_procs(nodes, timeout=15)
        assert not alive, f"nodes left running: {[p.pid for p in alive]}"
    finally:
        launcher.kill()
        for proc in nodes:
            if proc.is_running():
                proc.kill()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("restart", [False, True])
def test_a_node_that_exits_leaves_the_others_serving_or_is_started_again(tmp_path, restart):
    import threading
    import time

    import httpx

    cluster = LocalCluster(2, free_port_block(2), log_dir=str(tmp_path), data_dir=str(tmp_path))
    lines: list[str] = []
    try:
        cluster.start()
        node_id = httpx.get(f"{cluster.url(1)}/health", timeout=5).json()["node_id"]
        watcher = threading.Thread(
            target=lambda: lines.extend(cluster.supervise(restart=restart, poll_s=0.1)), daemon=True
        )
        watcher.start()
        cluster.procs[1].kill()
        deadline = time.time() + 60
        want = 2 if restart else 1
        while len(lines) < want and time.time() < deadline:
            time.sleep(0.1)
        assert lines[0].startswith(f"node 1 ({cluster.url(1)}) exited with code -9")
        assert httpx.get(f"{cluster.url(0)}/health", timeout=5).status_code == 200  # a survivor
        if restart:
            assert lines[1] == "node 1 started again"
            cluster.wait_formed([0, 1])  # back, with its id
            assert httpx.get(f"{cluster.url(1)}/health", timeout=5).json()["node_id"] == node_id
        else:
            assert lines[0].endswith("; the others keep serving")
            assert cluster.procs[1] is None and cluster.procs[0].poll() is None
            cluster.procs[0].kill()  # the last one: said too (trial 9: it ended silently)
            watcher.join(timeout=30)
            assert not watcher.is_alive()
            assert lines[1] == f"node 0 ({cluster.url(0)}) exited with code -9; no node is left"
    finally:
        cluster.stop()


@pytest.mark.timeout(180)
def test_a_cluster_started_again_serves_its_kept_model_once(tmp_path):
    """``shardline cluster`` run twice with the same data: the nodes' kept instance is
    placed again by the coordinator, and serve() waits for it instead of adding a second
    (each run of the README's command used to add one more instance, and runner); run
    again asking for another sharding, it serves that one alone."""
    base = free_port_block(2)
    first = LocalCluster(1, base, log_dir=str(tmp_path), data_dir=str(tmp_path))
    try:
        first.start()
        kept = first.serve(None, context=256, max_batch=1)
    finally:
        first.stop()
    again = LocalCluster(1, base, log_dir=str(tmp_path), data_dir=str(tmp_path))
    try:
        again.start()
        # "auto" takes the kept instance whatever its sharding (it matched none: a second)
        served = again.serve(None, "auto", context=256, max_batch=1)
        assert served["instance_id"] != kept["instance_id"]  # placed again: its old rank is gone
        assert served["context"] == 256  # as it was placed, not the defaults
        table = again.instances()
        assert [i["instance_id"] for i in table] == [served["instance_id"]], [
            (i["instance_id"], i["status"], i["error"], i["created_at"]) for i in table
        ]
        runners = runners_of(again.procs[0].pid, recursive=True)
        assert len(runners) == 1
    finally:
        again.stop()
    ring = LocalCluster(2, base, log_dir=str(tmp_path), data_dir=str(tmp_path))
    try:  # trial 8: another sharding asked kept the old instance, which took the requests
        ring.start()
        served = ring.serve(None, "ring", context=256, max_batch=1)
        assert [(i["instance_id"], i["sharding"]) for i in ring.instances()] == [(served["instance_id"], "ring")]
    finally:
        ring.stop()


@pytest.mark.fast
@pytest.mark.parametrize(
    "sharding, asked, other",
    [
        ("auto", ["a-pipe", "a-ring", "a-pipe1"], []),
        ("pipeline", ["a-pipe"], ["a-ring", "a-pipe1"]),
        ("tensor", [], ["a-pipe", "a-ring", "a-pipe1"]),
        ("ring", ["a-ring"], ["a-pipe", "a-pipe1"]),
    ],
)
def test_kept_instances_of_the_model_split_by_the_sharding_asked(sharding, asked, other):
    """Of a 2-node cluster's table; "a-pipe1": a pipeline on one node, as Ollama's load on
    demand placed the model again after a keep_alive of 0 (trial 9: `shardline cluster`
    then served it on 1 of its nodes, explaining that the sharding asked chose so)."""
    two, one = [{}, {}], [{}]
    table = [
        {"instance_id": "a-pipe", "model_id": "a", "sharding": "pipeline", "ranks": two},
        {"instance_id": "b-pipe", "model_id": "b", "sharding": "pipeline", "ranks": two},
        {"instance_id": "a-ring", "model_id": "a", "sharding": "ring", "ranks": two},
        {"instance_id": "a-pipe1", "model_id": "a", "sharding": "pipeline", "ranks": one},
    ]
    got = kept_instances(table, "a", sharding, 2)
    assert [[i["instance_id"] for i in part] for part in got] == [asked, other]


@pytest.mark.fast
def test_table_model_id_names_a_local_path_by_the_id_the_nodes_add_it_under(tmp_path):
    """A path's id, not the path: `shardline cluster --model PATH` placed one more copy of
    the model at every start, its kept instances never recognised (six loaded at once)."""
    folder = tmp_path / "my-model"
    folder.mkdir()
    assert table_model_id(None) == DEFAULT_MODEL_ID
    assert table_model_id("Qwen/Qwen3-0.6B") == "Qwen/Qwen3-0.6B"
    assert table_model_id("/models/qwen3moe-a3b.Q4_K_M.gguf") == "qwen3moe-a3b.Q4_K_M"
    assert table_model_id(str(folder)) == "my-model"


def _view(me: str, live: list[str], term: int, acting: bool) -> dict:
    """A node's ``GET /cluster/nodes`` answer, as much of it as :func:`views_formed` reads."""
    return {
        "node_id": me,
        "coordinator": min(live),
        "acting": acting,
        "epoch": {"term": term, "seq": 1, "coordinator": min(live)},
        "nodes": [{"node_id": n, "live": True} for n in live],
    }


@pytest.mark.fast
@pytest.mark.parametrize(
    "views, formed",
    [
        ([_view("a", ["a", "b"], 2, True), _view("b", ["a", "b"], 2, False)], True),
        # a restart's kept epoch names the node, which has not started its term yet: the
        # 1-node bench's placement was refused ("taking over as coordinator")
        ([_view("a", ["a"], 1, False)], False),
        ([_view("a", ["a", "b"], 1, False), _view("b", ["a", "b"], 1, False)], False),
        ([_view("a", ["a", "b"], 2, True), _view("b", ["b"], 2, False)], False),  # b does not hear a
        ([_view("a", ["a", "b"], 3, True), _view("b", ["a", "b"], 2, False)], False),  # b's table is older
    ],
)
def test_a_cluster_is_formed_once_its_coordinator_acts(views, formed):
    assert views_formed(views) is formed


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_kept_instance_deleted_while_it_is_placed_again_stays_deleted(tmp_path):
    """A cluster started again places its kept instance again; deleting it meanwhile (as
    ``shardline bench`` clears its nodes' table before it places its own) must not let
    the re-placement land after the delete: the bench once served from two runners of
    one model on 2 cores, one of them cold."""
    import time

    base = free_port_block(1)
    first = LocalCluster(1, base, log_dir=str(tmp_path), data_dir=str(tmp_path))
    try:
        first.start()
        first.place(None, context=256, max_batch=1)
    finally:
        first.stop()
    again = LocalCluster(1, base, log_dir=str(tmp_path), data_dir=str(tmp_path))
    try:
        again.start()
        again.clear()  # within the re-placement's reading of the model card
        placed = again.place(None, context=256, max_batch=1)
        deadline = time.monotonic() + 10  # a late re-placement would show within this
        while time.monotonic() < deadline:
            table = again.instances()
            assert [i["instance_id"] for i in table] == [placed["instance_id"]], [
                (i["instance_id"], i["status"]) for i in table
            ]
            time.sleep(0.5)
    finally:
        again.stop()


@pytest.mark.timeout(180)
def test_nodes_stopped_during_a_stream_end_it_and_keep_their_instance(tmp_path):
    """Ctrl-C (SIGINT to every node) while a stream is open: the stream ends with an error
    in the API's format, and the nodes stop without recording a failure of the instance
    their peers stopped with (the coordinator used to wait for the stream, fail the
    instance ~5 s later when its peers were gone, and save that)."""
    import json
    import threading

    import httpx
    from conftest import start_cluster

    cluster = start_cluster(2, tmp_path)
    instance_id = cluster.instances()[0]["instance_id"]
    lines: list[str] = []
    body = {
        "model": "HuggingFaceTB/SmolLM2-135M-Instruct",
        "stream": True,
        "max_tokens": 2000,
        "ignore_eos": True,
        "messages": [{"role": "user", "content": "Count."}],
    }

    def stream() -> None:
        try:
            with httpx.stream("POST", f"{cluster.url(0)}/v1/chat/completions", json=body, timeout=60) as response:
                lines.extend(line for line in response.iter_lines() if line)
        except httpx.HTTPError:
            pass

    reader = threading.Thread(target=stream)
    reader.start()
    try:
        while len(lines) < 3 and reader.is_alive():  # tokens are flowing
            threading.Event().wait(0.05)
    finally:
        cluster.stop()
    reader.join(timeout=30)
    assert lines and "stopping" in lines[-1], lines[-2:]
    for i in range(2):
        saved = json.loads((cluster.node_data_dir(i) / "cluster-state.json").read_text())
        assert [(x["instance_id"], x["status"]) for x in saved["instances"]] == [(instance_id, "ready")]


def test_a_cluster_on_ports_in_use_is_refused_before_any_node_starts(tmp_path):
    """A second ``shardline cluster`` on the ports of a running one: refused naming the
    port, where its nodes used to exit at once while the running cluster answered the
    readiness checks for them (and the launcher printed the banner, exit status 0)."""
    base = free_port_block(2)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", base + 1))
        listener.listen()
        cluster = LocalCluster(nodes=2, base_port=base, log_dir=str(tmp_path), data_dir=str(tmp_path))
        with pytest.raises(LocalClusterError, match=f"{base + 1}.*in use"):
            cluster.start()
        assert cluster.procs == []
    assert ports_in_use([base, base + 1]) == []  # closed: free again


@pytest.mark.fast
@pytest.mark.parametrize(
    "nodes, base, api_key, spin",
    [(1, {}, None, None), (3, {}, None, SHARED_SPIN_COUNT), (3, {"GOMP_SPINCOUNT": "infinite"}, "k", "infinite")],
    ids=["one node keeps libgomp's default", "nodes sharing the cores spin briefly", "the user's own setting stands"],
)
def test_a_local_nodes_environment(nodes, base, api_key, spin):
    env = node_environment({"PATH": "/bin", **base}, nodes, "secret", api_key)
    assert env["PATH"] == "/bin" and env["SHARDLINE_CLUSTER_KEY"] == "secret"
    assert env.get("SHARDLINE_API_KEY") == api_key and env.get("GOMP_SPINCOUNT") == spin


@pytest.mark.fast
@pytest.mark.parametrize(
    "available, nodes, asked, limit",
    [
        (24 << 30, 1, None, None),
        (24 << 30, 3, None, 8 << 30),
        (24 << 30, 3, 600 << 20, 600 << 20),
        (24 << 30, 1, 600 << 20, 600 << 20),
    ],
    ids=[
        "one node offers what is available",
        "nodes sharing a machine split it",
        "the user's limit stands",
        "the user's limit stands on one node",
    ],
)
def test_a_local_nodes_memory_offer(available, nodes, asked, limit):
    assert node_memory_limit(available, nodes, asked) == limit
