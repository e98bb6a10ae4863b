"""A process's own memory, as placement counts it: its anonymous (and shared-memory)
resident pages, without the file-backed ones.

File-backed resident pages are the libraries' code and mapped files: shared by every
process that maps them, reclaimable by the kernel under pressure, and their count follows
the page cache, not the process (libtorch's code was 62 MiB resident in a runner here and
143 MiB in the same runner on a machine where torch had just been installed, whose page
cache held the library in large folios). Linux's ``/proc/self/status`` separates them
(``RssAnon``, ``RssShmem``, ``RssFile``; ``VmHWM`` the resident set's high-water mark);
elsewhere the whole resident set (psutil) is counted.

Also the effects that keep that memory down: glibc's heap settings while loading
(:func:`large_allocations_mapped`) and handing freed heap pages back
(:func:`release_free_memory`).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import sys
from collections.abc import Iterator
from pathlib import Path

_STATUS = Path("/proc/self/status")


def _status_kib(status: Path = _STATUS) -> dict[str, int] | None:
    """A ``/proc/<pid>/status``'s memory lines in KiB (this process's by default), or None
    where there is none."""
    try:
        lines = status.read_text().splitlines()
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


def private_bytes_of(pid: int) -> int | None:
    """Another process's private resident bytes (``RssAnon + RssShmem``, as
    :func:`memory_now`), or None where ``/proc`` does not tell (not Linux, or it exited)."""
    status = _status_kib(Path(f"/proc/{pid}/status"))
    if status is None or "RssAnon" not in status:
        return None
    return (status["RssAnon"] + status.get("RssShmem", 0)) * 1024


@functools.cache
def _libc():
    """The C library, opened once per process: ``find_library`` runs ``ldconfig -p`` in a
    subprocess each call (121 calls, 0.8 s of a SmolLM2 load, when it was not cached)."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def release_free_memory() -> None:
    """Hand freed heap pages back to the system. glibc keeps them otherwise, so a loading
    rank's temporaries (each tensor's integer groups and the packing's int32 copies)
    would stay in its resident memory: SmolLM2 on one node held 514 MiB instead of 355
    after loading. A no-op where the C library has no ``malloc_trim``."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters


@contextlib.contextmanager
def large_allocations_mapped() -> Iterator[None]:
    """While loading, allocations of 1 MiB or more get their own mapping, returned to the
    system when freed. glibc's default raises that threshold to each large block freed
    (up to 32 MiB), after which the loader's temporaries fill the heap and stay: the
    last pipeline rank of SmolLM2 peaked at 580 MiB for 300 steady, 358 with this. After
    loading the threshold is 32 MiB and the heap is trimmed only above 64 MiB free (where
    glibc's own adjustment would settle): setting a threshold turns that adjustment off,
    and the default 128 KiB trim threshold then handed a step's freed activations back to
    the system and faulted them in again on the next layer (50,000 page faults a
    512-token prefill of SmolLM2, 10-15% of its time). A no-op where the C library has no
    ``mallopt``."""
    libc = _libc()
    if libc is None or not hasattr(libc, "mallopt"):
        yield
        return
    libc.mallopt(_M_MMAP_THRESHOLD, 1 << 20)
    try:
        yield
    finally:
        libc.mallopt(_M_MMAP_THRESHOLD, 32 << 20)
        libc.mallopt(_M_TRIM_THRESHOLD, 64 << 20)
