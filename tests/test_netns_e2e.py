"""Nodes in separate network stacks (tests/netns.py: network namespaces on a bridge, root
only): mDNS discovery with no peer list, and a rate-limited link that the measured link
profile reports."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import pytest

import netns

REASON = netns.unavailable()
pytestmark = [pytest.mark.timeout(120), pytest.mark.skipif(REASON is not None, reason=REASON or "")]

PORT = 52700
KEY = "netns-test-key-0123456789abcdef"


def start_node(hosts: netns.Hosts, i: int, tmp_path, *extra: str) -> subprocess.Popen:
    command = hosts.command(i, [sys.executable, "-m", "shardline.cli", "run",
                                "--host", hosts.addresses[i], "--port", str(PORT),
                                "--data-dir", str(tmp_path / f"node-{i}"), "--exit-with-parent",
                                *extra])
    log = open(tmp_path / f"node-{i}.log", "ab")
    return subprocess.Popen(command, env=dict(os.environ, SHARDLINE_CLUSTER_KEY=KEY),
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def nodes_view(hosts: netns.Hosts, i: int) -> list[dict]:
    return httpx.get(f"http://{hosts.addresses[i]}:{PORT}/cluster/nodes", timeout=2).json()["nodes"]


def wait_for(check, timeout_s: float, what: str):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            result = check()
        except (httpx.HTTPError, KeyError, ValueError):
            result = None
        if result:
            return result
        time.sleep(0.3)
    raise AssertionError(f"not within {timeout_s} s: {what}")


def stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        proc.kill()
    for proc in procs:
        proc.wait(10)


def test_nodes_on_separate_hosts_find_each_other_by_mdns(tmp_path):
    with netns.Hosts(2) as hosts:
        procs = [start_node(hosts, i, tmp_path) for i in range(2)]
        try:
            started = time.time()
            wait_for(lambda: all(sum(n["live"] for n in nodes_view(hosts, i)) == 2 for i in range(2)),
                     40, "each node lists both, found by mDNS")
            print(f"\nmDNS across namespaces: a cluster {time.time() - started:.1f} s after start")
        finally:
            stop(procs)


def test_a_rate_limited_link_is_measured_at_its_rate(tmp_path):
    """Each host sends at most 20 Mbit/s (tc tbf): the link profile node 0 measures to
    node 1 reports that within 30%."""
    rate_bytes = 20e6 / 8
    with netns.Hosts(2) as hosts:
        for i in range(2):
            hosts.limit(i, "20mbit")
        procs = [start_node(hosts, i, tmp_path, "--no-mdns", "--peers",
                            f"{hosts.addresses[1 - i]}:{PORT}") for i in range(2)]
        try:
            def measured():
                me = next(n for n in nodes_view(hosts, 0) if n["address"].startswith(hosts.addresses[0]))
                links = list(me["links"].values())
                return links[0]["bandwidth_bytes_per_s"] if links else None

            bandwidth = wait_for(measured, 60, "node 0's measured link to node 1")
            print(f"\ntbf 20 Mbit/s: measured {bandwidth * 8 / 1e6:.1f} Mbit/s")
            assert 0.7 * rate_bytes <= bandwidth <= 1.3 * rate_bytes
        finally:
            stop(procs)
