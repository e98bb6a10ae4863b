"""Copying a model's files from a peer's store: byte-range resume, SHA-256 check, refusals
(the peer is the node's own routes, served in-process)."""

from __future__ import annotations

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from tiny_models import hf_model

from shardline.models.store import ModelStore
from shardline.node.transfer import TransferError, add_model_routes, fetch_files

pytestmark = pytest.mark.timeout(120)

PEER = "http://testserver"


@pytest.fixture()
def peer(tmp_path):
    """A store holding a tiny 2-file model, and a client of the routes that serve it."""
    directory = tmp_path / "source"
    hf_model("llama", num_layers=2).save_pretrained(directory, safe_serialization=True, max_shard_size="100KB")
    store = ModelStore(tmp_path / "peer")
    manifest = store.add_local(directory, "test/tiny")
    ranges = []
    app = FastAPI()

    @app.middleware("http")
    async def record(request, call_next):
        ranges.append(request.headers.get("range"))
        return await call_next(request)

    add_model_routes(app, store)
    with TestClient(app) as client:
        yield store, manifest, client, ranges


def biggest(manifest):
    return max(manifest.files, key=lambda f: f.size)


def test_a_copy_brings_the_files_asked_for_and_records_the_manifest(tmp_path, peer):
    source, manifest, client, _ = peer
    store = ModelStore(tmp_path / "mine")
    wanted = manifest.shard_files(0, 1, top=False)
    received = fetch_files(client, PEER, store, manifest, wanted)

    assert store.manifest("test/tiny") == manifest
    assert store.present("test/tiny") == set(wanted)
    assert received == sum(f.size for f in manifest.files if f.path in wanted)
    for path in wanted:
        assert (store.model_dir("test/tiny") / path).read_bytes() == \
            (source.model_dir("test/tiny") / path).read_bytes()
    assert not store.summary()["test/tiny"]["complete"]  # only the shard's files
    assert fetch_files(client, PEER, store, manifest, wanted) == 0  # nothing left to copy


def test_an_interrupted_copy_resumes_where_it_stopped(tmp_path, peer):
    source, manifest, client, ranges = peer
    store = ModelStore(tmp_path / "mine")
    entry = biggest(manifest)
    data = (source.model_dir("test/tiny") / entry.path).read_bytes()
    half = len(data) // 2
    partial = store.model_dir("test/tiny") / (entry.path + ".partial")
    partial.parent.mkdir(parents=True)
    partial.write_bytes(data[:half])

    received = fetch_files(client, PEER, store, manifest, [entry.path])
    assert received == len(data) - half
    assert ranges == [f"bytes={half}-"]
    assert (store.model_dir("test/tiny") / entry.path).read_bytes() == data
    assert not partial.exists()


def test_a_corrupt_copy_is_refused_and_a_retry_starts_afresh(tmp_path, peer):
    source, manifest, client, _ = peer
    store = ModelStore(tmp_path / "mine")
    entry = biggest(manifest)
    partial = store.model_dir("test/tiny") / (entry.path + ".partial")
    partial.parent.mkdir(parents=True)
    partial.write_bytes(b"\xff" * 1000)  # not the file's first bytes

    with pytest.raises(TransferError, match="corrupt"):
        fetch_files(client, PEER, store, manifest, [entry.path])
    assert not partial.exists() and entry.path not in store.present("test/tiny")
    assert fetch_files(client, PEER, store, manifest, [entry.path]) == entry.size
    assert store.present("test/tiny") == {entry.path}


def test_a_peer_serves_only_the_files_of_its_manifests(tmp_path, peer):
    source, manifest, client, _ = peer
    for params in ({"model": "test/tiny", "path": "../../peer/test--tiny/config.json"},
                   {"model": "test/tiny", "path": "/etc/passwd"},
                   {"model": "../test--tiny", "path": "config.json"},
                   {"model": "test/absent", "path": "config.json"}):
        assert client.get("/internal/models/file", params=params).status_code == 404
    assert client.get("/internal/models/manifest", params={"model": "test/absent"}).status_code == 404
    source.remove("test/tiny")
    with pytest.raises(TransferError, match="404"):
        fetch_files(client, PEER, ModelStore(tmp_path / "mine"), manifest, ["config.json"])
