"""A client may name a local path as a model only under the node's --model-dir: any other
path gets one 400 answer, alike whether it exists or not (a real 1-node cluster)."""

from __future__ import annotations

import httpx
import pytest
from conftest import free_port_block
from tiny_models import hf_model, save_hf

from shardline import cli
from shardline.local_cluster import LocalCluster
from shardline.models.store import ModelStore

pytestmark = pytest.mark.timeout(180)

REFUSED = "is not a model id known to the cluster, nor a path under a --model-dir"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A 1-node cluster allowed ``allowed/``; a tiny safetensors model in ``allowed/`` and
    one in ``outside/``, a symlink in ``allowed/`` to the outside one."""
    tmp = tmp_path_factory.mktemp("model-dir")
    allowed, outside = tmp / "allowed", tmp / "outside"
    model = hf_model("llama", num_layers=2)
    save_hf(model, allowed / "tiny")
    save_hf(model, outside / "tiny")
    (outside / "x.gguf").write_bytes(b"GGUF")
    (allowed / "link").symlink_to(outside / "tiny")
    cluster = LocalCluster(
        nodes=1,
        base_port=free_port_block(1),
        runner_threads=1,
        log_dir=str(tmp / "logs"),
        data_dir=str(tmp / "logs"),
        model_dirs=[allowed],
    )
    cluster.start()
    try:
        yield cluster, allowed, outside
    finally:
        cluster.stop()


@pytest.mark.parametrize("route", ["/cluster/instances", "/cluster/placements/preview"])
def test_a_path_outside_the_model_dirs_is_refused_alike_whether_it_exists(setup, route):
    cluster, allowed, outside = setup
    names = {  # each existing, or not; the answers differ only in the name they quote
        "existing directory": str(outside / "tiny"),
        "existing gguf": str(outside / "x.gguf"),
        "absent gguf": str(outside / "absent.gguf"),
        "absent directory": str(outside / "absent") + "/",
        "symlink out": str(allowed / "link"),
        "dot-dot out": str(allowed / ".." / "outside" / "tiny"),
        "not even a directory": "/no/such/dir/x.gguf",
        "system file": "/etc/passwd",
    }
    answers = {}
    for what, name in names.items():
        response = httpx.post(f"{cluster.url(0)}{route}", json={"model": name, "sharding": "pipeline"}, timeout=60)
        assert response.status_code == 400, (what, response.text)
        detail = response.json()["error"]["message"]
        assert REFUSED in detail, (what, detail)
        answers[what] = detail.replace(repr(name), "NAME")
    assert len(set(answers.values())) == 1, answers
    assert ModelStore(cluster.node_data_dir(0) / "models").model_ids() == []


def test_a_path_under_a_model_dir_is_taken_in(setup):
    cluster, allowed, _ = setup
    response = httpx.post(
        f"{cluster.url(0)}/cluster/placements/preview",
        timeout=120,
        json={"model": str(allowed / "tiny"), "sharding": "pipeline"},
    )
    assert response.status_code == 200, response.text
    assert response.json()["candidates"]
    assert "tiny" in ModelStore(cluster.node_data_dir(0) / "models").model_ids()
    absent = httpx.post(
        f"{cluster.url(0)}/cluster/placements/preview",
        timeout=60,
        json={"model": str(allowed / "absent.gguf"), "sharding": "pipeline"},
    )
    assert absent.status_code == 400 and "no such file" in absent.json()["error"]["message"]  # allowed: may say


def test_a_model_dir_that_is_not_a_directory_stops_the_node(tmp_path, capsys):
    code = cli.main(
        [
            "run",
            "--data-dir",
            str(tmp_path),
            "--cluster-key",
            "k" * 32,
            "--no-mdns",
            "--model-dir",
            str(tmp_path / "absent"),
        ]
    )
    assert code == 2
    assert "not a directory" in capsys.readouterr().err
