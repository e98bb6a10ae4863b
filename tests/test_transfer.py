"""Copying a model's files from a peer's store: byte-range resume, SHA-256 check, refusals
(the peer is the node's own routes, served in-process), and confinement: a peer's manifest
or a symlink in the store writes nothing outside the store, and serves nothing from outside.
A GGUF file copied in pieces into a sparse file: what a rank reads, checked per piece,
resumed, extended later, served only where held."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from fastapi import FastAPI, Response
from fastapi import Request as FastAPIRequest
from fastapi.testclient import TestClient
from tiny_models import hf_model

from shardline.api.internal.transfer import router as model_file_routes
from shardline.models.byte_ranges import merged, missing
from shardline.models.confine import UnsafePathError
from shardline.models.file_pieces import HEADER_PIECE, Piece
from shardline.models.rank_reads import RankReads
from shardline.models.sparse_file import SparseRecord, read_record, record_path, write_record
from shardline.models.store import Manifest, ModelFile, ModelStore, ModelStoreError, sha256_file
from shardline.node.transfer import TransferError, fetch_files, fetch_pieces, runs, what_peer_serves

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

    app.include_router(model_file_routes(store))
    with TestClient(app) as client:
        yield store, manifest, client, ranges


def biggest(manifest):
    return max(manifest.files, key=lambda f: f.size)


def test_a_copy_brings_the_files_asked_for_and_records_the_manifest(tmp_path, peer):
    source, manifest, client, _ = peer
    store = ModelStore(tmp_path / "mine")
    wanted = manifest.shard_files(RankReads(0, 1, embed=False, head=False))
    received = fetch_files(client, PEER, store, manifest, wanted)

    assert store.manifest("test/tiny") == manifest
    assert store.present("test/tiny") == set(wanted)
    assert received == sum(f.size for f in manifest.files if f.path in wanted)
    for path in wanted:
        assert (store.model_dir("test/tiny") / path).read_bytes() == (source.model_dir("test/tiny") / path).read_bytes()
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
    for params in (
        {"model": "test/tiny", "path": "../../peer/test--tiny/config.json"},
        {"model": "test/tiny", "path": "/etc/passwd"},
        {"model": "../test--tiny", "path": "config.json"},
        {"model": "test/absent", "path": "config.json"},
    ):
        assert client.get("/internal/models/file", params=params).status_code == 404
    assert client.get("/internal/models/manifest", params={"model": "test/absent"}).status_code == 404
    source.remove("test/tiny")
    with pytest.raises(TransferError, match="404"):
        fetch_files(client, PEER, ModelStore(tmp_path / "mine"), manifest, ["config.json"])


def files_outside(root, store_dir) -> dict:
    """Every file under ``root`` but outside ``store_dir``, with its bytes."""
    return {
        p: p.read_bytes() for p in root.rglob("*") if p.is_file() and not p.is_symlink() and store_dir not in p.parents
    }


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


@pytest.mark.parametrize("path", ["tokenizer/../../../../x", "../x", "ABSOLUTE", "a/../../x", "..\\..\\x", "x\x00y"])
def test_a_manifest_that_leaves_the_store_is_refused_and_nothing_is_written(tmp_path, evil_peer, path):
    client, asked = evil_peer
    path = str(tmp_path / "escaped") if path == "ABSOLUTE" else path
    store = ModelStore(tmp_path / "store" / "models")
    data = {
        "model_id": "test/evil",
        "format": "safetensors",
        "config": {},
        "weight_map": {},
        "files": [{"path": path, "size": len(EVIL), "sha256": EVIL_SHA, "weights": False}],
    }
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
    manifest = Manifest(
        "test/evil", "safetensors", (ModelFile("tokenizer/vocab.json", len(EVIL) + 1, EVIL_SHA, False),), {}
    )
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


# A GGUF file copied in pieces: the header and the tensors a rank reads, into a sparse file.

GGUF_MODEL = "test/gguf"


@pytest.fixture()
def gguf_peer(tmp_path):
    """A store holding a tiny 4-layer llama GGUF whole (its manifest with pieces), a client
    of the routes that serve it, and the Range headers asked of them."""
    import tiny_models as tm

    store = ModelStore(tmp_path / "peer")
    directory = store.model_dir(GGUF_MODEL)
    directory.mkdir(parents=True)
    tm.write_gguf(tm.hf_model("llama", num_layers=4), directory / "tiny.gguf", arch="llama")
    manifest = store._describe(directory, GGUF_MODEL, "gguf")
    store.write_manifest(manifest)
    with served(store) as (client, ranges):
        yield store, manifest, client, ranges


class served:
    """A TestClient of ``store``'s model routes, and the Range headers they were asked."""

    def __init__(self, store: ModelStore) -> None:
        self.app = FastAPI()
        self.ranges: list[str | None] = []

        @self.app.middleware("http")
        async def record(request, call_next):
            self.ranges.append(request.headers.get("range"))
            return await call_next(request)

        self.app.include_router(model_file_routes(store))

    def __enter__(self):
        self.client = TestClient(self.app).__enter__()
        return self.client, self.ranges

    def __exit__(self, *exc):
        self.client.__exit__(*exc)


