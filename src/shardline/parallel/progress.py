"""Progress of a rank's collectives, for the runner's progress watchdog."""

from __future__ import annotations

import time


class Progress:
    """When this rank last completed a unit of work, and what it is waiting on now.

    The runner's progress watchdog reads it from another thread: a rank that is ``busy``
    and has not progressed for longer than its timeout fails the instance.
    """

    def __init__(self) -> None:
        self.at = time.monotonic()
        self.busy = False
        self.doing = "idle"

    def mark(self, doing: str) -> None:
        """Record progress (monotonic seconds now) and the next thing this rank waits on."""
        self.at = time.monotonic()
        self.doing = doing

    def stalled_for(self) -> float:
        """Seconds since the last progress while busy, else 0."""
        return time.monotonic() - self.at if self.busy else 0.0

    def begin(self, doing: str) -> None:
        """Enter a step: from now on a lack of progress counts as a stall."""
        self.mark(doing)
        self.busy = True

    def end(self) -> None:
        """Leave a step (the rank waits on its own inbox, which is not a stall)."""
        self.busy = False
        self.doing = "idle"
