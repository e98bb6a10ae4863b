"""Cluster membership on 127.0.0.1: the cluster key, lasting node ids, coordinator failover."""

from __future__ import annotations

import functools
import http.server
import os
import subprocess
import sys
import threading
import time

import httpx
import pytest
from conftest import CAPITAL_QUESTION, free_port_block, member_client, wait_until

from shardline.local_cluster import LocalCluster
from shardline.models.store import DEFAULT_MODEL_ID

pytestmark = pytest.mark.timeout(300)


def views(cluster: LocalCluster, indices) -> dict[int, dict]:
    return {i: httpx.get(f"{cluster.url(i)}/cluster/nodes", timeout=5).json() for i in indices}


wait_for = functools.partial(wait_until, interval_s=0.2, tolerate=(httpx.HTTPError,))


class FakePeer(http.server.BaseHTTPRequestHandler):
    """An address listed as a peer that is not one: records what it is sent, answers 401."""

    received: list[bytes] = []

    def _record(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        FakePeer.received.append(f"{self.requestline}\n{self.headers}".encode() + body)
        self.send_response(401)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_GET = do_POST = _record

    def log_message(self, *args) -> None:
        pass


def test_a_node_without_the_cluster_key_cannot_join_or_read_state(tmp_path):
    base = free_port_block(4)
    fake = http.server.ThreadingHTTPServer(("127.0.0.1", base + 3), FakePeer)
    threading.Thread(target=fake.serve_forever, daemon=True).start()
    peers = {0: ["--peers", f"127.0.0.1:{base + 1},127.0.0.1:{base + 3}"]}
    with LocalCluster(
        nodes=2, base_port=base, log_dir=str(tmp_path), data_dir=str(tmp_path), node_args=peers
    ) as cluster:
        cluster.start()
        stranger_port = base + 2
        stranger = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "shardline.cli",
                "run",
                "--port",
                str(stranger_port),
                "--peers",
                f"127.0.0.1:{base},127.0.0.1:{base + 1}",
                "--data-dir",
                str(tmp_path / "stranger"),
                "--exit-with-parent",
            ],
            env=dict(os.environ, SHARDLINE_CLUSTER_KEY="not-the-right-key-at-all"),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            stranger_url = f"http://127.0.0.1:{stranger_port}"
            wait_for(lambda: httpx.get(f"{stranger_url}/health", timeout=2).status_code == 200, 30, "stranger up")
            time.sleep(3)  # three membership rounds
            for view in views(cluster, range(2)).values():
                assert len(view["nodes"]) == 2  # neither the stranger nor the fake peer is a member
            assert len(httpx.get(f"{stranger_url}/cluster/nodes").json()["nodes"]) == 1
            # The fake peer was polled, and got no key material: signatures only.
            assert len(FakePeer.received) >= 3
            for request in FakePeer.received:
                assert cluster.cluster_key.encode() not in request and b"Bearer" not in request
                assert b"X-Shardline-Auth: t=" in request
            state = f"{cluster.url(0)}/internal/state"
            assert httpx.get(state).status_code == 401
            assert httpx.get(state, headers={"Authorization": f"Bearer {cluster.cluster_key}"}).status_code == 401
            with member_client("not-the-right-key-at-all") as stranger_client:
                assert stranger_client.get(state).status_code == 401
                task = stranger_client.post(f"{cluster.url(0)}/internal/tasks", json={"task_id": 1})
                assert task.status_code == 401
            with member_client(cluster.cluster_key) as member:
                answer = member.get(state)
                assert answer.status_code == 200 and answer.headers["X-Shardline-Auth"]
                # A recorded request, replayed to its node or sent on to another, is refused.
                request = answer.request
                for url in (state, f"{cluster.url(1)}/internal/state"):
                    replay = httpx.get(
                        url,
                        headers={
                            "X-Shardline-Auth": request.headers["X-Shardline-Auth"],
                            "Host": request.headers["Host"],
                        },
                    )
                    assert replay.status_code == 401, replay.text
        finally:
            stranger.kill()
            stranger.wait(10)
            fake.shutdown()