def rank_pieces(manifest: Manifest, reads: RankReads) -> list:
    return manifest.shard_pieces(reads)["tiny.gguf"]


def test_a_rank_copies_the_header_and_its_tensors_into_a_sparse_file(tmp_path, gguf_peer):
    source, manifest, client, ranges = gguf_peer
    store = ModelStore(tmp_path / "mine")
    reads = RankReads(1, 3, embed=False, head=False)
    wanted = rank_pieces(manifest, reads)
    assert [p.name for p in wanted][0] == HEADER_PIECE
    assert {p.name.split(".")[1] for p in wanted[1:]} == {"1", "2"}
    received = fetch_pieces(client, PEER, store, manifest, manifest.shard_pieces(reads))

    assert received == sum(p.size for p in wanted)
    held = merged(p.range for p in wanted)
    assert ranges == [f"bytes={a}-{b - 1}" for a, b in held]  # a request for each run side by side
    whole = (source.model_dir(GGUF_MODEL) / "tiny.gguf").read_bytes()
    copy = (store.model_dir(GGUF_MODEL) / "tiny.gguf").read_bytes()
    assert len(copy) == len(whole)  # the file's own size, holes where it lacks bytes
    for start, end in held:
        assert copy[start:end] == whole[start:end]
    for start, end in missing([(0, len(whole))], held):
        assert copy[start:end] == bytes(end - start)
    assert store.held_ranges(GGUF_MODEL, "tiny.gguf") == held
    assert "tiny.gguf" not in store.present(GGUF_MODEL)  # held in part: not present
    assert store.summary()[GGUF_MODEL]["ranges"] == {"tiny.gguf": [list(r) for r in held]}
    assert not store.summary()[GGUF_MODEL]["complete"]
    assert fetch_pieces(client, PEER, store, manifest, manifest.shard_pieces(reads)) == 0

    # the loader reads the rank's tensors from it as from the whole file
    from shardline.models.weights import open_weights

    mine, theirs = open_weights(store.weights_path(GGUF_MODEL)), open_weights(source.weights_path(GGUF_MODEL))
    assert mine.config == theirs.config
    for piece in wanted[1:]:
        assert mine.read(piece.name).equal(theirs.read(piece.name))


