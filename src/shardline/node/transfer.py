"""Copying a model's files from a peer's store: HTTP byte ranges, resumed, hash-checked.

A node serves the files of its store at ``/internal/models/file`` (behind the cluster key,
like every ``/internal`` route) with Starlette's ``FileResponse``, which answers
``Range: bytes=N-`` requests (RFC 9110, section 14) with ``206 Partial Content``. A node
that lacks files of its shard fetches them (:func:`fetch_files`): each into
``<file>.partial``, continued from its current size after an interruption, and renamed to
its own name only once its size and SHA-256 equal the manifest's.

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

import httpx
from fastapi import FastAPI
from fastapi.responses import FileResponse, JSONResponse

from shardline.models.confine import UnsafePathError, check_manifest_json
from shardline.models.store import (
    PARTIAL_SUFFIX,
    Manifest,
    ModelFile,
    ModelStore,
    ModelStoreError,
)

log = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 20


class TransferError(RuntimeError):
    """A file could not be copied from a peer: an error answer, a short or corrupt copy."""


def add_model_routes(app: FastAPI, store: ModelStore) -> None:
    """Serve ``store`` to peers: ``GET /internal/models/manifest?model=ID`` (the manifest)
    and ``GET /internal/models/file?model=ID&path=REL`` (a present file; byte ranges)."""

    @app.get("/internal/models/manifest")
    async def manifest(model: str):
        found = _manifest_or_none(store, model)
        if found is None:
            return JSONResponse(status_code=404, content={"detail": f"model {model!r} is not in this store"})
        return found.to_dict()

    @app.get("/internal/models/file")
    async def model_file(model: str, path: str):
        found = _manifest_or_none(store, model)
        missing = JSONResponse(status_code=404, content={"detail": f"{model}: no file {path!r} here"})
        # Only files named in the manifest, at a real path inside the model's directory.
        if found is None or path not in store.present(model):
            return missing
        try:
            real = store.confined_path(model, path)
        except (UnsafePathError, ModelStoreError) as exc:
            log.warning("refused to serve %s/%s: %s", model, path, exc)
            return missing
        return FileResponse(real, media_type="application/octet-stream")


def _manifest_or_none(store: ModelStore, model: str) -> Manifest | None:
    try:
        return store.manifest(model)
    except ModelStoreError:
        return None


class CopyProgress:
    """Bytes copied of a total: a rich progress bar on a terminal, else a log line each
    10%; ``on_advance(done, total)`` is called at most once a second and at the end."""

    def __init__(self, description: str, total_bytes: int,
                 on_advance: Callable[[int, int], None] | None = None) -> None:
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

            self._bar = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                                 TransferSpeedColumn(), TimeRemainingColumn())
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
                log.info("%s: %d of %d bytes (%d%%)", self.description, self.done, self.total,
                         self.done * 100 // max(self.total, 1))
        now = time.monotonic()
        if self.on_advance is not None and (now - self._last_call >= 1.0 or self.done >= self.total):
            self._last_call = now
            self.on_advance(self.done, self.total)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()


def fetch_files(client: httpx.Client, base_url: str, store: ModelStore, manifest: Manifest,
                paths: list[str], progress: CopyProgress | None = None) -> int:
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
        elif entry.path in paths and progress is not None:
            progress.advance(entry.size)
    return received


def _fetch_file(client: httpx.Client, base_url: str, store: ModelStore, model_id: str,
                entry: ModelFile, progress: CopyProgress | None) -> int:
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
        with client.stream("GET", f"{base_url}/internal/models/file", params=params, headers=headers,
                           timeout=30.0) as response:
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
            f"{hasher.hexdigest()[:12]}..., expected {entry.size} bytes, {entry.sha256[:12]}...")
    partial.replace(target)
    return received


def _hash_into(hasher, path: Path) -> None:
    with open(path, "rb") as f:
        while block := f.read(CHUNK_BYTES):
            hasher.update(block)
