"""A GGUF file cut into pieces a node can copy one by one: its header, then each tensor.

The pieces tile the file: the header piece is every byte before the first tensor's data
(magic, key/value metadata, tensor infos, alignment padding); each tensor's piece runs from
its data's first byte to the next tensor's first byte (its padding), the last one to the
end of the file. So a node that holds every piece holds the file byte for byte, and one
that holds the header and some tensors' pieces holds everything a reader of just those
tensors reads. Each piece has the SHA-256 of its bytes, computed where the model was
added, in the pass that hashes the whole file (:func:`sha256_pieces`); the manifest
records them (``Manifest.pieces``).

Pure but for :func:`sha256_pieces`, which reads the file.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from shardline.models.byte_ranges import Range

HEADER_PIECE = "(header)"
"""The name of the header's piece (no GGUF tensor is so named: :func:`piece_bounds` checks)."""

CHUNK_BYTES = 1 << 20
_SHA256 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class Piece:
    """Bytes ``[offset, offset + size)`` of a file: its header or one tensor's data."""

    name: str
    offset: int
    size: int
    sha256: str

    @property
    def range(self) -> Range:
        return (self.offset, self.offset + self.size)


def piece_bounds(tensors: Iterable[tuple[str, int, int]], file_size: int) -> list[tuple[str, int, int]]:
    """``(name, start, end)`` of each piece of a file of ``file_size`` bytes whose tensors
    are ``(name, data offset, data bytes)``: the header first, then the tensors in the
    file's order (see the module doc).

    Raises:
        ValueError: tensors overlap, one ends past the file, names repeat, or one is named
            :data:`HEADER_PIECE`.
    """
    ordered = sorted(tensors, key=lambda t: t[1])
    names = [t[0] for t in ordered]
    if len(set(names)) != len(names) or HEADER_PIECE in names:
        raise ValueError("tensor names repeat, or one is the header's")
    starts = [t[1] for t in ordered] + [file_size]
    out = [(HEADER_PIECE, 0, starts[0])]
    for (name, start, size), end in zip(ordered, starts[1:]):
        if start + size > end:
            raise ValueError(f"tensor {name!r} ({start}+{size}) runs into the next or past the file")
        out.append((name, start, end))
    return out


def sha256_pieces(path: Path, bounds: list[tuple[str, int, int]]) -> tuple[str, list[Piece]]:
    """The SHA-256 (hex) of the file at ``path`` and its pieces of ``bounds`` (from
    :func:`piece_bounds`, tiling the file), in one read of it."""
    whole = hashlib.sha256()
    pieces = []
    with open(path, "rb") as f:
        for name, start, end in bounds:
            hasher = hashlib.sha256()
            left = end - start
            while left:
                block = f.read(min(CHUNK_BYTES, left))
                if not block:
                    raise ValueError(f"{path} ends before byte {end}")
                whole.update(block)
                hasher.update(block)
                left -= len(block)
            pieces.append(Piece(name, start, end - start, hasher.hexdigest()))
        while block := f.read(CHUNK_BYTES):  # bounds that end short of the file
            whole.update(block)
    return whole.hexdigest(), pieces


def check_pieces(data: object, size: int) -> list[Piece]:
    """The pieces of a manifest's JSON (a list of ``{"name", "offset", "size", "sha256"}``)
    for a file of ``size`` bytes, checked to tile it: in order, each starting where the
    last ended, the first at 0, the last ending at ``size``, names once each.

    Raises:
        ValueError: they do not (the message says where).
    """
    if not isinstance(data, (list, tuple)) or not data:
        raise ValueError("pieces is not a non-empty list")
    out, end, names = [], 0, set()
    for entry in data:
        if not isinstance(entry, dict) or set(entry) != {"name", "offset", "size", "sha256"}:
            raise ValueError("a piece is not an object with the keys name, offset, size, sha256")
        piece = Piece(**entry)
        if not isinstance(piece.name, str) or piece.name in names:
            raise ValueError(f"piece name {piece.name!r} is not a string, or repeats")
        if (
            not all(isinstance(v, int) and not isinstance(v, bool) for v in (piece.offset, piece.size))
            or piece.offset != end
            or piece.size < 0
        ):
            raise ValueError(f"piece {piece.name!r} does not start at byte {end}")
        if not isinstance(piece.sha256, str) or not _SHA256.fullmatch(piece.sha256):
            raise ValueError(f"piece {piece.name!r}: sha256 is not 64 hex digits")
        names.add(piece.name)
        end = piece.offset + piece.size
        out.append(piece)
    if end != size:
        raise ValueError(f"pieces end at byte {end}, the file at {size}")
    return out
