"""The model store: adding models from a path or the Hugging Face cache, manifests, and
which files a rank's shard needs."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
from tiny_models import hf_model

from shardline.models.file_pieces import HEADER_PIECE
from shardline.models.rank_reads import RankReads
from shardline.models.store import DEFAULT_MODEL_ID, ModelNotFoundError, ModelStore, ModelStoreError, default_model_path
from shardline.models.tokenizer import Tokenizer
from shardline.models.weights import open_weights

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def split_model(tmp_path_factory) -> Path:
    """A tiny 4-layer Llama saved as 14 safetensors files with an index."""
    directory = tmp_path_factory.mktemp("split")
    hf_model("llama", num_layers=4).save_pretrained(directory, safe_serialization=True, max_shard_size="60KB")
    (directory / "pytorch_model.bin").write_bytes(b"not used")  # a file the store leaves out
    return directory


def test_adding_a_safetensors_directory_records_every_file_with_its_hash(tmp_path, split_model):
    store = ModelStore(tmp_path / "models")
    manifest = store.add_local(split_model, "test/tiny")

    assert store.model_ids() == ["test/tiny"]
    directory = store.model_dir("test/tiny")
    assert directory == tmp_path / "models" / "test--tiny"
    names = {f.path for f in manifest.files}
    assert "pytorch_model.bin" not in names
    assert names == {p.name for p in split_model.iterdir() if p.name != "pytorch_model.bin"}
    for f in manifest.files:
        data = (directory / f.path).read_bytes()
        assert f.size == len(data) and f.sha256 == hashlib.sha256(data).hexdigest()
        assert f.weights == f.path.endswith(".safetensors")
    assert store.present("test/tiny") == names
    assert manifest.config == open_weights(split_model).config.to_dict()
    assert store.card("test/tiny").config == manifest.config
    index = json.loads((split_model / "model.safetensors.index.json").read_text())["weight_map"]
    assert manifest.weight_map == index
    assert store.summary()["test/tiny"]["complete"] is True


def test_a_pipeline_rank_needs_only_the_files_of_its_layers(tmp_path, split_model):
    manifest = ModelStore(tmp_path / "models").add_local(split_model, "test/tiny")
    weight_files = {f.path for f in manifest.files if f.weights}
    small = set(manifest.tokenizer_files())
    assert "config.json" in small and not small & weight_files

    first_reads, middle_reads, last_reads = (
        RankReads(0, 2, True, False),
        RankReads(1, 3, False, False),
        RankReads(2, 4, False, True),
    )
    first, middle, last = (set(manifest.shard_files(r)) for r in (first_reads, middle_reads, last_reads))
    assert small <= first and small <= middle and small <= last
    for rank_files, reads in ((first, first_reads), (middle, middle_reads), (last, last_reads)):
        needed = {
            file
            for name, file in manifest.weight_map.items()
            if any(f"layers.{i}." in name for i in range(reads.layer_start, reads.layer_end))
            or (reads.embed and name == "model.embed_tokens.weight")
            or (reads.head and name in ("model.norm.weight", "lm_head.weight"))
        }
        assert rank_files & weight_files == needed
    # A middle rank skips the files of other layers and of the embedding and head.
    assert len(middle & weight_files) < len(weight_files)
    assert (first | last) & weight_files == weight_files


def test_adding_the_same_directory_again_keeps_the_entry(tmp_path, split_model):
    store = ModelStore(tmp_path / "models")
    first = store.add_local(split_model, "test/tiny")
    stamp = (store.model_dir("test/tiny") / "manifest.json").stat().st_mtime_ns
    assert store.add_local(split_model, "test/tiny") == first
    assert (store.model_dir("test/tiny") / "manifest.json").stat().st_mtime_ns == stamp
    assert store.remove("test/tiny") and store.model_ids() == []
    assert not store.remove("test/tiny")


def test_a_gguf_model_keeps_its_tokenizer_beside_it(tmp_path):
    store = ModelStore(tmp_path / "models")
    manifest = store.add_local(default_model_path(), "test/smollm2")

    assert manifest.format == "gguf"
    assert [f.path for f in manifest.files if f.weights] == [default_model_path().name]
    # The GGUF file is copied in pieces: the header and the rank's tensors.
    reads = RankReads(3, 7, embed=False, head=False)
    assert manifest.shard_files(reads) == manifest.tokenizer_files()
    pieces = manifest.shard_pieces(reads)[default_model_path().name]
    assert pieces[0].name == HEADER_PIECE and pieces[0].offset == 0
    assert {p.name.split(".")[1] for p in pieces[1:]} == {"3", "4", "5", "6"}
    assert manifest.shard_pieces(RankReads.whole(30))[default_model_path().name] == list(
        manifest.pieces[default_model_path().name]
    )
    assert all(p.startswith("tokenizer/") for p in manifest.tokenizer_files())
    assert store.weights_path("test/smollm2") == store.model_dir("test/smollm2") / default_model_path().name
    # Hard-linked where the file system allows it: the same bytes, no copy.
    assert (
        os.path.samefile(store.weights_path("test/smollm2"), default_model_path())
        or store.weights_path("test/smollm2").stat().st_size == default_model_path().stat().st_size
    )
    messages = [{"role": "user", "content": "What is the capital of France? été 東京"}]
    saved = Tokenizer(store.tokenizer_path("test/smollm2"))
    original = Tokenizer(default_model_path())
    assert saved.encode_chat(messages) == original.encode_chat(messages)
    assert saved.eos_token_ids == original.eos_token_ids
    # The embedded default is found without being in the store.
    assert store.weights_path(DEFAULT_MODEL_ID) == default_model_path()
    default = Tokenizer(store.tokenizer_path(DEFAULT_MODEL_ID))  # saved once per machine
    assert default.encode_chat(messages) == original.encode_chat(messages)


def test_bad_ids_and_paths_are_refused_with_the_reason(tmp_path, split_model):
    store = ModelStore(tmp_path / "models")
    with pytest.raises(ModelStoreError, match="org/name"):
        store.add_local(split_model, "../escape")
    with pytest.raises(ModelStoreError, match="org/name"):
        store.add_local(split_model, "a/b/c")
    with pytest.raises(ModelStoreError, match="org/name"):  # an empty id is not the default
        store.add_local(split_model, "")
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ModelStoreError, match="neither a .gguf file nor a directory"):
        store.add_local(tmp_path / "notes.txt")
    with pytest.raises(ModelStoreError, match="no such file or directory"):
        store.add_local(tmp_path / "absent.gguf")
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(default_model_path().read_bytes()[:5_000_000])
    with pytest.raises(ModelStoreError, match="not a model shardline can read: a GGUF file cut short"):
        store.add_local(truncated)
    (tmp_path / "text.gguf").write_text("hello")
    with pytest.raises(ModelStoreError, match="not a GGUF file"):
        store.add_local(tmp_path / "text.gguf")
    assert store.model_ids() == [] and not list((tmp_path / "models").glob(".adding-*"))
    with pytest.raises(ModelNotFoundError, match="not in the model store"):
        store.weights_path("test/absent")
    assert store.manifest("../../etc") is None


def _fake_hub_cache(root: Path, repo_id: str, source: Path) -> None:
    """The layout ``huggingface_hub`` keeps: refs/main names a snapshot of the files."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    for file in source.iterdir():
        (snapshot / file.name).write_bytes(file.read_bytes())


