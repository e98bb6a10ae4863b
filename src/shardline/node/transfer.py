"""Copying a model's files from a peer's store: HTTP byte ranges, resumed, hash-checked.

A node serves the files of its store at ``/internal/models/file``
(:mod:`shardline.api.internal.transfer`, behind the cluster key like every ``/internal``
route): a file it holds whole, with byte ranges of it (RFC 9110, section 14: ``206
Partial Content``); a file it holds in part (:mod:`shardline.models.sparse_file`) only as
one byte range that lies wholly in what it holds (anything else is answered 404: it never
serves bytes it does not hold).

A node that lacks files of its shard fetches them whole (:func:`fetch_files`): each into
``<file>.partial``, continued from its current size after an interruption, and renamed to
its own name only once its size and SHA-256 equal the manifest's. Of a GGUF file it fetches
only the pieces its ranks read (:func:`fetch_pieces`): each piece's range written at its
offset into the sparse file, recorded present once its SHA-256 equals the manifest's, and
continued after an interruption from what the record says was written.

Paths stay in the store (:mod:`shardline.models.confine`): a peer's manifest is checked
where it is parsed (``Manifest.from_dict``), and every file is written, or served, only
at a real path inside its model's directory (``ModelStore.confined_path``: no ``..``, no
absolute path, no symlink pointing out), opened with ``O_NOFOLLOW``. A refusal is logged
and raised as :class:`UnsafePathError`.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from shardline.models.byte_ranges import covers
from shardline.models.confine import UnsafePathError, check_manifest_json
from shardline.models.file_pieces import Piece
from shardline.models.sparse_file import RECORD_SUFFIX, SparseRecord, read_record, record_path, write_record
from shardline.models.store import PARTIAL_SUFFIX, Manifest, ModelFile, ModelStore

log = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 20
RECORD_EVERY_BYTES = 64 << 20
"""How often a piece being copied has its progress recorded, for a resume."""


class TransferError(RuntimeError):
    """A file could not be copied from a peer: an error answer, a short or corrupt copy."""


class CopyProgress:
    """Bytes copied of a total: a rich progress bar on a terminal, else a log line each
    10%; ``on_advance(done, total)`` is called at most once a second and at the end."""

    def __init__(
        self, description: str, total_bytes: int, on_advance: Callable[[int, int], None] | None = None
    ) -> None:
        self.description = description
        self.total = total_bytes
        self.done = 0
        self.on_advance = on_advance
        self._last_call = 0.0
        self._logged = -1
        self._bar = None
        if sys.stderr.isatty():
            from rich.progress import (
                BarColumn,
                DownloadColumn,
                Progress,
                TextColumn,
                TimeRemainingColumn,
                TransferSpeedColumn,
            )

            self._bar = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                DownloadColumn(),
                TransferSpeedColumn(),
                TimeRemainingColumn(),
            )
            self._task = self._bar.add_task(description, total=total_bytes)
            self._bar.start()

    def advance(self, nbytes: int) -> None:
        self.done += nbytes
        if self._bar is not None:
            self._bar.update(self._task, completed=self.done)
        else:
            tenth = self.done * 10 // max(self.total, 1)
            if tenth > self._logged:
                self._logged = tenth
                log.info(
                    "%s: %d of %d bytes (%d%%)",
                    self.description,
                    self.done,
                    self.total,
                    self.done * 100 // max(self.total, 1),
                )
        now = time.monotonic()
        if self.on_advance is not None and (now - self._last_call >= 1.0 or self.done >= self.total):
            self._last_call = now
            self.on_advance(self.done, self.total)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()


def fetch_files(
    client: httpx.Client,
    base_url: str,
    store: ModelStore,
    manifest: Manifest,
    paths: list[str],
    progress: CopyProgress | None = None,
) -> int:
    """Copy ``paths`` of ``manifest``'s model from the peer at ``base_url`` into ``store``,
    skipping files already present and resuming ``.partial`` ones. Blocking (run it in a
    thread). Records the manifest first. Returns the bytes received.

    Raises:
        TransferError: the peer answered an error, or a copy's size or SHA-256 is not the
            manifest's (the corrupt ``.partial`` is deleted, so a retry starts afresh).
        UnsafePathError: a file, or the model's directory, would lie outside the model's
            directory in the store (a symlink pointing out); nothing is written there.
        httpx.HTTPError: the connection failed (the ``.partial`` is kept for a resume).
    """
    try:
        check_manifest_json(manifest.to_dict())  # again: a Manifest need not come from from_dict
        store.write_manifest(manifest)
    except UnsafePathError as exc:
        log.warning("refused to record %s from %s: %s", manifest.model_id, base_url, exc)
        raise
    present = store.present(manifest.model_id)
    received = 0
    for entry in manifest.files:
        if entry.path in paths and entry.path not in present:
            received += _fetch_file(client, base_url, store, manifest.model_id, entry, progress)
    return received


def fetch_pieces(
    client: httpx.Client,
    base_url: str,
    store: ModelStore,
    manifest: Manifest,
    pieces: dict[str, list[Piece]],
    progress: CopyProgress | None = None,
) -> int:
    """Copy ``pieces`` (by file) of ``manifest``'s model from the peer at ``base_url`` into
    ``store``'s sparse files (:mod:`shardline.models.sparse_file`), skipping pieces held
    and files present whole, one range request for each run of pieces side by side,
    resuming a piece the record says was being written. A file
    whose every byte is then held becomes whole (its record is deleted). Blocking (run it
    in a thread). Records the manifest first. Returns the bytes received.

    Raises:
        TransferError: the peer answered an error or not the range asked, or a piece's
            SHA-256 is not the manifest's (it is not recorded; a retry copies it afresh).
        UnsafePathError: a file would lie outside the model's directory; nothing is written.
        httpx.HTTPError: the connection failed (what was written is recorded for a resume).
    """
    try:
        check_manifest_json(manifest.to_dict())
        store.write_manifest(manifest)
    except UnsafePathError as exc:
        log.warning("refused to record %s from %s: %s", manifest.model_id, base_url, exc)
        raise
    received = 0
    for path, wanted in store.missing_pieces(manifest, pieces).items():
        entry = manifest.file(path)
        try:
            target = store.confined_path(manifest.model_id, path)
            target.parent.mkdir(parents=True, exist_ok=True)
            target = store.confined_path(manifest.model_id, path)
            store.confined_path(manifest.model_id, path + RECORD_SUFFIX)
        except UnsafePathError as exc:
            log.warning("refused to copy %s/%s from %s: %s", manifest.model_id, path, base_url, exc)
            raise
        record = _sparse_file(target, entry)
        fd = os.open(target, os.O_RDWR | os.O_NOFOLLOW)
        try:
            for run in runs([p for p in wanted if not record.holds(p.range)]):
                record, got = _fetch_run(client, base_url, manifest.model_id, entry, target, fd, record, run, progress)
                received += got
        finally:
            os.close(fd)
        if record.complete:  # every piece: the file is the whole file, byte for byte
            record_path(target).unlink()
            log.info("%s/%s is now held whole", manifest.model_id, path)
    return received


def what_peer_serves(
    held: dict, files: list[str], pieces: dict[str, list[Piece]]
) -> tuple[list[str], dict[str, list[Piece]]]:
    """Of ``files`` (wanted whole) and ``pieces`` (by file), what a peer whose store
    summary of the model is ``held`` (``ModelStore.summary()``'s entry: ``present``,
    ``ranges``) can serve: the files it holds whole, and the pieces of files it holds
    whole or whose ranges it holds. Pure."""
    present = set(held.get("present", ()))
    ranges = held.get("ranges", {})
    out: dict[str, list[Piece]] = {}
    for path, wanted in pieces.items():
        servable = (
            wanted
            if path in present
            else [p for p in wanted if covers([tuple(r) for r in ranges.get(path, ())], p.range)]
        )
        if servable:
            out[path] = servable
    return [f for f in files if f in present], out


def _sparse_file(target: Path, entry: ModelFile) -> SparseRecord:
    """The record of the file held in part at ``target`` (of ``entry``'s version), making
    the record (first) and the file at its full size, all holes, where there are none; a
    record of another version is void: its file is made afresh."""
    record = read_record(target)
    if record is None or (record.sha256, record.size) != (entry.sha256, entry.size) or not target.exists():
        if record is not None:
            log.info("%s: its record is of another version of the file, or of none: copying it afresh", target)
        record = SparseRecord(entry.sha256, entry.size)
        write_record(target, record)  # before the file: a file with a record is never taken whole
        target.unlink(missing_ok=True)
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    try:
        if os.fstat(fd).st_size != entry.size:
            os.ftruncate(fd, entry.size)
    finally:
        os.close(fd)
    return record


def runs(pieces: list[Piece]) -> list[list[Piece]]:
    """``pieces`` by offset, in runs of pieces side by side: one request each. Pure."""
    out: list[list[Piece]] = []
    for piece in sorted(pieces, key=lambda p: p.offset):
        if out and out[-1][-1].offset + out[-1][-1].size == piece.offset:
            out[-1].append(piece)
        else:
            out.append([piece])
    return out


def _fetch_run(
    client: httpx.Client,
    base_url: str,
    model_id: str,
    entry: ModelFile,
    target: Path,
    fd: int,
    record: SparseRecord,
    run: list[Piece],
    progress: CopyProgress | None,
) -> tuple[SparseRecord, int]:
    """Copy a run of pieces side by side (:func:`runs`) with one range request into the
    open sparse file ``fd`` at their offsets, each checked and recorded as it ends; the
    record with them held, and the bytes received."""
    record, index, hasher, position = _resumed(fd, record, run, target, base_url, model_id, entry, progress)
    if index == len(run):
        return record, 0
    end = run[-1].offset + run[-1].size
    received, noted = 0, position
    params = {"model": model_id, "path": entry.path}
    try:
        with client.stream(
            "GET",
            f"{base_url}/internal/models/file",
            params=params,
            headers={"Range": f"bytes={position}-{end - 1}"},
            timeout=30.0,
        ) as response:
            expected = f"bytes {position}-{end - 1}/"
            if response.status_code != 206 or not response.headers.get("content-range", "").startswith(expected):
                raise TransferError(
                    f"{base_url} answered {response.status_code} "
                    f"({response.headers.get('content-range')}) for bytes {position}-{end - 1} "
                    f"of {model_id}/{entry.path}"
                )
            for chunk in response.iter_bytes(CHUNK_BYTES):
                if position + len(chunk) > end:
                    raise TransferError(
                        f"{base_url} sent more than bytes {run[0].offset}-{end - 1} of {model_id}/{entry.path}"
                    )
                received += len(chunk)
                if progress is not None:
                    progress.advance(len(chunk))
                while chunk:  # split at the pieces' ends
                    piece = run[index]
                    part = chunk[: piece.offset + piece.size - position]
                    os.pwrite(fd, part, position)
                    hasher.update(part)
                    position += len(part)
                    chunk = chunk[len(part) :]
                    if position == piece.offset + piece.size:
                        record = _checked(record, piece, hasher.hexdigest(), target, base_url, model_id, entry.path)
                        index, hasher, noted = index + 1, hashlib.sha256(), position
                    elif position - noted >= RECORD_EVERY_BYTES:
                        record, noted = record.writing_to(piece.offset, position), position
                        write_record(target, record)
    except httpx.HTTPError:
        if index < len(run) and position > run[index].offset:  # what was written, for a resume
            write_record(target, record.writing_to(run[index].offset, position))
        raise
    if index < len(run):
        if position > run[index].offset:
            write_record(target, record.writing_to(run[index].offset, position))
        raise TransferError(
            f"{base_url} sent bytes {run[0].offset}-{position - 1} of {model_id}/{entry.path}, short of {end}"
        )
    return record, received


def _resumed(
    fd: int,
    record: SparseRecord,
    run: list[Piece],
    target: Path,
    base_url: str,
    model_id: str,
    entry: ModelFile,
    progress: CopyProgress | None,
) -> tuple[SparseRecord, int, Any, int]:
    """Where the copy of ``run`` starts: past what an interrupted copy wrote of its first
    piece (``record.writing``; hashed from disk, and the piece checked and recorded where
    it was written to its end). Returns the record, the index of the piece the copy goes
    on with, that piece's hasher so far and the byte offset."""
    index, hasher = 0, hashlib.sha256()
    position = run[0].offset
    if (
        record.writing is not None
        and record.writing[0] == position
        and position < record.writing[1] <= position + run[0].size
    ):
        resumed = record.writing[1]  # bytes written before an interruption: hashed from disk
        while position < resumed:
            block = os.pread(fd, min(CHUNK_BYTES, resumed - position), position)
            if not block:
                break
            hasher.update(block)
            position += len(block)
        log.info(
            "resuming %s/%s piece %s at byte %d of %d",
            model_id,
            entry.path,
            run[0].name,
            position - run[0].offset,
            run[0].size,
        )
        if progress is not None:
            progress.advance(position - run[0].offset)
        if position == run[0].offset + run[0].size:  # written to its end before the interruption
            record = _checked(record, run[0], hasher.hexdigest(), target, base_url, model_id, entry.path)
            index, hasher = 1, hashlib.sha256()
    return record, index, hasher, position


def _checked(
    record: SparseRecord, piece: Piece, sha256: str, target: Path, base_url: str, model_id: str, path: str
) -> SparseRecord:
    """``record`` with ``piece`` held, written, once its bytes' SHA-256 is the manifest's.

    Raises:
        TransferError: it is not (the record is written without the piece, nothing to resume).
    """
    if sha256 != piece.sha256:
        write_record(target, record.not_writing())
        raise TransferError(
            f"copy of {model_id}/{path} piece {piece.name} from {base_url} is corrupt: "
            f"SHA-256 {sha256[:12]}..., expected {piece.sha256[:12]}..."
        )
    record = record.holding(piece.range)
    write_record(target, record)
    return record


def _fetch_file(
    client: httpx.Client,
    base_url: str,
    store: ModelStore,
    model_id: str,
    entry: ModelFile,
    progress: CopyProgress | None,
) -> int:
    try:  # checked before making its directory, and again after, before any write
        target = store.confined_path(model_id, entry.path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target = store.confined_path(model_id, entry.path)
        partial = store.confined_path(model_id, entry.path + PARTIAL_SUFFIX)
    except UnsafePathError as exc:
        log.warning("refused to copy %s/%s from %s: %s", model_id, entry.path, base_url, exc)
        raise
    offset = partial.stat().st_size if partial.exists() else 0
    if offset > entry.size:
        partial.unlink()
        offset = 0
    hasher = hashlib.sha256()
    if offset:
        _hash_into(hasher, partial)
        log.info("resuming %s/%s at byte %d of %d", model_id, entry.path, offset, entry.size)
    if progress is not None:
        progress.advance(offset)
    received = 0
    if offset < entry.size:
        headers = {"Range": f"bytes={offset}-"} if offset else {}
        params = {"model": model_id, "path": entry.path}
        with client.stream(
            "GET", f"{base_url}/internal/models/file", params=params, headers=headers, timeout=30.0
        ) as response:
            if response.status_code == 200 and offset:  # the peer ignored the range: start over
                hasher, offset = hashlib.sha256(), 0
            elif response.status_code not in (200, 206):
                raise TransferError(f"{base_url} answered {response.status_code} for {model_id}/{entry.path}")
            flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | (os.O_APPEND if offset else os.O_TRUNC)
            with os.fdopen(os.open(partial, flags, 0o644), "wb") as out:
                for chunk in response.iter_bytes(CHUNK_BYTES):
                    out.write(chunk)
                    hasher.update(chunk)
                    received += len(chunk)
                    if progress is not None:
                        progress.advance(len(chunk))
    size = partial.stat().st_size
    if size != entry.size or hasher.hexdigest() != entry.sha256:
        partial.unlink()
        raise TransferError(
            f"copy of {model_id}/{entry.path} from {base_url} is corrupt: {size} bytes, SHA-256 "
            f"{hasher.hexdigest()[:12]}..., expected {entry.size} bytes, {entry.sha256[:12]}..."
        )
    partial.replace(target)
    record_path(target).unlink(missing_ok=True)  # it was held in part: now whole
    return received


def _hash_into(hasher, path: Path) -> None:
    with open(path, "rb") as f:
        while block := f.read(CHUNK_BYTES):
            hasher.update(block)
