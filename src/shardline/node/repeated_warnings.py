"""Warnings of a condition that repeats until it ends (a peer that cannot be reached is
tried again every second): the first of a run is a warning, the rest debug lines until
the condition is seen to end."""

from __future__ import annotations

import logging
from collections.abc import Hashable


class RepeatedWarnings:
    """Warns once per run of a repeating condition, named by ``key``.

    Args:
        log: the logger the lines go to.
    """

    def __init__(self, log: logging.Logger) -> None:
        self.log = log
        self._ongoing: set[Hashable] = set()

    def warn(self, key: Hashable, message: str, *args: object) -> None:
        """Log ``message % args``: at WARNING the first time since ``key``'s condition last
        ended (saying the repeats go to the debug log), at DEBUG after."""
        if key in self._ongoing:
            self.log.debug(message, *args)
            return
        self._ongoing.add(key)
        self.log.warning(message + " (again: debug log, until it succeeds)", *args)

    def ended(self, key: Hashable) -> None:
        """``key``'s condition is over: its next occurrence warns again."""
        self._ongoing.discard(key)