def test_a_restarted_node_keeps_its_id_and_leaves_no_ghost(tmp_path):
    with LocalCluster(nodes=2, base_port=free_port_block(2), log_dir=str(tmp_path), data_dir=str(tmp_path)) as cluster:
        cluster.start()
        before = httpx.get(f"{cluster.url(1)}/health").json()["node_id"]
        cluster.procs[1].kill()
        cluster.procs[1].wait(10)
        cluster.start_node(1)
        after = wait_for(lambda: httpx.get(f"{cluster.url(1)}/health", timeout=2).json()["node_id"], 30, "node 1 back")
        assert after == before
        wait_for(lambda: all(n["live"] for n in views(cluster, [0])[0]["nodes"]), 15, "node 1 live again")
        assert sorted(n["node_id"] for n in views(cluster, [0])[0]["nodes"]) == sorted(
            httpx.get(f"{cluster.url(i)}/health").json()["node_id"] for i in range(2)
        )


@pytest.mark.slow
def test_killing_the_coordinator_elects_another_and_its_instances_keep_serving(tmp_path):
    with LocalCluster(
        nodes=3, base_port=free_port_block(3), runner_threads=1, log_dir=str(tmp_path), data_dir=str(tmp_path)
    ) as cluster:
        cluster.start()
        ids = [httpx.get(f"{cluster.url(i)}/health").json()["node_id"] for i in range(3)]
        coordinator = ids.index(views(cluster, [0])[0]["coordinator"])
        others = [i for i in range(3) if i != coordinator]
        inst = cluster.place(None, "pipeline", on=others)
        cluster.procs[coordinator].kill()
        killed = time.time()
        new = wait_for(
            lambda: (
                {v["coordinator"] for v in views(cluster, others).values()} == {min(ids[i] for i in others)}
                and min(ids[i] for i in others)
            ),
            10,
            "a new coordinator",
        )
        elected_after = time.time() - killed
        print(f"\ncoordinator killed: {new} elected after {elected_after:.1f} s")
        assert new != ids[coordinator]
        for i in others:
            listed = httpx.get(f"{cluster.url(i)}/cluster/instances").json()["instances"]
            assert [(x["instance_id"], x["status"]) for x in listed] == [(inst["instance_id"], "ready")]
            body = {
                "model": DEFAULT_MODEL_ID,
                "temperature": 0,
                "max_tokens": 16,
                "messages": [{"role": "user", "content": CAPITAL_QUESTION}],
            }
            answer = httpx.post(f"{cluster.url(i)}/v1/chat/completions", json=body, timeout=60).json()
            assert "Paris" in answer["choices"][0]["message"]["content"]


def multicast_on_loopback() -> bool:
    """Whether an mDNS service registered on 127.0.0.1 is seen by a browser there."""
    import socket

    from zeroconf import IPVersion, ServiceBrowser, ServiceInfo, Zeroconf

    found = []
    first = Zeroconf(interfaces=["127.0.0.1"], ip_version=IPVersion.V4Only)
    second = Zeroconf(interfaces=["127.0.0.1"], ip_version=IPVersion.V4Only)
    try:
        first.register_service(
            ServiceInfo(
                "_shardline-probe._tcp.local.",
                "p._shardline-probe._tcp.local.",
                addresses=[socket.inet_aton("127.0.0.1")],
                port=9,
            )
        )
        ServiceBrowser(
            second,
            "_shardline-probe._tcp.local.",
            handlers=[lambda zeroconf, service_type, name, state_change: found.append(name)],
        )
        deadline = time.time() + 3
        while not found and time.time() < deadline:
            time.sleep(0.1)
    finally:
        first.close()
        second.close()
    return bool(found)


