"""A GGUF file's key/value metadata and tensor infos, with the metadata cached per machine.

The ``gguf`` library's reader builds a memory-mapped view per element of every metadata
array: seconds, and a transient ~170 MB, for a 49,152-token tokenizer, at every open
(here it parses an in-memory copy instead: :func:`in_memory_fields_reader`). The
first open writes the parsed metadata to ``<cache dir>/gguf/<key>.json``; later opens jump
over the key/value section to the tensor infos, which the library still reads itself.

The key is the file's content (its size and first :data:`HEADER_FINGERPRINT_BYTES`), so a
copy from a peer or a renamed file finds what the first open parsed. The node warms the
cache for a file it has just copied by running this module (``python -m
shardline.models.gguf_header FILE``) in a short-lived process, so that the parse's
transient memory lands neither in the node (which does not import torch) nor in a runner
while it loads. This module imports neither torch nor shardline's model code.

Format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections import OrderedDict
from pathlib import Path
from typing import Any

from shardline.machine_cache import cache_dir, write_atomically

HEADER_FINGERPRINT_BYTES = 32 << 20
"""Bytes from a GGUF file's start that key its cached metadata (with its size): they hold
the key/value section of any real model (a 151,643-token tokenizer is ~7 MB); a section
that ends beyond them is not cached."""


def header_cache_file(path: Path) -> Path:
    """Where the metadata of the GGUF file at ``path`` is kept.

    Raises:
        OSError: the file cannot be read.
    """
    digest = hashlib.sha256(str(path.stat().st_size).encode())
    with open(path, "rb") as f:
        digest.update(f.read(HEADER_FINGERPRINT_BYTES))
    return cache_dir() / "gguf" / f"{digest.hexdigest()[:24]}.meta.json"


def in_memory_fields_reader(leave_out: tuple[str, ...] = ()):
    """``gguf.GGUFReader`` that parses the key/value section from an in-memory copy of
    the file's first :data:`HEADER_FINGERPRINT_BYTES`, not from its memory map: the
    library takes a view of the map per element, and views of a ``numpy.memmap`` cost
    ~10x those of an array (a 49,152-token vocabulary: 1.3 s against 4.2). A section
    that does not end inside the copy is parsed from the map, as the library does. Keys
    holding any of ``leave_out`` are left out of its ``fields``."""
    import numpy as np
    from gguf import GGUFReader

    class InMemoryFieldsReader(GGUFReader):
        data: Any
        fields: OrderedDict[str, Any]

        def _build_fields(self, offs: int, count: int) -> int:
            end = self._parsed_fields(offs, count)
            if leave_out:
                self.fields = OrderedDict(
                    (k, v) for k, v in self.fields.items() if not any(part in k for part in leave_out)
                )
            return end

        def _parsed_fields(self, offs: int, count: int) -> int:
            mapped = self.data
            self.data = np.array(mapped[:HEADER_FINGERPRINT_BYTES])
            try:
                end = super()._build_fields(offs, count)
                # A read past the copy comes back short: then every later read fails,
                # or the section ends exactly at the copy's end.
                if end < len(self.data):
                    return end
            except (IndexError, ValueError):
                pass
            finally:
                self.data = mapped
            self.fields = OrderedDict((k, v) for k, v in self.fields.items() if k.startswith("GGUF."))
            return super()._build_fields(offs, count)

    return InMemoryFieldsReader


def _reader_class():
    """:func:`in_memory_fields_reader`'s reader, which can skip the key/value section
    given a cached header (``{"kv_end", "metadata"}``)."""

    class HeaderCachedReader(in_memory_fields_reader()):  # type: ignore[misc]
        def __init__(self, path: str, header: dict | None) -> None:
            self._header = header
            super().__init__(path)

        def _build_fields(self, offs: int, count: int) -> int:
            if self._header is not None:
                return int(self._header["kv_end"])
            self.kv_end = super()._build_fields(offs, count)
            return self.kv_end

    return HeaderCachedReader


TOKENIZER_ARRAYS = "tokenizer.ggml."
"""The prefix of the tokenizer's keys (vocabulary, scores, merges), left out of the
metadata here: a runner needs the model's shape, not 49,152 strings (~10 MiB of Python
objects that stayed in its memory); the tokenizer reads them from the file itself."""


def gguf_metadata(reader) -> dict[str, Any]:
    """GGUF key/value metadata as plain Python values (strings, numbers, lists), without
    the tokenizer's arrays (:data:`TOKENIZER_ARRAYS`; its scalar keys stay)."""
    meta = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or (key.startswith(TOKENIZER_ARRAYS) and len(field.data) > 1):
            continue
        try:
            meta[key] = field.contents()
        except Exception:  # noqa: BLE001 - an unreadable optional field is left out
            continue
    return meta


