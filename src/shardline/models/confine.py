"""Confinement: the paths a node writes, serves or takes in stay where they belong.

Two kinds of path reach a node from outside:

- **a model's file paths**, in a manifest sent by a peer (``/internal/models/manifest``) or
  read from the store: each must be a plain relative POSIX path inside the model's
  directory (:func:`check_relative_path`, :func:`check_manifest_json`), checked once where
  the JSON is parsed, and again, resolved, at every write (:func:`confined`);
- **a local path a client names** as a model (``POST /cluster/instances``): taken in only
  when its real path lies under a directory the node's owner allowed with ``--model-dir``
  (:func:`resolve_under`).

The checks on the JSON are pure; :func:`confined` and :func:`resolve_under` read the file
system (``os.path.realpath``, which resolves symlinks and ``..``).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path

from shardline.models.file_pieces import check_pieces
from shardline.models.sparse_file import RECORD_SUFFIX

MANIFEST = "manifest.json"
PARTIAL_SUFFIX = ".partial"
FORMATS = ("gguf", "safetensors")
MAX_PATH_CHARS = 1024
MAX_PART_BYTES = 255  # a file name's limit on Linux file systems (NAME_MAX)
_SHA256 = re.compile(r"[0-9a-f]{64}")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_FILE_KEYS = {"path", "size", "sha256", "weights"}


class UnsafePathError(ValueError):
    """A path that would leave its directory, or a manifest naming one (the message says why)."""


def check_relative_path(path: object) -> str:
    """``path`` if it is a plain relative POSIX path that stays in its directory: a
    non-empty string of at most :data:`MAX_PATH_CHARS` characters, with no control character
    (NUL included) and no backslash, not absolute, whose ``/``-separated parts are neither
    empty, ``.`` nor ``..`` and each at most :data:`MAX_PART_BYTES` bytes of UTF-8.

    Raises:
        UnsafePathError: it is not (the message names the rule it breaks).
    """
    if not isinstance(path, str):
        raise UnsafePathError(f"path {path!r} is not a string")
    if not path:
        raise UnsafePathError("empty path")
    if len(path) > MAX_PATH_CHARS:
        raise UnsafePathError(f"path of {len(path)} characters (at most {MAX_PATH_CHARS})")
    if _CONTROL.search(path):
        raise UnsafePathError(f"path {path!r} holds a control character")
    if "\\" in path:
        raise UnsafePathError(f"path {path!r} holds a backslash")
    if path.startswith("/"):
        raise UnsafePathError(f"path {path!r} is absolute")
    for part in path.split("/"):
        if part in ("", ".", ".."):
            raise UnsafePathError(f"path {path!r} has a part {part!r} (empty, '.' and '..' are refused)")
        if len(part.encode("utf-8", "surrogatepass")) > MAX_PART_BYTES:
            raise UnsafePathError(f"path {path!r} has a part over {MAX_PART_BYTES} bytes")
    return path


def check_manifest_json(data: object) -> dict:
    """``data`` if it has the shape of a manifest (``Manifest.to_dict()``) whose every file
    path is safe to write under the model's directory: ``format`` one of :data:`FORMATS`;
    ``files`` a list of ``{"path", "size", "sha256", "weights"}`` with a path that passes
    :func:`check_relative_path`, is not the manifest's own name nor ends with
    :data:`PARTIAL_SUFFIX` or a partial file's record's suffix, and is listed once; ``size`` an int >= 0, ``sha256`` 64 lowercase
    hex digits, ``weights`` a bool; ``config`` an object; ``weight_map`` (optional) an object
    of strings naming listed files; ``pieces`` (optional) an object of listed files to
    pieces that tile each (:func:`~shardline.models.file_pieces.check_pieces`). The model
    id is left to ``check_model_id``.

    Raises:
        UnsafePathError: it is not (the message says what is wrong).
    """
    if not isinstance(data, dict):
        raise UnsafePathError("a manifest is a JSON object")
    if data.get("format") not in FORMATS:
        raise UnsafePathError(f"format {data.get('format')!r} is not one of {FORMATS}")
    files = data.get("files")
    if not isinstance(files, (list, tuple)):
        raise UnsafePathError("files is not a list")
    seen: set[str] = set()
    for entry in files:
        if not isinstance(entry, dict) or set(entry) != _FILE_KEYS:
            raise UnsafePathError(f"a file entry is not an object with the keys {sorted(_FILE_KEYS)}")
        path = check_relative_path(entry["path"])
        if path == MANIFEST or path.endswith((PARTIAL_SUFFIX, RECORD_SUFFIX)):
            raise UnsafePathError(f"path {path!r} is a name the store keeps for itself")
        if path in seen:
            raise UnsafePathError(f"path {path!r} is listed twice")
        seen.add(path)
        size = entry["size"]
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise UnsafePathError(f"{path}: size {size!r} is not a byte count")
        if not isinstance(entry["sha256"], str) or not _SHA256.fullmatch(entry["sha256"]):
            raise UnsafePathError(f"{path}: sha256 {entry['sha256']!r} is not 64 hex digits")
        if not isinstance(entry["weights"], bool):
            raise UnsafePathError(f"{path}: weights is not true or false")
    if not isinstance(data.get("config"), dict):
        raise UnsafePathError("config is not an object")
    weight_map = data.get("weight_map", {})
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) and v in seen for k, v in weight_map.items()
    ):
        raise UnsafePathError("weight_map is not an object of tensor names to listed files")
    pieces = data.get("pieces", {})
    sizes = {entry["path"]: entry["size"] for entry in files}
    if not isinstance(pieces, dict) or not all(isinstance(k, str) and k in seen for k in pieces):
        raise UnsafePathError("pieces is not an object of listed files to their pieces")
    for path, listed in pieces.items():
        try:
            check_pieces(listed, sizes[path])
        except (ValueError, TypeError) as exc:
            raise UnsafePathError(f"{path}: {exc}") from None
    return data


def is_within(path: Path, root: Path) -> bool:
    """Whether ``path`` is ``root`` or lies below it, comparing their parts (both should be
    resolved: ``a/../b`` is compared as written)."""
    return path == root or root in path.parents


def confined(root: Path, path: Path) -> Path:
    """The real path of ``path`` (symlinks and ``..`` resolved, the last part too), checked
    to lie inside the real path of ``root``. Call it after making ``path``'s parent and
    before writing or serving ``path``.

    Raises:
        UnsafePathError: it resolves outside ``root`` (the message gives both real paths).
    """
    real, real_root = Path(os.path.realpath(path)), Path(os.path.realpath(root))
    if not is_within(real, real_root):
        raise UnsafePathError(f"{path} resolves to {real}, outside {real_root}")
    return real


def resolve_under(name: str, roots: Iterable[Path]) -> Path | None:
    """The real path of the local path ``name`` (``~`` expanded; relative to the working
    directory; symlinks and ``..`` resolved) when it lies under the real path of one of
    ``roots``, else None (whether or not it exists: callers answer both alike)."""
    try:
        real = Path(os.path.realpath(Path(name).expanduser()))
        return real if any(is_within(real, Path(os.path.realpath(r))) for r in roots) else None
    except (ValueError, OSError, RuntimeError):  # NUL in the name, a symlink loop, no home
        return None
