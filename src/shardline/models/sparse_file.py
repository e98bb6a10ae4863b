"""A file held in part: at its own path and full size, with holes where its bytes are not
here, and a record of the byte ranges that are.

A node that copies only some pieces of a model's GGUF file (:mod:`shardline.models.file_pieces`)
makes the file at its own path with its full size (``ftruncate``: no disk for the rest) and
writes each piece at its offset, so a reader that memory-maps it reads the pieces it needs
as it would read the whole file; the holes read as zeros and cost no disk. Beside it, the
**record** ``<file>.ranges.json`` says which ranges hold the file's bytes, checked:

- ``sha256``: the whole file's, as the manifest gives it (a record of another version of the
  file is void: its ranges say nothing of this one);
- ``size``; ``present``: sorted, merged ``[start, end)`` ranges whose SHA-256 was checked;
- ``writing``: ``[start, written]`` while a piece starting at ``start`` is being copied:
  its bytes up to ``written`` are on disk, unchecked, for a resume.

The record exists from before the file is made until every byte is present; then it is
deleted, and the file is a whole file like any other. So a file with a record is partial,
whatever its size, and a crash at any point leaves a record that claims no more than what
was checked. :class:`SparseRecord` is pure; the functions below read and write the record.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from shardline.machine_cache import write_atomically
from shardline.models.byte_ranges import Range, added, covers, merged, total

RECORD_SUFFIX = ".ranges.json"


@dataclass(frozen=True)
class SparseRecord:
    """What a node holds of a file it holds in part (see the module doc)."""

    sha256: str
    size: int
    present: tuple[Range, ...] = ()
    writing: Range | None = None

    def holding(self, piece: Range) -> "SparseRecord":
        """This record once ``piece``'s bytes are checked (and no piece is being written)."""
        return replace(self, present=tuple(added(self.present, piece)), writing=None)

    def writing_to(self, start: int, written: int) -> "SparseRecord":
        """This record while the piece at ``start`` has its bytes up to ``written`` on disk."""
        return replace(self, writing=(start, written))

    def not_writing(self) -> "SparseRecord":
        """This record once a piece being written is given up (its bytes unchecked)."""
        return replace(self, writing=None)

    def holds(self, wanted: Range) -> bool:
        return covers(self.present, wanted)

    @property
    def complete(self) -> bool:
        """Whether every byte of the file is present."""
        return self.holds((0, self.size))

    @property
    def present_bytes(self) -> int:
        return total(self.present)

    def to_dict(self) -> dict:
        return {
            "sha256": self.sha256,
            "size": self.size,
            "present": [list(r) for r in self.present],
            "writing": list(self.writing) if self.writing else None,
        }

    @classmethod
    def from_dict(cls, data: dict) -> "SparseRecord":
        """Raises: ValueError, KeyError, TypeError: not a record."""
        size = int(data["size"])
        present = tuple(merged((int(a), int(b)) for a, b in data["present"]))
        if present and present[-1][1] > size:
            raise ValueError(f"a range ends past the file's {size} bytes")
        writing = data.get("writing")
        return cls(str(data["sha256"]), size, present, (int(writing[0]), int(writing[1])) if writing else None)


def record_path(path: Path) -> Path:
    """Where the record of the file at ``path`` lies."""
    return path.with_name(path.name + RECORD_SUFFIX)


def read_record(path: Path) -> SparseRecord | None:
    """The record of the file at ``path``; None when it has none (it is whole, or absent).
    An unreadable record reads as one holding nothing, so the file stays partial."""
    try:
        text = record_path(path).read_text()
    except FileNotFoundError:
        return None
    try:
        return SparseRecord.from_dict(json.loads(text))
    except (ValueError, KeyError, TypeError):
        return SparseRecord("", 0)


def write_record(path: Path, record: SparseRecord) -> None:
    """Write the record of the file at ``path`` (atomically: a reader sees the old or the new)."""
    write_atomically(record_path(path), json.dumps(record.to_dict()))