def test_a_hub_model_is_added_offline_from_the_hugging_face_cache(tmp_path, split_model, monkeypatch):
    from huggingface_hub import constants

    _fake_hub_cache(tmp_path / "hub", "tinyorg/tiny-llama", split_model)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    store = ModelStore(tmp_path / "models")

    manifest = store.add_from_hub("tinyorg/tiny-llama")
    assert manifest.model_id == "tinyorg/tiny-llama"
    assert "pytorch_model.bin" not in {f.path for f in manifest.files}
    assert store.summary()["tinyorg/tiny-llama"]["complete"]
    with pytest.raises(ModelNotFoundError, match="not in the local Hugging Face cache"):
        store.add_from_hub("tinyorg/absent")


def test_a_symlink_out_of_the_model_directories_is_not_taken_in(tmp_path, split_model):
    """A client's model directory (under --model-dir) holding a link to a file elsewhere:
    refused, nothing of it in the store; the same directory without the link is taken in."""
    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("not for the store")
    model = allowed / "tiny"
    model.mkdir(parents=True)
    for file in split_model.iterdir():
        os.link(file, model / file.name)
    (model / "notes.txt").symlink_to(outside / "secret.txt")
    store = ModelStore(tmp_path / "models")
    with pytest.raises(ModelStoreError, match="notes.txt resolve"):
        store.add_local(model, "test/tiny", roots=[allowed])
    assert store.model_ids() == []
    (model / "notes.txt").unlink()
    assert store.add_local(model, "test/tiny", roots=[allowed]).model_id == "test/tiny"


def test_nodes_starting_together_convert_the_default_tokenizer_once(tmp_path, monkeypatch):
    """The embedded default's tokenizer files are made once per machine: processes (here
    threads, each with its own lock file handle) asking at once wait for the first."""
    import threading
    import time

    from shardline.models import store as store_module
    from shardline.models import tokenizer as tokenizer_module

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls = []

    def convert(gguf_file, directory):
        calls.append(gguf_file)
        time.sleep(0.3)
        (Path(directory) / "tokenizer.json").write_text("{}")

    monkeypatch.setattr(tokenizer_module, "save_tokenizer_files", convert)
    found: list[Path] = []
    threads = [threading.Thread(target=lambda: found.append(store_module._default_tokenizer_dir())) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert len(calls) == 1 and len(found) == 3 and len(set(found)) == 1
    assert (found[0] / "tokenizer.json").is_file()


@pytest.mark.parametrize("arch", ["gemma3", "deepseek2"])
def test_an_unsupported_architecture_is_refused_before_any_copy_or_hash(tmp_path, monkeypatch, arch):
    """A GGUF of an architecture shardline cannot run is refused from its header alone,
    naming the architecture and the supported ones: no file is copied, linked or hashed
    (a many-gigabyte file took 19-49 s to be refused when it was)."""
    import gguf
    import numpy as np

    from shardline.models import store as store_module
    from shardline.models.config import UnsupportedModelError

    path = tmp_path / f"{arch}.gguf"
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(2)
    writer.add_tensor("token_embd.weight", np.zeros((100, 64), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    def untouched(*args):
        raise AssertionError(f"the store read the file's weights: {args}")

    monkeypatch.setattr(store_module, "sha256_file", untouched)
    monkeypatch.setattr(store_module, "_link_or_copy", untouched)
    store = ModelStore(tmp_path / "models")
    with pytest.raises(UnsupportedModelError, match=rf"'{arch}' is not supported \(supported: llama"):
        store.add_local(path)
    assert store.model_ids() == []
