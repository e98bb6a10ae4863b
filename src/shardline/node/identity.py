"""A node's lasting identity: its data directory, node id and cluster key.

The data directory is ``$XDG_DATA_HOME/shardline`` (``~/.local/share/shardline`` when the
variable is unset; XDG Base Directory Specification), or ``--data-dir``. It holds:

- ``node-id``: generated on first start and kept, so a restarted node rejoins as itself
  (its old entry is not left behind as a ghost);
- ``cluster-key``: the shared secret of the node's cluster, generated on first start
  unless one is given (``--cluster-key`` or ``SHARDLINE_CLUSTER_KEY``), and kept.

Every node-to-node request and answer is signed with a key derived from it
(``shardline.node.signing``); the key itself never leaves the machine. A node answers
``/internal/*`` only to signed requests, so a machine without the key can neither join, read
the cluster's state nor submit work, and two clusters can share a LAN.
"""

from __future__ import annotations

import os
import secrets
import uuid
from pathlib import Path


def default_data_dir() -> Path:
    """``$XDG_DATA_HOME/shardline``, or ``~/.local/share/shardline``."""
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(base) / "shardline"


def _read_or_create(path: Path, make) -> str:
    if path.exists():
        value = path.read_text().strip()
        if value:
            return value
    path.parent.mkdir(parents=True, exist_ok=True)
    value = make()
    tmp = path.with_suffix(".tmp")
    tmp.write_text(value + "\n")
    os.chmod(tmp, 0o600)
    tmp.replace(path)
    return value


def node_id(data_dir: Path) -> str:
    """This node's id: read from ``data_dir/node-id``, created (12 hex digits) if absent."""
    return _read_or_create(data_dir / "node-id", lambda: uuid.uuid4().hex[:12])


def cluster_key(data_dir: Path, given: str | None = None) -> tuple[str, bool]:
    """The cluster key and whether it was generated now.

    ``given`` (from the command line or environment) wins and is saved for next time.

    Raises:
        ValueError: ``given`` is shorter than 16 characters (too easy to guess).
    """
    path = data_dir / "cluster-key"
    if given is not None:
        if len(given) < 16:
            raise ValueError("the cluster key must be at least 16 characters")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(given + "\n")
        os.chmod(path, 0o600)
        return given, False
    existed = path.exists() and path.read_text().strip() != ""
    return _read_or_create(path, lambda: secrets.token_urlsafe(24)), not existed
