"""The instance table kept on disk: a node writes its table and epoch each time they
change and reads them back when it restarts (``cluster_state`` rule 1 across restarts).

The file is a :class:`~shardline.node.wire.StateMessage` as JSON, written atomically.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

from shardline.machine_cache import write_atomically
from shardline.node.state import ClusterState
from shardline.node.wire import StateMessage

log = logging.getLogger(__name__)


def save_table(path: Path, state: ClusterState) -> None:
    """Keep ``state`` in ``path``; a failure to write is logged (the node goes on)."""
    try:
        write_atomically(path, StateMessage.of(state).model_dump_json())
    except OSError as exc:
        log.warning("could not keep the instance table in %s: %s", path, exc)


def load_table(path: Path) -> ClusterState | None:
    """The table kept in ``path``, its epoch marked as read from disk (a minority's:
    ``Epoch.from_disk``, rule 4), or None where there is none or it cannot be read (logged)."""
    if not path.exists():
        return None
    try:
        kept = StateMessage.model_validate_json(path.read_bytes()).state()
    except (OSError, ValueError) as exc:  # pydantic's ValidationError is a ValueError
        log.warning("ignoring the kept instance table %s: %s", path, exc)
        return None
    return dataclasses.replace(kept, epoch=kept.epoch.from_disk())