def test_nodes_find_each_other_by_mdns_without_peers(tmp_path):
    try:
        usable = multicast_on_loopback()
    except OSError as exc:
        pytest.skip(f"no multicast socket on loopback here: {exc}")
    if not usable:
        pytest.skip("this machine does not deliver multicast on loopback, which mDNS needs")
    base = free_port_block(2)
    env = dict(os.environ, SHARDLINE_CLUSTER_KEY="mdns-test-key-0123456789")
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "shardline.cli",
                "run",
                "--port",
                str(base + i),
                "--data-dir",
                str(tmp_path / f"n{i}"),
                "--exit-with-parent",
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        for i in range(2)
    ]
    try:
        started = time.time()
        wait_for(
            lambda: all(
                sum(
                    n["live"]
                    for n in httpx.get(f"http://127.0.0.1:{base + i}/cluster/nodes", timeout=2).json()["nodes"]
                )
                == 2
                for i in range(2)
            ),
            30,
            "both nodes see each other",
        )
        print(f"\nmDNS: the nodes formed a cluster {time.time() - started:.1f} s after start")
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(10)


def test_nodes_report_profiles_and_links_and_auto_placement_takes_the_best_preview(tmp_path):
    with LocalCluster(
        nodes=2, base_port=free_port_block(2), runner_threads=1, log_dir=str(tmp_path), data_dir=str(tmp_path)
    ) as cluster:
        cluster.start()

        def profiled():
            nodes = views(cluster, [0])[0]["nodes"]
            return all(n["profile"] and n["profile"]["matmul_flops"] > 0 and n["links"] for n in nodes) and nodes

        nodes = wait_for(profiled, 60, "profiles and links of both nodes")
        for n in nodes:
            profile = n["profile"]
            assert profile["total_bytes"] > profile["available_bytes"] > 0
            assert profile["memory_bandwidth_bytes_per_s"] > 0 and profile["accelerator"]
            (link,) = n["links"].values()
            assert link["latency_s"] > 0 and link["bandwidth_bytes_per_s"] > 0
        preview = httpx.post(
            f"{cluster.url(1)}/cluster/placements/preview", json={"model": None, "sharding": "auto"}, timeout=60
        ).json()["candidates"]
        feasible = [c for c in preview if c["feasible"]]
        speeds = [c["predicted_decode_tokens_per_s"] for c in feasible]
        assert speeds == sorted(speeds, reverse=True) and len(feasible) >= 3
        assert {c["sharding"] for c in feasible} >= {"pipeline", "tensor", "ring"}
        inst = cluster.place(None, "auto")
        best = feasible[0]
        # (which node of two equal ones comes first depends on memory free at that moment)
        assert (inst["sharding"], len(inst["ranks"])) == (best["sharding"], len(best["node_ids"]))
        print(
            f"\nauto chose {best['sharding']} on {len(best['node_ids'])} node(s), predicted "
            f"{best['predicted_decode_tokens_per_s']:.0f} tok/s decode"
        )


def test_a_late_joiner_that_knows_one_member_is_known_by_all(tmp_path):
    """A 4th node started with --peers naming only node 0 (issue 13, case 6): every node
    lists all four as live, the three old ones included."""
    with LocalCluster(nodes=3, base_port=free_port_block(4), log_dir=str(tmp_path), data_dir=str(tmp_path)) as cluster:
        cluster.start()
        late_port = cluster.base_port + 3
        command = [
            sys.executable,
            "-m",
            "shardline.cli",
            "run",
            "--host",
            "127.0.0.1",
            "--port",
            str(late_port),
            "--peers",
            f"127.0.0.1:{cluster.base_port}",
            "--exit-with-parent",
            "--no-mdns",
            "--data-dir",
            str(tmp_path / "late"),
        ]
        with open(tmp_path / "late.log", "ab") as log:
            late = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=dict(os.environ, SHARDLINE_CLUSTER_KEY=cluster.cluster_key),
            )
        try:
            urls = [cluster.url(i) for i in range(3)] + [f"http://127.0.0.1:{late_port}"]

            def everyone_sees_four():
                seen = [httpx.get(f"{u}/cluster/nodes", timeout=2).json()["nodes"] for u in urls]
                return all(sum(n["live"] for n in nodes) == 4 for nodes in seen)

            wait_for(everyone_sees_four, 20, "all four nodes live in every node's view")
        finally:
            late.terminate()
            late.wait(15)
