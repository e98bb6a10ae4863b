"""Competing work for ``shardline bench --busy N``: N processes that each keep one core
busy while the workloads run, as a build, a browser or another model server does on a
person's machine (issue 47: a runner whose threads cannot all run must not collapse).

Each is a Python process spinning at normal priority; all are killed when the bench ends
(also on an error or a signal), and none outlives its parent: each polls that its parent
still lives and exits when it does not.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator

SPIN = (
    "import os, time\n"
    "parent, t = os.getppid(), time.monotonic()\n"
    "while True:\n"
    "    if time.monotonic() - t > 1.0:\n"
    "        if os.getppid() != parent: break\n"
    "        t = time.monotonic()\n"
)
"""A busy loop that ends within a second of its parent's death."""


def busy_refusal(count: int) -> str | None:
    """Why ``--busy count`` cannot run here (a negative count, or more than this
    machine's CPUs), or None."""
    cpus = os.cpu_count() or 1
    return None if 0 <= count <= cpus else f"--busy must be between 0 and this machine's {cpus} CPUs"


@contextlib.contextmanager
def busy_cores(count: int) -> Iterator[list[int]]:
    """Keep ``count`` cores busy for the ``with`` block; yields the processes' ids (none
    for 0).

    Raises:
        ValueError: :func:`busy_refusal`'s reason.
    """
    if why := busy_refusal(count):
        raise ValueError(why)
    procs = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(count)]
    try:
        yield [p.pid for p in procs]
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()
