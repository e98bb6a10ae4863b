"""A node's store served to its peers, the server side of :mod:`shardline.node.transfer`:
``GET /internal/models/manifest`` and ``GET /internal/models/file`` (behind the cluster
key, like every ``/internal`` route).

A file the node holds whole is answered with Starlette's ``FileResponse``, which answers
``Range: bytes=N-`` requests (RFC 9110, section 14) with ``206 Partial Content``; a file it
holds in part (:mod:`shardline.models.sparse_file`) only as one byte range that lies wholly
in what it holds (anything else is answered 404: it never serves bytes it does not hold).
Only files named in the manifest are served, each at a real path inside its model's
directory (``ModelStore.confined_path``).
"""

from __future__ import annotations

import logging
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse

from shardline.models.byte_ranges import Range, covers
from shardline.models.confine import UnsafePathError
from shardline.models.store import Manifest, ModelStore, ModelStoreError
from shardline.node.transfer import CHUNK_BYTES

log = logging.getLogger(__name__)


def router(store: ModelStore) -> APIRouter:
    """Serve ``store`` to peers: ``GET /internal/models/manifest?model=ID`` (the manifest)
    and ``GET /internal/models/file?model=ID&path=REL`` (a file present whole, byte ranges
    of it; or one range held of a file held in part)."""
    routes = APIRouter()

    @routes.get("/internal/models/manifest")
    async def manifest(model: str):
        found = _manifest_or_none(store, model)
        if found is None:
            return JSONResponse(status_code=404, content={"detail": f"model {model!r} is not in this store"})
        return found.to_dict()

    @routes.get("/internal/models/file")
    async def model_file(model: str, path: str, request: Request):
        return model_file_response(store, model, path, request.headers.get("range"))

    return routes


def model_file_response(store: ModelStore, model: str, path: str, range_header: str | None) -> Response:
    """The answer to ``GET /internal/models/file``: the file whole (byte ranges of it
    answered by ``FileResponse``), the one range asked of a file held in part (206), or
    404 for a file not in the manifest, not held, or outside the model's directory."""
    found = _manifest_or_none(store, model)
    missing = JSONResponse(status_code=404, content={"detail": f"{model}: no file {path!r} here"})
    # Only files named in the manifest, at a real path inside the model's directory.
    if found is None or path not in {f.path for f in found.files}:
        return missing
    size = found.file(path).size
    held = store.held_ranges(model, path, found)
    whole = held == [(0, size)]
    wanted = None
    if not whole:
        wanted = single_range(range_header, size)
        if wanted is None or not covers(held, wanted):
            return JSONResponse(
                status_code=404, content={"detail": f"{model}: {path!r} is not here whole, nor the bytes asked for"}
            )
    try:
        real = store.confined_path(model, path)
    except (UnsafePathError, ModelStoreError) as exc:
        log.warning("refused to serve %s/%s: %s", model, path, exc)
        return missing
    if whole:
        return FileResponse(real, media_type="application/octet-stream")
    assert wanted is not None
    start, end = wanted
    return StreamingResponse(
        _read_range(real, start, end),
        status_code=206,
        media_type="application/octet-stream",
        headers={"Content-Range": f"bytes {start}-{end - 1}/{size}", "Content-Length": str(end - start)},
    )


def single_range(header: str | None, size: int) -> Range | None:
    """The one byte range ``[start, end)`` a ``Range`` header asks of a file of ``size``
    bytes (``bytes=A-B``, ``bytes=A-``, ``bytes=-N``), or None when it asks none, several,
    or one that is empty or past the end."""
    if header is None or not header.startswith("bytes=") or "," in header:
        return None
    first, _, last = header[len("bytes=") :].strip().partition("-")
    try:
        if not first:
            start, end = max(size - int(last), 0), size
        else:
            start = int(first)
            end = min(int(last) + 1, size) if last else size
    except ValueError:
        return None
    return (start, end) if 0 <= start < end <= size else None


def _read_range(path: Path, start: int, end: int):
    """The bytes ``[start, end)`` of the file at ``path``, a chunk at a time."""
    with open(path, "rb") as f:
        f.seek(start)
        while start < end:
            block = f.read(min(CHUNK_BYTES, end - start))
            if not block:
                return
            start += len(block)
            yield block


def _manifest_or_none(store: ModelStore, model: str) -> Manifest | None:
    try:
        return store.manifest(model)
    except ModelStoreError:
        return None
