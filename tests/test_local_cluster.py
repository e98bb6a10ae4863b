"""The local cluster's node processes do not outlive the process that started them."""

import subprocess
import sys

import psutil
import pytest

from conftest import free_port_block


@pytest.mark.timeout(90)
def test_nodes_stop_when_their_launcher_is_killed(tmp_path):
    base = free_port_block(2)
    launcher = subprocess.Popen(
        [sys.executable, "-c",
         "import time; from shardline.local_cluster import LocalCluster; "
         f"c = LocalCluster(2, {base}, log_dir={str(tmp_path)!r}, data_dir={str(tmp_path)!r}); c.start(); "
         "print('up', flush=True); time.sleep(600)"],
        stdout=subprocess.PIPE, text=True,
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