def test_a_later_rank_copies_only_the_missing_pieces_and_then_the_file_is_whole(tmp_path, gguf_peer):
    source, manifest, client, ranges = gguf_peer
    store = ModelStore(tmp_path / "mine")
    first = RankReads(0, 2, embed=True, head=False)
    fetch_pieces(client, PEER, store, manifest, manifest.shard_pieces(first))
    ranges.clear()
    later = RankReads(1, 4, embed=False, head=True)
    received = fetch_pieces(client, PEER, store, manifest, manifest.shard_pieces(later))

    had = {p.name for p in rank_pieces(manifest, first)}
    new = [p for p in rank_pieces(manifest, later) if p.name not in had]
    assert new and received == sum(p.size for p in new)
    assert ranges == [f"bytes={a}-{b - 1}" for a, b in merged(p.range for p in new)]
    # every piece now: the file is whole, the same bytes, its record gone
    fetch_pieces(client, PEER, store, manifest, manifest.shard_pieces(RankReads.whole(4)))
    path = store.model_dir(GGUF_MODEL) / "tiny.gguf"
    assert store.present(GGUF_MODEL) == {"tiny.gguf"} and not record_path(path).exists()
    assert sha256_file(path) == manifest.file("tiny.gguf").sha256


@pytest.mark.parametrize("written", [0.5, 1.0])  # half of it; all of it, unchecked
def test_an_interrupted_piece_resumes_where_it_stopped(tmp_path, gguf_peer, written):
    source, manifest, client, ranges = gguf_peer
    store = ModelStore(tmp_path / "mine")
    big = max(manifest.pieces["tiny.gguf"], key=lambda p: p.size)
    whole = (source.model_dir(GGUF_MODEL) / "tiny.gguf").read_bytes()
    store.write_manifest(manifest)
    path = store.model_dir(GGUF_MODEL) / "tiny.gguf"
    half = big.offset + int(big.size * written)
    write_record(path, SparseRecord(manifest.file("tiny.gguf").sha256, len(whole)).writing_to(big.offset, half))
    with open(path, "wb") as f:
        f.truncate(len(whole))
        f.seek(big.offset)
        f.write(whole[big.offset : half])

    received = fetch_pieces(client, PEER, store, manifest, {"tiny.gguf": [big]})
    assert received == big.offset + big.size - half
    assert ranges == ([f"bytes={half}-{big.offset + big.size - 1}"] if written < 1 else [])
    assert path.read_bytes()[big.offset : big.offset + big.size] == whole[big.offset : big.offset + big.size]
    assert read_record(path).present == (big.range,)


def test_a_corrupt_piece_is_refused_and_not_recorded(tmp_path, gguf_peer):
    source, manifest, _, _ = gguf_peer
    piece = rank_pieces(manifest, RankReads(2, 3, embed=False, head=False))[1]
    app = FastAPI()

    @app.get("/internal/models/file")
    async def model_file(model: str, path: str):  # the range asked for, every byte wrong
        return Response(
            b"\xff" * piece.size,
            status_code=206,
            headers={
                "Content-Range": f"bytes {piece.offset}-{piece.offset + piece.size - 1}/{manifest.file(path).size}"
            },
        )

    store = ModelStore(tmp_path / "mine")
    with TestClient(app) as client, pytest.raises(TransferError, match="corrupt"):
        fetch_pieces(client, PEER, store, manifest, {"tiny.gguf": [piece]})
    record = read_record(store.model_dir(GGUF_MODEL) / "tiny.gguf")
    assert record is not None and record.present == () and record.writing is None
    assert store.held_ranges(GGUF_MODEL, "tiny.gguf") == []


def test_a_peer_that_answers_the_whole_file_to_a_range_is_refused(tmp_path, gguf_peer, evil_peer):
    _, manifest, _, _ = gguf_peer
    client, _ = evil_peer
    with pytest.raises(TransferError, match="answered 200"):
        fetch_pieces(
            client,
            PEER,
            ModelStore(tmp_path / "mine"),
            manifest,
            {"tiny.gguf": rank_pieces(manifest, RankReads(0, 1, True, False))},
        )


