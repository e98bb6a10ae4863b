"""A process's own memory, as placement counts it: its anonymous (and shared-memory)
resident pages, without the file-backed ones.

File-backed resident pages are the libraries' code and mapped files: shared by every
process that maps them, reclaimable by the kernel under pressure, and their count follows
the page cache, not the process (libtorch's code was 62 MiB resident in a runner here and
143 MiB in the same runner on a machine where torch had just been installed, whose page
cache held the library in large folios). Linux's ``/proc/self/status`` separates them
(``RssAnon``, ``RssShmem``, ``RssFile``; ``VmHWM`` the resident set's high-water mark);
elsewhere the whole resident set (psutil) is counted.
"""

from __future__ import annotations

import sys
from pathlib import Path

_STATUS = Path("/proc/self/status")


def _status_kib() -> dict[str, int] | None:
    """``/proc/self/status``'s memory lines in KiB, or None where there is none."""
    try:
        lines = _STATUS.read_text().splitlines()
    except OSError:
        return None
    out = {}
    for line in lines:
        key, _, value = line.partition(":")
        if value.strip().endswith("kB"):
            out[key] = int(value.split()[0])
    return out


def memory_now() -> tuple[int, int]:
    """This process's private resident bytes now, and at most so far (bytes).

    On Linux: ``RssAnon + RssShmem``, and for the peak ``VmHWM`` less the file pages
    resident now (the high-water mark counts them too; an approximation when they were
    fewer then). Elsewhere: the resident set size and ``getrusage``'s peak (kilobytes on
    Linux, bytes on macOS).
    """
    status = _status_kib()
    if status is not None and "RssAnon" in status:
        private = (status["RssAnon"] + status.get("RssShmem", 0)) * 1024
        peak = (status.get("VmHWM", 0) - status.get("RssFile", 0)) * 1024
        return private, max(private, peak)
    import resource

    import psutil

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak = peak if sys.platform == "darwin" else peak * 1024
    rss = psutil.Process().memory_info().rss
    return rss, max(peak, rss)  # the kernel's peak can lag the resident set by a page run