def open_gguf(path: Path) -> tuple[Any, dict[str, Any]]:
    """``(reader, metadata)`` of the GGUF file at ``path``: a ``gguf.GGUFReader`` (tensor
    infos, memory-mapped data) and the key/value metadata, from the cache where it holds
    this file's, else parsed and then cached (unless the file sets its own alignment,
    which the skipping reader does not read, or its section is beyond the key's bytes).

    Raises:
        OSError: the file cannot be read.
        ValueError: the file is not GGUF, or is cut short or corrupt (the message says
            which, with the ``gguf`` library's own error).
    """
    cache = header_cache_file(path)
    try:
        header = json.loads(cache.read_text())
        if header["kv_end"] > HEADER_FINGERPRINT_BYTES:
            header = None
    except (OSError, ValueError, KeyError, TypeError):
        header = None
    try:
        reader = _reader_class()(str(path), header)
    except (ValueError, IndexError, KeyError, TypeError) as exc:
        raise ValueError(_unreadable(path, exc)) from exc
    if header is not None:
        return reader, header["metadata"]
    metadata = gguf_metadata(reader)
    if "general.alignment" not in reader.fields and reader.kv_end <= HEADER_FINGERPRINT_BYTES:
        try:
            write_atomically(cache, json.dumps({"kv_end": reader.kv_end, "metadata": metadata}))
        except OSError:
            pass  # no cache: the next open parses the file again
    return reader, metadata


def tensor_layout(reader) -> list[tuple[str, int, int]]:
    """``(name, data offset, data bytes)`` of each tensor of an opened GGUF file (``reader``
    from :func:`open_gguf`), the offset from the file's start, in the file's order."""
    return sorted(((t.name, int(t.data_offset), int(t.n_bytes)) for t in reader.tensors), key=lambda t: t[1])


def _unreadable(path: Path, exc: Exception) -> str:
    """Why the GGUF reader failed on ``path``, in words: not GGUF at all (no ``GGUF`` magic,
    the format's first 4 bytes), or GGUF cut short or corrupt (a partial download or copy
    most often), with the file's size and the reader's own error."""
    with open(path, "rb") as f:
        magic = f.read(4)
    size = path.stat().st_size
    if magic != b"GGUF":
        return f"not a GGUF file (it starts with {magic!r}, not b'GGUF')"
    return (
        f"a GGUF file cut short or corrupt ({size:,} bytes: a partial download or copy?); "
        f"the gguf reader says: {type(exc).__name__}: {exc}"
    )


def gguf_config(reader, metadata: dict[str, Any]):
    """The :class:`~shardline.models.config.ModelConfig` of an opened GGUF file (``reader``
    and ``metadata`` from :func:`open_gguf`): its metadata, tensor names and the token
    embedding's rows. Needs no torch, so a node can read a model's shape cheaply.

    Raises:
        UnsupportedModelError: the architecture is not one shardline runs.
    """
    from shardline.models.config import ModelConfig

    tensors = {t.name: t for t in reader.tensors}
    embedding = tensors.get("token_embd.weight")
    return ModelConfig.from_gguf_metadata(
        metadata, set(tensors), int(embedding.shape[-1]) if embedding is not None else 0
    )


if __name__ == "__main__":  # warm the cache: python -m shardline.models.gguf_header FILE...
    for name in sys.argv[1:]:
        open_gguf(Path(name))