def test_a_node_serves_only_the_bytes_it_holds_of_a_file_held_in_part(tmp_path, gguf_peer):
    source, manifest, client, _ = gguf_peer
    middle = ModelStore(tmp_path / "middle")
    reads = RankReads(1, 3, embed=False, head=False)
    fetch_pieces(client, PEER, middle, manifest, manifest.shard_pieces(reads))
    whole = (source.model_dir(GGUF_MODEL) / "tiny.gguf").read_bytes()
    (start, end), *_ = middle.held_ranges(GGUF_MODEL, "tiny.gguf")
    size = len(whole)
    params = {"model": GGUF_MODEL, "path": "tiny.gguf"}
    with served(middle) as (partial_client, _):
        ok = partial_client.get("/internal/models/file", params=params, headers={"Range": f"bytes=0-{end - 1}"})
        assert ok.status_code == 206 and ok.content == whole[:end]
        for refused in (
            None,
            f"bytes=0-{size - 1}",
            "bytes=0-",
            f"bytes=-{size}",
            "bytes=0-1,5-6",
            "bytes=x-y",
            f"bytes={end - 1}-{end}",
        ):  # the whole file, a hole's byte, several ranges
            headers = {"Range": refused} if refused else {}
            response = partial_client.get("/internal/models/file", params=params, headers=headers)
            assert response.status_code == 404, refused
        # a third node copies from it what it holds, and not what it lacks
        third = ModelStore(tmp_path / "third")
        assert fetch_pieces(partial_client, PEER, third, manifest, manifest.shard_pieces(reads)) > 0
        assert third.held_ranges(GGUF_MODEL, "tiny.gguf") == middle.held_ranges(GGUF_MODEL, "tiny.gguf")
        with pytest.raises(TransferError, match="404"):
            fetch_pieces(
                partial_client, PEER, third, manifest, manifest.shard_pieces(RankReads(0, 1, embed=True, head=False))
            )


def test_what_a_peer_serves(gguf_peer):
    _, manifest, _, _ = gguf_peer
    pieces = manifest.pieces["tiny.gguf"]
    a, b, c = pieces[0], pieces[1], pieces[2]
    wanted = {"tiny.gguf": [a, b, c]}
    files = ["tokenizer/vocab.json"]
    table = [  # (the peer's summary of the model, files it serves, pieces it serves)
        ({}, [], {}),
        ({"present": ["tiny.gguf", "tokenizer/vocab.json"]}, files, wanted),
        ({"present": [], "ranges": {"tiny.gguf": [[a.offset, b.offset + b.size]]}}, [], {"tiny.gguf": [a, b]}),
        ({"present": [], "ranges": {"tiny.gguf": [[0, a.size - 1]]}}, [], {}),  # a byte short
        (
            {"present": [], "ranges": {"tiny.gguf": [[a.offset, a.offset + a.size], [c.offset, c.offset + c.size]]}},
            [],
            {"tiny.gguf": [a, c]},
        ),
    ]
    for held, served_files, served_pieces in table:
        assert what_peer_serves(held, files, wanted) == (served_files, served_pieces), held


def test_a_manifest_without_pieces_copies_its_gguf_whole(gguf_peer):
    _, manifest, _, _ = gguf_peer
    old = Manifest.from_dict({k: v for k, v in manifest.to_dict().items() if k != "pieces"})
    reads = RankReads(1, 2, embed=False, head=False)
    assert old.shard_files(reads) == ["tiny.gguf"] and old.shard_pieces(reads) == {}
    assert manifest.shard_files(reads) == []


@pytest.mark.parametrize("change", ["gap", "sha", "unlisted"])
def test_a_peers_manifest_with_bad_pieces_is_refused(gguf_peer, change):
    _, manifest, _, _ = gguf_peer
    data = manifest.to_dict()
    pieces = [dict(p) for p in data["pieces"]["tiny.gguf"]]
    if change == "gap":
        pieces[1]["offset"] += 1
    elif change == "sha":
        pieces[1]["sha256"] = "nope"
    data["pieces"] = {"other.gguf" if change == "unlisted" else "tiny.gguf": pieces}
    with pytest.raises(ModelStoreError, match="manifest refused"):
        Manifest.from_dict(data)


