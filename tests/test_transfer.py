"""Copying a model's files from a peer's store: byte-range resume, SHA-256 check, refusals
(the peer is the node's own routes, served in-process), and confinement: a peer's manifest
or a symlink in the store writes nothing outside the store, and serves nothing from outside."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from fastapi import FastAPI, Response
from fastapi.testclient import TestClient
from tiny_models import hf_model

from shardline.models.confine import UnsafePathError
from shardline.models.store import Manifest, ModelFile, ModelStore, ModelStoreError
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


def files_outside(root, store_dir) -> dict:
    """Every file under ``root`` but outside ``store_dir``, with its bytes."""
    return {p: p.read_bytes() for p in root.rglob("*")
            if p.is_file() and not p.is_symlink() and store_dir not in p.parents}


@pytest.fixture()
def evil_peer():
    """A fake peer that answers every file request with chosen bytes."""
    app = FastAPI()
    asked = []

    @app.get("/internal/models/file")
    async def model_file(model: str, path: str):
        asked.append(path)
        return Response(EVIL, media_type="application/octet-stream")

    with TestClient(app) as client:
        yield client, asked


EVIL = b"chosen bytes"
EVIL_SHA = hashlib.sha256(EVIL).hexdigest()


@pytest.mark.parametrize("path", ["tokenizer/../../../../x", "../x", "ABSOLUTE",
                                  "a/../../x", "..\\..\\x", "x\x00y"])
def test_a_manifest_that_leaves_the_store_is_refused_and_nothing_is_written(tmp_path, evil_peer, path):
    client, asked = evil_peer
    path = str(tmp_path / "escaped") if path == "ABSOLUTE" else path
    store = ModelStore(tmp_path / "store" / "models")
    data = {"model_id": "test/evil", "format": "safetensors", "config": {}, "weight_map": {},
            "files": [{"path": path, "size": len(EVIL), "sha256": EVIL_SHA, "weights": False}]}
    before = files_outside(tmp_path, tmp_path / "store")

    with pytest.raises(ModelStoreError, match="manifest refused"):  # where the JSON is parsed
        Manifest.from_dict(data)
    # and at the write, should such a manifest get past the parse (built directly)
    manifest = Manifest("test/evil", "safetensors", (ModelFile(path, len(EVIL), EVIL_SHA, False),), {})
    with pytest.raises(UnsafePathError):
        fetch_files(client, PEER, store, manifest, [path])
    assert asked == []
    assert files_outside(tmp_path, tmp_path / "store") == before


@pytest.mark.parametrize("link", ["tokenizer", "tokenizer/vocab.json.partial", "tokenizer/vocab.json", "."])
def test_a_symlink_in_the_store_pointing_out_is_not_written_through(tmp_path, evil_peer, link):
    """A directory, a ``.partial``, the file itself, or the model's directory: each a
    symlink to a place outside the store; the copy is refused before any byte is asked."""
    client, asked = evil_peer
    store = ModelStore(tmp_path / "store" / "models")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "vocab.json.partial").write_bytes(b"")
    (outside / "vocab.json").write_bytes(b"x")
    model_dir = store.model_dir("test/evil")
    if link == ".":
        store.root.mkdir(parents=True)
        model_dir.symlink_to(outside)
    else:
        (model_dir / link).parent.mkdir(parents=True, exist_ok=True)
        (model_dir / link).symlink_to(outside / Path(link).name if "/" in link else outside)
    manifest = Manifest("test/evil", "safetensors",
                        (ModelFile("tokenizer/vocab.json", len(EVIL) + 1, EVIL_SHA, False),), {})
    before = files_outside(tmp_path, tmp_path / "store")

    with pytest.raises(UnsafePathError, match="outside"):
        fetch_files(client, PEER, store, manifest, ["tokenizer/vocab.json"])
    assert asked == []
    assert files_outside(tmp_path, tmp_path / "store") == before


def test_a_peer_serves_no_file_through_a_symlink_out_of_its_store(tmp_path, peer):
    source, manifest, client, _ = peer
    entry = next(f for f in manifest.files if f.path == "config.json")
    secret = tmp_path / "secret"
    secret.write_bytes(b"s" * entry.size)  # the manifest's size: the store counts it present
    path = source.model_dir("test/tiny") / entry.path
    path.unlink()
    path.symlink_to(secret)
    assert entry.path in source.present("test/tiny")
    response = client.get("/internal/models/file", params={"model": "test/tiny", "path": entry.path})
    assert response.status_code == 404 and b"sss" not in response.content
