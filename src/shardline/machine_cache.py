"""What shardline keeps per machine so that slow work is done once: files derived from
another file (a GGUF's parsed metadata, a tokenizer rebuilt from it), in
``$XDG_CACHE_HOME/shardline`` (``~/.cache/shardline`` when the variable is unset; XDG Base
Directory Specification), keyed by the source file's path, size and modification time.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path


def cache_dir() -> Path:
    """``$XDG_CACHE_HOME/shardline``, or ``~/.cache/shardline``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "shardline"


def cache_path(kind: str, source: Path, suffix: str = "") -> Path:
    """``<cache dir>/<kind>/<key><suffix>`` for what is derived from ``source``, keyed by
    the file itself (device, inode, size, modification time): a changed or copied source
    gets a new key, a renamed one (the model store stages a file and moves it into place)
    keeps it.

    Raises:
        OSError: ``source`` cannot be read (stat).
    """
    stat = source.stat()
    identity = f"{stat.st_dev}|{stat.st_ino}|{stat.st_size}|{stat.st_mtime_ns}"
    key = hashlib.sha256(identity.encode()).hexdigest()[:24]
    return cache_dir() / kind / f"{key}{suffix}"


def write_atomically(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in its directory and a rename, so
    a reader sees the old file or the new one, never part of one.

    Raises:
        OSError: the directory cannot be made or written.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
        f.write(text)
    Path(f.name).replace(path)