def test_a_record_of_another_version_is_void_and_a_partial_file_is_not_taken_in_whole(tmp_path, gguf_peer):
    source, manifest, client, ranges = gguf_peer
    store = ModelStore(tmp_path / "mine")
    reads = RankReads(0, 1, embed=True, head=False)
    fetch_pieces(client, PEER, store, manifest, manifest.shard_pieces(reads))
    path = store.model_dir(GGUF_MODEL) / "tiny.gguf"
    # `models add` of the copy held in part is refused: it is not the model's file
    with pytest.raises(ModelStoreError, match="held in part"):
        ModelStore(tmp_path / "other").add_local(path, "test/copy")
    # the model changed where it was added: what is held of the old file counts for nothing
    record = read_record(path)
    write_record(path, SparseRecord("b" * 64, record.size, record.present))
    assert store.held_ranges(GGUF_MODEL, "tiny.gguf") == []
    assert store.missing_pieces(manifest, manifest.shard_pieces(reads)) == manifest.shard_pieces(reads)
    ranges.clear()
    fetch_pieces(client, PEER, store, manifest, manifest.shard_pieces(reads))
    assert ranges == [f"bytes={a}-{b - 1}" for a, b in merged(p.range for p in rank_pieces(manifest, reads))]
    assert store.held_ranges(GGUF_MODEL, "tiny.gguf") == merged(p.range for p in rank_pieces(manifest, reads))


def test_pieces_side_by_side_are_asked_in_one_run():
    def p(offset, size):
        return Piece(f"t{offset}", offset, size, "0" * 64)

    table = [
        ([], []),
        ([p(0, 10)], [[p(0, 10)]]),
        ([p(10, 5), p(0, 10), p(20, 1)], [[p(0, 10), p(10, 5)], [p(20, 1)]]),  # by offset
        ([p(0, 10), p(11, 1)], [[p(0, 10)], [p(11, 1)]]),  # a byte between: two requests
    ]
    for pieces, expected in table:
        assert runs(pieces) == expected


def test_a_run_cut_short_keeps_its_whole_pieces_and_resumes_inside_the_next(tmp_path, gguf_peer):
    source, manifest, client, ranges = gguf_peer
    whole = (source.model_dir(GGUF_MODEL) / "tiny.gguf").read_bytes()
    run = rank_pieces(manifest, RankReads(1, 2, embed=False, head=False))[1:]  # layer 1: side by side
    assert len(runs(run)) == 1 and len(run) > 3
    cut = run[2].offset + run[2].size // 2  # halfway through its third piece
    app = FastAPI()

    @app.get("/internal/models/file")
    async def model_file(model: str, path: str, request: FastAPIRequest):  # the right bytes, cut short
        start, end = (int(n) for n in request.headers["range"][len("bytes=") :].split("-"))
        return Response(
            whole[start:cut], status_code=206, headers={"Content-Range": f"bytes {start}-{end}/{len(whole)}"}
        )

    store = ModelStore(tmp_path / "mine")
    with TestClient(app) as short, pytest.raises(TransferError, match="short"):
        fetch_pieces(short, PEER, store, manifest, {"tiny.gguf": run})
    path = store.model_dir(GGUF_MODEL) / "tiny.gguf"
    record = read_record(path)
    assert record.present == ((run[0].offset, run[2].offset),) and record.writing == (run[2].offset, cut)

    received = fetch_pieces(client, PEER, store, manifest, {"tiny.gguf": run})
    end = run[-1].offset + run[-1].size
    assert ranges == [f"bytes={cut}-{end - 1}"] and received == end - cut
    assert store.held_ranges(GGUF_MODEL, "tiny.gguf") == [(run[0].offset, end)]
    assert path.read_bytes()[run[0].offset : end] == whole[run[0].offset : end]
