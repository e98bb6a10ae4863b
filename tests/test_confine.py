"""Confinement of paths from peers and clients (shardline.models.confine): which manifest
paths, manifests and model ids are refused, and where a resolved path may lie."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from shardline.models.confine import (
    UnsafePathError,
    check_manifest_json,
    check_relative_path,
    confined,
    is_within,
    resolve_under,
)
from shardline.models.store import Manifest, ModelStore, ModelStoreError, check_model_id

pytestmark = [pytest.mark.fast, pytest.mark.timeout(10)]

SHA = "0" * 64


@pytest.mark.parametrize(
    "path",
    [
        "config.json",
        "model-00001-of-00002.safetensors",
        "tokenizer/tokenizer.json",
        "a/b/c/d.txt",
        "..hidden",
        "a..b",
        "dir.with.dots/x",
        "ünïcode.json",
        "x" * 255,
    ],
)
def test_plain_relative_paths_pass(path):
    assert check_relative_path(path) == path


@pytest.mark.parametrize(
    "path, reason",
    [
        ("", "empty"),
        ("..", "'..'"),
        ("../x", "'..'"),
        ("a/../../b", "'..'"),
        ("tokenizer/../../../../x", "'..'"),
        ("a/..", "'..'"),
        ("./x", "'.'"),
        ("a/./b", "'.'"),
        ("/etc/passwd", "absolute"),
        ("//x", "absolute"),
        ("a//b", "''"),
        ("a/", "''"),
        ("a\x00b", "control"),
        ("a\nb", "control"),
        ("..\\..\\x", "backslash"),
        ("a\\b", "backslash"),
        ("x" * 256, "bytes"),
        ("é" * 200, "bytes"),  # 200 characters, 400 bytes
        ("a/" * 600 + "b", "characters"),
        (None, "not a string"),
        (7, "not a string"),
    ],
)
def test_unsafe_paths_are_refused_with_the_rule_they_break(path, reason):
    with pytest.raises(UnsafePathError, match=reason):
        check_relative_path(path)


def manifest_json(**changes) -> dict:
    data = {
        "model_id": "org/model",
        "format": "safetensors",
        "config": {},
        "files": [
            {"path": "config.json", "size": 10, "sha256": SHA, "weights": False},
            {"path": "model.safetensors", "size": 99, "sha256": SHA, "weights": True},
        ],
        "weight_map": {"lm_head.weight": "model.safetensors"},
    }
    data.update(changes)
    return data


def entry(path="x.json", **changes) -> dict:
    return dict({"path": path, "size": 1, "sha256": SHA, "weights": False}, **changes)


def test_a_sound_manifest_parses_and_round_trips():
    manifest = Manifest.from_dict(manifest_json())
    assert Manifest.from_dict(manifest.to_dict()) == manifest
    assert [f.path for f in manifest.files] == ["config.json", "model.safetensors"]


@pytest.mark.parametrize(
    "changes, reason",
    [
        ({"files": [entry("tokenizer/../../../../x")]}, "'..'"),
        ({"files": [entry("/tmp/x")]}, "absolute"),
        ({"files": [entry("a\x00")]}, "control"),
        ({"files": [entry("a\\b")]}, "backslash"),
        ({"files": [entry("")]}, "empty"),
        ({"files": [entry("manifest.json")]}, "keeps for itself"),
        ({"files": [entry("model.safetensors.partial")]}, "keeps for itself"),
        ({"files": [entry(), entry()]}, "twice"),
        ({"files": [entry(size=-1)]}, "byte count"),
        ({"files": [entry(size="1")]}, "byte count"),
        ({"files": [entry(size=True)]}, "byte count"),
        ({"files": [entry(sha256="../x")]}, "64 hex"),
        ({"files": [entry(weights="yes")]}, "true or false"),
        ({"files": [dict(entry(), extra=1)]}, "keys"),
        ({"files": ["config.json"]}, "keys"),
        ({"files": "config.json"}, "not a list"),
        ({"format": "pickle"}, "format"),
        ({"config": []}, "config"),
        ({"weight_map": {"t": "../../x"}}, "weight_map"),
        ({"weight_map": {"t": "absent.safetensors"}}, "weight_map"),
        ({"model_id": "../x"}, "model id"),
        ({"model_id": "/etc"}, "model id"),
        ({"model_id": "a/b/c"}, "model id"),
        ({"model_id": "org/.."}, "model id"),
        ({"model_id": "name\n"}, "model id"),
        ({"model_id": "x" * 201}, "model id"),
        ({"model_id": 5}, "model id"),
    ],
)
def test_unsafe_manifests_are_refused_where_they_are_parsed(changes, reason):
    with pytest.raises(ModelStoreError, match=f"manifest refused: .*{reason}"):
        Manifest.from_dict(manifest_json(**changes))


def test_a_manifest_missing_a_field_is_refused():
    data = manifest_json()
    del data["model_id"]
    with pytest.raises(ModelStoreError, match="manifest refused"):
        Manifest.from_dict(data)
    with pytest.raises(UnsafePathError):
        check_manifest_json([])


@pytest.mark.parametrize(
    "model_id, ok",
    [
        ("name", True),
        ("org/name", True),
        ("Org.1/na_me-2", True),
        ("x" * 96, True),
        ("o" * 96 + "/" + "n" * 96, True),
        ("x" * 97, False),
        ("o/" + "n" * 97, False),
        ("", False),
        ("..", False),
        ("a/..", False),
        ("a/b/c", False),
        ("/abs", False),
        ("a\\b", False),
        ("a\x00", False),
        ("a\n", False),
        ("-x", False),
    ],
)
def test_model_ids(model_id, ok):
    if ok:
        assert check_model_id(model_id) == model_id
    else:
        with pytest.raises(ModelStoreError):
            check_model_id(model_id)


@pytest.mark.parametrize(
    "path, root, inside",
    [
        ("/s/m", "/s/m", True),
        ("/s/m/a/b", "/s/m", True),
        ("/s/m2", "/s/m", False),
        ("/s", "/s/m", False),
        ("/other", "/s/m", False),
    ],
)
def test_is_within_compares_parts_not_prefixes(path, root, inside):
    assert is_within(Path(path), Path(root)) is inside


def test_a_symlink_pointing_out_of_the_root_is_refused(tmp_path):
    root, outside = tmp_path / "store", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (root / "link").symlink_to(outside)
    (root / "file-link").symlink_to(outside / "x")
    (root / "inner").symlink_to(root)
    assert confined(root, root / "a" / "b") == (root / "a" / "b").resolve()
    assert confined(root, root / "inner" / "x") == (root / "x").resolve()
    for escape in (root / "link" / "x", root / "file-link", root / ".." / "outside" / "x"):
        with pytest.raises(UnsafePathError, match="outside"):
            confined(root, escape)


def test_the_store_confines_a_models_files_to_its_directory(tmp_path):
    store = ModelStore(tmp_path / "models")
    directory = store.model_dir("org/m")
    directory.mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    (directory / "tokenizer").symlink_to(tmp_path / "elsewhere")
    assert store.confined_path("org/m", "a/b.json") == (directory / "a" / "b.json").resolve()
    for path in ("tokenizer/x.json", "../org--other/x", "/etc/passwd"):
        with pytest.raises(UnsafePathError):
            store.confined_path("org/m", path)
    os.symlink(tmp_path / "elsewhere", store.root / "org--linked")
    with pytest.raises(UnsafePathError, match="outside"):
        store.confined_path("org/linked", "x.json")


def test_a_local_path_is_taken_only_under_a_root_after_resolving(tmp_path):
    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    allowed.mkdir()
    outside.mkdir()
    (allowed / "m.gguf").write_bytes(b"")
    (outside / "m.gguf").write_bytes(b"")
    (allowed / "link.gguf").symlink_to(outside / "m.gguf")
    (allowed / "dirlink").symlink_to(outside)
    roots = [allowed]
    assert resolve_under(str(allowed / "m.gguf"), roots) == (allowed / "m.gguf").resolve()
    assert resolve_under(str(allowed / "absent.gguf"), roots) == (allowed / "absent.gguf").resolve()
    assert resolve_under(str(allowed), roots) == allowed.resolve()
    for name in (
        str(outside / "m.gguf"),
        str(outside / "absent.gguf"),
        str(allowed / "link.gguf"),
        str(allowed / "dirlink" / "m.gguf"),
        str(allowed / ".." / "outside" / "m.gguf"),
        str(allowed) + "2/m.gguf",
        "/etc/passwd",
        "a\x00b",
        "~nosuchuser__/x.gguf",
    ):
        assert resolve_under(name, roots) is None, name


def test_a_local_cluster_allows_the_directory_of_the_model_it_is_given(tmp_path, monkeypatch):
    from shardline.local_cluster import LocalCluster, model_dirs_for

    (tmp_path / "m.gguf").write_bytes(b"")
    (tmp_path / "st").mkdir()
    monkeypatch.chdir(tmp_path)
    assert model_dirs_for(str(tmp_path / "m.gguf")) == [str(tmp_path.resolve())]
    assert model_dirs_for("m.gguf") == [str(tmp_path.resolve())]  # relative, as the nodes see it
    assert model_dirs_for(str(tmp_path / "absent.gguf")) == [str(tmp_path.resolve())]
    assert model_dirs_for("./st") == [str((tmp_path / "st").resolve())]
    assert model_dirs_for("org/model") == [] and model_dirs_for(None) == []
    command = LocalCluster(2, 50000, data_dir=str(tmp_path), model_dirs=[tmp_path / "st", "/m"]).node_command(1)
    assert " ".join(command).count("--model-dir") == 2 and str(tmp_path / "st") in command
